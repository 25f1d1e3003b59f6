"""The support matrix: each pipeline's forward, backward, decode, FP8 and context-parallel
support, dtypes, head dims and features, and how it was verified, generated from the
pipelines' descriptors (`flash_cute.contract.descriptor.Descriptor`). The README holds it
between two markers; a test checks that it equals this output.

    python -m flash_cute.tools.support_matrix            # print it
    python -m flash_cute.tools.support_matrix --write    # rewrite the README's copy
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

from flash_cute.contract import descriptor as caps
from flash_cute.contract.limits import NOT_BUILT

START, END = "<!-- support-matrix:start -->", "<!-- support-matrix:end -->"
README = Path(__file__).resolve().parents[2] / "README.md"

# Features as the matrix names them, in its order (the capabilities a problem asks for).
FEATURES = ((caps.CAUSAL, "causal"), (caps.LOCAL, "window"), (caps.SOFTCAP, "softcap"),
            (caps.GQA, "GQA"), (caps.PACK_GQA, "packed GQA"), (caps.VARLEN, "varlen"),
            (caps.SEQUSED, "seqused"), (caps.DROPOUT, "dropout"), (caps.MODS, "score/mask mods"),
            (caps.BLOCK_SPARSE, "block masks"))
COLUMNS = ("pipeline", "GPUs", "verified", "forward", "backward", "decode", "FP8",
           "context parallel", "dtypes", "head dims", "features")


def _dims(pairs) -> str:
    return ", ".join(str(d) if d == dv else f"{d}/{dv}" for d, dv in pairs) or "—"


def _gpus(majors: range) -> str:
    first, last = majors.start, majors.stop - 1
    return f"sm{first}0" if first == last else f"sm{first}0 to sm{last}x"


def row(d: caps.Descriptor) -> dict:
    """One pipeline's cells. Context parallelism runs the operators inside the ring: their
    float32 partial output is the split-KV path with one split, so it needs split-KV, and
    its backward the pipeline's backward."""
    has = d.capabilities.__contains__
    backward = "—"
    if has(caps.BACKWARD):
        backward = "yes" + (", deterministic" if has(caps.DETERMINISTIC) else "")
        if tuple(d.backward_head_dims) != tuple(d.head_dims):
            backward += f" (hdim {_dims(d.backward_head_dims)})"
    parallel = "—"
    if "split-KV" in d.decode:
        parallel = "ring, Ulysses" + (", forward and backward" if has(caps.BACKWARD)
                                      else ", forward")
    return {
        "pipeline": d.name,
        "GPUs": _gpus(d.majors),
        "verified": f"on an {d.verified}" if d.hardware_tested else "compile-verified only",
        "forward": "yes" if has(caps.FORWARD) else "—",
        "backward": backward,
        "decode": ", ".join(d.decode) or "—",
        "FP8": f"forward, hdim {_dims(d.fp8_head_dims)}" if has(caps.FP8) else "—",
        "context parallel": parallel,
        "dtypes": ", ".join(d.dtypes),
        "head dims": _dims(d.head_dims),
        "features": ", ".join(name for cap, name in FEATURES if has(cap)),
    }


def descriptors() -> list:
    """The built pipelines' descriptors, in dispatch's order."""
    from flash_cute.runtime.dispatch import PIPELINES

    return [p.descriptor for p in PIPELINES]


def device_summary(major: int) -> str:
    """The matrix row of the pipeline dispatch takes on a GPU of compute capability
    `major`.x, one cell a line (what `python -m flash_cute` prints first on a GPU)."""
    from flash_cute.runtime.dispatch import PIPELINES, admitted

    here = [p for p in PIPELINES if p.runs_on(major) and admitted(p)]
    if not here:
        return f"no pipeline runs on compute capability {major}.x"
    r = row(here[0].descriptor)
    return "\n".join(f"  {c}: {r[c]}" for c in COLUMNS)


def markdown(rows=None) -> str:
    """The matrix as a Markdown table, between the README's markers."""
    rows = [row(d) for d in descriptors()] if rows is None else rows
    lines = ["| " + " | ".join(COLUMNS) + " |", "|" + "---|" * len(COLUMNS)]
    lines += ["| " + " | ".join(r[c] for c in COLUMNS) + " |" for r in rows]
    gaps = "Not built yet, each refused by name: " + "; ".join(t for _, t in NOT_BUILT) + "."
    return "\n".join([START, *lines, "", gaps, END])


def readme_copy(text: str) -> str:
    """The README's matrix, markers included."""
    if START not in text or END not in text:
        raise ValueError(f"the README has no {START} ... {END} block")
    return START + text.split(START, 1)[1].split(END, 1)[0] + END


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--write", action="store_true", help="rewrite the README's copy")
    args = parser.parse_args(argv)
    table = markdown()
    if not args.write:
        print(table)
        return 0
    text = README.read_text()
    README.write_text(text.replace(readme_copy(text), table))
    return 0


if __name__ == "__main__":
    sys.exit(main())

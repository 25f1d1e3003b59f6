"""`python -m flash_cute inspect --report DIR`: one self-contained HTML page (its PNGs
embedded, and also written beside it) comparing the three pipelines: per kernel its warp-role
diagram (roles, what each does, the buffers and barriers between them), where each tensor
lives, the primitives its SASS contains (the design chapter's Table 10-11, generated), its
resources as shares of the target's limits, and what changed from the previous generation,
all from the declared pipeline (`flash_cute.contract.pipeline`) and the cross-compile.
"""

from __future__ import annotations

import base64
import html
from pathlib import Path

from flash_cute.contract.pipeline import MEMORIES, TENSORS, Pipeline, from_dict

GENERATIONS = ("ampere", "hopper", "blackwell")
# The primitives of Table 10-11 and the SASS that shows each.
PRIMITIVES = (("mma.sync", ("HMMA",)), ("cp.async", ("LDGSTS",)),
              ("TMA", ("UTMALDG", "UTMASTG", "UBLKCP", "UBLKRED")), ("WGMMA", ("HGMMA", "QGMMA")),
              ("tcgen05 MMA", ("UTCHMMA", "UTCQMMA")), ("TMEM load/store", ("LDTM", "STTM")),
              ("setmaxnreg", ("USETMAXREG",)), ("MUFU.EX2", ("MUFU.EX2",)))
_LIMITS = {"sm_80": (255, 163 * 1024), "sm_90a": (255, 227 * 1024),
           "sm_100a": (255, 227 * 1024)}


def primitives(entry: dict) -> dict:
    """Which primitives the kernel's SASS contains (opcode counts by primitive), with its
    2-CTA forms and TMEM allocation, and its software exp2 share."""
    sass = entry["sass"]
    out = {}
    for name, ops in PRIMITIVES:
        out[name] = sum(n for op, n in sass.items()
                        if any(op == o or op.startswith(o + ".") for o in ops))
    out["2-CTA forms"] = sum(n for op, n in sass.items() if "2CTA" in op)
    out["TMEM allocation"] = sum(n for op, n in sass.items()
                                 if op.startswith(("UTCATOMSWS.FIND_AND_SET",
                                                   "UTCATOMSWS.2CTA.FIND_AND_SET")))
    share = entry["config"].get("ex2_emu") or 0
    out["exp2 in software"] = f"{share}/16 of the exponentials" if share else "none"
    return out


def changes(previous: Pipeline, current: Pipeline, prev_entry: dict, entry: dict) -> list:
    """What differs from the previous generation's kernel of the same direction, in words."""
    notes = []
    old, new = previous.residency(), current.residency()
    for tensor in TENSORS:
        if tensor in old and tensor in new and old[tensor] != new[tensor]:
            notes.append(f"{tensor} moves from {'+'.join(old[tensor])} to "
                         f"{'+'.join(new[tensor])}")
    roles_old = {r.name for r in previous.roles} - {"idle"}
    roles_new = {r.name for r in current.roles} - {"idle"}
    if roles_new != roles_old:
        notes.append(f"warp roles: {', '.join(sorted(roles_old))} become "
                     f"{', '.join(sorted(roles_new))}")
    if current.budgets() and not previous.budgets():
        notes.append("registers move between roles (setmaxnreg: "
                     f"{'/'.join(map(str, current.budgets().values()))})")
    p_old, p_new = primitives(prev_entry), primitives(entry)
    gained = [k for k, v in p_new.items() if isinstance(v, int) and v and not p_old.get(k)]
    lost = [k for k, v in p_old.items() if isinstance(v, int) and v and not p_new.get(k)]
    if gained:
        notes.append("new primitives: " + ", ".join(gained))
    if lost:
        notes.append("no longer used: " + ", ".join(lost))
    return notes


def role_diagram(pipe: Pipeline, path: Path) -> None:
    """Figure 10-7's kind: one box per role (warps, registers, what it does), one arrow per
    buffer from its producer to its consumer, labelled with the tensor, its memory, stages
    and barrier."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    roles = [r for r in pipe.roles if r.name != "idle"]
    names = list(dict.fromkeys(r.name for r in roles))
    places = names + [n for n in ("TMA", "global") if any(
        n in (b.producer, b.consumer) for b in pipe.buffers)]
    x = {name: i * 3.2 for i, name in enumerate(places)}
    fig, ax = plt.subplots(figsize=(max(3.2 * len(places), 6), 5.2))
    for name in places:
        group = [r for r in roles if r.name == name]
        if group:
            warps = sum(len(r.warps) for r in group)
            regs = group[0].registers
            text = f"{name}\n{warps} warp(s)\n{'launch' if regs is None else regs} regs"
            face = "#dbe9f6"
        else:
            text, face = name, "#eeeeee"
        ax.add_patch(plt.Rectangle((x[name] - 1.2, 3.4), 2.4, 1.3, facecolor=face,
                                   edgecolor="black"))
        ax.text(x[name], 4.05, text, ha="center", va="center", fontsize=8)
    for i, b in enumerate(pipe.buffers):
        src, dst = b.producer.split(" + ")[0], b.consumer.split(" + ")[0]
        y = 3.1 - 0.34 * i
        label = f"{b.tensor} [{b.memory}, {b.stages}x] {b.barrier}"[:70]
        if src == dst:
            ax.text(x[src], y, f"{label} (within the role)", ha="center", fontsize=6.5)
            continue
        ax.annotate("", xy=(x[dst], y), xytext=(x[src], y),
                    arrowprops=dict(arrowstyle="->", lw=0.9))
        ax.text((x[src] + x[dst]) / 2, y + 0.05, label, ha="center", fontsize=6.5)
    ax.set_xlim(-1.5, x[places[-1]] + 1.5)
    ax.set_ylim(3.1 - 0.34 * len(pipe.buffers) - 0.3, 4.9)
    ax.axis("off")
    ax.set_title(f"{pipe.kernel} ({pipe.arch}): warp roles and buffers", fontsize=10)
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)


def _img(path: Path) -> str:
    data = base64.b64encode(path.read_bytes()).decode()
    return f'<img alt="{html.escape(path.name)}" src="data:image/png;base64,{data}">'


def _table(rows, head) -> str:
    cells = "".join(f"<th>{html.escape(str(h))}</th>" for h in head)
    body = "".join("<tr>" + "".join(f"<td>{html.escape(str(c))}</td>" for c in row) + "</tr>"
                   for row in rows)
    return f"<table><tr>{cells}</tr>{body}</table>"


def write(entries: list, folder) -> Path:
    """The report of the inspected representative `entries` (each with its `pipeline`) into
    `folder`: report.html and one PNG per kernel. Returns the HTML's path."""
    folder = Path(folder)
    folder.mkdir(parents=True, exist_ok=True)
    entries = sorted((e for e in entries if "pipeline" in e and "error" not in e),
                     key=lambda e: (e["kernel"].endswith(".bwd"),
                                    GENERATIONS.index(e["kernel"].split(".")[0])))
    parts = ["<html><head><meta charset='utf-8'><title>flash-cute pipelines</title><style>"
             "body{font-family:sans-serif;max-width:1100px;margin:auto}table{border-collapse:"
             "collapse;margin:6px 0}td,th{border:1px solid #999;padding:2px 6px;font-size:13px}"
             "img{max-width:100%}</style></head><body>",
             "<h1>flash-cute: how each generation maps the attention loop onto its hardware</h1>",
             "<p>bf16, hdim 128, causal; cross-compiled without a GPU. The blackwell pipeline is "
             "compile-verified only. Roles and buffers are each kernel's declared pipeline, "
             "checked against its SASS by the tests.</p>"]
    previous = {}
    for e in entries:
        pipe = from_dict(e["pipeline"])
        direction = e["kernel"].split(".")[1]
        png = folder / f"{e['kernel'].replace('.', '_')}_{e['target']}.png"
        role_diagram(pipe, png)
        parts.append(f"<h2 id='{e['kernel']}'>{html.escape(e['kernel'])} ({e['target']})</h2>")
        parts.append(f"<p>{html.escape(pipe.rule)}</p>")
        parts.append(_table([(", ".join(map(str, r.warps)), r.registers or "launch",
                              r.name, r.does) for r in pipe.roles],
                            ("warps", "registers", "role", "does")))
        parts.append(_img(png))
        places = pipe.residency()
        parts.append("<h3>residency</h3>" + _table(
            [(t, *("x" if m in places[t] else "" for m in MEMORIES)) for t in TENSORS
             if t in places], ("tensor", *MEMORIES)))
        parts.append("<h3>primitives in the SASS (Table 10-11)</h3>" + _table(
            [(k, v) for k, v in primitives(e).items()], ("primitive", "SASS count")))
        regs, smem = _LIMITS.get(e["target"], (255, 227 * 1024))
        largest = max(pipe.budgets().values(), default=e["registers"])
        parts.append("<h3>resources</h3>" + _table(
            [("registers, the largest role", f"{largest} of {regs}", f"{largest / regs:.0%}"),
             ("shared memory", f"{e['smem_bytes'] / 1024:.0f} KiB of {smem // 1024} KiB",
              f"{e['smem_bytes'] / smem:.0%}"),
             ("spills", f"{e['spill_bytes']} B", "")], ("resource", "used", "share")))
        if direction in previous:
            before, before_entry = previous[direction]
            notes = changes(before, pipe, before_entry, e) or ["no difference in the data"]
            parts.append(f"<h3>what changed from {before.kernel}</h3><ul>"
                         + "".join(f"<li>{html.escape(n)}</li>" for n in notes) + "</ul>")
        previous[direction] = (pipe, e)
    parts.append("</body></html>")
    path = folder / "report.html"
    path.write_text("\n".join(parts))
    return path

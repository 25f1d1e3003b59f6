"""Reading compiled kernels without a GPU: SASS opcode counts and resource usage from a cubin.

Resource usage comes from the cubin's ELF (read by pyelftools): registers from the kernel's
``.text`` section header (``sh_info >> 24``, as cuobjdump reads it), static shared memory from
its ``.nv.shared`` section, and the per-thread local-memory frame (spills and local arrays) from
the ``EIATTR_FRAME_SIZE`` attribute in ``.nv.info.<kernel>`` (NVIDIA's records, read here).
"""

import io
import re
import struct
from collections import Counter
from dataclasses import dataclass

from elftools.elf.elffile import ELFFile

# Opcodes whose modifiers matter enough to be counted on their own as well.
# WARPGROUP.DEPBAR (a wait on in-flight WGMMAs) tells whether ptxas serialized the WGMMAs.
# FADD2.FTZ.RM: the packed round-down split of sm100's software exp2 (`exp2_emulated_pair`);
# UTCATOMSWS.FIND_AND_SET / .AND: sm100's tensor-memory allocation and release; the pair's
# allocation (cta_group::2) disassembles as UTCATOMSWS.2CTA.FIND_AND_SET.ALIGN, its release as
# the same UTCATOMSWS.AND after a handshake on the dealloc mbarrier; UTMALDG.4D.2CTA: a TMA
# load of the pair (completing on the leader's barrier); UBLKCP.S.S: a bulk copy into the
# peer CTA's shared memory.
FULL_FORM_OPCODES = ("MUFU.EX2", "UTCHMMA.2CTA", "WARPGROUP.DEPBAR", "IMAD.WIDE",
                     "FADD2.FTZ.RM", "UTCATOMSWS.FIND_AND_SET", "UTCATOMSWS.AND",
                     "UTCATOMSWS.2CTA.FIND_AND_SET", "UTMALDG.4D.2CTA", "UBLKCP.S.S")

_SASS_INSTR = re.compile(
    r"/\*[0-9a-f]{4,}\*/\s+(?:\{\s*)?(?:@!?U?P[T0-9]+\s+)?([A-Z][A-Z0-9_]*(?:\.[A-Z0-9_]+)*)"
)

_EIATTR_FRAME_SIZE = 0x11
_EIATTR_REGCOUNT = 0x2F
_EIFMT_SVAL = 0x04


def opcode_counts(sass: str) -> dict:
    """Counts keyed by the bare opcode (``HMMA``), plus the full forms in FULL_FORM_OPCODES."""
    bare = Counter()
    full = Counter()
    for match in _SASS_INSTR.finditer(sass):
        op = match.group(1)
        bare[op.split(".")[0]] += 1
        for form in FULL_FORM_OPCODES:
            if op == form or op.startswith(form + "."):
                full[form] += 1
    counts = dict(sorted(bare.items()))
    counts.update(full)
    return counts


_SASS_LINE = re.compile(r"/\*([0-9a-f]{4,})\*/\s+(.*?)\s*;")
_SASS_LABEL = re.compile(r"^\s*(\.L_x_\d+):")
_BRANCH_TARGET = re.compile(r"\bBRA\b.*?\((\.L_x_\d+)\)")


def loop_bodies(sass: str) -> list:
    """The loops of a disassembly, innermost first: for each backward branch (a ``BRA`` to a
    label above it), the instructions from the label to the branch, as text without the
    address. Nested loops appear once each, the outer ones holding the inner ones."""
    instructions, labels = [], {}
    for line in sass.splitlines():
        label = _SASS_LABEL.match(line)
        if label:
            labels[label.group(1)] = len(instructions)
            continue
        instr = _SASS_LINE.search(line)
        if instr:
            instructions.append(instr.group(2))
    loops = set()
    for end, text in enumerate(instructions):
        target = _BRANCH_TARGET.search(text)
        if target and labels.get(target.group(1), end + 1) <= end:
            loops.add((labels[target.group(1)], end))
    return [instructions[a:b + 1] for a, b in sorted(loops, key=lambda ab: ab[1] - ab[0])]


@dataclass
class KernelResources:
    name: str
    registers: int
    static_smem_bytes: int
    frame_bytes: int


def _sval_attrs(elf: bytes, off: int, size: int) -> dict:
    """{(attr, symbol index): value} for the (symbol, u32) records of an .nv.info section.

    Records are (u8 format, u8 attribute, u16 length, data); only EIFMT_SVAL ones carry data.
    """
    attrs = {}
    pos, end = off, off + size
    while pos + 4 <= end:
        fmt, attr, length = struct.unpack_from("<BBH", elf, pos)
        if fmt != _EIFMT_SVAL:
            pos += 4
            continue
        if length == 8:
            sym, value = struct.unpack_from("<II", elf, pos + 4)
            attrs[(attr, sym)] = value
        pos += 4 + length
    return attrs


def kernel_resources(cubin: bytes) -> list:
    """One KernelResources per kernel in the cubin (its ELF read by pyelftools; the
    `.nv.info` attribute records, NVIDIA's own format, by `_sval_attrs`)."""
    elf = ELFFile(io.BytesIO(cubin))
    if elf.elfclass != 64:
        raise ValueError("not a 64-bit ELF cubin")
    symbols = {sym.name: i for i, sym in enumerate(elf.get_section_by_name(".symtab")
                                                    .iter_symbols())}
    attrs = {}
    for section in elf.iter_sections():
        if section.name == ".nv.info" or section.name.startswith(".nv.info."):
            data = section.data()
            attrs.update(_sval_attrs(data, 0, len(data)))
    kernels = []
    for section in elf.iter_sections():
        if not section.name.startswith(".text."):
            continue
        kname = section.name[len(".text."):]
        sym = symbols.get(kname, -1)
        registers = attrs.get((_EIATTR_REGCOUNT, sym), section["sh_info"] >> 24)
        frame = attrs.get((_EIATTR_FRAME_SIZE, sym), 0)
        shared = elf.get_section_by_name(".nv.shared." + kname)
        smem = shared["sh_size"] if shared is not None else 0
        kernels.append(KernelResources(kname, registers, smem, frame))
    return kernels

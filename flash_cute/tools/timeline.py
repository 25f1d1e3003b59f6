"""Reading and drawing a kernel's measured timeline (`flash_cute.contract.timeline`): the
intervals of each warp's phases, a Gantt chart per warp role (the design chapter's Figure
10-8, measured), and the overlap as numbers: how much of the softmax time a tensor-core GEMM
of another warp runs beside it, and how much of each K/V load's latency no consumer waits
for."""

from __future__ import annotations

from collections import defaultdict

from flash_cute.contract.timeline import EVENT, EVENTS, GEMMS, PHASES


def intervals(records, roles=None) -> list:
    """(cta, warp, role, phase, block, t0, t1) of every phase found in `records` (a nested
    list or array [ctas, warps, slots, 3] of (event, block, ns); rows with event < 0 or a
    zero time are unused). `roles`: warp -> role name (default "warp w")."""
    out = []
    for c, cta in enumerate(records):
        for w, warp in enumerate(cta):
            open_at = {}
            for event, block, t in (tuple(int(v) for v in r) for r in warp):
                if event < 0 or t == 0 or event >= len(EVENTS):
                    continue
                name = EVENTS[event]
                for phase, start, end in PHASES:
                    if name == start:
                        open_at[phase] = (block, t)
                    elif name == end and phase in open_at:
                        b0, t0 = open_at.pop(phase)
                        role = roles.get(w, f"warp {w}") if roles else f"warp {w}"
                        out.append((c, w, role, phase, b0, t0, t))
    return out


def load_latencies(records) -> dict:
    """(cta, block) -> (issued, first used): a block's load issue (its producer's record) and
    the end of the first wait for it (only a consumer sees it land, so a load counts from
    its issue to its first use)."""
    issued, landed = {}, {}
    for c, cta in enumerate(records):
        for warp in cta:
            for event, block, t in (tuple(int(v) for v in r) for r in warp):
                if t == 0 or event < 0:
                    continue
                if event == EVENT["load_issued"]:
                    issued.setdefault((c, block), t)
                elif event == EVENT["wait_end"]:
                    landed[(c, block)] = min(landed.get((c, block), t), t)
    return {k: (issued[k], landed[k]) for k in issued if k in landed}


def _overlap(a0, a1, spans) -> int:
    """Length of [a0, a1) covered by the union of `spans`."""
    covered, cursor = 0, a0
    for s0, s1 in sorted(spans):
        s0, s1 = max(s0, cursor), min(s1, a1)
        if s1 > s0:
            covered += s1 - s0
            cursor = s1
    return covered


def overlap(records, roles=None) -> dict:
    """The overlap in numbers: `tensor_core_during_softmax` (the share of softmax time in
    which a GEMM of another warp of the CTA runs) and `load_latency_hidden` (the share of
    each load's issue-to-landing time in which no consumer of that block was waiting)."""
    spans = intervals(records, roles)
    gemms = defaultdict(list)
    for c, w, _, phase, _, t0, t1 in spans:
        if phase in GEMMS:
            gemms[c].append((w, t0, t1))
    soft_total = soft_covered = 0
    for c, w, _, phase, _, t0, t1 in spans:
        if phase == "softmax":
            soft_total += t1 - t0
            soft_covered += _overlap(t0, t1, [(a, b) for v, a, b in gemms[c] if v != w])
    waits = defaultdict(list)
    for c, _, _, phase, block, t0, t1 in spans:
        if phase == "waiting":
            waits[(c, block)].append((t0, t1))
    latency_total = exposed = 0
    for key, (issued, landed) in load_latencies(records).items():
        latency_total += landed - issued
        exposed += _overlap(issued, landed, waits[key])
    return {"tensor_core_during_softmax": soft_covered / soft_total if soft_total else 0.0,
            "load_latency_hidden": 1 - exposed / latency_total if latency_total else 0.0}


def render(records, path, roles=None, title="measured timeline") -> bool:
    """A Gantt chart of the first CTA's warps (one row per warp that recorded a phase,
    labelled with its role), phases coloured, into `path`."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return False
    spans = [s for s in intervals(records, roles) if s[0] == 0]
    if not spans:
        return False
    start = min(s[5] for s in spans)
    warps = sorted({s[1] for s in spans})
    colors = dict(zip([p for p, _, _ in PHASES], plt.cm.tab10.colors))
    fig, ax = plt.subplots(figsize=(11, 0.5 * len(warps) + 1.5))
    for _, w, _, phase, _, t0, t1 in spans:
        ax.barh(warps.index(w), (t1 - t0) / 1e3, left=(t0 - start) / 1e3, color=colors[phase],
                edgecolor="none")
    labels = [f"{(roles or {}).get(w, 'warp')} ({w})" for w in warps]
    ax.set_yticks(range(len(warps)), labels)
    ax.invert_yaxis()
    ax.set_xlabel("µs since the CTA's first record")
    handles = [plt.Rectangle((0, 0), 1, 1, color=colors[p]) for p, _, _ in PHASES]
    ax.legend(handles, [p for p, _, _ in PHASES], fontsize=7, loc="lower right")
    numbers = overlap(records, roles)
    ax.set_title(f"{title}\ntensor core busy during {numbers['tensor_core_during_softmax']:.0%}"
                 f" of the softmax, {numbers['load_latency_hidden']:.0%} of load latency hidden")
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)
    return True

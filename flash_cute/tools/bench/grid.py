"""The benchmark grid: its axes (head dims, (batch, seqlen) sizes, causal, direction), the
cell record `BenchConfig`, the standard and `--quick` grids and their filters. Pure Python
(no torch, no GPU)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Iterable, Sequence

HDIMS = (64, 128, 256)
SIZES = ((32, 512), (16, 1024), (8, 2048), (4, 4096), (2, 8192), (1, 16384))
QUICK_HDIMS = (64, 128)
QUICK_SIZES = ((8, 2048), (2, 8192))
CAUSALS = (False, True)
DIRECTIONS = ("fwd", "bwd")
# Constant total width (nheads * hdim) keeps the memory traffic per token comparable
# across head dims, as in the flash-attention benchmarks.
MODEL_DIM = 2048


@dataclass(frozen=True)
class BenchConfig:
    """One benchmark cell; layout is [batch, seqlen, nheads, hdim] with seqlen_q == seqlen_k."""

    direction: str
    hdim: int
    causal: bool
    batch: int
    seqlen: int
    nheads: int

    @property
    def key(self) -> tuple:
        """Row identity in the table: (direction, hdim, causal, batch, seqlen)."""
        return (self.direction, self.hdim, self.causal, self.batch, self.seqlen)

    def label(self) -> str:
        """Short human-readable description, used in progress lines."""
        return (f"{self.direction} hdim={self.hdim} causal={int(self.causal)} "
                f"b={self.batch} s={self.seqlen} h={self.nheads}")


def make_grid(quick: bool = False) -> list[BenchConfig]:
    """All cells of the standard (or `--quick`) grid, in table order."""
    hdims, sizes = (QUICK_HDIMS, QUICK_SIZES) if quick else (HDIMS, SIZES)
    return [
        BenchConfig(direction, hdim, causal, batch, seqlen, MODEL_DIM // hdim)
        for direction in DIRECTIONS
        for hdim in hdims
        for causal in CAUSALS
        for batch, seqlen in sizes
    ]


def filter_grid(
    configs: Iterable[BenchConfig],
    hdims: Sequence[int] | None = None,
    seqlens: Sequence[int] | None = None,
    causal: str = "both",
    direction: str = "both",
) -> list[BenchConfig]:
    """Keep the cells matching every given filter (None / "both" means no filter)."""
    causals = {"0": {False}, "1": {True}, "both": {False, True}}[str(causal)]
    directions = set(DIRECTIONS) if direction == "both" else {direction}
    return [
        c for c in configs
        if (hdims is None or c.hdim in hdims)
        and (seqlens is None or c.seqlen in seqlens)
        and c.causal in causals
        and c.direction in directions
    ]

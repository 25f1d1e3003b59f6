"""The ring's overlap condition: a K/V block's transfer to the next rank must take no longer
than the attention over it, or the ring waits on the link.

Forward, per ring step, on a shard of L tokens: the kernel does 4·L²·d·H_q FLOPs (QKᵀ and
PV) while K and V of L tokens, 2·L·d·H_kv elements, cross the link. Overlap holds when
2·L·d·H_kv·bytes / BW ≤ 4·L²·d·H_q / F, that is L ≥ F·H_kv·bytes / (2·H_q·BW): the head dim
cancels. A causal ring step computes about half a block on average, doubling the bound. The
backward does 2.5× the forward's FLOPs and sends K, V and the fp32 dK, dV accumulators
(2·bytes + 2·4 bytes per element instead of 2·bytes).
"""

from __future__ import annotations


def min_block_tokens(bandwidth_gbps: float, tflops: float, heads_q: int, heads_kv: int,
                     bytes_per_element: int = 2, causal: bool = False,
                     direction: str = "fwd") -> float:
    """The smallest shard length L (tokens per rank) at which a ring step's K/V transfer
    (`bandwidth_gbps`: GB/s of the link, one direction) hides under its attention
    (`tflops`: the kernel's achieved TFLOP/s). The head dim cancels.

    Args:
        bandwidth_gbps: the link's GB/s, one direction.
        tflops: the attention kernel's achieved TFLOP/s.
        heads_q: query heads.
        heads_kv: K/V heads (what travels).
        bytes_per_element: of K and V (2 for bf16).
        causal: a causal step does half the work.
        direction: "fwd", or "bwd" (2.5x the work; fp32 dK and dV travel too).

    Returns:
        Tokens per rank.

    Raises:
        ValueError: an unknown direction, or a non-positive argument."""
    if direction not in ("fwd", "bwd"):
        raise ValueError(f"direction must be 'fwd' or 'bwd', got {direction!r}")
    if min(bandwidth_gbps, tflops, heads_q, heads_kv, bytes_per_element) <= 0:
        raise ValueError("bandwidth, TFLOP/s, head counts and bytes must be positive")
    flops_per_token2 = 4.0 * heads_q * (0.5 if causal else 1.0)      # per L² · d
    sent_per_token = 2.0 * heads_kv * bytes_per_element               # per L · d
    if direction == "bwd":
        flops_per_token2 *= 2.5
        sent_per_token += 2.0 * heads_kv * 4                          # fp32 dK, dV
    return tflops * 1e12 * sent_per_token / (bandwidth_gbps * 1e9 * flops_per_token2)

"""Dropout's random numbers, host side: the Philox4x32-10 generator in torch integer ops, the
keep rule, each element's random draw, and the seed a call's kernels read.

Every kernel (forward and backward, any arch, any tiling) and the CPU reference derive the
same keep decision for attention element (b, h, q, k) -- b the batch entry (or varlen
sequence), h the query head, q and k positions inside the sequence -- from the call's 64-bit
seed alone:

* one Philox4x32-10 block, key = the seed's two 32-bit words, counter
  ``(k & ~9, q & ~8, b * nheads + h, 0)``, gives four 32-bit words;
* element (q, k) takes word ``2 * ((q >> 3) & 1) + ((k >> 3) & 1)`` of it, and of that word
  the low 16 bits for even k, the high 16 for odd k;
* it is kept when those 16 bits are below ``t = keep_threshold(p)``, so the keep probability
  is exactly ``t / 65536`` (within 2^-17 of 1 - p): 16 random bits per element, not FA2's 8.
  Kept values are scaled by 1 / (1 - p) (FA2's scaling).

So one block serves the eight elements ``{q, q+8} x {k, k+1, k+8, k+9}`` a thread holds in the
mma.sync / WGMMA accumulator layout (rows q and q+8, column pairs 8 apart), and four of them
in the transposed (Sᵀ) layout of the Hopper backward.

A framed seed (`framed_seed`; `flash_cute.contract.constants`) places a call inside a larger
attention: its rows are positions first + stride · i there, its heads and batch entries
offset, so a context-parallel ring step's kernels draw the whole sequence's decisions.

The seed is drawn on the device by torch's own generator (`draw_seed`), so it follows
torch.manual_seed, and under CUDA-graph capture torch's graph-safe generator state gives every
replay a fresh seed; the kernels read it from device memory, never as a host constant.
"""

import torch

from flash_cute.contract.constants import (
    DROPOUT_FRAME,
    DROPOUT_SHIFT,
    PHILOX_M,
    PHILOX_ROUNDS,
    PHILOX_W,
    dropout_frame_kind,
    keep_threshold,
)

_MASK32 = 0xFFFFFFFF


def keep_probability(dropout_p: float) -> float:
    """The exact probability that an element is kept: keep_threshold(p) / 65536."""
    return keep_threshold(dropout_p) / 65536


def philox4x32(counter, key):
    """Philox4x32-10 (Salmon et al. 2011, as Random123 and cuRAND): `counter` four int64
    tensors of 32-bit values (broadcastable), `key` two ints; returns four int64 tensors."""
    c0, c1, c2, c3 = counter
    k0, k1 = key
    for r in range(PHILOX_ROUNDS):
        if r:
            k0, k1 = (k0 + PHILOX_W[0]) & _MASK32, (k1 + PHILOX_W[1]) & _MASK32
        hi0, lo0 = _mulhilo(c0, PHILOX_M[0])
        hi1, lo1 = _mulhilo(c2, PHILOX_M[1])
        c0, c1, c2, c3 = hi1 ^ c1 ^ k0, lo1, hi0 ^ c3 ^ k1, lo0
    return c0, c1, c2, c3


def _mulhilo(a, m: int):
    """(high, low) 32-bit words of the 64-bit product a * m, in int64 without overflow (a
    and m below 2^32: the product is formed from a's 16-bit halves)."""
    t1, t2 = (a & 0xFFFF) * m, (a >> 16) * m
    s = t1 + ((t2 & 0xFFFF) << 16)
    return (s >> 32) + (t2 >> 16), s & _MASK32


def seed_words(seed: torch.Tensor) -> tuple:
    """The two 32-bit key words of a seed tensor (int64 [1], as `draw_seed` makes it)."""
    value = int(seed.reshape(-1)[0].item()) & ((1 << 64) - 1)
    return value & _MASK32, value >> 32


def random16(seed: torch.Tensor, batch_head: torch.Tensor, q: torch.Tensor, k: torch.Tensor):
    """Each element's 16 random bits (int64, broadcast over `batch_head` = b * nheads + h, `q`
    and `k`), as the kernels draw them."""
    key = seed_words(seed)
    zero = torch.zeros((), dtype=torch.int64, device=q.device)
    # The kernels' coordinates are 32-bit: a framed call's positions wrap as theirs do.
    q, k, batch_head = q & _MASK32, k & _MASK32, batch_head & _MASK32
    words = philox4x32((k & ~9, q & ~8, batch_head, zero), key)
    which = 2 * ((q >> 3) & 1) + ((k >> 3) & 1)
    stacked = torch.stack(torch.broadcast_tensors(*words), dim=0)
    shape = torch.broadcast_shapes(batch_head.shape, q.shape, k.shape)
    word = torch.gather(stacked, 0, torch.broadcast_to(which, shape)[None])[0]
    return (word >> (16 * (k & 1))) & 0xFFFF


def framed_seed(seed: torch.Tensor, q_first: int = 0, k_first: int = 0, stride: int = 1,
                head_offset: int = 0, batch_offset: int = 0, *, heads: int) -> torch.Tensor:
    """`seed` (int64 [1]) with a coordinate frame (`contract.constants`): a call whose query
    row i is position q_first + stride · i of a larger attention (keys alike), whose head h
    is head_offset + h of its `heads`, and whose batch entry b is batch_offset + b, draws that
    attention's decisions (`heads`: the larger attention's query heads, which number the
    streams, so it has no default). A shift whose starts are multiples of 16 takes the short form
    (`DROPOUT_SHIFT`), which the kernels draw as fast as a plain seed. Values are 32-bit:
    0 ≤ each < 2^31."""
    frame = (q_first, k_first, stride, head_offset, batch_offset, heads)
    if not all(isinstance(x, int) and 0 <= x < 2 ** 31 for x in frame) or stride < 1 or \
            heads < 1:
        raise ValueError(f"a dropout frame takes 32-bit non-negative ints, stride and heads ≥ "
                         f"1: got {dict(zip(DROPOUT_FRAME, frame))}")
    if stride == 1 and q_first % 16 == 0 and k_first % 16 == 0:
        frame = (q_first // 16, k_first // 16, head_offset, batch_offset, heads)
    tail = torch.tensor(frame, dtype=torch.int64, device=seed.device)
    return torch.cat([seed.reshape(1), tail])


def frame_of(seed: torch.Tensor, nheads: int) -> dict:
    """A seed's frame as `DROPOUT_FRAME`'s fields (ints); a plain seed's is the identity."""
    values = seed.reshape(-1)[1:].tolist()
    kind = dropout_frame_kind(seed.numel())
    if kind == "frame":
        return dict(zip(DROPOUT_FRAME, values))
    shift = dict(zip(DROPOUT_SHIFT, values or (0, 0, 0, 0, nheads)))
    return dict(q_first=16 * shift["q_first_16"], k_first=16 * shift["k_first_16"], stride=1,
                head_offset=shift["head_offset"], batch_offset=shift["batch_offset"],
                heads=shift["heads"])


def keep_mask(seed: torch.Tensor, dropout_p: float, batch_index, nheads: int, seqlen_q: int,
              seqlen_k: int, device=None) -> torch.Tensor:
    """The keep decisions [len(batch_index), nheads, seqlen_q, seqlen_k] (bool) of the batch
    entries (or varlen sequences) `batch_index`, for positions from 0 in each, or where a
    framed seed (`framed_seed`) places them."""
    device = seed.device if device is None else device
    f = frame_of(seed, nheads)
    b = torch.as_tensor(list(batch_index), dtype=torch.int64, device=device) + f["batch_offset"]
    h = torch.arange(nheads, dtype=torch.int64, device=device) + f["head_offset"]
    q = torch.arange(seqlen_q, dtype=torch.int64, device=device) * f["stride"] + f["q_first"]
    k = torch.arange(seqlen_k, dtype=torch.int64, device=device) * f["stride"] + f["k_first"]
    bh = (b[:, None] * f["heads"] + h[None, :])[:, :, None, None]
    return random16(seed.reshape(-1)[:1].to(device), bh, q[:, None], k[None, :]) < \
        keep_threshold(dropout_p)


def draw_seed(device) -> torch.Tensor:
    """A call's seed: int64 [1] from torch's generator of `device` (on the device, so CUDA
    graph replays draw a new one)."""
    return torch.empty(1, dtype=torch.int64, device=device).random_()

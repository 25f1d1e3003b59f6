"""Constants the host code, the float models and the kernels share. Plain Python, no torch and
no CuTe DSL, so that a device block can read them without importing a torch module."""

from typing import Optional

# A block mask's state of one (query block, key block) tile: skipped, masked element by
# element, or kept whole.
EMPTY, PARTIAL, FULL = 0, 1, 2

# Dropout's Philox4x32-10: multipliers, key increments (Weyl constants) and rounds.
PHILOX_M = (0xD2511F53, 0xCD9E8D57)
PHILOX_W = (0x9E3779B9, 0xBB67AE85)
PHILOX_ROUNDS = 10

# A framed dropout seed (int64): the seed, then where a call's elements sit in a larger
# attention, so that its keep decisions are that attention's (a context-parallel ring step's
# local kernels take one). Head h of batch entry b draws the stream (b + batch_offset) ·
# heads + head_offset + h. Two forms, told apart by their length (no value need be read on
# the host):
# * a shift, int64 [1 + 5]: query row i is position 16 · q_first_16 + i, keys alike. Starts
#   at multiples of 16 keep the kernels' Philox groups whole: they draw as fast as unframed.
# * any frame, int64 [1 + 6]: query row i is position q_first + stride · i, keys alike; the
#   kernels draw a Philox block per element.
# A plain seed (int64 [1]) is the shift (0, 0, 0, 0, the call's own heads).
DROPOUT_SHIFT = ("q_first_16", "k_first_16", "head_offset", "batch_offset", "heads")
DROPOUT_FRAME = ("q_first", "k_first", "stride", "head_offset", "batch_offset", "heads")


def dropout_frame_kind(seed_numel: int) -> Optional[str]:
    """"" (a plain seed), "shift" or "frame", from a seed tensor's length (None: no form).
    Compared, not hashed: under torch.compile the length is a symbolic int."""
    for kind, length in (("", 1), ("shift", 1 + len(DROPOUT_SHIFT)),
                         ("frame", 1 + len(DROPOUT_FRAME))):
        if seed_numel == length:
            return kind
    return None


def keep_threshold(dropout_p: float) -> int:
    """t with keep ⇔ (16 random bits) < t: round((1 - p) · 2^16), at most 65535 (so a
    kernel's 32-bit compare of ``t << 16`` holds), at least 1."""
    return max(1, min(65535, int((1.0 - dropout_p) * 65536 + 0.5)))


# p(f) ~ 2^f on [0, 1): coefficients of f, f^2, ... (the constant is exactly 1).
# Fitted once by linear programming (minimax relative error on 20001 points of
# [0, 1]) with p(0) = 1 and p(1) = 2 pinned, so 2^j * p(f) is continuous at
# every integer; p(1) evaluates to exactly 2.0 in float32 Horner form.
EXP2_POLY_COEFFS = {
    3: (0.695424318, 0.226307675, 0.0782679692),
    4: (0.693032205, 0.241379663, 0.0520322807, 0.013555848),
    5: (0.693152308, 0.240156025, 0.0558243245, 0.00898833852, 0.00187899789),
}

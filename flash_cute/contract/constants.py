"""Constants the host code, the float models and the kernels share. Plain Python, no torch and
no CuTe DSL, so that a device block can read them without importing a torch module."""

# A block mask's state of one (query block, key block) tile: skipped, masked element by
# element, or kept whole.
EMPTY, PARTIAL, FULL = 0, 1, 2

# Dropout's Philox4x32-10: multipliers, key increments (Weyl constants) and rounds.
PHILOX_M = (0xD2511F53, 0xCD9E8D57)
PHILOX_W = (0x9E3779B9, 0xBB67AE85)
PHILOX_ROUNDS = 10


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

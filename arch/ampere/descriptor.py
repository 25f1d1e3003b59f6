"""The ampere pipeline's descriptor: sm80 code (cp.async + mma.sync), which runs on every GPU
from sm80 on."""

from flash_cute.contract import descriptor as caps
from flash_cute.contract.descriptor import Pipeline

from flash_cute.arch.ampere import planner as api


def _inspect_configs() -> tuple:
    from flash_cute.arch.ampere.inspect_configs import CONFIGS

    return CONFIGS


AMPERE = Pipeline(
    name="ampere",
    majors=range(8, 13),
    # dQ is added with fp32 atomics, so its rounding depends on the order CTAs finish: no
    # deterministic backward.
    capabilities=frozenset({caps.FORWARD, caps.BACKWARD, caps.CAUSAL, caps.LOCAL, caps.SOFTCAP,
                            caps.GQA, caps.VARLEN, caps.SEQUSED, caps.DROPOUT,
                            caps.MODS, caps.BLOCK_SPARSE}),
    plan_forward=api.plan_forward,
    plan_backward=api.plan_backward,
    check_supported=api.check_supported,
    inspect_configs=_inspect_configs,
)

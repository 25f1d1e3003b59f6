"""A kernel's declared pipeline (`flash_cute.contract.pipeline`) against its SASS: what the
machine code shows of the roles and the memories.

* setmaxnreg: the budgets of the USETMAXREG instructions are the declared budgets, and there
  are at least as many instructions as distinct budgets and at most one per warpgroup (the
  consumer warpgroups of the hopper kernels share one code path); a kernel that declares no
  budget has no USETMAXREG, and its rule puts all warps in one role.
* the register pool: setmaxnreg only moves registers within the CTA's allocation (the
  launch's registers per thread times its threads), so the budgets, one per warpgroup, must
  fit in it (past it, a TRY_ALLOC spins forever).
* tensor memory: allocated (UTCATOMSWS.FIND_AND_SET, tcgen05.alloc; the pair's
  UTCATOMSWS.2CTA.FIND_AND_SET) exactly when a buffer lives in TMEM.
* the global timer: read only by a kernel compiled to record its timeline.
"""

from __future__ import annotations

import re

from flash_cute.contract.pipeline import Pipeline

_SETMAXREG = re.compile(r"USETMAXREG\.(?:TRY_ALLOC|DEALLOC)\.CTAPOOL\s+(?:UP\d+,\s*)?(0x[0-9a-f]+)")


def sass_facts(sass: str) -> dict:
    """What the SASS text says about roles and memories."""
    return {"setmaxnreg": [int(v, 16) for v in _SETMAXREG.findall(sass)],
            "tmem_alloc": ("UTCATOMSWS.FIND_AND_SET" in sass
                           or "UTCATOMSWS.2CTA.FIND_AND_SET" in sass),
            "global_timer": "SR_GLOBALTIMER" in sass}


def check(pipeline: Pipeline, sass: str, registers: int | None = None) -> list:
    """The ways `pipeline` disagrees with the kernel's SASS text (empty: none); `registers`,
    the compiled kernel's per thread, adds the register pool's check."""
    facts = sass_facts(sass)
    found = facts["setmaxnreg"]
    budgets = pipeline.budgets()
    problems = []
    if budgets:
        if set(found) != set(budgets.values()):
            problems.append(f"setmaxnreg budgets in the SASS {sorted(set(found))} are not the "
                            f"declared {sorted(set(budgets.values()))}")
        if not len(set(budgets.values())) <= len(found) <= len(budgets):
            problems.append(f"{len(found)} USETMAXREG for {len(budgets)} warpgroups of "
                            f"{len(set(budgets.values()))} budgets")
        if registers is not None and sum(budgets.values()) > registers * len(budgets):
            problems.append(f"setmaxnreg budgets {budgets} need {sum(budgets.values())} "
                            f"registers a thread-row; the CTA holds {registers} x "
                            f"{len(budgets)}")
    else:
        if found:
            problems.append(f"USETMAXREG {found} in a kernel that declares no budget")
        if len(pipeline.roles) != 1:
            problems.append("without setmaxnreg the declared rule puts all warps in one role, "
                            f"but {len(pipeline.roles)} roles are declared")
    if pipeline.uses("TMEM") != facts["tmem_alloc"]:
        problems.append(f"TMEM buffers declared: {pipeline.uses('TMEM')}, TMEM allocated in "
                        f"the SASS: {facts['tmem_alloc']}")
    return problems

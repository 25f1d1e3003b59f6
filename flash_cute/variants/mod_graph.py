"""Score and mask modifications in FlexAttention's form: the public names, gathered (a facade).

Users were shown this path (`flash_cute.mod_graph.register`, now
`flash_cute.variants.mod_graph`); the code lives in four modules, by role:

* `flash_cute.variants.tracer`: `trace` records a score / mask mod with torch.fx into a
  `ModGraph` in the op subset `OPS` (anything else raises `UnsupportedMod`), and evaluates a
  graph on broadcast index grids (`evaluate`, `values`, `index_grids`); `alibi_graph`.
* `flash_cute.variants.derivative`: the generated derivative (`score_derivative`,
  `load_derivative`, `derivative`), the learnable captured tensors (`learnable_loads`,
  `learnable`) and their gradients in torch (`accumulate_load_grads`).
* `flash_cute.variants.kernel_view`: what the kernels compile of a call's mods
  (`kernel_mods`, a `KernelMods`; the limits `MAX_AUX`, `AUX_DTYPES`; `aux_for_kernel`).
* `flash_cute.variants.registry`: the registry behind the operators' `variant` key
  (`CallMods`, `register`, `register_alibi`, `register_fa4`, `registered`, `lookup`,
  `holders`, `SCALAR_ENTRIES`).

The package's own code imports each name from the module that defines it, never from here.
Module-level state (the registry's dicts, `SCALAR_ENTRIES`) lives in `registry` alone:
rebinding a name here changes nothing there. `INPUTS`, `LENGTH_INPUTS`, `MASK_INPUTS`,
`Node`, `KernelMods` and `input_reads` are `flash_cute.contract.mods`' names, kept here as
this module always exported them.
"""

from flash_cute.contract.mods import (
                                     INPUTS,
                                     LENGTH_INPUTS,
                                     MASK_INPUTS,
                                     KernelMods,
                                     Node,
                                     input_reads,
)
from flash_cute.variants.derivative import (
                                     accumulate_load_grads,
                                     derivative,
                                     learnable,
                                     learnable_loads,
                                     load_derivative,
                                     score_derivative,
)
from flash_cute.variants.kernel_view import AUX_DTYPES, MAX_AUX, aux_for_kernel, kernel_mods
from flash_cute.variants.registry import (
                                     SCALAR_ENTRIES,
                                     CallMods,
                                     holders,
                                     lookup,
                                     register,
                                     register_alibi,
                                     register_fa4,
                                     registered,
)
from flash_cute.variants.tracer import (
                                     OPS,
                                     ModGraph,
                                     UnsupportedMod,
                                     alibi_graph,
                                     evaluate,
                                     index_grids,
                                     trace,
                                     values,
)

__all__ = [
    # tracer
    "OPS", "ModGraph", "UnsupportedMod", "alibi_graph", "evaluate", "index_grids", "trace",
    "values",
    # derivative
    "accumulate_load_grads", "derivative", "learnable", "learnable_loads", "load_derivative",
    "score_derivative",
    # kernel_view
    "AUX_DTYPES", "MAX_AUX", "aux_for_kernel", "kernel_mods",
    # registry
    "SCALAR_ENTRIES", "CallMods", "holders", "lookup", "register", "register_alibi",
    "register_fa4", "registered",
    # flash_cute.contract.mods
    "INPUTS", "LENGTH_INPUTS", "MASK_INPUTS", "KernelMods", "Node", "input_reads",
]

"""Score and mask modifications in FlexAttention's form, traced into a small op graph.

A score mod is a plain torch function ``score_mod(score, b, h, q_idx, kv_idx) -> score`` and a
mask mod ``mask_mod(b, h, q_idx, kv_idx) -> bool``, the very functions a user passes to
`torch.nn.attention.flex_attention`, with captured tensors (``slopes[h]``,
``bias[q_idx - kv_idx]``). `trace` records one with torch.fx into a `ModGraph`: a list of
nodes over the five inputs, constants and loads from the captured tensors, in a documented
op subset (`OPS`); anything else is refused with the op's name. The graph is what every
implementation runs: `evaluate` (torch, on broadcast index grids: the reference and the CPU
operator), `derivative.score_derivative` (d out / d score, generated from the same graph, so no
hand-written backward is needed) and, next, the kernels' code (`kernel_view.kernel_mods`).

Semantics, shared by every implementation:

* ``score`` is the scaled score q·k · softmax_scale; the mod's result goes to the softmax.
* ``b`` is the batch entry (the sequence, for the packed layout), ``h`` the query head,
  ``q_idx`` / ``kv_idx`` the positions inside the sequence; all int32.
* A load from a captured tensor clamps each index into the tensor's extent, so no index
  arithmetic reads outside it.
"""

import functools
import operator
from typing import Callable, NamedTuple, Optional

import torch

from flash_cute.contract.mods import INPUTS, LENGTH_INPUTS, MASK_INPUTS, Node

# Graph op -> (arity, torch implementation). Loads ("load") and constants are nodes of their own.
OPS = {
    "add": (2, torch.add), "sub": (2, torch.sub), "mul": (2, torch.mul),
    "div": (2, torch.div), "floordiv": (2, lambda a, b: torch.div(a, b, rounding_mode="floor")),
    "mod": (2, torch.remainder), "pow": (2, torch.pow),
    "minimum": (2, torch.minimum), "maximum": (2, torch.maximum),
    "lt": (2, torch.lt), "le": (2, torch.le), "gt": (2, torch.gt), "ge": (2, torch.ge),
    "eq": (2, torch.eq), "ne": (2, torch.ne),
    "and": (2, torch.logical_and), "or": (2, torch.logical_or),
    "neg": (1, torch.neg), "not": (1, torch.logical_not), "abs": (1, torch.abs),
    "exp": (1, torch.exp), "log": (1, torch.log), "tanh": (1, torch.tanh),
    "sigmoid": (1, torch.sigmoid), "sqrt": (1, torch.sqrt),
    "where": (3, torch.where),
}

# torch.fx targets -> graph ops.
_FUNCTIONS = {
    operator.add: "add", operator.sub: "sub", operator.mul: "mul", operator.truediv: "div",
    operator.floordiv: "floordiv", operator.mod: "mod", operator.pow: "pow",
    operator.neg: "neg", operator.lt: "lt", operator.le: "le", operator.gt: "gt",
    operator.ge: "ge", operator.eq: "eq", operator.ne: "ne", operator.and_: "and",
    operator.or_: "or", operator.invert: "not", operator.abs: "abs", operator.getitem: "load",
    torch.add: "add", torch.sub: "sub", torch.mul: "mul", torch.div: "div",
    torch.neg: "neg", torch.abs: "abs", torch.exp: "exp", torch.log: "log",
    torch.tanh: "tanh", torch.sigmoid: "sigmoid", torch.sqrt: "sqrt", torch.where: "where",
    torch.minimum: "minimum", torch.maximum: "maximum", torch.logical_and: "and",
    torch.logical_or: "or", torch.logical_not: "not",
}
_METHODS = {"exp": "exp", "log": "log", "tanh": "tanh", "sigmoid": "sigmoid", "abs": "abs",
            "sqrt": "sqrt", "neg": "neg", "__getitem__": "load"}


class ModGraph(NamedTuple):
    """A traced mod: nodes in order, the output node, and the captured tensors it loads."""
    nodes: tuple
    output: int
    aux: tuple
    kind: str  # "score" or "mask"

    def uses(self, name: str) -> bool:
        return any(n.op == name for n in self.nodes)


class UnsupportedMod(TypeError):
    """A mod uses an operation outside `OPS` (or a form of one the kernels cannot run)."""


def trace(fn: Callable, kind: str = "score") -> ModGraph:
    """The `ModGraph` of a FlexAttention-form score mod (``kind="score"``) or mask mod
    (``"mask"``); raises `UnsupportedMod` naming what is outside the op subset."""
    import torch.fx

    names = INPUTS if kind == "score" else MASK_INPUTS
    try:
        tracer = _tracer_class()()
        graph = tracer.trace(_positional(fn, len(names)))
        gm = torch.fx.GraphModule(tracer.root, graph)
    except UnsupportedMod:
        raise
    except Exception as exc:
        raise UnsupportedMod(f"{kind}_mod {getattr(fn, '__name__', fn)!r} could not be traced "
                             f"({type(exc).__name__}: {exc}); mods are traced with torch.fx: "
                             "no data-dependent Python control flow (use torch.where)") from exc
    return _Builder(gm, names, kind).build()


@functools.lru_cache(maxsize=None)
def _tracer_class():
    import torch.fx

    class Tracer(torch.fx.Tracer):
        """torch.fx's tracer, taking captured `nn.Parameter`s (a learnable bias, ALiBi slopes)
        as it takes captured tensors: fx looks a parameter up among its root module's, which a
        traced function has none of."""

        def create_arg(self, a):
            if isinstance(a, torch.nn.Parameter) and not any(
                    a is p for p in self.root.parameters()):
                self.root.register_parameter(f"_captured_{len(list(self.root.parameters()))}", a)
            return super().create_arg(a)

    return Tracer


def _positional(fn: Callable, arity: int) -> Callable:
    """`fn` behind a wrapper with exactly `arity` positional parameters (fx traces by them)."""
    args = ", ".join(f"a{i}" for i in range(arity))
    scope = {"fn": fn}
    exec(f"def mod({args}):\n    return fn({args})\n", scope)  # noqa: S102 - fixed template
    return scope["mod"]


class _Builder:
    def __init__(self, gm, names, kind):
        self.gm, self.names, self.kind = gm, names, kind
        self.nodes, self.aux, self.index = [], [], {}

    def build(self) -> ModGraph:
        output = None
        for node in self.gm.graph.nodes:
            if node.op == "placeholder":
                self.index[node] = self._add(self.names[len(self.index)], ())
            elif node.op == "get_attr":
                self.index[node] = ("aux", self._aux(getattr(self.gm, node.target)))
            elif node.op in ("call_function", "call_method"):
                self.index[node] = self._call(node)
            elif node.op == "output":
                output = self._value(node.args[0])
        if isinstance(output, tuple) or output is None:
            raise UnsupportedMod(f"{self.kind}_mod must return a value computed from its inputs")
        return ModGraph(tuple(self.nodes), output, tuple(self.aux), self.kind)

    def _add(self, op, args) -> int:
        self.nodes.append(Node(op, tuple(args)))
        return len(self.nodes) - 1

    def _aux(self, tensor) -> int:
        for i, t in enumerate(self.aux):
            if t is tensor:
                return i
        self.aux.append(tensor)
        return len(self.aux) - 1

    def _value(self, arg) -> int:
        """The node index of an fx argument (a node, or a Python number made a constant)."""
        if isinstance(arg, (bool, int, float)):
            return self._add("const", (arg,))
        if isinstance(arg, torch.Tensor) and arg.dim() == 0:
            return self._add("const", (arg.item(),))
        value = self.index.get(arg)
        if value is None or isinstance(value, tuple):
            raise UnsupportedMod(f"{self.kind}_mod uses {arg!r} as a value; captured tensors "
                                 "may only be indexed (e.g. bias[q_idx - kv_idx])")
        return value

    def _call(self, node) -> int:
        target = node.target
        op = (_FUNCTIONS.get(target) if node.op == "call_function" else _METHODS.get(target))
        if op is None:
            name = getattr(target, "__name__", str(target))
            raise UnsupportedMod(
                f"{self.kind}_mod uses {name!r}, which flash-cute's mods do not support; "
                f"supported: {', '.join(sorted(OPS))} (and their operators), indexing of "
                "captured tensors, Python numbers")
        if node.kwargs:
            raise UnsupportedMod(f"{self.kind}_mod passes keyword arguments to {op!r}")
        if op == "load":
            return self._load(node)
        arity = OPS[op][0]
        if len(node.args) != arity:
            raise UnsupportedMod(f"{self.kind}_mod calls {op!r} with {len(node.args)} "
                                 f"arguments, not {arity}")
        return self._add(op, [self._value(a) for a in node.args])

    def _load(self, node) -> int:
        base, index = node.args
        source = self.index.get(base)
        if not (isinstance(source, tuple) and source[0] == "aux"):
            raise UnsupportedMod(f"{self.kind}_mod indexes a computed value; only captured "
                                 "tensors may be indexed")
        tensor = self.aux[source[1]]
        index = index if isinstance(index, tuple) else (index,)
        if len(index) != tensor.dim():
            raise UnsupportedMod(f"{self.kind}_mod indexes a {tensor.dim()}-D captured tensor "
                                 f"with {len(index)} indices; index every dimension")
        if tensor.dtype.is_complex:
            raise UnsupportedMod(f"{self.kind}_mod loads from a complex tensor")
        return self._add("load", (source[1], *[self._value(i) for i in index]))


def evaluate(graph: ModGraph, inputs: dict, aux: Optional[tuple] = None):
    """The graph's output on broadcastable torch tensors `inputs` (by input name); `aux`
    replaces the captured tensors (same shapes), e.g. moved to another device."""
    return _tensor(values(graph, inputs, aux)[graph.output])


def values(graph: ModGraph, inputs: dict, aux: Optional[tuple] = None) -> list:
    """Every node's value, as `evaluate` computes them."""
    aux = graph.aux if aux is None else aux
    out = []
    for node in graph.nodes:
        if node.op in INPUTS or node.op in LENGTH_INPUTS:
            out.append(inputs[node.op])
        elif node.op == "const":
            out.append(node.args[0])
        elif node.op == "load":
            out.append(_load(aux[node.args[0]], [out[i] for i in node.args[1:]]))
        else:
            out.append(OPS[node.op][1](*[_tensor(out[i]) for i in node.args]))
    return out


def _tensor(value):
    """A tensor of a value; Python floats become float64 0-d tensors, which keep a constant
    exact without widening the dimensioned tensors they meet (type promotion)."""
    if isinstance(value, torch.Tensor):
        return value
    return torch.tensor(value, dtype=torch.float64 if isinstance(value, float) else None)


def _load(tensor: torch.Tensor, index: list):
    """tensor[index] with each index clamped into its dimension (the kernels' rule)."""
    clamped = []
    for dim, i in enumerate(index):
        i = _tensor(i).to(torch.int64, copy=False) if not isinstance(i, int) else torch.tensor(i)
        clamped.append(i.clamp(0, tensor.shape[dim] - 1).to(tensor.device))
    return tensor[tuple(clamped)]


def index_grids(batch_index, heads: int, seqlen_q: int, seqlen_k: int, device=None) -> dict:
    """Broadcastable int32 grids of b [B, 1, 1, 1], h [1, H, 1, 1], q_idx [1, 1, Q, 1] and
    kv_idx [1, 1, 1, K] (`batch_index`: an int, or a list of batch entries)."""
    b = torch.tensor(batch_index if isinstance(batch_index, list) else [batch_index],
                     dtype=torch.int32, device=device)
    return {"b": b.view(-1, 1, 1, 1),
            "h": torch.arange(heads, dtype=torch.int32, device=device).view(1, -1, 1, 1),
            "q_idx": torch.arange(seqlen_q, dtype=torch.int32, device=device).view(1, 1, -1, 1),
            "kv_idx": torch.arange(seqlen_k, dtype=torch.int32, device=device).view(1, 1, 1, -1)}


def alibi_graph(slopes: torch.Tensor) -> ModGraph:
    """FlashAttention-2's ALiBi as a score mod: score − slope · |q_idx + seqlen_k − seqlen_q −
    kv_idx| (bottom-right aligned), slopes fp32 [nheads] or [batch, nheads]."""
    nodes = [Node(name, ()) for name in INPUTS + LENGTH_INPUTS]   # 0..6
    at = {name: i for i, name in enumerate(INPUTS + LENGTH_INPUTS)}

    def add(op, *args):
        nodes.append(Node(op, args))
        return len(nodes) - 1

    index = (at["h"],) if slopes.dim() == 1 else (at["b"], at["h"])
    slope = add("load", 0, *index)
    shift = add("sub", add("add", at["q_idx"], at["seqlen_k"]), at["seqlen_q"])
    distance = add("abs", add("sub", shift, at["kv_idx"]))
    out = add("sub", at["score"], add("mul", slope, distance))
    return ModGraph(tuple(nodes), out, (slopes,), "score")

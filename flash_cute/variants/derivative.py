"""The generated derivative of a traced score mod (`tracer.ModGraph`), and the gradients of its
learnable captured tensors.

`score_derivative` (d out / d score) and `load_derivative` (d out / d a load from a captured
tensor) build a graph of the same nodes by forward differentiation (`derivative`, each op's
`_rule`), so no hand-written backward is needed; `learnable_loads` / `learnable` pick the
captured tensors that get gradients, and `accumulate_load_grads` evaluates theirs in torch
(the CPU operators and the reference), as the kernels' atomics accumulate them.
"""

from typing import Callable, Optional

import torch

from flash_cute.contract.mods import INPUTS, LENGTH_INPUTS, Node
from flash_cute.variants.tracer import ModGraph, UnsupportedMod, _tensor, evaluate, values

# Comparisons and logic ops: bool values, whose derivative is 0 (`_rule`).
_BOOL = {"lt", "le", "gt", "ge", "eq", "ne", "and", "or", "not"}


def score_derivative(graph: ModGraph) -> ModGraph:
    """The graph of d(score_mod)/d(score), over the same inputs and captured tensors,
    from each op's rule (a load, a comparison and an index are constant in the score)."""
    if graph.kind != "score":
        raise ValueError("only a score mod has a derivative")
    return derivative(graph, lambda i, node: node.op == "score")


def load_derivative(graph: ModGraph, load: int) -> ModGraph:
    """The graph of d(score_mod)/d(the value node `load` reads from a captured tensor): the
    factor of that tensor's gradient at the element's (clamped) index."""
    if graph.nodes[load].op != "load":
        raise ValueError(f"node {load} is not a load")
    return derivative(graph, lambda i, node: i == load)


def derivative(graph: ModGraph, wrt: Callable) -> ModGraph:
    """The graph of d(output)/d(x), x the nodes `wrt(index, node)` picks (each counting as x
    itself), by forward differentiation: every other input, constant and load is constant."""
    nodes = list(graph.nodes)
    zero = _append(nodes, Node("const", (0.0,)))
    one = _append(nodes, Node("const", (1.0,)))
    deriv = {}
    for i, node in enumerate(graph.nodes):
        deriv[i] = one if wrt(i, node) else _rule(nodes, node, i, deriv, zero, one)
    return ModGraph(tuple(nodes), deriv[graph.output], graph.aux, graph.kind)


def learnable_loads(graph: Optional[ModGraph]) -> tuple:
    """The load nodes of a score mod that read a floating-point captured tensor requiring
    grad (a learnable bias, ALiBi slopes): their tensors get gradients."""
    if graph is None or graph.kind != "score":
        return ()
    return tuple(i for i, n in enumerate(graph.nodes) if n.op == "load"
                 and graph.aux[n.args[0]].is_floating_point()
                 and graph.aux[n.args[0]].requires_grad)


def learnable(variant: Optional["CallMods"]) -> tuple:  # noqa: F821 - registry.CallMods
    """The captured tensors of a call's mods that get gradients, in the order the backward
    returns them (first load first; each tensor once)."""
    if variant is None or variant.fa4 is not None:
        return ()
    graph = variant.score_mod
    out = []
    for i in learnable_loads(graph):
        t = graph.aux[graph.nodes[i].args[0]]
        if not any(t is o for o in out):
            out.append(t)
    return tuple(out)


def accumulate_load_grads(graph: ModGraph, inputs: dict, ds, grads: dict) -> None:
    """Add d(loss)/d(captured tensor) for each of `learnable_loads(graph)` into `grads` (by
    the tensor's id: a float tensor of its shape): ``ds`` [b, h, sq, sk] is d(loss)/d(the
    mod's output); each element adds ds · d(output)/d(load) at the load's clamped index, as
    the kernels' atomics do."""
    aux = tuple(t.detach().to(ds.device) for t in graph.aux)
    vals = values(graph, inputs, aux)
    for load in learnable_loads(graph):
        node = graph.nodes[load]
        tensor, grad = graph.aux[node.args[0]], grads[id(graph.aux[node.args[0]])]
        factor = evaluate(load_derivative(graph, load), inputs, aux)
        contrib = ds * torch.broadcast_to(torch.as_tensor(factor, dtype=ds.dtype,
                                                          device=ds.device), ds.shape)
        index = []
        for dim, i in enumerate(node.args[1:]):
            idx = torch.as_tensor(_tensor(vals[i]), device=ds.device).to(torch.int64)
            index.append(torch.broadcast_to(idx.clamp(0, tensor.shape[dim] - 1), ds.shape))
        grad.index_put_(tuple(i.reshape(-1) for i in index), contrib.reshape(-1).to(grad.dtype),
                        accumulate=True)


def _append(nodes: list, node: Node) -> int:
    nodes.append(node)
    return len(nodes) - 1


def _rule(nodes, node, i, deriv, zero, one) -> int:
    op, args = node.op, node.args
    if (op in INPUTS or op in LENGTH_INPUTS or op in ("const", "load") or op in _BOOL
            or op in ("floordiv", "mod")):
        return zero
    d = [deriv[a] for a in args]
    if op != "where" and all(x == zero for x in d):
        return zero

    def new(o, *a):
        return _append(nodes, Node(o, a))

    if op in ("add", "sub"):
        return d[0] if d[1] == zero else (new("neg", d[1]) if op == "sub" and d[0] == zero
                                          else new(op, d[0], d[1]) if d[0] != zero else d[1])
    if op == "neg":
        return new("neg", d[0])
    if op == "mul":
        a, b = args
        terms = [new("mul", d[0], b)] if d[0] != zero else []
        terms += [new("mul", a, d[1])] if d[1] != zero else []
        return terms[0] if len(terms) == 1 else new("add", *terms)
    if op == "div":
        a, b = args
        if d[1] == zero:
            return new("div", d[0], b)
        quotient = new("div", new("mul", a, d[1]), new("mul", b, b))
        return new("neg", quotient) if d[0] == zero else new("sub", new("div", d[0], b), quotient)
    if op == "pow":
        if d[1] != zero:
            raise UnsupportedMod("score_mod raises to a power that depends on the score")
        a, n = args
        lower = (_append(nodes, Node("const", (nodes[n].args[0] - 1,)))
                 if nodes[n].op == "const" else new("sub", n, one))
        return new("mul", new("mul", n, new("pow", a, lower)), d[0])
    if op == "exp":
        return new("mul", i, d[0])
    if op == "log":
        return new("div", d[0], args[0])
    if op == "tanh":
        return new("mul", new("sub", one, new("mul", i, i)), d[0])
    if op == "sigmoid":
        return new("mul", new("mul", i, new("sub", one, i)), d[0])
    if op == "sqrt":
        return new("div", d[0], new("mul", _append(nodes, Node("const", (2.0,))), i))
    if op == "abs":
        sign = new("where", new("lt", args[0], zero), new("neg", one), one)
        return new("mul", sign, d[0])
    if op in ("minimum", "maximum"):
        a, b = args
        pick_a = new("le" if op == "minimum" else "ge", a, b)
        return new("where", pick_a, d[0], d[1])
    if op == "where":
        return zero if d[1] == d[2] == zero else new("where", args[0], d[1], d[2])
    raise UnsupportedMod(f"no derivative rule for {op!r}")

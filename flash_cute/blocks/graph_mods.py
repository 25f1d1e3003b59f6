"""Block: traced score and mask mods (`flash_cute.contract.mods.KernelMods`) run inside a kernel.

The graph is walked at trace time, once per score element of a thread's fragment, and each
node becomes a few DSL operations on that element's (score, b, h, q_idx, kv_idx); nodes that
vary with the row only (q_idx, loads indexed by it) are emitted once per row, those that vary
with the column only (kv_idx, loads indexed by it) once per column, the rest once per tile
(`levels`). Semantics follow `tracer.evaluate` (the CPU operators' and the
reference's):

* values are float32, int32 or bool; an int meets a float as float (torch's promotion), `/`
  is true division, `//` and `%` floor (Python's, also for negative operands);
* a load clamps each index into its dimension, so no index content reads outside a tensor;
  where one index of a load varies below the tile, or below a kept row or column, and the
  others do not (`doc[b, kv_idx]`, `bias[h, q_idx - kv_idx]`), the two values a clamp can
  give are read once there and each element loads unclamped under an in-range predicate,
  else takes an edge value: one base address plus constants, where clamped indices needed
  an address (a register pair) per load;
  bool tensors are read as uint8, int64 values as int32;
* exp, log, tanh and sqrt are the hardware's approximate forms (MUFU), as the softmax's own
  exponential and the built-in softcap are.

`Scores` (`flash_cute.blocks.score`) calls `GraphMods.apply` in place of a built-in score mod; the
arch kernels build one per tile (`bind`), with the tile's batch entry, head and lengths.
"""

import cutlass
import cutlass.cute as cute
from cutlass import Boolean, Float32, Int32
from cutlass._mlir.dialects import arith
from cutlass.cutlass_dsl import dsl_user_op

from flash_cute.blocks.dsl_state import DslState
from flash_cute.contract.block_range import tiles_nest
from flash_cute.contract.mods import input_reads


def levels(nodes: tuple, pack: int = 1) -> tuple:
    """Per node, what its value varies with: a subset of {"row", "col", "score"} (empty: the
    whole tile). q_idx varies by row, kv_idx by column; h by row only with packed GQA (a
    tile's rows then hold several heads), else it is the tile's."""
    varying = {"q_idx": {"row"}, "kv_idx": {"col"}, "score": {"score"},
               "h": {"row"} if pack > 1 else set()}
    return tuple(frozenset().union(*(varying.get(name, ()) for name in reads))
                 for reads in input_reads(nodes))


def needed(nodes: tuple, outputs) -> frozenset:
    """The nodes the outputs read, transitively."""
    todo, seen = [o for o in outputs if o is not None], set()
    while todo:
        i = todo.pop()
        if i in seen:
            continue
        seen.add(i)
        node = nodes[i]
        if node.op == "load":
            todo.extend(node.args[1:])
        elif node.op != "const":
            todo.extend(node.args)
    return frozenset(seen)


# The fewest loads of one node per thread and tile that read edge values instead of clamping
# each index: the edge values and the base address stay live across the tile loop, which the
# ampere forward's 8 column loads at 255 registers cannot afford (docs/decisions.md,
# D-MODS-EDGES).
EDGE_LOADS = 16


class GraphMods(DslState):
    """A kernel's traced mods at one tile. `spec`: a `KernelMods` (compile-time); `aux`: the
    captured tensors (cute tensors, in the spec's order); `batch`, `head`: the tile's batch
    entry and head (packed GQA: its K/V head, the rows holding `pack` query heads each);
    `seqlen_q` / `seqlen_k`: the sequence's used lengths."""

    def __init__(self, spec, aux, batch: Int32, head: Int32, seqlen_q: Int32, seqlen_k: Int32,
                 tile_m: int, tile_n: int, pack: int = 1):
        # A backward's fp32 gradients of learnable captured tensors follow the tensors.
        self.spec, self.aux = spec, aux[:len(spec.aux)]
        self.grads = aux[len(spec.aux):len(spec.aux) + len(getattr(spec, "grad_slots", ()))]
        self.batch, self.head = batch, head
        self.seqlen_q, self.seqlen_k = seqlen_q, seqlen_k
        self.tile_m, self.tile_n, self.pack = tile_m, tile_n, pack

    def nested(self) -> bool:
        """Whether each of the kernel's tiles lies within one of the block mask's blocks
        (`block_range.tiles_nest`)."""
        return tiles_nest(self.spec.block_size, self.tile_m, self.tile_n, self.pack)

    def apply(self, acc_mn: cute.Tensor, coord_mn: cute.Tensor, m_block: Int32, n_block: Int32,
              mod_scale: Float32, grad_mn=None, mask="mod", visible=None):
        """In place: the score mod's output (of the raw score times `mod_scale`), -inf where
        the mask says False: the mask mod's output node by default, else the node `mask`
        (None: no mask, a block mask's full tile; `Scores.sparse_mods`); with `grad_mn`, the
        score mod's derivative there too; `visible` (a DSL Boolean, uniform over the tile)
        ands into the mask. Plain Python at trace time: the walk holds no staged control
        flow."""
        spec = self.spec
        self.mask_out = spec.mask if mask == "mod" else mask
        outs = (spec.score, spec.score_grad if grad_mn is not None else None, self.mask_out)
        live, level, tile = self._tile_walk(outs)
        # What varies by column alone (a document id of kv_idx) is computed once per column,
        # what varies by row alone once per row: the smaller side of the fragment is computed
        # first and kept, the other side one at a time, so few of its values are live at once.
        n_rows, n_cols = cute.size(acc_mn, mode=[0]), cute.size(acc_mn, mode=[1])
        side = self._row_walk if n_rows <= n_cols else self._col_walk
        side_level = frozenset({"row" if n_rows <= n_cols else "col"})
        many = _frequent_loads(live, level, side_level, n_rows, n_cols)
        for i in many:
            tile.edges(i, level)
        kept = [side(tile, live, level, i, coord_mn, m_block, n_block)
                for i in range(min(n_rows, n_cols))]
        for walk in kept:
            for i in many:
                walk.edges(i, level, side_level)
        other = self._col_walk if n_rows <= n_cols else self._row_walk
        for j in range(max(n_rows, n_cols)):
            walk_j = other(tile, live, level, j, coord_mn, m_block, n_block)
            for i in range(min(n_rows, n_cols)):
                r, c = (i, j) if n_rows <= n_cols else (j, i)
                row_walk, col_walk = (kept[i], walk_j) if n_rows <= n_cols else (walk_j, kept[i])
                self._element(col_walk.extended(row_walk.env, row_walk.values), acc_mn, grad_mn,
                              r, c, mod_scale, visible)

    def _tile_walk(self, outs):
        """(the nodes `outs` read, each node's level, a walk holding the tile-level values)."""
        spec = self.spec
        live = sorted(needed(spec.nodes, outs))
        level = levels(spec.nodes, self.pack)
        tile = _Walk(spec.nodes, self.aux, {"b": _index(self.batch), "h": _index(self.head),
                                           "seqlen_q": _index(self.seqlen_q),
                                           "seqlen_k": _index(self.seqlen_k)})
        for i in live:
            if not level[i]:
                tile.value(i)
        return live, level, tile

    def _row_walk(self, tile, live, level, r, coord_mn, m_block, n_block):
        """Row r's inputs and its row-level values."""
        row = Int32(m_block * self.tile_m + coord_mn[r, 0][0])
        env = {"q_idx": _index(row)}
        if cutlass.const_expr(self.pack > 1):
            env = {"q_idx": _index(row // self.pack),
                   "h": _index(self.head * self.pack + row % self.pack)}
        walk = tile.extended(env)
        for i in live:
            if level[i] == {"row"}:
                walk.value(i)
        return walk

    def _col_walk(self, tile, live, level, c, coord_mn, m_block, n_block):
        """Column c's input and its column-level values."""
        walk = tile.extended({"kv_idx": _index(n_block * self.tile_n + coord_mn[0, c][1])})
        for i in live:
            if level[i] == {"col"}:
                walk.value(i)
        return walk

    def _element(self, walk, acc_mn, grad_mn, r: int, c: int, mod_scale, visible):
        spec = self.spec
        s = acc_mn[r, c]
        if cutlass.const_expr(spec.score is not None):
            walk.env["score"] = (s * mod_scale, "f")
            s = walk.as_float(walk.value(spec.score))
            if cutlass.const_expr(grad_mn is not None and spec.score_grad is not None):
                grad_mn[r, c] = walk.as_float(walk.value(spec.score_grad))
        keep = visible
        if cutlass.const_expr(self.mask_out is not None):
            keep = walk.as_bool(walk.value(self.mask_out))
            if cutlass.const_expr(visible is not None):
                keep = keep & visible
        if cutlass.const_expr(keep is not None):
            s = _select(keep, (s, "f"), (-Float32.inf, "f"))[0]
        acc_mn[r, c] = s


    def accumulate_grads(self, ds_mn: cute.Tensor, coord_mn: cute.Tensor, m_block: Int32,
                         n_block: Int32):
        """Add dS · d(score mod)/d(load) of each learnable load (`KernelMods.aux_grads`) into
        its tensor's fp32 gradient at the load's clamped index, over the in-bounds elements;
        `ds_mn`: d(loss)/d(the mod's output), before the chain into the raw score. An index
        uniform over the tile (slopes[h]) takes one atomic per warp, one that varies by row
        or column alone one per row or column, any other one per element. Plain Python at
        trace time, like `apply`."""
        spec = self.spec
        slots = spec.grad_slots
        idx_nodes = [spec.nodes[load].args[1:] for _, load, _ in spec.aux_grads]
        outs = [d for _, _, d in spec.aux_grads] + [i for nodes in idx_nodes for i in nodes]
        live, level, tile = self._tile_walk(outs)
        n_rows, n_cols = cute.size(ds_mn, mode=[0]), cute.size(ds_mn, mode=[1])
        cols = [self._col_walk(tile, live, level, c, coord_mn, m_block, n_block)
                for c in range(n_cols)]
        for (slot, _, dnode), nodes in zip(spec.aux_grads, idx_nodes):
            grad = self.grads[slots.index(slot)]
            varies = frozenset().union(*(level[i] for i in nodes))
            if not varies <= {"row", "col"}:
                raise ValueError(f"a learnable load indexed by {sorted(varies)} "
                                 "(`kernel_view._load_grads` refuses it)")
            per_element = "row" in varies and "col" in varies
            col_sums = [Float32(0.0) for _ in range(n_cols)]
            total = Float32(0.0)
            for r in range(n_rows):
                row = self._row_walk(tile, live, level, r, coord_mn, m_block, n_block)
                row_sum = Float32(0.0)
                for c in range(n_cols):
                    walk = cols[c].extended(row.env, row.values)
                    inside = ((walk.env["q_idx"][0] < self.seqlen_q)
                              & (walk.env["kv_idx"][0] < self.seqlen_k))
                    term = _select(inside, (ds_mn[r, c] * walk.as_float(walk.value(dnode)), "f"),
                                   (0.0, "f"))[0]
                    if per_element:
                        _atomic_add(grad, [walk.value(i) for i in nodes], term)
                    elif "col" in varies:
                        col_sums[c] = col_sums[c] + term
                    else:
                        row_sum = row_sum + term
                if "row" in varies and not per_element:
                    _atomic_add(grad, [row.value(i) for i in nodes], row_sum)
                total = total + row_sum
            if "col" in varies and not per_element:
                for c in range(n_cols):
                    _atomic_add(grad, [cols[c].value(i) for i in nodes], col_sums[c])
            elif not varies:
                # One index for the whole tile: the warp's sum, added by its first lane.
                _atomic_add(grad, [tile.value(i) for i in nodes],
                            cute.arch.warp_reduction_sum(total), lane0=True)


def _frequent_loads(live, level, side_level, n_rows: int, n_cols: int) -> list:
    """The nodes made at least EDGE_LOADS times per thread and tile, which read edge values
    (`_Walk.edges`); the kept side's own loads and those of a small fragment stay clamped."""
    def count(lv):
        per_element = "score" in lv or {"row", "col"} <= lv
        return n_rows * n_cols if per_element else max(n_rows, n_cols)
    return [i for i in live if not level[i] <= side_level and count(level[i]) >= EDGE_LOADS]


@dsl_user_op
def _below(v: Int32, extent: Int32, *, loc=None, ip=None) -> Boolean:
    """0 <= v < extent as one unsigned compare (the DSL compares Uint32 values as signed)."""
    return Boolean(arith.cmpi(arith.CmpIPredicate.ult, v.ir_value(loc=loc, ip=ip),
                              extent.ir_value(loc=loc, ip=ip), loc=loc, ip=ip))


def _clamp(v, extent):
    return cutlass.max(cutlass.min(Int32(v), Int32(extent) - 1), Int32(0))


@cute.jit
def _load_or(t: cute.Tensor, coord, inside, other):
    """t[coord] where `inside`, else `other` (a predicated load: no address is formed outside
    t)."""
    x = other
    if inside:
        x = t[coord] if cutlass.const_expr(len(coord) > 1) else t[coord[0]]
    return x


def _atomic_add(grad: cute.Tensor, idx: list, value, lane0: bool = False):
    """grad[idx] += value, an fp32 atomic (each index clamped into its dimension, as a load
    reads), skipped where value is 0 (masked and out-of-bounds elements); `lane0`: by the
    warp's first lane alone (a value the warp has summed)."""
    coord = [_clamp(v, grad.shape[dim]) for dim, (v, _) in enumerate(idx)]
    offset = cute.crd2idx(tuple(coord) if len(coord) > 1 else coord[0], grad.layout)
    _add_nonzero(grad.iterator + offset, value, lane0)


@cute.jit
def _add_nonzero(ptr: cute.Pointer, value: Float32, lane0: cutlass.Constexpr[bool]):
    if value != Float32(0.0) and (not lane0 or cute.arch.lane_idx() == 0):
        cute.arch.atomic_add(ptr, value)


def _index(value):
    """An integer input as a plain Int32: coordinates arrive as CuTe layout integers, whose
    `//` and `%` assume non-negative operands (q_idx - kv_idx is not)."""
    return Int32(value), "i"


def _select(cond, a, b):
    """(value, kind) of ``a if cond else b`` for a DSL or Python condition."""
    kind = "f" if "f" in (a[1], b[1]) else a[1]
    if isinstance(cond, bool):
        return a if cond else b
    cls = {"f": Float32, "i": Int32, "b": Boolean}[kind]
    x, y = (v if not isinstance(v, (bool, int, float)) else cls(v)
            for v in (_as(a, kind), _as(b, kind)))
    return cls(cutlass.select_(cond, x, y)), kind


def _as(value, kind: str):
    v, have = value
    if have == kind:
        return v
    if kind == "f":
        if have == "b":
            return _select(v, (1.0, "f"), (0.0, "f"))[0]
        return float(v) if isinstance(v, int) else Float32(v)
    if kind == "i":
        return int(v) if isinstance(v, bool) else _select(v, (1, "i"), (0, "i"))[0]
    return v != 0 if not isinstance(v, bool) else v


class _Walk:
    """One element's values: (value, kind) per node, computed on first use."""

    def __init__(self, nodes, aux, env, values=None):
        self.nodes, self.aux, self.env = nodes, aux, env
        self.values = {} if values is None else values

    def extended(self, env: dict, values: dict = None) -> "_Walk":
        """A walk with this one's values and inputs, plus `env` and `values`."""
        return _Walk(self.nodes, self.aux, {**self.env, **env},
                     {**self.values, **(values or {})})

    def as_float(self, value):
        v = _as(value, "f")
        return Float32(v) if isinstance(v, float) else v

    def as_bool(self, value):
        return _as(value, "b")

    def value(self, i: int):
        if i not in self.values:
            self.values[i] = self._compute(i, self.nodes[i])
        return self.values[i]

    def edges(self, i: int, level: tuple, at: frozenset = frozenset()):
        """For load node i whose indices but one vary no more than `at` (the tile's or a
        kept row's or column's values: this walk's), the values its clamp gives below 0 and
        past the end of the other index, kept under ("edges", i) for `_load`; only where that
        index's stride is a constant (the innermost dimension), which keeps the elements'
        addresses one base plus constants."""
        node = self.nodes[i]
        if node.op != "load" or ("edges", i) in self.values:
            return
        idx = node.args[1:]
        varying = [d for d, a in enumerate(idx) if not level[a] <= at]
        t = self.aux[node.args[0]]
        if len(varying) != 1 or not isinstance(t.stride[varying[0]], int):
            return
        d = varying[0]
        coord = [None if k == d else _clamp(self.value(a)[0], t.shape[k])
                 for k, a in enumerate(idx)]
        ends = []
        for end in (Int32(0), Int32(t.shape[d]) - 1):
            coord[d] = end
            ends.append(t[tuple(coord)] if len(coord) > 1 else t[coord[0]])
        self.values[("edges", i)] = (d, coord, ends)

    def _compute(self, node_id: int, node):
        op, args = node.op, node.args
        if op in self.env:
            return self.env[op]
        if op == "const":
            v = args[0]
            return v, "b" if isinstance(v, bool) else "i" if isinstance(v, int) else "f"
        if op == "load":
            return self._load(args[0], [self.value(i) for i in args[1:]],
                              self.values.get(("edges", node_id)))
        vals = [self.value(i) for i in args]
        if op == "where":
            return _select(_as(vals[0], "b"), vals[1], vals[2])
        return _OPS[op](*vals)

    def _load(self, index: int, idx: list, edges=None):
        t = self.aux[index]
        if edges is None:
            coord = [_clamp(v, t.shape[dim]) for dim, (v, _) in enumerate(idx)]
            x = t[tuple(coord)] if len(coord) > 1 else t[coord[0]]
        else:
            d, coord, (low, high) = edges
            v = Int32(idx[d][0])
            coord = list(coord)
            coord[d] = v
            # select_ of two Uint8 values gives an Int8: the edge goes back to t's type.
            edge = t.element_type(cutlass.select_(v < 0, low, high))
            x = _load_or(t, tuple(coord), _below(v, Int32(t.shape[d])), edge)
        dtype = t.element_type
        if cutlass.const_expr(dtype in (cutlass.Float32, cutlass.Float16, cutlass.BFloat16)):
            return Float32(x), "f"
        if cutlass.const_expr(dtype == cutlass.Uint8):
            return Int32(x) != 0, "b"
        return Int32(x), "i"


def _kind(*vals):
    kinds = {k for _, k in vals}
    return "f" if "f" in kinds else "i" if "i" in kinds else "b"


def _python(*vals):
    return all(isinstance(v, (int, float, bool)) for v, _ in vals)


def _arith(fn):
    """A binary arithmetic op: both operands promoted (bool counts as int)."""
    def op(a, b):
        kind = _kind(a, b)
        kind = "i" if kind == "b" else kind
        if _python(a, b):
            return fn(a[0], b[0]), "f" if isinstance(fn(a[0], b[0]), float) else kind
        return fn(_as(a, kind), _as(b, kind)), kind
    return op


def _compare(fn):
    def op(a, b):
        kind = _kind(a, b)
        if _python(a, b):
            return bool(fn(a[0], b[0])), "b"
        return fn(_as(a, kind), _as(b, kind)), "b"
    return op


def _float_fn(fn):
    def op(a):
        if _python(a):
            import math

            return float(fn(math, float(a[0]))), "f"
        return fn(None, _as(a, "f")), "f"
    return op


def _div(a, b):
    if _python(a, b):
        return a[0] / b[0], "f"
    return _as(a, "f") / _as(b, "f"), "f"


def _floordiv(a, b):
    kind = _kind(a, b)
    if _python(a, b):
        return a[0] // b[0], kind
    if kind == "f":
        return cute.math.floor(_as(a, "f") / _as(b, "f")), "f"
    return _floor_div_int(_as(a, "i"), _as(b, "i")), "i"


def _floor_div_int(a, b):
    """floor(a / b) from divisions of non-negative operands only, whose result every integer
    division agrees on (inside a kernel `//` has lowered to a truncating one)."""
    if isinstance(b, int):
        if b < 0:
            a, b = -a, -b
    else:
        negative = b < 0
        a = _select(negative, (-a, "i"), (a, "i"))[0]
        b = _select(negative, (-b, "i"), (b, "i"))[0]
    down = -((-a + (b - 1)) // b)
    return _select(a >= 0, (a // b, "i"), (down, "i"))[0]


def _mod(a, b):
    """Floor remainder (torch.remainder, Python's %): a - floor(a / b) * b."""
    q = _floordiv(a, b)
    return _arith(lambda x, y: x - y)(a, _arith(lambda x, y: x * y)(q, b))


def _pow(a, b):
    n = b[0]
    if _python(a, b):
        return a[0] ** n, _kind(a, b)
    if isinstance(n, int) or (isinstance(n, float) and n.is_integer() and 0 <= n <= 8):
        n = int(n)
        if 0 <= n <= 8:
            result = (1, "i") if a[1] != "f" else (1.0, "f")
            for _ in range(n):
                result = _arith(lambda x, y: x * y)(result, a)
            return result if isinstance(b[0], int) else (_as(result, "f"), "f")
    if n == 0.5:
        return cute.math.sqrt(_as(a, "f"), fastmath=True), "f"
    # a ** n = exp2(n log2 a), a >= 0 (torch gives NaN for a < 0 and a non-integer n).
    return cute.math.exp2(float(n) * cute.math.log2(_as(a, "f"), fastmath=True),
                          fastmath=True), "f"


def _minmax(is_min: bool):
    def op(a, b):
        kind = _kind(a, b)
        if _python(a, b):
            return (min if is_min else max)(a[0], b[0]), kind
        x, y = _as(a, kind), _as(b, kind)
        if kind == "f":
            return (cute.arch.fmin(x, y) if is_min else cute.arch.fmax(x, y)), "f"
        return (cutlass.min(x, y) if is_min else cutlass.max(x, y)), kind
    return op


def _logic(fn):
    def op(a, b):
        if _python(a, b):
            return bool(fn(bool(a[0]), bool(b[0]))), "b"
        return fn(_as(a, "b"), _as(b, "b")), "b"
    return op


def _not(a):
    if _python(a):
        return not a[0], "b"
    return _select(_as(a, "b"), (False, "b"), (True, "b"))


def _neg(a):
    if _python(a):
        return -a[0], a[1]
    return -_as(a, "i" if a[1] == "b" else a[1]), "i" if a[1] == "b" else a[1]


def _abs(a):
    if _python(a):
        return abs(a[0]), a[1]
    if a[1] == "f":
        return cute.arch.fmax(a[0], -a[0]), "f"
    x = _as(a, "i")
    return cutlass.max(x, -x), "i"


def _exp(m, x):
    return m.exp(x) if m else cute.math.exp(x, fastmath=True)


def _log(m, x):
    return m.log(x) if m else cute.math.log(x, fastmath=True)


def _tanh(m, x):
    return m.tanh(x) if m else cute.math.tanh(x, fastmath=True)


def _sqrt(m, x):
    return m.sqrt(x) if m else cute.math.sqrt(x, fastmath=True)


def _sigmoid(m, x):
    if m:
        return 1.0 / (1.0 + m.exp(-x))
    return Float32(1.0) / (Float32(1.0) + cute.math.exp(-x, fastmath=True))


_OPS = {
    "add": _arith(lambda x, y: x + y), "sub": _arith(lambda x, y: x - y),
    "mul": _arith(lambda x, y: x * y), "div": _div, "floordiv": _floordiv, "mod": _mod,
    "pow": _pow, "minimum": _minmax(True), "maximum": _minmax(False),
    "lt": _compare(lambda x, y: x < y), "le": _compare(lambda x, y: x <= y),
    "gt": _compare(lambda x, y: x > y), "ge": _compare(lambda x, y: x >= y),
    "eq": _compare(lambda x, y: x == y), "ne": _compare(lambda x, y: x != y),
    "and": _logic(lambda x, y: x & y), "or": _logic(lambda x, y: x | y),
    "not": _not, "neg": _neg, "abs": _abs,
    "exp": _float_fn(_exp), "log": _float_fn(_log), "tanh": _float_fn(_tanh),
    "sigmoid": _float_fn(_sigmoid), "sqrt": _float_fn(_sqrt),
}

"""Views of MMA register fragments that let the shared blocks ignore each arch's MMA layout.

`acc_to_mn` turns a thread's accumulator into (rows, cols); the blocks (softmax, mask) only
ever see that view. `acc_to_operand_a` reinterprets the P accumulator of S = Q Kᵀ as the A
operand of O += P V (the FA2 trick that keeps P in registers).
"""

import cutlass
import cutlass.cute as cute


def _mn_layout(acc_layout: cute.Layout) -> cute.Layout:
    shape, stride = acc_layout.shape, acc_layout.stride
    if cutlass.const_expr(cute.rank(shape[0]) == 3):
        # WGMMA: ((2, 2, N/8), MMA_M, MMA_N) -> ((2, MMA_M), (2, N/8, MMA_N))
        return cute.make_layout(
            ((shape[0][1], shape[1]), (shape[0][0], shape[0][2], shape[2])),
            stride=((stride[0][1], stride[1]), (stride[0][0], stride[0][2], stride[2])),
        )
    # mma.sync m16n8: ((2, 2), MMA_M, MMA_N) -> ((2, MMA_M), (2, MMA_N))
    return cute.make_layout(
        ((shape[0][1], shape[1]), (shape[0][0], shape[2])),
        stride=((stride[0][1], stride[1]), (stride[0][0], stride[2])),
    )


def acc_to_mn(acc: cute.Tensor) -> cute.Tensor:
    """A thread's accumulator (or its coordinate tensor) viewed as (rows, cols)."""
    return cute.make_tensor(acc.iterator, _mn_layout(acc.layout))


def acc_to_operand_a(acc: cute.Tensor) -> cute.Tensor:
    """The S accumulator (or P, its converted copy) viewed as the A operand of O += P V.

    mma.sync m16n8k16: C fragment (4, MMA_M, MMA_N) -> A fragment ((4, 2), MMA_M, MMA_N/2);
    two adjacent n8 accumulator tiles hold exactly the registers of one k16 A tile.
    WGMMA (register A): ((2, 2, N/8), MMA_M, MMA_N) -> ((2, 2, 2), MMA_M, (N/16, MMA_N)); a
    thread's k16 A registers are the same two-columns-by-two-rows pairs as its accumulator, for
    two adjacent n8 column groups, so N/8 must be even.
    """
    if cutlass.const_expr(cute.rank(acc.layout.shape[0]) == 3):
        return cute.make_tensor(acc.iterator, _wgmma_acc_to_a_layout(acc.layout))
    div = cute.logical_divide(acc.layout, (None, None, 2))
    layout = cute.make_layout(
        ((div.shape[0], div.shape[2][0]), div.shape[1], div.shape[2][1]),
        stride=((div.stride[0], div.stride[2][0]), div.stride[1], div.stride[2][1]),
    )
    return cute.make_tensor(acc.iterator, layout)


def _wgmma_acc_to_a_layout(acc_layout: cute.Layout) -> cute.Layout:
    if cutlass.const_expr(acc_layout.shape[0][2] % 2 != 0):
        raise ValueError(f"WGMMA P operand needs an even number of n8 groups, got "
                         f"{acc_layout.shape}")
    div = cute.logical_divide(acc_layout, ((None, None, 2), None, None))
    # div: ((2, 2, (2, N/16)), MMA_M, MMA_N)
    return cute.make_layout(
        ((div.shape[0][0], div.shape[0][1], div.shape[0][2][0]), div.shape[1],
         (div.shape[0][2][1], div.shape[2])),
        stride=((div.stride[0][0], div.stride[0][1], div.stride[0][2][0]), div.stride[1],
                (div.stride[0][2][1], div.stride[2])),
    )


def assume_aligned_strides(t: cute.Tensor, divby: int) -> cute.Tensor:
    """`t` with each run-time stride declared a multiple of `divby` elements.

    Run-time tensors arrive with fully dynamic strides; 128-bit copies need the compiler to know
    every row start stays 16-byte aligned. Validation guarantees it (strides % 8 == 0 for 16-bit
    types) before any launch.
    """
    strides = tuple(s if isinstance(s, int) else cute.assume(s, divby=divby) for s in t.stride)
    return cute.make_tensor(t.iterator, cute.make_layout(t.shape, stride=strides))


def transpose_view(t: cute.Tensor) -> cute.Tensor:
    """The (C, R[, S]) view of an (R, C[, S]) tensor (e.g. Kᵀ of a K tile in shared memory);
    a trailing stage mode stays last."""
    rows, cols = cute.size(t, mode=[0]), cute.size(t, mode=[1])
    if cutlass.const_expr(cute.rank(t) == 3):
        stages = cute.size(t, mode=[2])
        return cute.composition(
            t, cute.make_layout((cols, rows, stages), stride=(rows, 1, rows * cols)))
    return cute.composition(t, cute.make_layout((cols, rows), stride=(rows, 1)))


def pack_heads(t: cute.Tensor, row_mode: int, head_mode: int, pack: int) -> cute.Tensor:
    """Packed-GQA view of `t`: each group of `pack` consecutive heads (the query heads of one
    K/V head) folded into the row mode, so the row mode becomes (pack, rows) (row r of a
    group is row r // pack of head r % pack, in CuTe's colexicographic order) and the head
    mode counts groups. Works on plain tensors and on TMA coordinate tensors alike."""
    shape, stride = list(t.shape), list(t.stride)
    shape[row_mode] = (pack, shape[row_mode])
    stride[row_mode] = (stride[head_mode], stride[row_mode])
    shape[head_mode] = shape[head_mode] // pack
    stride[head_mode] = stride[head_mode] * pack
    return cute.make_tensor(t.iterator, cute.make_layout(tuple(shape), stride=tuple(stride)))

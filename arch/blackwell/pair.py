"""What the blackwell backward's CTAs say to each other: the raw mbarriers between its roles
within a CTA and across the pair (a cluster of two running tcgen05 cta_group::2 MMAs), and
the bulk copy that hands the peer its half of dS.

With the pair only the leader (rank 0) issues MMAs, so every "MMA may go on" barrier lives in
the leader and both CTAs' threads arrive on it; every "MMA done" barrier lives in both CTAs and
one tcgen05.commit signals both (a multicast mask). One CTA alone uses the same barriers
locally. Phases are carried by the waiters (`BlackwellBwd` docstring)."""

import cutlass
import cutlass.cute as cute
from cutlass import Int32
from cutlass._mlir.dialects import llvm, nvvm
from cutlass.cute.nvgpu import tcgen05
from cutlass.cutlass_dsl import T, dsl_user_op

from flash_cute.blocks.dsl_state import DslState

from .config import BWD_BARRIERS, bwd_arrival_counts

LEADER = 0
# Arrivals on another CTA's barrier hand over data (TMEM, shared memory) at cluster scope, as
# the DSL asks of DSMEM hand-offs.
_CLUSTER = nvvm.MemScopeKind.CLUSTER
# The barriers, by index into one MemRange of mbarriers (`config.BWD_BARRIERS`).
S_FULL, DP_FULL, S_READ, P_FULL, DS_FULL, SDS_FULL, SDS_EMPTY, DQ_FULL, DQ_READ, DKV_FULL, \
    PEER_SDS = range(len(BWD_BARRIERS))
COUNT = len(BWD_BARRIERS)


@cute.jit
def wait(bar: cute.Pointer, phase: Int32):
    """Wait for the mbarrier's phase of parity `phase` to complete: a try-wait loop in line,
    where `mbarrier_wait`'s retry path sits out of line and keeps the barrier's address
    alive across the whole kernel (D-BW-BWD-REGS)."""
    done = cute.arch.mbarrier_try_wait(bar, phase)
    while not done:
        done = cute.arch.mbarrier_try_wait(bar, phase)


class PairSync(DslState):
    """The CTA's handshake barriers (`config.bwd_arrival_counts`), and how each role reaches
    them."""

    def __init__(self, bars: cute.Pointer, cta_group: int):
        self.bars = bars
        self.cta_group = cta_group

    @property
    def pair(self) -> bool:
        return self.cta_group == 2

    @cute.jit
    def init(self, warp_idx: Int32):
        counts = bwd_arrival_counts(self.cta_group)
        if warp_idx == 0:
            with cute.arch.elect_one():
                for i, name in enumerate(BWD_BARRIERS):
                    cute.arch.mbarrier_init(self.bars + i, counts[name])

    def wait(self, i: int, phase: Int32):
        wait(self.bars + i, phase)

    @cute.jit
    def commit(self, i: int):
        """From the MMA warp: barrier `i` of both CTAs (of this one alone) completes when the
        MMAs issued so far are done."""
        with cute.arch.elect_one():
            if cutlass.const_expr(self.pair):
                tcgen05.commit(self.bars + i, 0b11, tcgen05.CtaGroup.TWO)
            else:
                tcgen05.commit(self.bars + i)

    @cute.jit
    def arrive_leader(self, i: int):
        """One arrival per warp on the leader's barrier `i` (this CTA's alone)."""
        with cute.arch.elect_one():
            if cutlass.const_expr(self.pair):
                cute.arch.mbarrier_arrive(self.bars + i, peer_cta_rank_in_cluster=LEADER,
                                          scope=_CLUSTER)
            else:
                cute.arch.mbarrier_arrive(self.bars + i)

    @cute.jit
    def arrive_local(self, i: int):
        """One arrival per warp on this CTA's barrier `i`."""
        with cute.arch.elect_one():
            cute.arch.mbarrier_arrive(self.bars + i)

    def relay(self, i: int):
        """One lane: an arrival on the leader's barrier `i` from the peer CTA."""
        cute.arch.mbarrier_arrive(self.bars + i, peer_cta_rank_in_cluster=LEADER,
                                  scope=_CLUSTER)

    def arm_peer(self, i: int, peer: Int32, num_bytes: int):
        """One lane: an arrival on the peer's barrier `i` that expects `num_bytes` of copy."""
        cute.arch.mbarrier_arrive_and_expect_tx(self.bars + i, num_bytes,
                                                peer_cta_rank_in_cluster=peer, scope=_CLUSTER)


@dsl_user_op
def block_x(*, loc=None, ip=None) -> Int32:
    """blockIdx.x read where it is used (volatile, so the compiler does not keep one read
    from the kernel's start live through every role)."""
    return Int32(llvm.inline_asm(T.i32(), [], "mov.u32 $0, %ctaid.x;", "=r",
                                 has_side_effects=True, is_align_stack=False,
                                 asm_dialect=llvm.AsmDialect.AD_ATT))


@dsl_user_op
def copy_to_peer(src: cute.Pointer, dst: cute.Pointer, bar: cute.Pointer, num_bytes: int,
                 peer: Int32, *, loc=None, ip=None):
    """One lane: `num_bytes` of this CTA's shared memory at `src` into the peer CTA's at the
    offset of `dst`, completing on the peer's mbarrier at the offset of `bar` (both mapped
    into the cluster's window, as the instruction requires of both)."""
    dst_cluster = cute.arch.map_dsmem_ptr(dst, peer, loc=loc, ip=ip)
    bar_cluster = cute.arch.map_dsmem_ptr(bar, peer, loc=loc, ip=ip)
    args = [Int32(dst_cluster.toint(loc=loc, ip=ip)).ir_value(loc=loc, ip=ip),
            Int32(src.toint(loc=loc, ip=ip)).ir_value(loc=loc, ip=ip),
            Int32(bar_cluster.toint(loc=loc, ip=ip)).ir_value(loc=loc, ip=ip),
            Int32(num_bytes).ir_value(loc=loc, ip=ip)]
    llvm.inline_asm(None, args,
                    "cp.async.bulk.shared::cluster.shared::cta.mbarrier::complete_tx::bytes "
                    "[$0], [$1], $3, [$2];", "r,r,r,r", has_side_effects=True,
                    is_align_stack=False, asm_dialect=llvm.AsmDialect.AD_ATT)


class TmaRing(DslState):
    """A ring of TMA-filled stages the MMA warp consumes (full / empty / ready mbarriers per
    stage), as `PipelineTmaUmma` has the first two, with what depends on the CTA's rank read
    where it is used: the full barrier counts one arrival, the leader's, which arms both
    CTAs' bytes (a cta_group::2 TMA completes on the leader's barrier); the empty barrier
    completes on the MMA warp's tcgen05.commit, sent to both CTAs.

    `tails` (varlen or seqused): rows of a stage past the sequence hold another sequence's
    or unused values, possibly NaN, that 0 × NaN would carry into the gradients. Then the
    MMA waits for a third barrier, ready (the leader's, an arrival per CTA), which the tail
    warps complete once their rows past the sequence are zeroed (`BlackwellBwd.tail_role`).
    """

    def __init__(self, bars: cute.Pointer, stages: int, tx_bytes: int, cta_group: int,
                 tails: bool = False):
        self.full = bars
        self.empty = bars + stages
        self.ready = bars + 2 * stages
        self.stages, self.tx_bytes, self.cta_group = stages, tx_bytes, cta_group
        self.tails = tails

    @cute.jit
    def init(self, warp_idx: Int32):
        if warp_idx == 0:
            with cute.arch.elect_one():
                for i in cutlass.range_constexpr(self.stages):
                    cute.arch.mbarrier_init(self.full + i, 1)
                    cute.arch.mbarrier_init(self.empty + i, 1)
                    cute.arch.mbarrier_init(self.ready + i, self.cta_group)

    @cute.jit
    def producer_acquire(self, state):
        """Wait for the stage to be free, then (the leader) arm its full barrier."""
        wait(self.empty + state.index, state.phase)
        if block_x() % self.cta_group == LEADER:
            with cute.arch.elect_one():
                cute.arch.mbarrier_arrive_and_expect_tx(self.full + state.index,
                                                        self.tx_bytes)

    def barrier(self, state) -> cute.Pointer:
        return self.full + state.index

    def consumer_wait(self, state):
        if self.tails:
            wait(self.ready + state.index, state.phase)
        else:
            wait(self.full + state.index, state.phase)

    def landed_wait(self, state):
        """A tail warp: the stage's bytes are in (the leader's full barrier counts both
        CTAs'; the peer's completes on the leader's `landed_signal_peer`)."""
        wait(self.full + state.index, state.phase)

    def landed_signal_peer(self, state):
        """One lane of the leader: the stage landed, on the peer's full barrier (which no
        TMA of the pair completes)."""
        cute.arch.mbarrier_arrive(self.full + state.index, peer_cta_rank_in_cluster=1 - LEADER,
                                  scope=_CLUSTER)

    def ready_arrive(self, state):
        """One lane of either CTA of the pair: an arrival on the leader's ready barrier."""
        cute.arch.mbarrier_arrive(self.ready + state.index, peer_cta_rank_in_cluster=LEADER,
                                  scope=_CLUSTER)

    def ready_arrive_local(self, state):
        """One lane of the one CTA: an arrival on its ready barrier."""
        cute.arch.mbarrier_arrive(self.ready + state.index)

    @cute.jit
    def consumer_release(self, state):
        """The stage frees once the MMAs issued so far have read it."""
        with cute.arch.elect_one():
            if cutlass.const_expr(self.cta_group == 2):
                tcgen05.commit(self.empty + state.index, 0b11, tcgen05.CtaGroup.TWO)
            else:
                tcgen05.commit(self.empty + state.index)

    @cute.jit
    def producer_tail(self, state):
        """Before the CTA exits: every stage's last release has landed (a commit may not
        arrive on the barrier of a CTA that has left)."""
        for _ in cutlass.range_constexpr(self.stages):
            wait(self.empty + state.index, state.phase)
            state.advance()

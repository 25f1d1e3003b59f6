"""A model of the blackwell backward's synchronization, run on the CPU: each role of each CTA
of each cluster is a generator of the barrier operations it performs, in the kernel's order
(`BlackwellBwd` docstring), with the arrival counts (`config.bwd_arrival_counts`), the waits
the TMEM plan adds (`config.bwd_tmem_waits`) and the dQ turns (`config.dq_turn_of_pair`,
`dq_turn_pending`) the kernel takes from its config; TMA loads and the copy of dS to the
peer land at random later times. A scheduler interleaves everything at random, each role at
a random speed of its own, over clusters with varied query-tile counts (0 included) and
checks: no deadlock, no waiter
lapped (a phase completing unseen), every arrival in the phase it is meant for (no barrier
left with a partial phase), both CTAs allocate and free their tensor memory, the leader's
dQ MMA of a query tile comes after both CTAs' dS of it (what the relay carries), and with
deterministic dQ the adds into each query tile come in the order of the clusters' turns.
MMAs complete when issued, so a tcgen05.commit arrives at once. Negative controls: turns
counted in CTAs hang; without the wait for dQ's read, or for the relay, the model sees the
fault."""

import random

import pytest
from test_blackwell_protocol import Waiter

from flash_cute.arch.blackwell import config
from flash_cute.contract.block_range import m_block_range

LEADER = 0
WG_WARPS = 4


class Barrier:
    """The forward model's barrier with the transaction bytes the pair's TMA and peer copy
    complete (`Waiter` is the forward model's)."""

    def __init__(self, name: str, count: int):
        self.name, self.count = name, count
        self.pending = self.tx = self.completed = 0

    def arrive(self, n: int = 1, expect: int = 0):
        self.pending += n
        self.tx += expect
        assert self.pending <= self.count, f"{self.name}: more arrivals than its count"
        self._check()

    def complete_tx(self, nbytes: int):
        self.tx -= nbytes
        self._check()

    def _check(self):
        if self.pending == self.count and self.tx == 0:
            self.pending, self.completed = 0, self.completed + 1


def wait(waiter):
    """Yield until `waiter`'s barrier completes a phase, then take it (this scheduler asks
    the test it is given)."""
    yield ("wait", waiter.ready)
    waiter.take()


class Cta:
    """One CTA's barriers: its rings' full / empty / ready barriers and its handshakes."""

    def __init__(self, name, cta_group, stages: dict):
        counts = config.bwd_arrival_counts(cta_group)
        self.sync = {b: Barrier(f"{name}.{b}", counts[b]) for b in config.BWD_BARRIERS}
        self.rings = {r: ([Barrier(f"{name}.{r}.full[{i}]", 1) for i in range(n)],
                          [Barrier(f"{name}.{r}.empty[{i}]", 1) for i in range(n)],
                          [Barrier(f"{name}.{r}.ready[{i}]", cta_group) for i in range(n)])
                      for r, n in stages.items()}
        self.tmem = []


class Run:
    def __init__(self, sched, hdims, steps, deterministic, pending, rng, tails=False):
        self.sched, self.g = sched, sched.cta_group
        self.plan = config.bwd_tmem_plan(*hdims, sched)
        self.waits = config.bwd_tmem_waits(self.plan)
        self.separate = self.g == 2 and not config.shares_transposed(*hdims, sched)
        # Folded (hdim 256): each warpgroup holds query rows of both CTAs' halves, so the
        # peer's rows come from half the warps of both, which meet at a named barrier
        # before warpgroup 0's lane copies them (`BlackwellBwd._ds_done`).
        self.folded = config.folds(sched)
        self.named = {}
        self.shared = self.g == 2 and not self.separate
        stages = {"kv": 1, "q": sched.q_stages, "do": sched.do_stages}
        if self.separate:
            stages.update(qt=sched.q_stages, dot=sched.do_stages)
        self.steps = steps  # per cluster: (query tiles, their turns)
        self.ctas = [[Cta(f"c{c}.r{r}", self.g, stages) for r in range(self.g)]
                     for c in range(len(steps))]
        self.deterministic, self.pending, self.rng = deterministic, pending, rng
        self.semaphores, self.adds, self.events = {}, [], []
        self.asyncs = []
        self.omit = set()  # waits the negative controls drop
        # Varlen or seqused: the tail warps acknowledge every stage (`BlackwellBwd.tail_role`)
        # and the MMA takes a stage by its ready barrier; `acked` / `taken`: when each CTA
        # acknowledged, and the MMA took, each use of each stage.
        self.tails = tails
        self.acked, self.taken = {}, {}
        self.t = 0  # the scheduler's steps

    # ------------------------------------------------------------------ helpers
    def leader(self, c):
        return self.ctas[c][LEADER]

    def commit(self, c, name):
        for cta in self.ctas[c]:
            cta.sync[name].arrive()

    def release(self, c, ring, index):
        for cta in self.ctas[c]:
            cta.rings[ring][1][index].arrive()

    def later(self, action):
        """Something that lands at a random later time (a TMA, a bulk copy)."""
        self.asyncs.append(action)

    def stage_order(self, c):
        """The rings of the stages the load warp fills, in its order (the tail warps walk the
        same): K/V once, then per query tile Q, (Qᵀ), dO, (dOᵀ)."""
        tiles, _ = self.steps[c]
        if not tiles:
            return
        yield "kv"
        for _ in tiles:
            yield "q"
            if self.separate or self.shared:
                yield "qt" if self.separate else "q"
            yield "do"
            if self.separate or self.shared:
                yield "dot" if self.separate else "do"

    # ------------------------------------------------------------------ roles
    def load(self, c, r):
        cta, lead = self.ctas[c][r], self.leader(c)
        heads = {ring: 0 for ring in cta.rings}
        empties = {ring: [Waiter(b, -1) for b in cta.rings[ring][1]] for ring in cta.rings}

        def fill(ring):
            i = heads[ring] % len(empties[ring])
            yield from wait(empties[ring][i])
            full = lead.rings[ring][0][i]
            if r == LEADER:
                full.arrive(1, expect=self.g)  # both CTAs' bytes, a unit each
            self.later(lambda: full.complete_tx(1))
            heads[ring] += 1

        for ring in self.stage_order(c):
            yield from fill(ring)
        for ring in cta.rings:  # the producer tail: every stage released
            for _ in range(len(empties[ring])):
                yield from wait(empties[ring][heads[ring] % len(empties[ring])])
                heads[ring] += 1

    def mma(self, c):
        lead = self.leader(c)
        fulls = {ring: [Waiter(b) for b in lead.rings[ring][0]] for ring in lead.rings}
        heads = {ring: 0 for ring in lead.rings}
        sync = {b: Waiter(lead.sync[b]) for b in config.BWD_BARRIERS}

        readies = {ring: [Waiter(b) for b in lead.rings[ring][2]] for ring in lead.rings}

        def take(ring):
            i = heads[ring] % len(fulls[ring])
            yield from wait((readies if self.tails else fulls)[ring][i])
            self.taken[(c, ring, heads[ring])] = self.t
            return i

        def release(ring):
            self.release(c, ring, heads[ring] % len(fulls[ring]))
            heads[ring] += 1

        tiles, _ = self.steps[c]
        if not tiles:
            return
        yield from take("kv")
        for i, _ in enumerate(tiles):
            yield from take("q")
            if "dq_read" in self.waits and i > 0 and "DQ_READ" not in self.omit:
                yield from wait(sync["DQ_READ"])
            self.commit(c, "S_FULL")
            if self.g == 2:
                release("q")
            yield from take("do")
            if "s_read" in self.waits:
                yield from wait(sync["S_READ"])
            elif i > 0:
                sync["S_READ"].seen += 1  # arrived, not waited for: its phase passes
            self.commit(c, "DP_FULL")
            if self.g == 2:
                release("do")
            dot = "dot" if self.separate else "do"
            if self.g == 2:
                yield from take(dot)
            yield from wait(sync["P_FULL"])
            release(dot)
            qt = "qt" if self.separate else "q"
            if self.g == 2:
                yield from take(qt)
            yield from wait(sync["DS_FULL"])
            release(qt)
            yield from wait(sync["SDS_FULL"])
            if self.g == 2 and "PEER_SDS" not in self.omit:
                yield from wait(sync["PEER_SDS"])
            if "dq_read" not in self.waits and i > 0 and "DQ_READ" not in self.omit:
                yield from wait(sync["DQ_READ"])
            self.events.append(("dQ MMA", c, i, tuple(cta.sync["SDS_FULL"].completed
                                                      for cta in self.ctas[c])))
            self.commit(c, "DQ_FULL")
            self.commit(c, "SDS_EMPTY")
        self.commit(c, "DKV_FULL")
        release("kv")

    def compute(self, c, r, wg):
        cta, lead = self.ctas[c][r], self.leader(c)
        peer = self.ctas[c][r ^ 1] if self.g == 2 else None
        mine = {b: Waiter(cta.sync[b]) for b in config.BWD_BARRIERS}
        tiles, _ = self.steps[c]
        for i, _ in enumerate(tiles):
            yield from wait(mine["S_FULL"])
            lead.sync["S_READ"].arrive(WG_WARPS)
            lead.sync["P_FULL"].arrive(WG_WARPS)
            if i > 0:
                yield from wait(mine["SDS_EMPTY"])
            yield from wait(mine["DP_FULL"])
            lead.sync["DS_FULL"].arrive(WG_WARPS)
            if self.folded:
                cta.sync["SDS_FULL"].arrive(WG_WARPS // 2)
                yield from self.meet(c, r, i, 0)
                if wg == 0 or "ONE_COPIER" in self.omit:
                    target = peer.sync["SDS_FULL"]
                    target.arrive(1, expect=1)
                    self.later(lambda t=target: t.complete_tx(1))
                yield from self.meet(c, r, i, 1)
            elif self.g == 1 or wg == r:
                cta.sync["SDS_FULL"].arrive(WG_WARPS)
            else:
                target = peer.sync["SDS_FULL"]
                target.arrive(1, expect=1)
                self.later(lambda t=target: t.complete_tx(1))
        if tiles:
            yield from wait(mine["SDS_EMPTY"])  # the last dQ MMA's, met before the exit
            yield from wait(mine["DKV_FULL"])

    def meet(self, c, r, i, k):
        """The folded exchange's named barrier (both warpgroups' peer-half warps), its k-th
        use at step i: all of them arrive, then go on."""
        bar = self.named.setdefault((c, r, i, k), Barrier(f"c{c}.r{r}.xchg[{i},{k}]", 2))
        bar.arrive()
        yield ("wait", lambda: bar.completed > 0)

    def reduce(self, c, r):
        cta, lead = self.ctas[c][r], self.leader(c)
        full = Waiter(cta.sync["DQ_FULL"])
        tiles, turns = self.steps[c]
        for m, turn in zip(tiles, turns):
            yield from wait(full)
            if self.deterministic:
                yield ("wait", lambda m=m, turn=turn: not self.pending(
                    self.semaphores.get(m, 0), turn, self.sched))
            lead.sync["DQ_READ"].arrive(WG_WARPS)
            self.adds.append((m, turn, c, r))
            if self.deterministic:
                self.semaphores[m] = self.semaphores.get(m, 0) + 1

    def tail(self, c, r):
        """The tail warp: each stage in the load warp's order, once landed (the leader: its
        full barrier, both CTAs' bytes, passed on to the peer's full barrier; the peer: that
        arrival), zeroed where it runs past the sequence, then acknowledged on the leader's
        ready barrier."""
        cta, lead = self.ctas[c][r], self.leader(c)
        own = {ring: [Waiter(b) for b in cta.rings[ring][0]] for ring in cta.rings}
        heads = {ring: 0 for ring in cta.rings}

        def ack(ring):
            i = heads[ring] % len(own[ring])
            yield from wait(own[ring][i])
            if r == LEADER and self.g == 2 and "LANDED" not in self.omit:
                self.ctas[c][1].rings[ring][0][i].arrive()
            self.acked.setdefault((c, ring, heads[ring]), []).append(self.t)
            lead.rings[ring][2][i].arrive()
            heads[ring] += 1

        for ring in self.stage_order(c):
            yield from ack(ring)

    def relay(self, c):
        local = Waiter(self.ctas[c][1].sync["SDS_FULL"])
        for _ in self.steps[c][0]:
            yield from wait(local)
            self.leader(c).sync["PEER_SDS"].arrive()

    def cta_roles(self, c, r):
        cta = self.ctas[c][r]
        cta.tmem.append("alloc")
        roles = [self.load(c, r), self.reduce(c, r), self.compute(c, r, 0),
                 self.compute(c, r, 1)]
        if r == LEADER:
            roles.append(self.mma(c))
        elif self.g == 2:
            roles.append(self.relay(c))
        if self.tails:
            roles.append(self.tail(c, r))
        return roles

    def simulate(self):
        roles = {}
        for c in range(len(self.steps)):
            for r in range(self.g):
                for k, gen in enumerate(self.cta_roles(c, r)):
                    roles[(c, r, k)] = gen
        waiting = {key: None for key in roles}
        # Each role runs at a speed of its own (slow warps lag by whole steps).
        speed = {key: self.rng.random() ** 3 + 1e-3 for key in roles}
        while waiting or self.asyncs:
            ready = [key for key, test in waiting.items() if test is None or test()]
            if self.asyncs and (not ready or self.rng.random() < 0.3):
                self.asyncs.pop(self.rng.randrange(len(self.asyncs)))()
                continue
            assert ready, f"deadlock: {sorted(waiting)} wait"
            key = self.rng.choices(ready, [speed[k] for k in ready])[0]
            self.t += 1
            try:
                _, waiting[key] = next(roles[key])
            except StopIteration:
                del waiting[key]
        # The join (a cluster barrier), then each CTA frees its tensor memory once.
        for cta in (cta for cluster in self.ctas for cta in cluster):
            cta.tmem.append("free")
        return self


def _clusters(sched, seqlen_q, seqlen_k, causal, window=(None, None)):
    """Per cluster: its query tiles and its dQ turn at each (`m_block_range`,
    `dq_turn_of_pair`: the kernel's functions)."""
    out = []
    span = sched.cta_group * sched.tile_n
    for n in range(config.pair_tiles(seqlen_k, sched)):
        lo, hi = m_block_range(n, sched.tile_m, span, seqlen_q, seqlen_k, causal, *window)
        tiles = list(range(lo, hi))
        out.append((tiles, [config.dq_turn_of_pair(n, m, sched, seqlen_q, seqlen_k, causal,
                                                   *window) for m in tiles]))
    return out


# (head dims, seqlen_q, seqlen_k, causal, window): causal and not, a local window whose
# first clusters see no query, one query tile, clusters past one CTA's keys.
CASES = [((64, 64), 700, 900, True, (None, None)),
         ((128, 128), 1000, 1100, False, (None, None)),
         ((128, 128), 300, 1500, False, (100, 0)),
         ((192, 128), 600, 700, True, (None, None)),
         ((192, 128), 129, 257, False, (None, None)),
         ((128, 128), 50, 1000, False, (20, 20)),
         ((256, 256), 700, 500, True, (None, None)),
         ((256, 256), 300, 900, False, (100, 0))]


@pytest.mark.parametrize("dims,seqlen_q,seqlen_k,causal,window", CASES)
@pytest.mark.parametrize("deterministic", [False, True])
def test_random_interleavings_finish_in_step(dims, seqlen_q, seqlen_k, causal, window,
                                             deterministic):
    sched = config.BWD_SCHEDULES[dims]
    clusters = _clusters(sched, seqlen_q, seqlen_k, causal, window)
    for seed in range(20):
        run = Run(sched, dims, clusters, deterministic, config.dq_turn_pending,
                  random.Random(seed)).simulate()
        for cluster in run.ctas:
            for cta in cluster:
                assert cta.tmem == ["alloc", "free"]
                for bar in cta.sync.values():
                    assert bar.pending == 0 and bar.tx == 0, bar.name
                for fulls, empties, readies in cta.rings.values():
                    assert all(b.pending == 0 for b in fulls + empties + readies)
        # The leader's dQ MMA of step i: both CTAs' dS of it are in shared memory.
        for _, c, i, completed in run.events:
            assert all(done >= i + 1 for done in completed), (c, i, completed)
        if deterministic:
            for m in {a[0] for a in run.adds}:
                turns = [turn for mm, turn, _, _ in run.adds if mm == m]
                assert turns == sorted(turns), (m, turns)


def test_some_cluster_has_no_query_tile():
    """The cases include clusters that visit no query tile (their roles skip, the CTAs still
    allocate and free, and their dK and dV are stored as zeros)."""
    sched = config.BWD_SCHEDULES[(128, 128)]
    for _, sq, sk, causal, window in CASES[2::3]:
        clusters = _clusters(sched, sq, sk, causal, window)
        assert any(not tiles for tiles, _ in clusters) and any(tiles for tiles, _ in clusters)


def test_turns_counted_in_ctas_deadlock_the_pair():
    """The negative control: the semaphore waited for as if it counted clusters while it
    counts CTAs hangs the second cluster of a query tile."""
    sched = config.BWD_SCHEDULES[(128, 128)]
    clusters = _clusters(sched, 1000, 1100, False)
    with pytest.raises(AssertionError, match="deadlock"):
        Run(sched, (128, 128), clusters, True, lambda value, turn, s: value != turn,
            random.Random(0)).simulate()


def _failures(omit, dims=(192, 128), seeds=30):
    sched = config.BWD_SCHEDULES[dims]
    clusters = _clusters(sched, 900, 300, False)
    failures = 0
    for seed in range(seeds):
        run = Run(sched, dims, clusters, False, config.dq_turn_pending, random.Random(seed))
        run.omit = set(omit)
        try:
            run.simulate()
            for _, c, i, completed in run.events:
                assert all(done >= i + 1 for done in completed), (c, i, completed)
        except AssertionError:
            failures += 1
    return failures


def test_the_model_sees_a_missing_wait():
    """Negative controls: without the MMA warp's wait for the reduce warps' read of dQ, it
    commits a second dQ before they look (a lapped waiter); without its wait for the
    relay, it issues a dQ MMA before the peer's dS has landed."""
    assert _failures({"DQ_READ"}) > 0
    assert _failures({"PEER_SDS"}) > 0
    assert _failures(()) == 0


def test_the_folded_exchange_copies_once_per_step():
    """hdim 256: both warpgroups' peer-half warps meet, and warpgroup 0's lane alone copies;
    were each warpgroup to copy, the peer's SDS_FULL would take an arrival too many."""
    assert _failures((), dims=(256, 256)) == 0
    assert _failures({"ONE_COPIER"}, dims=(256, 256)) > 0


@pytest.mark.parametrize("dims,seqlen_q,seqlen_k,causal,window", CASES)
def test_tail_warps_acknowledge_every_stage_before_the_mma_takes_it(dims, seqlen_q, seqlen_k,
                                                                      causal, window):
    """Varlen or seqused: each CTA's tail warp acknowledges every stage in the load warp's
    order, and the MMA takes each use of each stage only after both CTAs' acknowledgments
    (the rows past the sequence zeroed in both); nothing deadlocks or laps, every ready
    barrier's phases close."""
    sched = config.BWD_SCHEDULES[dims]
    clusters = _clusters(sched, seqlen_q, seqlen_k, causal, window)
    for seed in range(10):
        run = Run(sched, dims, clusters, False, config.dq_turn_pending, random.Random(seed),
                  tails=True).simulate()
        assert run.taken and set(run.taken) == set(run.acked)
        for use, at in run.taken.items():
            acks = run.acked[use]
            assert len(acks) == sched.cta_group and max(acks) < at, (use, acks, at)
        for cluster in run.ctas:
            for cta in cluster:
                for fulls, empties, readies in cta.rings.values():
                    assert all(b.pending == 0 for b in fulls + empties + readies)


def test_without_the_leaders_word_the_peers_tail_warp_hangs():
    """The negative control: the peer's full barrier completes only on the leader's
    arrival (no TMA of the pair lands there); without it the pair deadlocks."""
    sched = config.BWD_SCHEDULES[(128, 128)]
    clusters = _clusters(sched, 300, 600, False)
    run = Run(sched, (128, 128), clusters, False, config.dq_turn_pending, random.Random(0),
              tails=True)
    run.omit = {"LANDED"}
    with pytest.raises(AssertionError, match="deadlock"):
        run.simulate()

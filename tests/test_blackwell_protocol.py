"""A model of the blackwell forward's synchronization, run on the CPU: each warp role is a
generator of the barrier operations it performs, in the kernel's order (`BlackwellFwd`
docstring), and a scheduler interleaves them at random over persistent tiles with varied
block counts (0 included). It checks that no interleaving deadlocks, that every wait meets
the barrier completion it expects (never one phase ahead: no waiter is lapped), that every
arrival lands in the phase it is meant for, and that at the end every barrier has as many
completions as its waiters consumed. MMAs complete when issued, so a tcgen05.commit arrives
at once; what this cannot see is a divergence between the model and the kernel, which the
kernel's SASS checks (`tests/test_blackwell.py`) and hardware runs cover."""

import random

import pytest

Q_STAGES = 2
TILE_M = 128


class Barrier:
    def __init__(self, name: str, count: int):
        self.name, self.count = name, count
        self.pending, self.completed = 0, 0

    def arrive(self, n: int = 1):
        self.pending += n
        assert self.pending <= self.count, f"{self.name}: more arrivals than its count"
        if self.pending == self.count:
            self.pending, self.completed = 0, self.completed + 1


class Waiter:
    """A role's view of a barrier: how many completions it has consumed."""

    def __init__(self, barrier: Barrier, start: int = 0):
        self.barrier, self.seen = barrier, start

    def ready(self) -> bool:
        return self.barrier.completed > self.seen

    def take(self):
        assert self.barrier.completed == self.seen + 1, \
            f"{self.barrier.name}: a waiter was lapped (a phase completed unseen)"
        self.seen += 1


class Ring:
    """A pipeline of `stages` full/empty barrier pairs: the producer's acquire waits for the
    stage's release (its first pass free), the consumer's wait for its fill."""

    def __init__(self, name: str, stages: int, producers: int, consumers: int):
        self.full = [Barrier(f"{name}.full[{i}]", producers) for i in range(stages)]
        self.empty = [Barrier(f"{name}.empty[{i}]", consumers) for i in range(stages)]
        self.stages = stages

    def producer(self):
        return RingSide(self.empty, start=-1)

    def consumer(self):
        return RingSide(self.full, start=0)


class RingSide:
    def __init__(self, bars, start: int):
        self.waiters = [Waiter(b, start) for b in bars]
        self.index = 0

    def wait(self):
        """(barrier waiter of the current stage, its index); the caller yields it."""
        return self.waiters[self.index], self.index

    def advance(self):
        self.index = (self.index + 1) % len(self.waiters)


def wait(waiter):
    yield ("wait", waiter)
    waiter.take()


def load_role(tiles, q, k, v):
    qp, kp, vp = q.producer(), k.producer(), v.producer()
    for n in tiles:
        for _ in range(q.stages):
            w, i = qp.wait()
            yield from wait(w)
            q.full[i].arrive()
            qp.advance()
        for _ in range(n):
            for ring, side in ((k, kp), (v, vp)):
                w, i = side.wait()
                yield from wait(w)
                ring.full[i].arrive()
                side.advance()
    for ring, side in ((q, qp), (k, kp), (v, vp)):
        for _ in range(ring.stages):
            w, _ = side.wait()
            yield from wait(w)
            side.advance()


def mma_role(tiles, q, k, v, s_full, p_ready, o_full):
    qc, kc, vc = q.consumer(), k.consumer(), v.consumer()
    p_wait = [Waiter(b) for b in p_ready]
    for n in tiles:
        q_index = qc.index
        for _ in range(Q_STAGES):
            w, _ = qc.wait()
            yield from wait(w)
            qc.advance()
        if n > 0:
            w, k_index = kc.wait()
            yield from wait(w)
            for i in range(Q_STAGES):
                s_full[i].arrive()
            k.empty[k_index].arrive()
            kc.advance()
            for _ in range(n - 1):
                w, v_index = vc.wait()
                yield from wait(w)
                w, k_index = kc.wait()
                yield from wait(w)
                for i in range(Q_STAGES):
                    yield from wait(p_wait[i])
                    s_full[i].arrive()
                v.empty[v_index].arrive()
                vc.advance()
                k.empty[k_index].arrive()
                kc.advance()
            # Q released once every QKᵀ is issued, before the last PVs.
            for i in range(Q_STAGES):
                q.empty[(q_index + i) % q.stages].arrive()
            w, v_index = vc.wait()
            yield from wait(w)
            for i in range(Q_STAGES):
                yield from wait(p_wait[i])
                o_full[i].arrive()
            v.empty[v_index].arrive()
            vc.advance()
        else:
            for i in range(Q_STAGES):
                q.empty[(q_index + i) % q.stages].arrive()


def mma_role_one_tile(tiles, q, k, v, s_full, p_ready, o_full, in_turn=True):
    """One Q tile (`BlackwellFwd._mma_one_tile`): QK(0) into S buffer 0, then per block the
    next block's QKᵀ into the other buffer before this block's PV, o_full after every PV.
    `in_turn=False` (a negative control) keeps every QKᵀ in buffer 0."""
    qc, kc, vc = q.consumer(), k.consumer(), v.consumer()
    p_wait = [Waiter(b) for b in p_ready]
    for n in tiles:
        q_index = qc.index
        w, _ = qc.wait()
        yield from wait(w)
        qc.advance()
        buf = 0
        for j in range(n):
            if j == 0:
                w, k_index = kc.wait()
                yield from wait(w)
                s_full[0].arrive()
                k.empty[k_index].arrive()
                kc.advance()
            if j + 1 < n:
                w, k_index = kc.wait()
                yield from wait(w)
                s_full[1 - buf if in_turn else 0].arrive()
                k.empty[k_index].arrive()
                kc.advance()
            else:
                q.empty[q_index].arrive()
            w, v_index = vc.wait()
            yield from wait(w)
            yield from wait(p_wait[buf])
            o_full[0].arrive()
            v.empty[v_index].arrive()
            vc.advance()
            buf = 1 - buf
        if n == 0:
            q.empty[q_index].arrive()


def softmax_role_one_tile(tiles, s_full, p_ready, stats):
    """One Q tile: its blocks' S from the two buffers in turn, from buffer 0 at each tile."""
    s_wait = [Waiter(b) for b in s_full]
    side = stats[0].producer()
    def hand_over():
        w, idx = side.wait()
        yield from wait(w)
        stats[0].full[idx].arrive(TILE_M)
        side.advance()

    for n in tiles:
        buf = 0
        for _ in range(n):
            yield from wait(s_wait[buf])
            yield from hand_over()
            p_ready[buf].arrive(TILE_M)
            buf = 1 - buf
        yield from hand_over()  # l
        yield from hand_over()  # m
    w, _ = side.wait()
    yield from wait(w)


def correction_role_one_tile(tiles, p_ready, o_full, stats):
    """One Q tile: per block its factor, O rescaled once the PV before is done (o_full), then
    p_ready of the block's buffer; at the end l, m and the last PV."""
    side = stats[0].consumer()
    o_wait = Waiter(o_full[0])
    for n in tiles:
        buf = 0
        for j in range(n + 2):
            w, idx = side.wait()
            yield from wait(w)
            stats[0].empty[idx].arrive(TILE_M)
            side.advance()
            if 0 < j < n:
                yield from wait(o_wait)
            if j < n:
                p_ready[buf].arrive(TILE_M)
                buf = 1 - buf
        if n > 0:
            yield from wait(o_wait)


def softmax_role(tiles, i, s_full, p_ready, stats):
    s_wait = Waiter(s_full[i])
    side = stats[i].producer()
    for n in tiles:
        hand_overs = []
        for _ in range(n):
            yield from wait(s_wait)
            hand_overs.append(1)
            w, idx = side.wait()
            yield from wait(w)
            stats[i].full[idx].arrive(TILE_M)
            side.advance()
            p_ready[i].arrive(TILE_M)
        for _ in range(2):  # l, then m
            w, idx = side.wait()
            yield from wait(w)
            stats[i].full[idx].arrive(TILE_M)
            side.advance()
    w, _ = side.wait()
    yield from wait(w)


def correction_role(tiles, p_ready, o_full, stats, v, clears_v_tail):
    sides = [stats[i].consumer() for i in range(Q_STAGES)]
    o_wait = [Waiter(b) for b in o_full]
    v_side = v.consumer()
    v_seen = [Waiter(b) for b in v.full]

    def take(i):
        w, idx = sides[i].wait()
        yield from wait(w)
        stats[i].empty[idx].arrive(TILE_M)
        sides[i].advance()

    for n in tiles:
        if clears_v_tail and n > 0:
            # Waits for the tile's first V block without consuming it (the MMA does).
            w = v_seen[v_side.index]
            target = v_side.waiters[v_side.index].seen + 1
            yield ("wait_at_least", w.barrier, target)
        for _ in range(n if clears_v_tail else 0):
            v_side.waiters[v_side.index].seen += 1
            v_side.advance()
        for _ in range(n):
            for i in range(Q_STAGES):
                yield from take(i)
                p_ready[i].arrive(TILE_M)
        for i in range(Q_STAGES):
            yield from take(i)
            yield from take(i)
            if n > 0:
                yield from wait(o_wait[i])


def simulate(tiles, k_stages, v_stages, clears_v_tail, seed, p_ready_count=2 * TILE_M,
             q_tiles=Q_STAGES, in_turn=True):
    q = Ring("q", q_tiles, 1, 1)
    k, v = Ring("k", k_stages, 1, 1), Ring("v", v_stages, 1, 1)
    s_full = [Barrier(f"s_full[{i}]", 1) for i in range(2)]
    p_ready = [Barrier(f"p_ready[{i}]", p_ready_count) for i in range(2)]
    o_full = [Barrier(f"o_full[{i}]", 1) for i in range(q_tiles)]
    stats = [Ring(f"stats[{i}]", 1, TILE_M, TILE_M) for i in range(q_tiles)]
    roles = {"load": load_role(tiles, q, k, v)}
    if q_tiles == 2:
        roles.update(mma=mma_role(tiles, q, k, v, s_full, p_ready, o_full),
                     softmax0=softmax_role(tiles, 0, s_full, p_ready, stats),
                     softmax1=softmax_role(tiles, 1, s_full, p_ready, stats),
                     correction=correction_role(tiles, p_ready, o_full, stats, v,
                                                clears_v_tail))
    else:
        roles.update(mma=mma_role_one_tile(tiles, q, k, v, s_full, p_ready, o_full, in_turn),
                     softmax0=softmax_role_one_tile(tiles, s_full, p_ready, stats),
                     correction=correction_role_one_tile(tiles, p_ready, o_full, stats))
    blocked = {name: None for name in roles}
    rng = random.Random(seed)
    while roles:
        runnable = [name for name in roles if _ready(blocked[name])]
        assert runnable, "deadlock: " + ", ".join(f"{n} waits on {_what(blocked[n])}"
                                                  for n in roles)
        name = rng.choice(runnable)
        try:
            blocked[name] = next(roles[name])
        except StopIteration:
            del roles[name]
    for b in s_full + p_ready + o_full:
        assert b.pending == 0, f"{b.name}: arrivals left over"
    n_total = sum(tiles)
    if q_tiles == 2:
        uses = [n_total, n_total]
        assert all(b.completed == sum(1 for n in tiles if n) for b in o_full)
    else:  # blocks in turn from buffer 0 at each tile; o_full after every PV
        uses = [sum((n + 1) // 2 for n in tiles), sum(n // 2 for n in tiles)]
        assert o_full[0].completed == n_total
    assert [b.completed for b in s_full] == uses
    assert [b.completed for b in p_ready] == uses or p_ready_count != 2 * TILE_M


def _ready(op) -> bool:
    if op is None:
        return True
    if op[0] == "wait":
        return op[1].ready()
    return op[1].completed >= op[2]


def _what(op) -> str:
    if op is None:
        return "nothing"
    return op[1].barrier.name if op[0] == "wait" else op[1].name


@pytest.mark.parametrize("k_stages, v_stages", [(4, 4), (2, 2), (2, 1)])
@pytest.mark.parametrize("clears_v_tail", [False, True])
def test_the_roles_never_deadlock_and_meet_every_phase(k_stages, v_stages, clears_v_tail):
    """Persistent CTAs walking tiles of 0 to 7 blocks, 200 random interleavings each."""
    rng = random.Random(k_stages * 10 + v_stages)
    for seed in range(200):
        tiles = [rng.choice([0, 1, 1, 2, 3, 7]) for _ in range(rng.randint(1, 5))]
        simulate(tiles, k_stages, v_stages, clears_v_tail, seed)


def test_the_model_catches_a_miscounted_arrival():
    """The model fails where the kernel would hang: p_ready expecting one arrival too many,
    or one too few (a phase completes before the MMA has read it: a lapped waiter)."""
    with pytest.raises(AssertionError, match="deadlock"):
        simulate([2, 1], 2, 2, False, 0, p_ready_count=2 * TILE_M + 1)
    with pytest.raises(AssertionError, match="lapped|more arrivals"):
        for seed in range(50):
            simulate([3, 2], 2, 2, False, seed, p_ready_count=TILE_M)


@pytest.mark.parametrize("k_stages, v_stages", [(3, 2), (2, 1)])
def test_one_q_tile_with_s_in_turn_never_deadlocks_and_meets_every_phase(k_stages, v_stages):
    """hdim 256's schedule (`FwdSchedule.q_tiles` 1): the softmax of S(j+1) under PV(j), the
    correction waiting for the PV before each rescale; tiles of 0 to 7 blocks."""
    rng = random.Random(k_stages * 10 + v_stages)
    for seed in range(200):
        tiles = [rng.choice([0, 1, 1, 2, 3, 7]) for _ in range(rng.randint(1, 5))]
        simulate(tiles, k_stages, v_stages, False, seed, q_tiles=1)


def test_the_one_tile_model_catches_s_kept_in_one_buffer():
    """Every QKᵀ into buffer 0 (the buffers not taken in turn): the softmax waits on buffer 1
    forever, or buffer 0 completes a phase its waiter has not seen."""
    with pytest.raises(AssertionError, match="deadlock|lapped"):
        for seed in range(50):
            simulate([3, 2], 3, 2, False, seed, q_tiles=1, in_turn=False)

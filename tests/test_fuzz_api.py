"""A CPU fuzz of the public API (Hypothesis): random calls of every public function, valid
and with one bad index content, checked by `fuzz_calls.run` (the FlashAttention rule against
the test's own float64 model, the cache against the test's own append; a bad content raises
ValueError naming the argument and leaves the cache bitwise unchanged).

The quick run (derandomized, so CI draws the same calls each time) is in the README's
pytest; the long one is marked slow. Each run checks that at least 60 % of its draws were
valid calls. Each failing example Hypothesis shrank is kept in `REGRESSIONS`, run on its
own."""

import collections

import fuzz_calls
import pytest
from hypothesis import HealthCheck, given, settings

QUICK, LONG = 600, 3000
_SETTINGS = dict(deadline=None, database=None, suppress_health_check=list(HealthCheck))


_BASE = dict(seed=0, dtype="bf16", d=16, hk=1, group=1, causal=False, softcap=0.0, splits=1,
             corrupt=None, window=(None, None))
_VARLEN = dict(_BASE, kind="varlen", packed=True, lens_q=[0], lens_k=[0], trailing=0,
               seqused_q=False, seqused_k=False, mod="none", sink=False, dropout=0.0,
               bwd=False)
REGRESSIONS = {
    # The CPU path refused packed q rows past cu_seqlens_q[-1]; the kernels give them O = 0
    # and LSE = -inf, as docs/guide/reliability.md says.
    "rows past cu_seqlens_q": dict(_VARLEN, trailing=3),
    # A learnable sink gives a padding row (past seqused_q) LSE = sink, as a keyless row.
    "sink on a padding row": dict(_VARLEN, packed=False, seqused_q=True, seqused_k=True,
                                  sink=True),
    # The reference's backward took the softcap's derivative after ALiBi's bias (now ALiBi
    # with softcap is refused, as a score_mod with softcap is).
    "alibi with softcap": dict(_BASE, kind="func", causal=True, b=1, sq=3, sk=5,
                               view="contiguous", mod="alibi", sink=False, dropout=0.0,
                               bwd=True),
    # A seqused_k past a paged table's rows was reported as a page_table entry.
    "seqused_k past the pages": dict(_BASE, kind="paged", api="varlen", b=1, page=1,
                                     slots=1, spare=0, sq=1, lens=[0], pad_unused=True,
                                     corrupt="seqused_k_past_span"),
}


@pytest.mark.parametrize("name", list(REGRESSIONS))
def test_shrunk_examples_stay_fixed(name):
    fuzz_calls.run(dict(REGRESSIONS[name]))


def test_drawn_appends_fit_the_cache_so_their_corruptions_apply():
    """A kvcache draw whose append was longer than the cache ran as a read, so a corruption
    drawn for a write (a repeated cache_batch_idx) was legal and not refused: the slow run
    found it (b=2, new=2, capacity=1, batch_idx_repeat). The draw now makes such a call a
    read before it draws the corruption; checked on draws alone, which are cheap."""
    @given(spec=fuzz_calls.specs())
    def draw(spec):
        if spec["kind"] == "kvcache":
            room = spec["slots"] * spec["page"] if spec["layout"] == "paged" else \
                spec["capacity"]
            assert spec["new"] <= room, spec
            if spec["corrupt"] in ("batch_idx_repeat", "shared_write_page", "append_past"):
                assert spec["new"] > 0, spec
    settings(max_examples=3000, **_SETTINGS)(draw)()


def _draws(counts):
    @given(spec=fuzz_calls.specs())
    def call(spec):
        counts[fuzz_calls.run(spec)] += 1
        counts[spec["kind"]] += 1
    return call


def _valid_share(counts) -> float:
    return counts["valid"] / max(counts["valid"] + counts["invalid"], 1)


def test_quick_api_fuzz():
    counts = collections.Counter()
    settings(max_examples=QUICK, derandomize=True, **_SETTINGS)(_draws(counts))()
    assert counts["valid"] + counts["invalid"] >= QUICK * 0.9, counts
    assert _valid_share(counts) >= 0.6, counts
    assert all(counts[kind] for kind in ("func", "varlen", "paged", "kvcache", "combine",
                                         "fa2")), counts


@pytest.mark.slow
def test_long_api_fuzz():
    counts = collections.Counter()
    settings(max_examples=LONG, **_SETTINGS)(_draws(counts))()
    assert counts["valid"] + counts["invalid"] >= LONG * 0.9, counts
    assert _valid_share(counts) >= 0.6, counts

"""The n-gram proposer: what it finds, what it refuses, and that its cost is bounded by the window."""

import time

import pytest

from sluice.scheduling.config import SchedulerConfig
from sluice.scheduling.ngram import TokenBytes, propose


def drafts(tokens, k=4, n_min=2, n_max=4, window=4096):
    return propose(TokenBytes(tokens), k, n_min, n_max, window)


def test_copies_what_followed_the_latest_earlier_occurrence():
    # "1 2 3" occurs twice before the tail; the later one is followed by 7 8 9.
    assert drafts([1, 2, 3, 4, 5, 6, 1, 2, 3, 7, 8, 9, 0, 0, 1, 2, 3]) == [7, 8, 9, 0]


def test_longer_ngrams_win_over_more_recent_shorter_ones():
    # The tail "5 2 3" matches in full at the start (followed by 40); "2 3" alone matches later (followed by 50).
    assert drafts([5, 2, 3, 40, 41, 9, 2, 3, 50, 51, 5, 2, 3], k=2, n_max=3) == [40, 41]
    assert drafts([5, 2, 3, 40, 41, 9, 2, 3, 50, 51, 5, 2, 3], k=2, n_max=2) == [50, 51]


def test_nothing_to_copy_gives_no_drafts():
    assert drafts(list(range(100))) == []
    assert drafts([7]) == []
    assert drafts([1, 2, 9, 1, 3], n_min=2) == []  # only a 1-gram repeats
    assert drafts([1, 2, 9, 1, 3, 1], n_min=1) == [3, 1, 3, 1]


def test_a_match_overlapping_the_tail_continues_periodically():
    assert drafts([5, 5, 5, 5], k=4) == [5, 5, 5, 5]
    assert drafts([9, 1, 2, 1, 2, 1, 2], k=5) == [1, 2, 1, 2, 1]


def test_matches_inside_a_token_are_skipped():
    # Packed little-endian, 256 then 0 read 00 01 00 00 00 00 00 00: from byte 1 of 256 on, the bytes of the
    # pair (1, 0), across a token boundary.
    tokens = [65536, 1, 256, 0, 7, 1, 0]
    got = drafts(tokens, n_min=2, n_max=2)
    assert got == []  # the only byte match of [1, 0] straddles token boundaries
    assert drafts([1, 0, 5, 6, 65536, 1, 256, 1, 0], n_min=2, n_max=2) == [5, 6, 65536, 1]


def test_the_window_bounds_the_search():
    tokens = [1, 2, 3, 4] + list(range(10, 60)) + [1, 2, 3]
    assert drafts(tokens, window=100) == [4, 10, 11, 12]
    assert drafts(tokens, window=20) == []


def test_token_bytes_appends_match_a_fresh_pack():
    tb = TokenBytes([3, 4])
    for t in (5, 3, 4):
        tb.append(t)
    assert tb.data == TokenBytes([3, 4, 5, 3, 4]).data and len(tb) == 5
    assert propose(tb, 3, 2, 2, 100) == [5, 3, 4]


def test_cost_is_bounded_by_the_window_on_an_adversarial_context():
    """A long context built to defeat the search (near misses everywhere) costs what the window allows."""
    near_miss = [7] * 15 + [8]
    context = near_miss * 20_000 + [7] * 16  # 320k tokens, the tail a 16-gram of 7s found nowhere in the window
    tb = TokenBytes(context)
    start = time.perf_counter()
    for _ in range(10):
        propose(tb, 16, 1, 16, 4096)
    per_call = (time.perf_counter() - start) / 10
    assert per_call < 0.01, f"{per_call * 1e3:.1f} ms per proposal"


@pytest.mark.parametrize("fields, message", [
    ({"speculative_method": "eagle"}, "unknown speculative method"),
    ({"num_speculative_tokens": 0}, "num_speculative_tokens"),
    ({"num_speculative_tokens": 17}, "num_speculative_tokens"),
    ({"prompt_lookup_min": 3, "prompt_lookup_max": 2}, "prompt_lookup_min"),
    ({"prompt_lookup_min": 0}, "prompt_lookup_min"),
    ({"prompt_lookup_window": 2}, "prompt_lookup_window"),
])
def test_bad_speculation_knobs_are_refused(fields, message):
    with pytest.raises(ValueError, match=message):
        SchedulerConfig(**fields).validate()

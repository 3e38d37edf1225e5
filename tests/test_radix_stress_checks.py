"""``bench/radix_stress.py``'s end-of-load accounting (its CPU smoke run passes them; here each check must fail on
the leak it is there for)."""

import os
import sys

import pytest

sys.path.insert(0, os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "bench"))
from radix_stress import accounting  # noqa: E402

DRAINED = {
    "requests_in_flight": 0,
    "kv_used_tokens": 0,
    "free_rows": 4,
    "state_slots_used": 0,
    "free_state_slots": 4,
    "snapshot_slots_used": 5,
    "snapshot_slots_total": 16,
    "evictable_snapshots": 5,
    "evictable_tokens": 900,
    "cached_tokens_in_tree": 900,
    "snapshot_hits": 3,
}


def test_a_drained_engine_passes():
    assert accounting(DRAINED, 4, "INFO ... served") == []


@pytest.mark.parametrize(
    "change, failed",
    [
        ({"requests_in_flight": 1}, "no request in flight"),
        ({"kv_used_tokens": 64}, "every KV slot free"),
        ({"free_rows": 3}, "every page-table row free"),
        ({"state_slots_used": 1, "free_state_slots": 3}, "every live state slot free"),
        ({"snapshot_slots_used": 17, "evictable_snapshots": 17}, "snapshots within the pool"),
        ({"evictable_snapshots": 4}, "every held snapshot evictable"),
        ({"evictable_tokens": 800}, "every tree token evictable"),
        ({"snapshot_hits": 0}, "snapshot hits happened"),
    ],
)
def test_each_leak_is_named(change, failed):
    assert accounting({**DRAINED, **change}, 4, "") == [failed]


def test_an_integrity_failure_in_the_log_is_named():
    assert accounting(DRAINED, 4, "ERROR radix integrity check failed: ...") == ["no integrity-check failure or panic"]

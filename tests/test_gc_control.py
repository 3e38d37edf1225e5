"""The garbage-collector controls of ``engine/gc_control.py``: start-up objects frozen out of the collector (so a
full collection inside a step walks only what the steps allocated), the switch that keeps the default, and the
clock that attributes collection time to a step."""

import gc

import pytest

from freetoken.engine.gc_control import GcClock, freeze_startup_objects


@pytest.fixture
def unfrozen():
    gc.unfreeze()
    yield
    gc.unfreeze()


def test_freeze_moves_live_objects_out_of_the_collector(unfrozen):
    keep = [[i] for i in range(1000)]  # tracked objects alive "at the end of start-up"
    frozen = freeze_startup_objects({})
    assert frozen == gc.get_freeze_count() and frozen >= len(keep)
    tracked_after = len(gc.get_objects())
    assert tracked_after < frozen  # what a collection walks now is what came after the freeze


def test_freeze_switch(unfrozen):
    assert freeze_startup_objects({"FREETOKEN_GC_FREEZE": "0"}) == 0 and gc.get_freeze_count() == 0
    with pytest.raises(ValueError, match="FREETOKEN_GC_FREEZE='yes'"):
        freeze_startup_objects({"FREETOKEN_GC_FREEZE": "yes"})


def test_clock_counts_collections_while_started():
    clock = GcClock().start()
    try:
        gc.collect()
        gc.collect(0)
    finally:
        clock.stop()
    assert clock.count[2] >= 1 and clock.count[0] >= 1 and clock.total_ms() > 0
    before = list(clock.count)
    gc.collect()  # stopped: not counted
    assert clock.count == before and clock._callback not in gc.callbacks
    assert clock.summary().startswith("gc ") and "collections of gen 0/1/2" in clock.summary()


def test_a_served_worker_freezes_its_start_up_objects(tiny_llama_dir, monkeypatch, unfrozen, caplog):
    """``ft serve``'s worker (the variable unset, as in production) ends its start-up with the freeze."""
    import logging

    from freetoken.worker import Worker

    monkeypatch.delenv("FREETOKEN_GC_FREEZE", raising=False)
    log = logging.getLogger("freetoken")
    log.addHandler(caplog.handler)  # the freetoken logger does not propagate to the root's capture
    try:
        with caplog.at_level(logging.INFO, logger="freetoken"):
            Worker({"model_path": tiny_llama_dir, "device": "cpu", "dtype": "float32", "num_tokens": 256,
                    "max_running_requests": 2, "load_progress": False})  # fmt: skip
    finally:
        log.removeHandler(caplog.handler)
    assert gc.get_freeze_count() > 0
    assert any("start-up objects out of the garbage collector" in m for m in caplog.messages), caplog.messages

"""The graphs' and kernels' on/off switches read from the environment (``tuning_env.switch_from_env``): 1 or unset is
on, 0 off, and anything else stops a worker's start-up in one line naming the variable (a typo such as ``off`` or
``false`` must not leave an optimization silently on through a whole A/B run)."""

import pytest

from freetoken.tuning_env import switch_from_env

SWITCHES = (
    "FREETOKEN_MOE_PREFILL_GRAPHS",
    "FREETOKEN_GDN_BATCH_GRAPHS",
    "FREETOKEN_GDN_STAGE_INPUTS",
    "FREETOKEN_EXTEND_SLOT_INT32",
)


@pytest.mark.parametrize("name", SWITCHES)
def test_switch_values(monkeypatch, name):
    monkeypatch.delenv(name, raising=False)
    assert switch_from_env(name) is True
    for raw, on in (("1", True), ("", True), ("0", False), (" 0 ", False)):
        monkeypatch.setenv(name, raw)
        assert switch_from_env(name) is on
    for bad in ("off", "false", "2"):
        monkeypatch.setenv(name, bad)
        with pytest.raises(ValueError, match=f"{name}={bad!r}: expected 1"):
            switch_from_env(name)


def test_the_layers_read_their_switches(monkeypatch):
    """Each switch turns its path off at run time (the A/B use) through the function the layer calls every step."""
    import torch

    from freetoken.kernels.attention import int32_key_offsets
    from freetoken.layers.gated_deltanet import batch_graphs_on, eager_batch_steps, stage_inputs
    from freetoken.layers.moe_prefill_graphs import graphs_switched_on

    pools = torch.empty(4, 2, 8), torch.empty(4, 2, 8)
    for name in SWITCHES:
        monkeypatch.delenv(name, raising=False)
    assert batch_graphs_on() and stage_inputs() and graphs_switched_on() and int32_key_offsets(*pools)
    with eager_batch_steps():
        assert not batch_graphs_on()
    for name, read in zip(
        SWITCHES, (graphs_switched_on, batch_graphs_on, stage_inputs, lambda: int32_key_offsets(*pools))
    ):
        monkeypatch.setenv(name, "0")
        assert not read(), name
        monkeypatch.delenv(name)


@pytest.mark.parametrize("name", SWITCHES)
def test_bad_switch_stops_start_up(monkeypatch, tmp_path, name):
    """A hybrid model's worker refuses a switch that is neither 0 nor 1 at start-up, not at the first step that reads it."""
    from conftest import assert_start_up_refuses

    assert_start_up_refuses(monkeypatch, tmp_path, name, "off")

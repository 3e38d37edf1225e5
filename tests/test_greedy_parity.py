"""bench/greedy_parity.py's helpers: the truncated config it serves with ``--layers`` and where two answers part."""

import json
import os
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.join(ROOT, "bench"))
from greedy_parity import at_parting, first_difference, margin, truncated_config  # noqa: E402


def test_truncated_config_keeps_the_first_layers_and_their_types(tmp_path):
    src = os.path.join(ROOT, "configs", "qwen3.6-35b-a3b")
    truncated_config(src, 8, str(tmp_path))
    with open(os.path.join(src, "config.json")) as f:
        full = json.load(f)["text_config"]
    with open(tmp_path / "config.json") as f:
        cut = json.load(f)["text_config"]
    assert cut["num_hidden_layers"] == 8
    assert cut["layer_types"] == full["layer_types"][:8]
    assert cut["layer_types"].count("full_attention") == 2  # Qwen3.6: every 4th layer attends
    assert {k: v for k, v in cut.items() if k not in ("num_hidden_layers", "layer_types")} == {
        k: v for k, v in full.items() if k not in ("num_hidden_layers", "layer_types")
    }
    assert sorted(os.listdir(tmp_path)) == sorted(os.listdir(src))


def test_first_difference():
    assert first_difference("abc", "abc") is None
    assert first_difference("abc", "abd") == 2
    assert first_difference("ab", "abc") == 2  # one answer a prefix of the other
    assert first_difference("", "x") == 0


def test_where_two_answers_part_and_by_how_much():
    x = {"tokens": ["a", "b", "c"], "top": [{"a": -0.1}, {"b": -0.50, "z": -0.52}, {"c": -1.0}]}
    y = {"tokens": ["a", "z", "q"], "top": [{"a": -0.1}, {"z": -0.49, "b": -0.51}, {"q": -2.0}]}
    part = at_parting(x, y)
    assert part == {"token": 1, "a": "b", "b": "z", "x": [-0.50, -0.52], "y": [-0.51, -0.49]}
    assert margin(*part["x"]) == "0.020" and margin(*part["y"][::-1]) == "0.020"  # a near tie both ways
    assert margin(-0.5, None) == "top5-" and margin(None, -0.5) == "-"
    assert at_parting(x, x) is None
    assert at_parting({"tokens": ["a"], "top": []}, {"tokens": ["b"], "top": []}) is None  # no logprobs returned

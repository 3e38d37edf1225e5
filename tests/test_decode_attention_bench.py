"""``bench/decode_attention_bench.py --smoke`` (CPU, interpreter): every split count and stage-1 launch override it
sweeps gives the torch reference's output, and the split counts are capped by the context the graph serves."""

import json
import os
import subprocess
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.join(ROOT, "bench"))


def test_parse_config_caps_splits_and_reads_overrides():
    from decode_attention_bench import parse_config

    assert parse_config("graph", 64, 1024) == (64, {})
    assert parse_config("s16", 64, 8) == (8, {})  # no more splits than the max length allows
    assert parse_config("graph:n64,w8,st1", 4, 100) == (4, {"block_n": 64, "warps": 8, "stages": 1})


def test_smoke_run_matches_the_reference(tmp_path):
    out = tmp_path / "decode_attention.json"
    env = dict(os.environ, TRITON_INTERPRET="1")
    configs = "graph,s1,s4,graph:n64,graph:w2,graph:st1"
    r = subprocess.run(
        [sys.executable, os.path.join(ROOT, "bench", "decode_attention_bench.py"), "--smoke", "--configs", configs,
         "--out", str(out)],
        capture_output=True, text=True, timeout=600, env=env,
    )  # fmt: skip
    assert r.returncode == 0, r.stdout[-2000:] + r.stderr[-2000:]
    rows = json.loads(out.read_text())["rows"]
    assert len(rows) == 2 * len(configs.split(","))  # two smoke cases, no SDPA baselines on the CPU
    for row in rows:
        assert "error" not in row, row
        assert row["max_abs_diff"] < 1e-4, row  # fp32 on the CPU
        assert 1 <= row["splits"] <= -(-row["max_len"] // 32)

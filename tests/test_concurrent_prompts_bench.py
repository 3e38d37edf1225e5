"""``bench/concurrent_prompts_bench.py``: the stream gaps it attributes to a joining prompt (a pure function of the
token times), and one small run end to end against a tiny hybrid model's server on the CPU (the bench must not rot
between GPU sessions)."""

import json
import os
import subprocess
import sys

BENCH = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "bench")
sys.path.insert(0, BENCH)
from concurrent_prompts_bench import gaps_around_joins  # noqa: E402


def test_a_joiner_is_charged_the_longest_stream_gap_overlapping_its_wait():
    streams = [
        {"stamps": [0.0, 1.0, 2.0, 5.0, 6.0]},  # a 3 s gap from 2 to 5
        {"stamps": [0.5, 1.5, 2.5, 4.0, 7.5]},  # 1.5 s from 2.5 to 4, 3.5 s from 4 to 7.5
    ]
    joined = [
        {"sent": 2.2, "stamps": [4.5]},  # overlaps 2-5 (3 s), 2.5-4 (1.5), 4-7.5 (3.5): 3.5
        {"sent": 8.0, "stamps": [9.0]},  # after every stream ended: nothing overlaps
    ]
    steady, stalls = gaps_around_joins(streams, joined)
    assert steady == [1.0, 1.0, 1.0]  # the gaps that ended before the first join was sent (not 1.5-2.5)
    assert stalls == [3.5, 0.0]


def test_end_to_end_on_a_tiny_hybrid_model(tmp_path):
    import hf_reference as R

    model = tmp_path / "model"
    model.mkdir()
    R.write_released_qwen3_5_moe(str(model), seed=3, max_position_embeddings=4096)
    out = tmp_path / "r.json"
    cmd = [sys.executable, os.path.join(BENCH, "concurrent_prompts_bench.py"), "--burst", "3", "--joins", "2",
           "--rounds", "1", "--burst-words", "10", "--join-words", "30", "--out", str(out), "--",
           "--model-path", str(model), "--max-running-requests", "3"]  # fmt: skip
    done = subprocess.run(cmd, capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stdout[-2000:] + done.stderr[-2000:]
    report = json.loads(out.read_text())
    assert set(report["servers"]) == {"batch graphs", "eager varlen"}
    for server in report["servers"].values():
        assert server["env"] in ({}, {"FREETOKEN_GDN_BATCH_GRAPHS": "0"}) and server["exit_code"] == 0
        (rnd,) = server["rounds"]
        assert rnd["burst"]["prompts"] == 3 and rnd["burst"]["ttft_ms_last"] >= rnd["burst"]["ttft_ms_p50"] > 0
        assert rnd["join"]["streams"] == 2 and rnd["join"]["join_ttft_ms_p50"] > 0
        assert rnd["join"]["join_step"]["tokens"] > 30 and rnd["join"]["join_step"]["engine_ms"] > 0
    assert "burst: TTFT p50 ms" in done.stdout

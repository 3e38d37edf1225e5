"""Does ``ft serve`` keep its SIGTERM handler through start-up and serving, and does SIGTERM end it with a drain and
exit 0? (A GPU server has been seen to end with -15, SIGTERM's default action, and no drain line.)

Starts the server with the given arguments, reads the process's caught-signal mask (``SigCgt`` in
``/proc/PID/status``) once it answers and again after each request, sends SIGTERM, and prints the exit code, the
seconds to exit and the log lines from the signal on. Writes JSON.

    python bench/shutdown_check.py --out bench/out/shutdown_check.json -- \\
        --model-path configs/qwen3.6-35b-a3b --dummy-weight --moe-backend fused --max-seq-len-override 8192
"""

from __future__ import annotations

import argparse
import os
import signal
import sys
import time

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "tests"))
from report import write_report  # noqa: E402
from server_harness import ServerProcess  # noqa: E402

SIGTERM_BIT = 1 << (signal.SIGTERM - 1)


def caught(pid: int) -> dict:
    """``{"SigCgt": hex, "sigterm_caught": bool}`` from /proc (None where it cannot be read)."""
    try:
        with open(f"/proc/{pid}/status") as f:
            fields = dict(line.split(":", 1) for line in f if ":" in line)
    except OSError:
        return {"SigCgt": None, "sigterm_caught": None}
    mask = int(fields["SigCgt"].strip(), 16)
    return {"SigCgt": fields["SigCgt"].strip(), "sigterm_caught": bool(mask & SIGTERM_BIT)}


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--requests", type=int, default=2)
    ap.add_argument("--out", default="bench/out/shutdown_check.json")
    ap.add_argument("serve_args", nargs=argparse.REMAINDER)
    a = ap.parse_args()
    import requests

    args = [x for x in a.serve_args if x != "--"]
    srv = ServerProcess(args, ready_timeout=900)
    checks = [{"when": "ready", **caught(srv.proc.pid)}]
    model = requests.get(srv.url + "/v1/models", timeout=30).json()["data"][0]["id"]
    for i in range(a.requests):
        body = {"model": model, "messages": [{"role": "user", "content": f"Hello {i}"}], "max_tokens": 8}
        r = requests.post(srv.url + "/v1/chat/completions", json=body, timeout=300)
        checks.append({"when": f"after request {i + 1} ({r.status_code})", **caught(srv.proc.pid)})
    before = len(srv.log())
    t0 = time.monotonic()
    srv.proc.send_signal(signal.SIGTERM)
    try:
        code = srv.proc.wait(60)
    except Exception:
        srv.proc.kill()
        code = srv.proc.wait()
    seconds = time.monotonic() - t0
    after = srv.log()[before:]
    for c in checks:
        print(f"{c['when']:<28} SigCgt {c['SigCgt']}  SIGTERM caught: {c['sigterm_caught']}")
    print(f"SIGTERM -> exit {code} in {seconds:.1f} s; log after the signal:")
    print(after[-3000:] or "(nothing)")
    result = {"serve_args": args, "checks": checks, "exit_code": code, "exit_s": seconds, "log_after": after[-6000:]}
    write_report(a.out, result)
    return 0 if code == 0 else 1


if __name__ == "__main__":
    sys.exit(main())

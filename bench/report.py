"""The JSON report a bench script ends with, stamped with its command and date (``write_report``)."""

from __future__ import annotations

import datetime
import json
import os
import shlex
import sys


def write_report(path: str, report: dict) -> str:
    """Write a bench's JSON report to ``path``: adds "command" (sys.executable + argv, shell-quoted) and "date" (UTC,
    seconds) to ``report`` unless it has them (the file lists them first), creates the folder, prints
    ``JSON: <path>``; returns the path."""
    report.setdefault("command", shlex.join([sys.executable, *sys.argv]))
    report.setdefault("date", datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"))
    os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
    with open(path, "w") as f:
        json.dump({"command": report["command"], "date": report["date"], **report}, f, indent=2)
    print(f"JSON: {path}", flush=True)
    return path

"""``bench/report.py``: every bench's JSON report carries the command that made it and its date."""

import datetime
import json
import os
import shlex
import sys

sys.path.insert(0, os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "bench"))
from report import write_report  # noqa: E402


def test_adds_command_and_date_first(tmp_path, monkeypatch):
    monkeypatch.setattr(sys, "argv", ["bench/x.py", "--out", "a b.json"])
    path = str(tmp_path / "r.json")
    payload = {"gpu": "none", "rows": [1, 2]}
    assert write_report(path, payload) == path
    with open(path) as f:
        report = json.load(f)
    assert list(report) == ["command", "date", "gpu", "rows"]
    assert shlex.split(report["command"]) == [sys.executable, "bench/x.py", "--out", "a b.json"]
    date = datetime.datetime.fromisoformat(report["date"])
    assert date.utcoffset() == datetime.timedelta(0) and date.microsecond == 0
    assert abs((datetime.datetime.now(datetime.timezone.utc) - date).total_seconds()) < 60
    assert payload == report  # stamped in place too: a script may print its date after writing


def test_keeps_a_given_command_and_date(tmp_path):
    path = str(tmp_path / "r.json")
    write_report(path, {"date": "2026-01-01T00:00:00+00:00", "command": "ft serve", "x": 1})
    with open(path) as f:
        report = json.load(f)
    assert report == {"command": "ft serve", "date": "2026-01-01T00:00:00+00:00", "x": 1}
    assert list(report) == ["command", "date", "x"]


def test_creates_the_folder_and_prints_the_path(tmp_path, capsys):
    path = str(tmp_path / "out" / "nested" / "r.json")
    write_report(path, {"x": 1})
    assert os.path.isfile(path)
    assert capsys.readouterr().out == f"JSON: {path}\n"

"""HTTP clients for fault, load and hostile-input tests: every call has a connect timeout, a read timeout and a
wall-clock deadline, and comes back as a plain record (never raises), so a test can check what every client got
and that none of them waited past its bound."""

from __future__ import annotations

import json
import socket
import threading
import time
from dataclasses import dataclass, field

import requests

CONNECT_TIMEOUT = 5.0


@dataclass
class Outcome:
    """What one client got. ``kind``: ``ok`` (finished with a finish_reason), ``error`` (an HTTP error status, or
    an SSE error event), ``cancelled`` (the client hung up on purpose), ``connection`` (the server went away)."""

    kind: str
    status: int | None = None
    text: str = ""
    finish_reason: str | None = None
    error: dict | None = None
    chunks: int = 0
    pieces: list[str] = field(default_factory=list)  # streamed: each content chunk's text
    elapsed: float = 0.0
    ended: float = 0.0  # time.monotonic() when the answer was complete
    done: bool = False  # saw data: [DONE]
    detail: str = ""

    def finish(self, t0: float) -> "Outcome":
        self.ended = time.monotonic()
        self.elapsed = self.ended - t0
        return self

    @property
    def message(self) -> str:
        return (self.error or {}).get("message", "") if isinstance(self.error, dict) else ""


def chat_body(content: str = "Count from one to twenty.", max_tokens: int = 16, stream: bool = False, **extra) -> dict:
    return {
        "model": "demo",
        "messages": [{"role": "user", "content": content}],
        "max_tokens": max_tokens,
        "temperature": 0,
        "stream": stream,
        **extra,
    }


def post_json(url: str, body, deadline: float = 60.0, path: str = "/v1/chat/completions", **kw) -> Outcome:
    """A non-streaming POST (``body`` a dict, or bytes sent as they are)."""
    t0 = time.monotonic()
    try:
        if isinstance(body, (bytes, bytearray)):
            r = requests.post(
                url + path,
                data=body,
                headers={"content-type": "application/json"},
                timeout=(CONNECT_TIMEOUT, deadline),
                **kw,
            )
        else:
            r = requests.post(url + path, json=body, timeout=(CONNECT_TIMEOUT, deadline), **kw)
    except requests.RequestException as e:
        return Outcome("connection", detail=repr(e)).finish(t0)
    out = Outcome("ok" if r.status_code == 200 else "error", status=r.status_code).finish(t0)
    try:
        data = r.json()
    except ValueError:
        out.detail = r.text[:500]
        if r.status_code == 200:
            out.kind = "error"
        return out
    if r.status_code == 200:
        choice = (data.get("choices") or [{}])[0]
        out.text = (choice.get("message") or {}).get("content", choice.get("text", ""))
        out.finish_reason = choice.get("finish_reason")
    else:
        out.error = data.get("error") if isinstance(data, dict) else None
    return out


def stream(
    url: str, body: dict, deadline: float = 60.0, path: str = "/v1/chat/completions", hang_up_after: int | None = None
) -> Outcome:
    """A streaming POST read event by event until ``[DONE]``, the deadline, or (``hang_up_after`` = N) right
    after the N-th content chunk, when the client closes the connection on purpose."""
    body = {**body, "stream": True}
    t0 = time.monotonic()
    out = Outcome("connection")
    try:
        with requests.post(url + path, json=body, stream=True, timeout=(CONNECT_TIMEOUT, deadline)) as r:
            out.status = r.status_code
            if r.status_code != 200:
                out.kind = "error"
                try:
                    out.error = r.json().get("error")
                except ValueError:
                    out.detail = r.text[:500]
                return out.finish(t0)
            # bytes, decoded per line: the stream carries no charset, and requests would decode it as
            # ISO-8859-1, splitting lines at U+0085 (the 0x85 byte inside many UTF-8 characters)
            for raw in r.iter_lines():
                line = raw.decode("utf-8")
                if time.monotonic() - t0 > deadline:
                    out.kind, out.detail = "connection", "deadline passed while streaming"
                    break
                if not line or line.startswith(":"):
                    continue
                assert line.startswith("data: "), line
                data = line[len("data: ") :]
                if data == "[DONE]":
                    out.done = True
                    break
                event = json.loads(data)
                if "error" in event:
                    out.kind, out.error = "error", event["error"]
                    continue
                for choice in event.get("choices") or []:
                    piece = (choice.get("delta") or {}).get("content") or choice.get("text") or ""
                    if piece:
                        out.chunks += 1
                        out.text += piece
                        out.pieces.append(piece)
                    if choice.get("finish_reason"):
                        out.finish_reason = choice["finish_reason"]
                        if out.kind != "error":
                            out.kind = "ok"
                if hang_up_after is not None and out.chunks >= hang_up_after:
                    out.kind = "cancelled"
                    break  # leaving the `with` closes the connection
    except requests.RequestException as e:
        out.kind, out.detail = "connection", repr(e)
    except (ValueError, AssertionError) as e:
        out.kind, out.detail = "error", f"bad stream: {e!r}"
    out.finish(t0)
    if out.kind == "connection" and out.done:
        out.kind = "error"
    return out


def raw_request(port: int, payload: bytes, timeout: float = 30.0) -> tuple[int | None, bytes]:
    """Sends raw bytes over a socket (for bodies ``requests`` would not send as they are) and reads the reply
    until the server closes or ``timeout``; returns (status, whole reply)."""
    with socket.create_connection(("127.0.0.1", port), timeout=CONNECT_TIMEOUT) as s:
        s.settimeout(timeout)
        s.sendall(payload)
        data = b""
        t0 = time.monotonic()
        while time.monotonic() - t0 < timeout:
            try:
                chunk = s.recv(65536)
            except socket.timeout:
                break
            except ConnectionResetError:
                break
            if not chunk:
                break
            data += chunk
            if b"\r\n\r\n" in data:
                head, _, rest = data.partition(b"\r\n\r\n")
                length = next(
                    (int(l.split(b":")[1]) for l in head.split(b"\r\n") if l.lower().startswith(b"content-length:")),
                    None,
                )
                if length is not None and len(rest) >= length:
                    break
    status = None
    if data.startswith(b"HTTP/1.1 "):
        status = int(data[9:12])
    return status, data


class HealthPoller:
    """Polls /health every ``interval`` s in a thread, recording (sent, received, status) with status an int
    or ``None`` when the server could not be reached."""

    def __init__(self, url: str, interval: float = 0.05):
        self.url, self.interval = url, interval
        self.samples: list[tuple[float, float, int | None]] = []
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)

    def __enter__(self):
        self._thread.start()
        return self

    def __exit__(self, *exc):
        self.stop()

    def stop(self):
        self._stop.set()
        self._thread.join(10)

    def _run(self):
        while not self._stop.is_set():
            sent = time.monotonic()
            try:
                status = requests.get(self.url + "/health", timeout=(2, 5)).status_code
            except requests.RequestException:
                status = None
            self.samples.append((sent, time.monotonic(), status))
            self._stop.wait(self.interval)

    def statuses(self) -> list[int | None]:
        return [s for _, _, s in self.samples]

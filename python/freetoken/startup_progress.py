"""Start-up phases, said as each begins: a log line (logs show where a long start-up is) and, under systemd, the
service's status (``STATUS=`` through ``NOTIFY_SOCKET``: ``systemctl status freetoken`` shows it). The Rust side
says the phases around the load (listening, serving, stopping) the same way (``ft_server::notify``).

On a terminal the weights load also draws a progress bar (``load_progress``, on when stderr is a terminal).
"""

from __future__ import annotations

import os
import socket

from .log import get_logger

logger = get_logger(__name__)


def phase(text: str, log: bool = True) -> None:
    """``text`` (one line, e.g. "Loading weights from X") begins; ``log=False`` when a log line already says it."""
    if log:
        logger.info(text)
    notify("STATUS=" + text.replace("\n", " "))


def notify(state: str) -> bool:
    """Sends ``state`` to systemd's notify socket (``sd_notify(3)``: one datagram; ``@`` names an abstract
    socket); False when not run by systemd or when the send fails (never fatal)."""
    address = os.environ.get("NOTIFY_SOCKET")
    if not address:
        return False
    if address.startswith("@"):
        address = "\0" + address[1:]
    try:
        with socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM) as s:
            s.sendto(state.encode(), address)
        return True
    except OSError:
        return False

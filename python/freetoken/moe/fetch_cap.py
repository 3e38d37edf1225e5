"""``FetchCap``: how many of a MoE layer's cache misses the hybrid backend fetches over PCIe in one lookup (the
others are computed on the host CPU: ``hybrid_experts.py``).

One value, read by the host reference (``slot_cache.py``), the device cache (``device_slot_cache.py``) and both
admission functions (``kernels/expert_admission.py``, which pass its three numbers to the kernel), so the rule is
stated once: a one-token lookup fetches ``one_token`` when that is set (one decode stream:
``backend_choice.AUTO_ONE_TOKEN_FETCH``), any other at least ``floor``, or ``share`` per mille of its misses
(rounded up) where that is more, so that with many streams the PCIe and the host side of a layer finish together
(``share`` is measured at start-up: ``hybrid_fetch_share.py``).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional


@dataclass(frozen=True)
class FetchCap:
    floor: int  # misses fetched at least (--moe-hybrid-max-fetch; 0: the cpu backend, none)
    share: int = 0  # per mille of the lookup's misses, where that is more than floor
    one_token: Optional[int] = None  # a one-token lookup's cap instead (None: the rule above)

    def __post_init__(self):
        if self.floor < 0:
            raise ValueError(f"the fetch cap's floor must be >= 0, got {self.floor}")
        if not 0 <= self.share <= 1000:
            raise ValueError(f"the fetch cap's share is per mille of a lookup's misses, 0..1000, got {self.share}")
        if self.one_token is not None and self.one_token < 0:
            raise ValueError(f"the fetch cap of a one-token lookup must be None or >= 0, got {self.one_token}")

    def of(self, misses: int, tokens: int) -> int:
        """Misses a lookup of ``tokens`` tokens with ``misses`` misses fetches. Integer arithmetic, as the admission
        kernel computes it."""
        if self.one_token is not None and tokens == 1:
            return self.one_token
        return max(self.floor, (self.share * misses + 999) // 1000)

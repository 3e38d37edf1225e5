"""``moe/host_pinning.py``: the expert banks page-locked in place through the driver, unlocked when freed, and a
failed registration that leaves torch's next launch alone."""

import ctypes
import gc

import pytest
import torch

from freetoken.moe.host_pinning import _driver, pin_in_place

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA"),
]

MIB = 1 << 20


def _bank() -> torch.Tensor:
    # large enough for its own mapping (glibc's mmap threshold), so no other allocation shares its pages
    return torch.full((16 * MIB,), 3, dtype=torch.uint8)


def test_pinned_bank_copies_and_is_unpinned_when_freed():
    dev = torch.device("cuda")
    for _ in range(3):  # a new bank often lands where the last one was: it must register again
        bank = _bank()
        assert pin_in_place(bank, dev) and bank.is_pinned()
        assert pin_in_place(bank, dev)  # already pinned: nothing to do
        assert int(bank.to(dev, non_blocking=True).sum()) == 3 * 16 * MIB
        ptr = bank.data_ptr()
        del bank
        gc.collect()
        # unregistered with it: the driver no longer knows the range (0 would mean it was still registered)
        assert _driver().cuMemHostUnregister(ctypes.c_void_p(ptr)) != 0


def test_a_failed_registration_leaves_torch_unharmed():
    dev = torch.device("cuda")
    bank = _bank()
    tail = bank[8 * MIB :]
    assert pin_in_place(tail, dev)
    # the whole bank overlaps the pinned tail: the driver refuses it. torch's cudaHostRegister left that refusal as
    # the runtime's last error, raised by the next kernel launch (H100, 2026-12-07)
    assert not bank.is_pinned() and not pin_in_place(bank, dev)
    assert float((torch.ones(4, device=dev) + 1).sum()) == 8.0

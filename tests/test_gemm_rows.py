"""layers/gemm_rows.py: a prefill-sized GEMM on its activation padded to a row multiple gives the unpadded rows'
values (FREETOKEN_GEMM_PAD_ROWS, default 64; the device-side reason is in layers/gemm_rows.py), and a hybrid model's
logits do not change with it on."""

from __future__ import annotations

import pytest
import torch
from test_gemm_warmup import GemmCalls

from freetoken.layers import gemm_rows
from freetoken.layers.gemm_rows import MIN_ROWS, pad_rows_setting, padded_rows_linear


def _rows(seen: GemmCalls) -> list[int]:
    return [rows for _, rows, _ in seen.seen]


def test_the_setting_comes_from_the_environment(monkeypatch):
    monkeypatch.delenv("FREETOKEN_GEMM_PAD_ROWS", raising=False)
    assert pad_rows_setting() == 64
    monkeypatch.setenv("FREETOKEN_GEMM_PAD_ROWS", "0")
    assert pad_rows_setting() == 0
    monkeypatch.setenv("FREETOKEN_GEMM_PAD_ROWS", "128")
    assert pad_rows_setting() == 128
    monkeypatch.setenv("FREETOKEN_GEMM_PAD_ROWS", "x")
    with pytest.raises(ValueError, match="FREETOKEN_GEMM_PAD_ROWS"):
        pad_rows_setting()
    with pytest.raises(ValueError, match="expected 0"):
        pad_rows_setting(-1)


@pytest.mark.parametrize("rows", [100, 130, 64, MIN_ROWS - 1, 8])
def test_padded_gemm_keeps_the_rows_values(rows):
    torch.manual_seed(rows)
    lin = torch.nn.Linear(48, 40)
    x = torch.randn(rows, 48)
    with GemmCalls() as seen:
        got = padded_rows_linear(x, lin, pad=64)
    padded = rows >= MIN_ROWS and rows % 64 != 0
    assert _rows(seen) == [-(-rows // 64) * 64 if padded else rows]
    assert got.shape == (rows, 40) and got.is_contiguous()
    torch.testing.assert_close(got, lin(x), rtol=1e-6, atol=1e-6)
    with GemmCalls() as seen:  # off: the plain call
        padded_rows_linear(x, lin, pad=0)
    assert _rows(seen) == [rows]


def test_hybrid_model_logits_are_the_same_with_padding(tmp_path, monkeypatch):
    """A tiny Qwen3.5-MoE prefill of 100 tokens with every dense projection padded to 128 rows gives the logits of
    the unpadded run."""
    import hf_reference as R
    from test_prefill_warmup import _chunk, _worker

    R.write_released_qwen3_5_moe(str(tmp_path), seed=7, max_position_embeddings=512)
    ids = R.prompt(100, seed=2, vocab=1000)
    w = _worker(str(tmp_path), max_prefill_length=256)
    monkeypatch.setattr(gemm_rows, "PAD_ROWS", 0)
    with GemmCalls() as seen:
        plain = _chunk(w, ids, 0, row=1)
    assert 100 in _rows(seen) and 128 not in _rows(seen)
    monkeypatch.setattr(gemm_rows, "PAD_ROWS", 64)
    with GemmCalls() as seen:
        padded = _chunk(w, ids, 0, row=1)
    assert 128 in _rows(seen) and 100 not in _rows(seen)
    torch.testing.assert_close(padded, plain, rtol=1e-5, atol=1e-5)

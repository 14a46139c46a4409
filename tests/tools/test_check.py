"""``flashtile check`` (flashtile.tools.check): the CPU matrix passes, a wrong result is reported
as a failure with exit status 1, a missing GPU is a clear error. The GPU run is in
test_check_gpu.py."""

from __future__ import annotations

import pytest

pytest.importorskip("torch")

import flashtile  # noqa: E402
from flashtile import cli  # noqa: E402


def test_check_on_cpu_passes(capsys, monkeypatch):
    monkeypatch.delenv("FLASHTILE_BACKEND", raising=False)
    assert cli.main(["check", "--device", "cpu"]) == 0
    out = capsys.readouterr().out
    assert "10/10 cases pass" in out and "torch-twin" in out and "FAIL" not in out
    for api in ("flash_attn_func", "flash_attn_varlen_func", "scaled_dot_product_attention", "flash_attn_with_kvcache",
                "flex_attention"):
        assert f"ok    {api}" in out


def test_check_reports_a_wrong_result(capsys, monkeypatch):
    monkeypatch.delenv("FLASHTILE_BACKEND", raising=False)
    right = flashtile.flash_attn_func
    monkeypatch.setattr(flashtile, "flash_attn_func", lambda *a, **kw: right(*a, **kw) * 1.01)
    assert cli.main(["check", "--device", "cpu"]) == 1
    out = capsys.readouterr().out
    assert "FAIL  flash_attn_func [float32]" in out and "ok    flash_attn_varlen_func" in out
    assert "5/10 cases pass, 5 fail" in out


def test_check_without_a_gpu_says_so(capsys, monkeypatch):
    import torch

    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    assert cli.main(["check", "--device", "cuda"]) == 2
    assert "no CUDA GPU" in capsys.readouterr().out

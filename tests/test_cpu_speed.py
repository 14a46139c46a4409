"""The interpreter shortcuts of ``tests/cpu_speed.py`` (the suite's speed on the CPU box)
change nothing the interpreted kernels compute: a forward and backward in this process,
with them, is bitwise the same as in a fresh process without them."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

torch = pytest.importorskip("torch")
triton = pytest.importorskip("triton")

ROOT = Path(__file__).resolve().parents[1]

CALL = """
def call(path):
    import torch

    import flashtile

    g = torch.Generator().manual_seed(0)
    q = torch.randn(2, 70, 4, 32, generator=g, dtype=torch.float16).requires_grad_()
    k, v = (torch.randn(2, 70, 2, 32, generator=g, dtype=torch.float16).requires_grad_() for _ in range(2))
    out, lse, _ = flashtile.flash_attn_func(q, k, v, causal=True, return_attn_probs=True)
    grads = torch.autograd.grad(out, (q, k, v), torch.randn(out.shape, generator=g, dtype=out.dtype))
    torch.save([out, lse, *grads], path)
"""


def test_interpreter_shortcuts_change_nothing(tmp_path, monkeypatch):
    if os.environ.get("TRITON_INTERPRET") != "1" or triton.__version__ != "3.6.0":
        pytest.skip("the shortcuts are for triton 3.6.0's interpreter")
    from triton.runtime import interpreter

    assert getattr(interpreter, "_flashtile_tests_patched", False)  # on in this process (conftest)
    monkeypatch.setenv("FLASHTILE_BACKEND", "triton")
    scope = {}
    exec(CALL, scope)  # noqa: S102  (the same code in both processes)
    scope["call"](tmp_path / "with.pt")
    env = dict(os.environ, PYTHONPATH=str(ROOT / "src"), TRITON_INTERPRET="1", FLASHTILE_BACKEND="triton")
    proc = subprocess.run([sys.executable, "-c", CALL + "\nimport sys\ncall(sys.argv[1])\n", str(tmp_path / "without.pt")],
                          env=env, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr[-3000:]
    got, want = torch.load(tmp_path / "with.pt"), torch.load(tmp_path / "without.pt")
    assert len(got) == len(want) == 5
    assert all(torch.equal(a, b) for a, b in zip(got, want))

"""``flashtile check`` on the GPU: every case passes at fp16 and bf16."""

from __future__ import annotations

import pytest

pytestmark = pytest.mark.gpu


def test_check_on_the_gpu_passes(capsys):
    from flashtile.tools.check import run_check

    assert run_check("cuda") == 0, capsys.readouterr().out
    assert "20/20 cases pass" in capsys.readouterr().out

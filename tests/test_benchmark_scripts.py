"""The GPU benchmark scripts at least import and parse their arguments on CPU."""

from __future__ import annotations

import importlib.util
from pathlib import Path

import pytest

pytest.importorskip("triton")
ROOT = Path(__file__).resolve().parents[1] / "benchmarks"


@pytest.mark.parametrize("name", ["sweep_fwd", "sweep_bwd", "train_block", "host_overhead"])
def test_script_imports_and_shows_help(name, capsys):
    spec = importlib.util.spec_from_file_location(f"bench_{name}", ROOT / f"{name}.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    with pytest.raises(SystemExit) as exc:
        module.main(["--help"])
    assert exc.value.code == 0
    assert "usage" in capsys.readouterr().out


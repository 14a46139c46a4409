"""The ``flashtile`` command line and the numpy-only package import (CPU)."""

from __future__ import annotations

import os
import subprocess
import sys
import types
from pathlib import Path

import pytest

from flashtile import cli
from flashtile.tools.demo import SECTION_TITLES

SRC = Path(__file__).resolve().parents[2] / "src"


def _run_python(*args: str, timeout: float = 120) -> subprocess.CompletedProcess:
    """Run the interpreter of this test session with src/ on the path."""
    env = dict(os.environ)
    env["PYTHONPATH"] = str(SRC) + os.pathsep + env.get("PYTHONPATH", "")
    return subprocess.run([sys.executable, *args], capture_output=True, text=True, env=env,
                          timeout=timeout, check=False)


def test_demo_passes_and_prints_all_sections(capsys: pytest.CaptureFixture[str]) -> None:
    assert len(SECTION_TITLES) == 5
    assert cli.main(["demo"]) == 0
    out = capsys.readouterr().out
    for title in SECTION_TITLES:
        assert title in out
    assert "FAIL" not in out
    assert "checks passed" in out


def test_python_dash_m_flashtile_demo() -> None:
    proc = _run_python("-m", "flashtile", "demo")
    assert proc.returncode == 0, proc.stdout + proc.stderr
    for title in SECTION_TITLES:
        assert title in proc.stdout


def test_demo_reports_a_failed_check(monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]) -> None:
    """A broken implementation makes the demo print FAIL and return 1."""
    import flashtile.tools.demo as demo

    real = demo.flash_attention_forward

    def off_by_a_little(*args, **kwargs):
        out = real(*args, **kwargs)
        return (out[0] * (1 + 1e-9), out[1]) if isinstance(out, tuple) else out * (1 + 1e-9)

    monkeypatch.setattr(demo, "flash_attention_forward", off_by_a_little)
    assert demo.run_demo() == 1
    out = capsys.readouterr().out
    assert "[FAIL] full   batch=-    Sq=256  Sk=256  d=64 " in out and "FAILED" in out
    assert SECTION_TITLES[-1] in out  # a failure does not stop the later sections


def test_demo_survives_a_crashing_section(monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]) -> None:
    import flashtile.tools.demo as demo

    def broken(*args, **kwargs):
        raise RuntimeError("boom")

    monkeypatch.setattr(demo, "unstable_attention", broken)
    assert demo.run_demo() == 1
    out = capsys.readouterr().out
    assert "RuntimeError: boom" in out
    assert SECTION_TITLES[3] in out and SECTION_TITLES[4] in out


def test_no_subcommand_prints_help_and_exits_2(capsys: pytest.CaptureFixture[str]) -> None:
    assert cli.main([]) == 2
    assert "demo" in capsys.readouterr().err
    proc = _run_python("-m", "flashtile")
    assert proc.returncode == 2
    assert "usage:" in proc.stderr


def test_unknown_option_is_a_usage_error() -> None:
    with pytest.raises(SystemExit) as exc:
        cli.main(["demo", "--no-such-option"])
    assert exc.value.code == 2
    with pytest.raises(SystemExit) as exc:
        cli.main(["traffic", "--seq", "0"])
    assert exc.value.code == 2


def test_traffic_prints_a_table(capsys: pytest.CaptureFixture[str]) -> None:
    assert cli.main(["traffic", "--seq", "128", "4096", "--d", "128", "--dtype-bytes", "2"]) == 0
    out = capsys.readouterr().out
    lines = out.splitlines()
    assert any(line.strip().startswith("128 ") for line in lines)
    assert any(line.strip().startswith("4096 ") for line in lines)
    assert "d=128" in out


@pytest.mark.parametrize("flags", [["--causal"], ["--backward"], ["--causal", "--backward"], ["--br", "32", "--bc", "16"]])
def test_traffic_variants(flags: list[str], capsys: pytest.CaptureFixture[str]) -> None:
    assert cli.main(["traffic", "--seq", "256", "1024", *flags]) == 0
    out = capsys.readouterr().out
    assert any(line.strip().startswith("1024 ") for line in out.splitlines())
    if "--backward" in flags:
        assert "backward" in out
    if "--causal" in flags:
        assert "causal=True" in out


def test_traffic_plot_writes_a_png(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    pytest.importorskip("matplotlib")
    path = tmp_path / "traffic.png"
    assert cli.main(["traffic", "--seq", "128", "256", "512", "--plot", str(path)]) == 0
    assert path.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert str(path) in capsys.readouterr().out


def test_bench_forwards_its_arguments(monkeypatch: pytest.MonkeyPatch) -> None:
    """Everything after `bench`, its own -h included, reaches flashtile.tools.bench.main."""
    seen: list[list[str]] = []
    import flashtile.tools.bench

    monkeypatch.setattr(flashtile.tools.bench, "main", lambda argv: seen.append(list(argv)) or 7)
    assert cli.main(["bench", "--quick", "--pass", "fwd", "bwd", "--seqlen", "1024", "-h"]) == 7
    assert cli.main(["bench"]) == 7
    assert seen == [["--quick", "--pass", "fwd", "bwd", "--seqlen", "1024", "-h"], []]


_NO_TORCH = """
import sys
sys.modules["torch"] = None   # any `import torch` now raises ImportError
sys.modules["triton"] = None
import numpy as np
import flashtile
assert flashtile.__version__ == "0.1.0"
from flashtile.reference import flash_attention_forward, naive_attention
rng = np.random.default_rng(0)
Q, K, V = (rng.standard_normal((9, 4)) for _ in range(3))
diff = np.abs(flash_attention_forward(Q, K, V, Br=4, Bc=4) - flashtile.reference.naive_attention(Q, K, V)).max()
assert diff < 1e-12, diff
flashtile.traffic.memory_work(256, 64)
import flashtile.cli, flashtile.tools.demo
assert sys.modules["torch"] is None and sys.modules["triton"] is None
try:
    flashtile.no_such_name
except AttributeError:
    pass
else:
    raise AssertionError("unknown attribute did not raise AttributeError")
print("ok")
"""


def test_import_flashtile_without_torch_or_triton() -> None:
    proc = _run_python("-c", _NO_TORCH)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert proc.stdout.strip() == "ok"


def test_import_flashtile_loads_nothing_heavy() -> None:
    code = ("import sys, flashtile, flashtile.cli; "
            "print(sorted(m for m in ('torch', 'triton', 'matplotlib') if m in sys.modules))")
    proc = _run_python("-c", code)
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.strip() == "[]"


def test_gpu_api_names_are_lazy() -> None:
    import flashtile

    for name in ("flash_attn_func", "flash_attn_qkvpacked_func", "flash_attn_kvpacked_func",
                 "scaled_dot_product_attention"):
        assert name in flashtile.__all__
        assert name in dir(flashtile)


def test_without_torch_the_gpu_names_say_what_to_install():
    # A fresh interpreter where torch cannot be imported (None in sys.modules blocks it).
    import subprocess
    import sys as _sys

    code = (
        "import sys; sys.modules['torch'] = None\n"
        "import flashtile\n"
        "try:\n"
        "    flashtile.flash_attn_func\n"
        "except ImportError as err:\n"
        "    print('IMPORT', err)\n"
        "from flashtile.cli import main\n"
        "print('RC', main(['bench', '--dry-run']))\n"
    )
    out = subprocess.run([_sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert "IMPORT flashtile.flash_attn_func needs torch, which is not installed: `pip install torch triton`" in out.stdout
    assert "RC 2" in out.stdout and "flashtile bench needs torch" in out.stderr

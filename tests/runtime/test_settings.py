"""Every environment switch is read and checked in runtime/settings.py, and nowhere else in
the library (the tools excepted: they run subprocesses and name their own tools)."""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

from flashtile.runtime import settings

SRC = Path(__file__).resolve().parents[2] / "src" / "flashtile"


@pytest.mark.parametrize("name, reader, bad", [
    ("FLASHTILE_BACKEND", settings.backend, "cuda"),
    ("FLASHTILE_BWD_DQ", settings.bwd_dq, "sometimes"),
    ("FLASHTILE_KVCACHE_CHECK", settings.kvcache_check, "both"),
])
def test_a_bad_value_names_the_switch(monkeypatch, name, reader, bad):
    monkeypatch.setenv(name, bad)
    with pytest.raises(ValueError, match=name):
        reader()
    monkeypatch.setenv(name, "")  # empty is the default
    assert reader() == {"FLASHTILE_BACKEND": "auto", "FLASHTILE_BWD_DQ": "auto",
                        "FLASHTILE_KVCACHE_CHECK": "auto"}[name]
    monkeypatch.setenv(name, " " + reader().upper() + " ")
    assert reader() == "auto"


@pytest.mark.parametrize("name, reader, default, other", [
    ("FLASHTILE_DECODE_APPEND", settings.decode_append, "fused", "separate"),
    ("FLASHTILE_DECODE_COMBINE", settings.decode_combine, "auto", "separate"),
    ("FLASHTILE_DECODE_CHECK", settings.decode_check, "auto", "spread"),
    ("FLASHTILE_PDL", lambda: "on" if settings.pdl() else "off", "on", "off"),
])
def test_the_decode_switches(monkeypatch, name, reader, default, other):
    monkeypatch.setenv(name, "sometimes")
    with pytest.raises(ValueError, match=name):
        reader()
    monkeypatch.delenv(name)
    assert reader() == default
    monkeypatch.setenv(name, other.upper())
    assert reader() == other


def test_switches_are_read_at_call_time(monkeypatch):
    monkeypatch.delenv("FLASHTILE_WS", raising=False)
    assert settings.gluon_enabled()
    monkeypatch.setenv("FLASHTILE_WS", "0")
    assert not settings.gluon_enabled()
    monkeypatch.setenv("FLASHTILE_PLANS", "0")
    assert not settings.plans_enabled()
    monkeypatch.setenv("TRITON_INTERPRET", "1")
    assert settings.interpret() and not settings.fast_launch()
    monkeypatch.setenv("FLASHTILE_CACHE_DIR", "/tmp/somewhere")
    assert settings.cache_dir() == "/tmp/somewhere"


def test_the_plans_key_on_every_switch():
    from flashtile.runtime import replay

    assert len(replay.env_key()[0]) == len(settings.SWITCHES)
    documented = settings.__doc__
    assert all(f"``{name}``" in documented for name in settings.SWITCHES)


def test_no_other_library_module_reads_the_environment():
    readers = []
    for path in SRC.rglob("*.py"):
        rel = path.relative_to(SRC).as_posix()
        if rel in ("runtime/settings.py",) or rel.startswith("tools/"):
            continue
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.Attribute) and node.attr in ("environ", "getenv"):
                readers.append(f"{rel}:{node.lineno}")
    assert not readers, readers


def test_torch_compile_reads_a_switch_once_when_it_traces(monkeypatch):
    """A traced call reads the switches in Python, once (``trace_as_constants``, set up by the
    torch glue): Dynamo never traces the reads, which torch 2.11's could not (the environment
    mapping's ``get``), and the value is the graph's from then on."""
    torch = pytest.importorskip("torch")
    import flashtile.dispatch  # noqa: F401  (the torch glue marks the readers)

    reads = []

    def get(key):  # a read Dynamo cannot trace: it breaks the graph where traced
        torch._dynamo.graph_break()
        reads.append(key)
        return None if key != settings.SWITCH_KEYS[settings.SWITCHES.index("FLASHTILE_BWD_DQ")] else b"split"

    monkeypatch.setattr(settings, "_get", get)
    settings._PARSED.clear()

    def f(x):
        return x + 1 if settings.bwd_dq() == "split" else x - 1

    torch._dynamo.reset()
    compiled = torch.compile(f, fullgraph=True, backend="eager")
    x = torch.zeros(3)
    assert torch.equal(compiled(x), x + 1)
    n = len(reads)
    assert n >= 1
    assert torch.equal(compiled(x), x + 1) and len(reads) == n  # the graph holds the value
    settings._PARSED.clear()

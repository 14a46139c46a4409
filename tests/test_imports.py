"""The shape of the tree: no import cycles in src/, no module importing another module's
underscore names, ``import flashtile`` without torch, and the registry as the only place
that picks a kernel family. Read from the code's own imports (ast), nothing is run."""

from __future__ import annotations

import ast
import subprocess
import sys
from pathlib import Path

import pytest

SRC = Path(__file__).resolve().parents[1] / "src"
PACKAGE = SRC / "flashtile"


def _modules() -> dict[str, Path]:
    mods = {}
    for path in PACKAGE.rglob("*.py"):
        parts = list(path.relative_to(SRC).with_suffix("").parts)
        if parts[-1] == "__init__":
            parts = parts[:-1]
        mods[".".join(parts)] = path
    return mods


MODULES = _modules()


def _resolve(module: str, name: str | None) -> str:
    """The flashtile module an import names (``from a.b import c``: a.b.c when c is a module)."""
    if name is not None and f"{module}.{name}" in MODULES:
        return f"{module}.{name}"
    return module


def _imports(path: Path):
    """(imported module, the names taken, line) of every flashtile import in ``path``."""
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.ImportFrom) and node.module and node.module.startswith("flashtile") and not node.level:
            for alias in node.names:
                yield _resolve(node.module, alias.name), alias.name, node.lineno
        elif isinstance(node, ast.ImportFrom) and node.level:
            raise AssertionError(f"{path}:{node.lineno}: relative import (the tree uses absolute imports)")
        elif isinstance(node, ast.Import):
            for alias in node.names:
                if alias.name.startswith("flashtile"):
                    yield alias.name, None, node.lineno


def _graph() -> dict[str, set[str]]:
    graph = {}
    for module, path in MODULES.items():
        deps = set()
        for target, _, _ in _imports(path):
            # importing a.b.c runs a and a.b first: packages count as edges only through
            # what they import themselves
            if target in MODULES and target != module:
                deps.add(target)
        graph[module] = deps
    return graph


def _cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """Strongly connected components with more than one module (Tarjan)."""
    index, low, stack, on, out = {}, {}, [], set(), []
    counter = [0]

    def visit(v):
        index[v] = low[v] = counter[0]
        counter[0] += 1
        stack.append(v)
        on.add(v)
        for w in graph.get(v, ()):
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            comp = []
            while True:
                w = stack.pop()
                on.discard(w)
                comp.append(w)
                if w == v:
                    break
            if len(comp) > 1:
                out.append(sorted(comp))

    sys.setrecursionlimit(10_000)
    for v in graph:
        if v not in index:
            visit(v)
    return out


def test_no_import_cycles():
    """Every import points down: a module never needs, directly or through others, a
    module that needs it (function-level imports included)."""
    cycles = _cycles(_graph())
    assert not cycles, "import cycles: " + "; ".join(" <-> ".join(c) for c in cycles)


def test_the_cycle_finder_finds_a_cycle():
    assert _cycles({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}) == [["a", "b", "c"]]
    assert _cycles({"a": {"b"}, "b": set()}) == []


def test_no_module_imports_another_modules_underscore_names():
    bad = []
    for module, path in MODULES.items():
        for target, name, line in _imports(path):
            if name and name.startswith("_") and not name.startswith("__") and target != module:
                bad.append(f"{path.relative_to(SRC)}:{line}: {name} from {target}")
        # module._name on a module imported as a name (from flashtile.x import y; y._z)
        aliases = {}
        tree = ast.parse(path.read_text())
        for node in ast.walk(tree):
            if isinstance(node, ast.ImportFrom) and node.module and node.module.startswith("flashtile"):
                for alias in node.names:
                    if f"{node.module}.{alias.name}" in MODULES:
                        aliases[alias.asname or alias.name] = f"{node.module}.{alias.name}"
        for node in ast.walk(tree):
            if (isinstance(node, ast.Attribute) and isinstance(node.value, ast.Name) and node.value.id in aliases
                    and node.attr.startswith("_") and not node.attr.startswith("__")):
                bad.append(f"{path.relative_to(SRC)}:{node.lineno}: {node.value.id}.{node.attr}")
    assert not bad, "\n".join(bad)


def test_import_flashtile_needs_no_torch():
    code = ("import sys; sys.modules['torch'] = None; sys.modules['triton'] = None\n"
            "import flashtile, flashtile.reference, flashtile.traffic\n"
            "assert 'torch' not in [m for m in sys.modules if sys.modules[m] is not None]\n")
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                          env={"PYTHONPATH": str(SRC), "PATH": ""})
    assert proc.returncode == 0, proc.stderr


GLUON_KERNELS = ("flashtile.backends.sm90.forward", "flashtile.backends.sm90.backward_split",
                 "flashtile.backends.sm90.backward_onepass")
SCOPES = ("kernels_scope", "forward_scope", "backward_scope", "onepass_scope")


def test_the_registry_alone_chooses_a_kernel_family():
    """Only the registry asks a family's scope, and the library reaches the Gluon kernels
    only through the launch path (backends/run.py launches what the registry chose); the
    tools compile and measure them directly."""
    bad = []
    for module, path in MODULES.items():
        tools = module.startswith("flashtile.tools.") or module.startswith("flashtile.backends.sm90.")
        if module != "flashtile.backends.run" and not tools:
            bad += [f"{path.relative_to(SRC)}:{line}: imports {target}" for target, _, line in _imports(path)
                    if target in GLUON_KERNELS]
        if module in ("flashtile.backends.registry", "flashtile.backends.sm90.scope"):
            continue
        for node in ast.walk(ast.parse(path.read_text())):
            name = node.attr if isinstance(node, ast.Attribute) else node.id if isinstance(node, ast.Name) else None
            if name in SCOPES:
                bad.append(f"{path.relative_to(SRC)}:{node.lineno}: asks {name} (the registry's job)")
    assert not bad, "\n".join(bad)


@pytest.mark.parametrize("module", sorted(MODULES))
def test_every_module_says_what_it_is(module):
    doc = ast.get_docstring(ast.parse(MODULES[module].read_text()))
    assert doc, f"{module} has no docstring"


def test_argument_errors_come_from_the_validation_module():
    """The public functions (api/, parallel/) raise no argument error themselves: every
    check of every entry point is in problem/validate.py (the cross-rank shape check of
    parallel/group.py excepted: it needs a collective)."""
    bad = []
    for module, path in MODULES.items():
        if not module.startswith(("flashtile.api", "flashtile.parallel")) or module == "flashtile.parallel.group":
            continue
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.Raise) and node.exc is not None:
                call = node.exc.func if isinstance(node.exc, ast.Call) else node.exc
                if isinstance(call, ast.Name) and call.id in ("ValueError", "TypeError"):
                    bad.append(f"{path.relative_to(SRC)}:{node.lineno}: raises {call.id}")
    assert not bad, "\n".join(bad)

"""Shared fixtures. Nothing here touches CUDA at import: the suite collects on CPU."""

from __future__ import annotations

import os
import sys

import pytest

sys.path.insert(0, os.path.dirname(__file__))  # tests/oracle.py and friends

import cpu_speed  # noqa: E402


def _cuda_available() -> bool:
    try:
        import torch
    except ImportError:
        return False
    return torch.cuda.is_available()


def pytest_configure(config):
    # Under `-n 2` on 2 cores each worker's torch ran as many intra-op threads as there are
    # cores: the oversubscribed small ops took 2.4x as long (the twin file: 43 s against 18).
    # (A GPU machine's workers keep torch's default: their references run on its cores.)
    if os.environ.get("PYTEST_XDIST_WORKER") and not _cuda_available():
        cpu_speed.one_torch_thread()
    cpu_speed.interpreter_shortcuts()
    # On a GPU, every direct kernel launch also runs Triton's own binary lookup and fails
    # the test if the two differ (flashtile.runtime.launch).
    if "FLASHTILE_LAUNCH_CHECK" not in os.environ and _cuda_available():
        os.environ["FLASHTILE_LAUNCH_CHECK"] = "1"


def _slow_seconds(item) -> float:
    marker = item.get_closest_marker("slow")
    return marker.kwargs.get("seconds", 20) if marker else 0


def pytest_collection_modifyitems(config, items):
    # Longest first: with `-n 2 --maxschedchunk 1` (make test) each worker takes the next
    # test when it is free, so the long compile checks start early instead of ending the run
    # on one worker. Stable: the rest keep their order.
    items.sort(key=lambda item: -_slow_seconds(item))
    if _cuda_available():
        return
    skip = pytest.mark.skip(reason="needs a CUDA GPU (run `-m gpu` on the device machine)")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip)


def pytest_runtest_teardown(item, nextitem):
    # `-n 6` on one GPU: a worker's caching allocator keeps what its largest test reserved, and
    # the other workers' tests then ran out of memory (run 175: one worker held 60.9 GiB of the
    # H100's 79). Each GPU test hands its unused blocks back.
    torch = sys.modules.get("torch")
    if "gpu" in item.keywords and torch is not None and torch.cuda.is_initialized():
        torch.cuda.empty_cache()


@pytest.fixture
def poison_outputs(monkeypatch):
    """Make every output and gradient buffer start as NaN, so unwritten elements fail."""
    pytest.importorskip("torch")
    from flashtile.backends import layout

    for name in ("bshd_view", "new_lse"):
        original = getattr(layout, name)

        def poisoned(t, *args, _original=original):
            return _original(t, *args).fill_(float("nan"))

        monkeypatch.setattr(layout, name, poisoned)
    yield


@pytest.fixture(params=["torch", "triton"])
def backend(request, monkeypatch):
    """Each test twice: on the torch twin, and on the Triton kernels under the interpreter
    (skipped without TRITON_INTERPRET=1)."""
    if request.param == "triton":
        if os.environ.get("TRITON_INTERPRET") != "1":
            pytest.skip("set TRITON_INTERPRET=1 (make test does) to run the Triton kernels on CPU")
        pytest.importorskip("triton")
    monkeypatch.setenv("FLASHTILE_BACKEND", request.param)
    return request.param


@pytest.fixture
def triton_backend(monkeypatch):
    """Run the Triton kernels on CPU tensors (needs TRITON_INTERPRET=1 from the start)."""
    if os.environ.get("TRITON_INTERPRET") != "1":
        pytest.skip("set TRITON_INTERPRET=1 (make test does) to run the Triton kernels on CPU")
    pytest.importorskip("triton")
    monkeypatch.setenv("FLASHTILE_BACKEND", "triton")


@pytest.fixture
def plan_replays(monkeypatch):
    """Count launch-plan replays (``n``; ``raw``: those with C-launcher steps), from an
    empty plan cache; ``plans_off(fn)`` runs fn on the full path."""
    pytest.importorskip("torch")
    from flashtile.runtime import replay as plan

    plan.clear()
    count = {"n": 0, "raw": 0}
    original = plan.Plan.replay

    def counting(self, inputs, bases):
        count["n"] += 1
        count["raw"] += any(kind == "raw" for kind, *_ in self.steps)
        return original(self, inputs, bases)

    monkeypatch.setattr(plan.Plan, "replay", counting)
    yield count
    plan.clear()


@pytest.fixture
def plans_off(monkeypatch):
    def run(fn):
        with monkeypatch.context() as m:
            m.setenv("FLASHTILE_PLANS", "0")
            return fn()

    return run

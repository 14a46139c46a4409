"""Launches that do nothing: the host path alone, on a machine without a GPU.

``stub_launches()`` makes every ``runtime.launch.Launcher`` launch report a compiled kernel
whose C launch only records its arguments, so launch plans are recorded and replayed as
on a GPU. For ``benchmarks/host_overhead.py --cpu-stub`` and the tests of
``runtime.replay``. Outputs are uninitialized memory.
"""

from __future__ import annotations

import contextlib
from typing import Optional

import torch

from flashtile.runtime import launch, replay


class _StubRun:
    """Stands in for Triton's ``CudaLauncher``: its C launch records its arguments."""

    global_scratch_size = profile_scratch_size = 0
    launch_cooperative_grid = launch_pdl = False

    def __init__(self, log: Optional[list]):
        self.log = log

    def launch(self, *args):
        if self.log is not None:
            self.log.append(args)


class _StubCompiled:
    function = 0
    packed_metadata = ()

    class metadata:
        tensordesc_meta = None

    def __init__(self, log):
        self.run = _StubRun(log)


@contextlib.contextmanager
def stub_launches(log: Optional[list] = None):
    """Context manager: every launch does nothing and reports a compiled kernel whose C
    launch appends its arguments to ``log`` (when given); the ordinary launch appends what
    Triton's C launcher would have received. Plans made meanwhile are dropped at the end."""
    compiled = _StubCompiled(log)

    def fake(launcher, grid, args, constexprs, num_warps, num_stages):
        if log is not None:
            g = tuple(grid) + (1,) * (3 - len(grid))
            full = [a.data_ptr() if isinstance(a, torch.Tensor) else a for a in launcher.full_args(args, constexprs)]
            log.append((*g, 0, 0, False, False, None, None, (), None, None, None, *full))
        return compiled

    launch.set_stub(fake)
    try:
        yield compiled
    finally:
        launch.set_stub(None)
        replay.clear()

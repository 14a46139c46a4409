"""Kernel launches whose host cost is close to the driver's.

``kernel[grid](*args, **constexprs)`` makes Triton re-derive, on every call, how each
argument specializes the binary (pointer dtype and 16-byte alignment, ints equal to 1 or
divisible by 16, 32- vs 64-bit ints), format a cache key from that and look it up. Our
kernels take 30-45 arguments, so this is most of the launcher's host time: the H200
host spent 60-100 us per forward launch (``benchmarks/host_profile.py``), about as long
as the kernel itself at seqlen 512.

``launch`` derives the same facts with a few comparisons per argument, keeps the compiled
kernel Triton returned for them, and calls it directly (``CompiledKernel.run``, the call
``JITFunction.run`` ends in). The key it builds is at least as fine as Triton's, so a new
key only costs one ordinary ``kernel[grid]`` call (which finds Triton's own cached binary
or compiles it), never a wrong binary. ``FLASHTILE_LAUNCH_CHECK=1`` (set by the GPU tests)
also runs Triton's own lookup on every direct launch and raises if it would have picked
another binary. ``FLASHTILE_FAST_LAUNCH=0`` turns the direct path off; it is also off under
``TRITON_INTERPRET=1``, with launch hooks installed, and for triton versions other than
the 3.6 it was written against. Not seen by the direct path:
``fn.device_caches`` cleared by hand (the launcher keeps its own references to compiled
kernels; build a new ``Launcher`` to drop them). While ``runtime.replay`` records a call, each
launch is also reported to its recorder (the compiled kernel and the full argument list).
"""

from __future__ import annotations

from typing import Any, Sequence

import triton
from triton.runtime import driver

from flashtile.runtime import settings
from flashtile.runtime.replay import active_recorder, hooks_installed

_I32_MIN, _I32_MAX = -(2**31), 2**31 - 1
_I64_MIN, _I64_MAX, _U64_MAX = -(2**63), 2**63 - 1, 2**64 - 1
_UNKNOWN = object()  # an argument type without a rule here: take Triton's own path
TESTED_VERSION = triton.__version__.startswith("3.6.")
# ``runtime.stubs``: a function that stands in for every launch (no GPU needed), or None.
_stub = None


def fast_ok() -> bool:
    """Whether launches take the direct path (module docstring)."""
    return _stub is not None or (TESTED_VERSION and settings.fast_launch())


def set_stub(fn) -> None:
    """Make ``fn(launcher, grid, args, constexprs, num_warps, num_stages)`` stand in for
    every launch (returning what Triton would: a compiled kernel), or None to launch for
    real again. For ``runtime.stubs``: host-cost probes and tests without a GPU."""
    global _stub
    _stub = fn


def arg_key(a: Any) -> Any:
    """What about one runtime argument can change the binary Triton builds for it."""
    t = type(a)
    if t is int:
        if a == 1:
            return 1
        if not _I64_MIN <= a <= _U64_MAX:  # Triton refuses these; let it say so
            return _UNKNOWN
        return (a % 16 == 0, _I32_MIN <= a <= _I32_MAX, a > _I64_MAX)
    if t is float or a is None:
        return t
    if t is bool:
        return ("u1", a)
    if hasattr(a, "data_ptr"):  # torch.Tensor (or a tensor-like Triton accepts)
        return (a.dtype, a.data_ptr() % 16 == 0)
    if hasattr(a, "block_shape"):  # triton.tools.tensor_descriptor.TensorDescriptor
        return ("desc", a.base.dtype, tuple(a.block_shape), getattr(a, "padding", None),
                _layout_key(getattr(a, "layout", None)), a.base.data_ptr() % 16 == 0)
    return _UNKNOWN


_LAYOUT_KEYS: dict[int, tuple[Any, str]] = {}


def _layout_key(layout: Any) -> Any:
    """str(layout), which Triton's key holds, cached per layout object: a Gluon layout's str
    costs ~3x the lookup and a call passes 4-6 of them. Not the layout itself: layouts that
    compare equal can print differently (``transposed=0`` vs ``False``) and Triton keys on
    the print. Each entry keeps its layout alive, so an id is never reused while cached."""
    if layout is None:
        return None
    hit = _LAYOUT_KEYS.get(id(layout))
    if hit is not None and hit[0] is layout:
        return hit[1]
    if len(_LAYOUT_KEYS) >= 1024:  # layouts built per call by a caller: stay bounded
        _LAYOUT_KEYS.clear()
    key = str(layout)
    _LAYOUT_KEYS[id(layout)] = (layout, key)
    return key


class Launcher:
    """Direct launches of one ``@triton.jit`` kernel; see the module docstring."""

    def __init__(self, fn):
        self.fn = fn
        self.cache: dict[tuple, Any] = {}
        self._tail: dict[int, tuple[str, ...]] = {}

    def full_args(self, args: Sequence[Any], constexprs: dict[str, Any]) -> list[Any]:
        """Every kernel parameter in signature order (what Triton's binder returns)."""
        names = self._tail.get(len(args))
        if names is None:
            names = self._tail[len(args)] = tuple(self.fn.arg_names[len(args):])
        full = list(args)
        for name in names:
            if name in constexprs:
                full.append(constexprs[name])
            else:
                full.append(self.fn.params[self.fn.arg_names.index(name)].default)
        return full

    def __call__(self, grid: tuple[int, ...], args: Sequence[Any], constexprs: dict[str, Any],
                 num_warps: int, num_stages: int) -> None:
        rec = active_recorder()
        if rec is None:
            self._launch(grid, args, constexprs, num_warps, num_stages)
            return
        rec.paused += 1  # the interpreter's own tensor work is not the call's
        try:
            compiled = self._launch(grid, args, constexprs, num_warps, num_stages)
        finally:
            rec.paused -= 1
        if not (fast_ok() and not self.fn.pre_run_hooks and not hooks_installed()
                and hasattr(compiled, "packed_metadata")):
            compiled = None  # the interpreter, hooks, FLASHTILE_FAST_LAUNCH=0: replays go through kernel[grid]
        rec.launch(self, compiled, grid, args, constexprs, num_warps, num_stages)

    def _launch(self, grid, args, constexprs, num_warps, num_stages):
        """Launch; returns the compiled kernel (what Triton returned under the interpreter)."""
        if _stub is not None:
            return _stub(self, grid, args, constexprs, num_warps, num_stages)
        key = None
        if fast_ok() and not self.fn.pre_run_hooks and not hooks_installed():
            arg_keys = tuple(map(arg_key, args))
            if _UNKNOWN not in arg_keys:
                device = driver.active.get_current_device()
                # Triton's key also holds its debug flag and instrumentation mode (both can change at run time).
                modes = (self.fn.debug or triton.knobs.runtime.debug, triton.knobs.compilation.instrumentation_mode)
                key = (device, num_warps, num_stages, modes, tuple(constexprs.items()), arg_keys)
                compiled = self.cache.get(key)
                if compiled is not None:
                    self._run(compiled, device, modes, grid, args, constexprs, num_warps, num_stages)
                    return compiled
        compiled = self.fn[grid](*args, **constexprs, num_warps=num_warps, num_stages=num_stages)
        if key is not None:
            self.cache[key] = compiled
        return compiled

    def _run(self, compiled, device, modes, grid, args, constexprs, num_warps, num_stages) -> None:
        """The end of ``JITFunction.run`` for a kernel it has already compiled."""
        # As jit.run: a global the kernel read at compile time must not have changed since.
        for (name, _), (val, globals_dict) in self.fn.used_global_vals.items():
            if globals_dict.get(name, _UNKNOWN) != val:
                raise RuntimeError(f"Global variable {name} has changed since {self.fn.__name__} was compiled")
        if settings.launch_check():
            self._check(device, modes, compiled, args, constexprs, num_warps, num_stages)
        stream = driver.active.get_current_stream(device)
        grid = tuple(grid) + (1, 1)
        compiled.run(grid[0], grid[1], grid[2], stream, compiled.function, compiled.packed_metadata,
                     None, None, None, *self.full_args(args, constexprs))

    def _check(self, device, modes, compiled, args, constexprs, num_warps, num_stages) -> None:
        from triton.runtime.jit import compute_cache_key

        kernel_cache, key_cache, _, _, binder = self.fn.device_caches[device]
        bound, spec, options = binder(*args, **constexprs, num_warps=num_warps, num_stages=num_stages,
                                      debug=modes[0], instrumentation_mode=modes[1])
        theirs = kernel_cache.get(compute_cache_key(key_cache, spec, options))
        if theirs is not compiled:
            raise AssertionError(f"flashtile.runtime.launch: the direct launch of {self.fn.__name__} picked another "
                                 f"binary than Triton would (key {spec})")
        mine = self.full_args(args, constexprs)
        if len(mine) != len(bound) or not all(_same(a, b) for a, b in zip(bound.values(), mine)):
            raise AssertionError(f"flashtile.runtime.launch: argument order differs from Triton's for {self.fn.__name__}")


def _same(a: Any, b: Any) -> bool:
    return a is b or (type(a) in (int, float, bool) and type(a) is type(b) and a == b)

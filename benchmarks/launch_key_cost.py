"""Host cost of deciding which binary a launch runs: Triton's binder vs flashtile's key.

    PYTHONPATH=src python3 benchmarks/launch_key_cost.py

No GPU needed: builds Triton's own argument binder for the forward kernel (the code
``JITFunction.run`` calls on every launch) and times it against
``flashtile.runtime.launch.arg_key`` over the same 43 runtime arguments.
"""

from __future__ import annotations

import timeit

import torch
from triton.backends.nvidia.compiler import CUDABackend
from triton.runtime.jit import create_function_from_signature

from flashtile.runtime import launch
from flashtile.backends.triton.forward import fwd_kernel


def main() -> None:
    fn = fwd_kernel
    binder = create_function_from_signature(fn.signature, fn.params, CUDABackend)
    q = torch.zeros(2, 4, 64, 64, dtype=torch.bfloat16)
    n_runtime = sum(not p.is_constexpr for p in fn.params)
    args = ([q] * 12 + [64 * 4 * 64, 64, 4096] * 10)[:n_runtime - 4] + [0.5, 0.0, 0.0, 0.0]
    constexprs = {name: 1 for name in fn.arg_names[len(args):]}

    def triton_binder():
        _, spec, options = binder(*args, **constexprs, num_warps=4, num_stages=3, debug=False,
                                  instrumentation_mode="")
        return tuple(spec), str(options)

    def flashtile_key():
        return 0, 4, 3, tuple(constexprs.items()), tuple(map(launch.arg_key, args))

    for f in (triton_binder, flashtile_key):
        n = 20000
        print(f"{f.__name__:14s} {timeit.timeit(f, number=n) / n * 1e6:6.2f} us per launch "
              f"({len(args)} runtime arguments)")


if __name__ == "__main__":
    main()

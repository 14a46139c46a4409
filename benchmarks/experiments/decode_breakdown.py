"""Experiment (issue 38): where a small decode step's time goes, flashtile against cuDNN.

    PYTHONPATH=src python3 benchmarks/experiments/decode_breakdown.py [--only 10 11 14]   # GPU only

For each shape of ``flashtile bench --decode`` (default: batch 1-4 at 4k and 8k cached
tokens), one generation step as the bench's graph rows run it (flashtile appends the new
token; the cache cycles through cold copies, ``tools.bench.decode.cold_copies``):

- ``step``: the step's time under CUDA graphs (``do_bench_cudagraph`` median, as the bench);
- each kernel's device time, from ``torch.profiler`` over a captured graph of the same
  steps replayed once (CUPTI records the kernels a graph launches), averaged per step;
- ``gaps``: the step minus the sum of its kernels' times: launch latency between the
  kernels of a step and between steps, which Programmatic Dependent Launch overlaps.

``--eager``: the bench's eager rows instead (``do_bench``: the L2 flushed by zeroing 256 MB
before each call, the kernels of eager calls, the flush's own kernel left out). At batch 1-2
x 4k-8k keys eager steps took 7-13 us more than graph steps in H100 run 190, flashtile's
2.6-3.8 us more than cuDNN's; the flush (~85 us of GPU time) should keep the host ahead,
so the question is which kernel grows.

What it tells: whether flashtile's extra microseconds against cuDNN are in a kernel (which
one) or between kernels.
"""

from __future__ import annotations

import argparse
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
from sweep_common import breakdown, device_us  # noqa: E402  (the profiler's per-kernel times)


def kernel_times(call, steps: int) -> dict[str, float]:
    """{kernel name: device us per step} of ``steps`` calls captured in one graph."""
    import torch

    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        for _ in range(3):
            call()
    torch.cuda.current_stream().wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        for _ in range(steps):
            call()
    graph.replay()
    torch.cuda.synchronize()
    return device_us(graph.replay, steps)


def eager_kernel_times(call, steps: int) -> dict[str, float]:
    """{kernel name: device us per step} of ``steps`` eager calls, each after the L2 flush
    ``triton.testing.do_bench`` makes (its driver's cache buffer, zeroed), the flush's kernel
    left out."""
    import torch
    from triton import runtime

    driver = runtime.driver.active
    cache = driver.get_empty_cache_for_benchmark()

    def run():
        for _ in range(steps):
            driver.clear_cache(cache)
            call()

    run()
    torch.cuda.synchronize()
    return {name: us for name, us in device_us(run, steps).items() if "fill" not in name.lower()}


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--only", nargs="+", type=int, default=[10, 11, 14, 15, 18, 19],
                   help="indices into tools.bench.decode.shapes() (default: B1, B2, B4 at 4k and 8k)")
    p.add_argument("--impl", nargs="+", default=["flashtile", "sdpa-cudnn"])
    p.add_argument("--rep", type=int, default=50)
    p.add_argument("--eager", action="store_true", help="eager steps after an L2 flush, as the bench's eager rows")
    args = p.parse_args(argv)
    import torch

    from flashtile.tools.bench.decode import build, cold_copies, measure, shapes

    print(f"{torch.cuda.get_device_name()} torch {torch.__version__}", flush=True)
    todo = shapes()
    for i in args.only:
        shape = todo[i]
        copies = 1 if args.eager else cold_copies(shape)
        for impl in args.impl:
            mode = "eager" if args.eager else "cuda_graph"
            step_us = 1e3 * measure(impl, shape, mode, 10, args.rep, append=impl == "flashtile")
            call = build(impl, shape, 0, impl == "flashtile", copies)
            with torch.no_grad():
                per = eager_kernel_times(call, 20) if args.eager else kernel_times(call, max(copies, 8))
            print(f"{shape.label():28s} {impl:10s} step {step_us:6.2f} us  {breakdown(step_us, per)}", flush=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())

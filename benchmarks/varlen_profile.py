"""Where the varlen backward's time goes: the kernels of one backward, varlen vs fixed length.

    PYTHONPATH=src python3 benchmarks/varlen_profile.py [--dist equal] [--headdim 128] [--causal]

The varlen backward of `flashtile bench --varlen` runs at 0.60-0.87x the fixed-length
backward of the same documents (docs/perf-notes.md, "Varlen"). This runs both backwards
(``flashtile`` and ``flashtile-fixed`` of `flashtile.tools.bench.varlen.build`) under
torch.profiler and prints each one's CUDA kernels: calls and total microseconds per
kernel name, summed over ``--iters`` backwards, so the gap can be read kernel by kernel
(the main dK/dV and dQ kernels, the Delta preprocess, the work-list builds, the gathers of
the padded gradients).
"""

from __future__ import annotations

import argparse
import sys
from collections import defaultdict

import torch

from flashtile.tools.bench.varlen import build, lengths_for


def kernel_table(impl, lengths, heads, headdim, causal, iters):
    call, ins = build(impl, lengths, heads, headdim, causal, True)
    out = call()
    dout = torch.randn_like(out)
    for _ in range(3):
        torch.autograd.grad(out, ins, dout, retain_graph=True)
    torch.cuda.synchronize()
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CUDA]) as prof:
        for _ in range(iters):
            torch.autograd.grad(out, ins, dout, retain_graph=True)
        torch.cuda.synchronize()
    per = defaultdict(lambda: [0, 0.0])
    for evt in prof.events():
        if evt.device_type == torch.autograd.DeviceType.CUDA:
            name = evt.name[:70]
            per[name][0] += 1
            per[name][1] += evt.device_time_total if hasattr(evt, "device_time_total") else evt.cuda_time_total
    return per


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--dist", default="equal", choices=("equal", "uniform", "longtail"))
    p.add_argument("--headdim", type=int, default=128)
    p.add_argument("--heads", type=int, default=None, help="default: 2048 / headdim")
    p.add_argument("--causal", action="store_true")
    p.add_argument("--iters", type=int, default=10)
    args = p.parse_args(argv)
    heads = args.heads or 2048 // args.headdim
    lengths = lengths_for(args.dist)
    print(f"# varlen backward kernels: dist {args.dist} ({len(lengths)} documents, {sum(lengths)} tokens), "
          f"d{args.headdim}, {heads} heads, causal={args.causal}, us per backward (mean of {args.iters})")
    for impl in ("flashtile", "flashtile-fixed"):
        per = kernel_table(impl, lengths, heads, args.headdim, args.causal, args.iters)
        total = sum(t for _, t in per.values()) / args.iters
        print(f"\n{impl}: {total:9.1f} us of kernels per backward")
        for name, (n, t) in sorted(per.items(), key=lambda kv: -kv[1][1]):
            print(f"  {t / args.iters:9.1f} us  {n / args.iters:5.1f} calls  {name}")
    return 0


if __name__ == "__main__":
    sys.exit(main())

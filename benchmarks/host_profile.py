"""Where the host time of one call goes (GPU needed): cProfile over many enqueued calls.

    PYTHONPATH=src python3 benchmarks/host_profile.py [--calls 300] [--top 25]
    PYTHONPATH=src python3 benchmarks/host_profile.py --no-profile [--repeat 5]   # A/B: times only

Profiles, at d128 S512 causal (bf16, batch 32 or ``--batch``, 16 heads), the forward launcher alone with
the TMA config and with pointer loads, the public forward without and with grad, the
backward, and a KV-cache decode step (batch 8 x 4096, ``--only kvcache`` for it alone). Prints per-call wall time without the profiler, then the profile's top functions
by own time. Use it with host_overhead.py: that one says whether a shape is launch-bound,
this one says which Python or driver call to cut; ``--torch-profiler`` shows the CUDA API
calls (a sync, an allocation, a memset) that cProfile folds into its caller.
"""

from __future__ import annotations

import argparse
import cProfile
import io
import pstats
import sys

import torch

import flashtile
from flashtile.backends.configs import FwdConfig, default_fwd_config
from flashtile.backends.run import launch_forward
from host_overhead import host_us
from sweep_common import canonical


def profile(name: str, fn, n: int, top: int) -> None:
    us = host_us(fn, n, warmup=20)
    prof = cProfile.Profile()
    prof.enable()
    for _ in range(n):
        fn()
    prof.disable()
    torch.cuda.synchronize()
    buf = io.StringIO()
    pstats.Stats(prof, stream=buf).strip_dirs().sort_stats("tottime").print_stats(top)
    print(f"\n===== {name}: {us:.1f} us/call host (no profiler)\n" + buf.getvalue(), flush=True)


def torch_profile(name: str, fn, n: int, top: int) -> None:
    """torch.profiler over ``n`` calls: CPU ops and CUDA runtime/driver calls (a device sync,
    an allocation or a memset shows here, which cProfile folds into its caller) and kernels."""
    from torch.profiler import ProfilerActivity, profile as tprofile

    for _ in range(20):
        fn()
    torch.cuda.synchronize()
    with tprofile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        for _ in range(n):
            fn()
        torch.cuda.synchronize()
    table = prof.key_averages().table(sort_by="self_cpu_time_total", row_limit=top, max_name_column_width=60)
    print(f"\n===== {name}: torch.profiler over {n} calls (counts are totals)\n{table}", flush=True)


def main(argv=None) -> int:
    p = argparse.ArgumentParser()
    p.add_argument("--calls", type=int, default=300)
    p.add_argument("--top", type=int, default=25)
    p.add_argument("--headdim", type=int, default=128)
    p.add_argument("--seqlen", type=int, default=512)
    p.add_argument("--no-profile", action="store_true",
                   help="only the host time per call, the minimum over --repeat rounds (for A/B runs)")
    p.add_argument("--repeat", type=int, default=5)
    p.add_argument("--batch", type=int, help="batch of the fwd/bwd cases (default: 16384 // seqlen tokens)")
    p.add_argument("--torch-profiler", action="store_true",
                   help="torch.profiler's table (CPU ops, CUDA API calls, kernels) instead of cProfile")
    p.add_argument("--only", nargs="+", help="the cases whose name holds one of these words")
    args = p.parse_args(argv)
    d, S = args.headdim, args.seqlen
    B, H = args.batch or 16384 // S, 2048 // d
    q = torch.randn(B, S, H, d, device="cuda", dtype=torch.bfloat16)
    k, v = torch.randn_like(q), torch.randn_like(q)
    q4, k4, v4, out4, lse, problem = canonical(q, k, v, True)
    cfg = default_fwd_config(torch.cuda.get_device_capability(), d, "bfloat16", True, S)
    ptr = FwdConfig(cfg.block_m, cfg.block_n, cfg.num_warps, cfg.num_stages, False)
    leaves = [t.clone().requires_grad_(True) for t in (q, k, v)]
    out = flashtile.flash_attn_func(*leaves, causal=True)
    dout = torch.randn_like(out)
    cases = {
        f"launcher {cfg}": lambda: launch_forward(q4, k4, v4, out4, lse, problem, cfg),
        f"launcher {ptr}": lambda: launch_forward(q4, k4, v4, out4, lse, problem, ptr),
        "flash_attn_func, no grad": lambda: flashtile.flash_attn_func(q, k, v, causal=True),
        "flash_attn_func, grad": lambda: flashtile.flash_attn_func(*leaves, causal=True),
        "backward (autograd.grad)": lambda: torch.autograd.grad(out, leaves, dout, retain_graph=True),
    }
    # decode: batch 8, 4096 cached tokens, GQA 32/8, cache_seqlens on the device (checked there)
    qd = torch.randn(8, 1, 32, d, device="cuda", dtype=torch.bfloat16)
    kc, vc = (torch.randn(8, 4096, 8, d, device="cuda", dtype=torch.bfloat16) for _ in range(2))
    seqlens = torch.full((8,), 4000, device="cuda", dtype=torch.int32)
    cases["flash_attn_with_kvcache, B8 4096"] = lambda: flashtile.flash_attn_with_kvcache(
        qd, kc, vc, cache_seqlens=seqlens)
    if args.only:
        cases = {n: fn for n, fn in cases.items() if any(w in n for w in args.only)}
    for name, fn in cases.items():
        if args.no_profile:
            best = min(host_us(fn, args.calls, warmup=20) for _ in range(args.repeat))
            print(f"{name}: {best:.1f} us/call host (min of {args.repeat})", flush=True)
        elif args.torch_profiler:
            print(f"{name}: {host_us(fn, args.calls, warmup=20):.1f} us/call host (no profiler)", flush=True)
            torch_profile(name, fn, args.calls, args.top)
        else:
            profile(name, fn, args.calls, args.top)
    return 0


if __name__ == "__main__":
    sys.exit(main())

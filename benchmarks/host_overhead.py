"""Host cost per call vs GPU time, to tell launch-bound shapes from kernel-bound ones.

    PYTHONPATH=src python3 benchmarks/host_overhead.py

For each shape: do_bench of the kernel launcher alone (``attention_forward``), of the
public API (``flash_attn_func``) and of torch SDPA (cuDNN); and the host time per call of
each (perf_counter over 200 enqueued calls, no sync inside: while the GPU queue is not
full this is the CPU cost of one call). When host us/call > kernel us, do_bench of the
API measures the host, not the kernel.

    TRITON_INTERPRET=1 PYTHONPATH=src python3 benchmarks/host_overhead.py --cpu-stub

needs no GPU: it replaces the kernel launchers with no-ops and times the Python host
path alone (validation, autograd, buffers, config lookup) on small CPU tensors.
"""

from __future__ import annotations

import argparse
import sys
import time

import torch
from triton.testing import do_bench

import flashtile
from flashtile.bench import make_shape
from flashtile.ops.configs import default_fwd_config
from flashtile.ops.forward import attention_forward
from sweep_common import canonical


def host_us(fn, n=200, warmup=1):
    """Host microseconds per call: ``n`` calls enqueued back to back after ``warmup``."""
    for _ in range(warmup):
        fn()
    torch.cuda.synchronize()
    t = time.perf_counter()
    for _ in range(n):
        fn()
    host = (time.perf_counter() - t) / n * 1e6
    torch.cuda.synchronize()
    return host


def cpu_stub(n: int = 2000) -> None:
    """Host microseconds per call of the API with the kernel launchers stubbed out."""
    import os

    os.environ["FLASHTILE_BACKEND"] = "triton"
    import flashtile.ops.backward as bwd
    import flashtile.ops.forward as fwd

    fwd.attention_forward = lambda *a, **k: None
    bwd.attention_backward = lambda *a, **k: None

    def per_call(fn):
        for _ in range(100):
            fn()
        t = time.perf_counter()
        for _ in range(n):
            fn()
        return (time.perf_counter() - t) / n * 1e6

    q = torch.randn(2, 512, 8, 64, dtype=torch.float16)
    leaves = [t.clone().requires_grad_(True) for t in (q, q, q)]
    out = flashtile.flash_attn_func(*leaves, causal=True)
    dout = torch.ones_like(out)
    rows = {
        "flash_attn_func, no grad": lambda: flashtile.flash_attn_func(q, q, q, causal=True),
        "flash_attn_func, inputs require grad": lambda: flashtile.flash_attn_func(*leaves, causal=True),
        "backward (autograd.grad, retained graph)": lambda: torch.autograd.grad(out, leaves, dout, retain_graph=True),
        "torch.ops.flashtile.attn_fwd, no grad": lambda: torch.ops.flashtile.attn_fwd(
            *(t.transpose(1, 2) for t in (q, q, q)), 0.125, 0, -1, 0, 0.0, None, None),
    }
    for name, fn in rows.items():
        print(f"{name:42s} {per_call(fn):7.1f} us", flush=True)


def main(argv=None) -> int:
    p = argparse.ArgumentParser()
    p.add_argument("--cpu-stub", action="store_true", help="no GPU: time the host path with stubbed launchers")
    p.add_argument("--shapes", default="64,512,1;256,512,1;128,512,1;128,1024,0;64,4096,0",
                   help="d,seqlen,causal;... (batch*seqlen = 16k, hidden 2048)")
    args = p.parse_args(argv)
    if args.cpu_stub:
        cpu_stub()
        return 0
    from torch.nn.attention import SDPBackend, sdpa_kernel
    for spec in args.shapes.split(";"):
        d, S, causal = (int(x) for x in spec.split(","))
        causal = bool(causal)
        shape = make_shape(S, d, causal, "bf16")
        B, H = shape.batch, shape.nheads
        q = torch.randn(B, S, H, d, device="cuda", dtype=torch.bfloat16)
        k, v = torch.randn_like(q), torch.randn_like(q)
        q4, k4, v4, out4, lse, problem = canonical(q, k, v, causal)
        cfg = default_fwd_config(torch.cuda.get_device_capability(), d, "bfloat16", causal, S)
        direct = lambda: attention_forward(q4, k4, v4, out4, lse, config=cfg, **problem)
        api = lambda: flashtile.flash_attn_func(q, k, v, causal=causal)
        op = lambda: torch.ops.flashtile.attn_fwd(q4, k4, v4, d ** -0.5, 0, -1, 0 if causal else -1, 0.0, None, None)
        qt, kt, vt = (t.transpose(1, 2).contiguous() for t in (q, k, v))
        with sdpa_kernel(SDPBackend.CUDNN_ATTENTION):
            cudnn = lambda: torch.nn.functional.scaled_dot_product_attention(qt, kt, vt, is_causal=causal)
            row = {}
            for name, fn in (("direct", direct), ("op", op), ("api", api), ("cudnn", cudnn)):
                fn()
                torch.cuda.synchronize()
                row[name] = (do_bench(fn, warmup=25, rep=100, return_mode="median") * 1e3, host_us(fn))
        print(f"d{d} S{S} B{B} H{H} causal={int(causal)} {cfg}: "
              + "  ".join(f"{n}: gpu {g:6.1f} us host {h:6.1f} us" for n, (g, h) in row.items()), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())

"""Experiment (issue 38): the library's backward against its one-pass kernel alone and cuDNN, kernel by kernel.

    PYTHONPATH=src python3 benchmarks/experiments/bwd_breakdown.py [--shapes 128,4096,1;128,16384,1]   # GPU only

H100 run 180 (docs/perf-notes.md, session 33) found the library's d128 backward 35-80 us (1%)
behind ``gluon_bwd_onepass.py``'s kernel row without causal, and 105-165 us (3-7%) behind it
with causal. That kernel row already holds the dQ zeroing and cast, and the Delta preprocess
does the same work with or without causal. Per shape (headdim, seqlen, causal; batch 16384 //
seqlen, 2048 // headdim heads, bf16, as ``gluon_bwd.run`` times them), this times:

- ``library``: ``torch.autograd.grad`` through ``flash_attn_func`` ((B, S, H, D) views of (B,
  H, S, D) tensors, as ``gluon_bwd.run``'s "api" row);
- ``kernel, true lse``: ``attention_backward_onepass`` alone on the library forward's LSE
  and Delta;
- ``kernel, random lse``: the same, on ``gluon_bwd.run``'s random LSE (|N(0,1)| + 5) and
  Delta, as run 180's kernel row;
- ``cudnn``: SDPA's cuDNN backward.

At head dims without a one-pass kernel (256: the split dV, dK and dQ kernels) only the
``library`` and ``cudnn`` rows: which of the three kernels a causal call loses in
(``--shapes "256,8192,1;256,8192,0"``; H100 run 256 read causal d256 0.90-0.95x cuDNN at
S4096-8192, 1.03-1.07x without causal).

For each: ``do_bench``'s median, and each kernel's device time per call from
``torch.profiler`` over ``--calls`` eager calls (``sweep_common``'s helpers). Their sum
against the median ("gaps") is the time between kernels (launches, the host); the library's
kernels against the kernel rows show which kernel, or which input, holds the gap.
"""

from __future__ import annotations

import argparse
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
from sweep_common import breakdown, device_us  # noqa: E402  (the profiler's per-kernel times)


def kernel_times(call, calls: int) -> dict[str, float]:
    """{kernel name: device us per call} over ``calls`` eager calls after a warm-up."""
    import torch

    for _ in range(3):
        call()
    torch.cuda.synchronize()
    return device_us(lambda: [call() for _ in range(calls)], calls)


def rows(head_dim: int, seqlen: int, causal: bool) -> dict:
    """{row name: zero-argument call} of one shape (module docstring)."""
    import torch
    from torch.nn.attention import SDPBackend, sdpa_kernel

    import flashtile
    from flashtile.backends.sm90.backward_onepass import HEAD_DIMS, attention_backward_onepass

    batch, heads = 16384 // seqlen, 2048 // head_dim
    q, k, v, dout = (torch.randn(batch, heads, seqlen, head_dim, device="cuda", dtype=torch.bfloat16)
                     for _ in range(4))
    leaves = [t.transpose(1, 2).detach().requires_grad_(True) for t in (q, k, v)]
    do = dout.transpose(1, 2)
    out = flashtile.flash_attn_func(*leaves, causal=causal)  # the "api" row's path (no LSE asked for)
    cudnn_leaves = [t.detach().requires_grad_(True) for t in (q, k, v)]
    with sdpa_kernel(SDPBackend.CUDNN_ATTENTION):
        cudnn_out = torch.nn.functional.scaled_dot_product_attention(*cudnn_leaves, is_causal=causal)

    def cudnn():
        with sdpa_kernel(SDPBackend.CUDNN_ATTENTION):
            return torch.autograd.grad(cudnn_out, cudnn_leaves, dout, retain_graph=True)

    def library():
        return torch.autograd.grad(out, leaves, do, retain_graph=True)

    if head_dim not in HEAD_DIMS:  # d256: the split kernels, no one-pass kernel to time alone
        return {"library": library, "cudnn": cudnn}
    with torch.no_grad():
        lse = flashtile.flash_attn_func(*(t.detach() for t in leaves), causal=causal, return_attn_probs=True)[1]
    true_lse = lse.contiguous()
    true_delta = (out.detach().float() * do.float()).sum(-1).transpose(1, 2).contiguous()
    random_lse = torch.randn(batch, heads, seqlen, device="cuda").abs() + 5
    random_delta = torch.randn(batch, heads, seqlen, device="cuda")
    grads = [torch.empty_like(t) for t in (q, k, v)]

    def kernel(lse_, delta_):
        return lambda: attention_backward_onepass(q, k, v, dout, lse_, delta_, *grads, scale=head_dim ** -0.5,
                                                  diag_offset=0, causal=causal)

    return {"library": library,
            "kernel, true lse": kernel(true_lse, true_delta),
            "kernel, random lse": kernel(random_lse, random_delta),
            "cudnn": cudnn}


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--shapes", default="128,4096,1;128,16384,1;128,4096,0;128,16384,0",
                   help="headdim,seqlen,causal;...")
    p.add_argument("--calls", type=int, default=20, help="eager calls under the profiler")
    args = p.parse_args(argv)
    import torch
    from triton.testing import do_bench

    print(f"{torch.cuda.get_device_name()} torch {torch.__version__}", flush=True)
    for spec in args.shapes.split(";"):
        head_dim, seqlen, causal = (int(x) for x in spec.split(","))
        batch, heads = 16384 // seqlen, 2048 // head_dim
        flops = 2.5 * 4 * batch * heads * seqlen * seqlen * head_dim / (2 if causal else 1)
        for name, call in rows(head_dim, seqlen, bool(causal)).items():
            ms = do_bench(call, warmup=25, rep=100)
            print(f"d{head_dim} S{seqlen} causal={causal} {name:18s} {ms * 1e3:8.1f} us {flops / ms * 1e-9:6.1f} TF/s"
                  f"  {breakdown(ms * 1e3, kernel_times(call, args.calls), 40)}", flush=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())

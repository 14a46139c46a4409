"""Issue 36's features against the same call without them (H200): ``learnable_sink`` and
``attention_chunk`` at d64/d128, forward and forward+backward, S 2k-16k, bf16; and head dim
512 / (192, 128) against the best peer that takes the shape (cuDNN or flash SDPA where they
do, else plain flashtile at the padded head dim).

    python benchmarks/features.py --out rows.jsonl

One row per (feature, d, S, causal, pass): the time of the call with the feature and
without, and their ratio (the issue's sink target: at most 1.03x). Timed with
``triton.testing.do_bench`` (median, warmup 25, rep 100), one process.
"""

from __future__ import annotations

import argparse
import json


def _time(fn) -> float:
    from triton.testing import do_bench

    return do_bench(fn, warmup=25, rep=100, return_mode="median")


def _pass_fn(call, q, k, v, which: str):
    import torch

    if which == "fwd":
        return lambda: call(q, k, v)
    out = call(q, k, v)
    dout = torch.randn_like(out)
    leaves = [t for t in (q, k, v) if t.requires_grad]

    def fwd_bwd():
        o = call(q, k, v)
        torch.autograd.grad(o, leaves, dout)
    return fwd_bwd


def sink_and_chunk_rows(seqlens, head_dims, passes):
    import torch

    import flashtile

    rows = []
    total = 16384
    for d in head_dims:
        for s in seqlens:
            batch = max(1, total // s)
            heads = 2048 // d
            for causal in (False, True):
                q, k, v = (torch.randn(batch, s, heads, d, device="cuda", dtype=torch.bfloat16, requires_grad=True)
                           for _ in range(3))
                sink = (torch.randn(heads, device="cuda") + 3).requires_grad_(True)
                variants = {
                    "plain": lambda q_, k_, v_: flashtile.flash_attn_func(q_, k_, v_, causal=causal),
                    "sink": lambda q_, k_, v_: flashtile.flash_attn_func(q_, k_, v_, causal=causal,
                                                                         learnable_sink=sink),
                    "chunk-1024": lambda q_, k_, v_: flashtile.flash_attn_func(q_, k_, v_, causal=causal,
                                                                               attention_chunk=1024),
                }
                for which in passes:
                    times = {}
                    for name, call in variants.items():
                        times[name] = _time(_pass_fn(call, q, k, v, which))
                    for name in ("sink", "chunk-1024"):
                        row = dict(feature=name, headdim=d, seqlen=s, batch=batch, heads=heads, causal=causal,
                                   ms=times[name], ms_plain=times["plain"], ratio=times[name] / times["plain"],
                                   **{"pass": which})
                        rows.append(row)
                        print(json.dumps(row), flush=True)
    return rows


def wide_rows(seqlen: int, passes):
    import torch
    import torch.nn.functional as F
    from torch.nn.attention import SDPBackend, sdpa_kernel

    import flashtile

    rows = []
    for d, dv in ((512, 512), (192, 128)):
        batch, heads = max(1, 16384 // seqlen), 16
        q = torch.randn(batch, heads, seqlen, d, device="cuda", dtype=torch.bfloat16, requires_grad=True)
        k = torch.randn(batch, heads, seqlen, d, device="cuda", dtype=torch.bfloat16, requires_grad=True)
        v = torch.randn(batch, heads, seqlen, dv, device="cuda", dtype=torch.bfloat16, requires_grad=True)
        impls = {"flashtile": lambda q_, k_, v_: flashtile.scaled_dot_product_attention(q_, k_, v_, is_causal=True)}
        for name, backend in (("sdpa-cudnn", SDPBackend.CUDNN_ATTENTION), ("sdpa-flash", SDPBackend.FLASH_ATTENTION),
                              ("sdpa-efficient", SDPBackend.EFFICIENT_ATTENTION)):
            def peer(q_, k_, v_, backend=backend):
                with sdpa_kernel(backend):
                    return F.scaled_dot_product_attention(q_, k_, v_, is_causal=True)
            impls[name] = peer
        for which in passes:
            for name, call in impls.items():
                try:
                    ms = _time(_pass_fn(call, q, k, v, which))
                except Exception as exc:  # the peer does not take the shape
                    print(json.dumps(dict(impl=name, headdim=d, headdim_v=dv, error=str(exc)[:120])), flush=True)
                    continue
                flops = 2 * batch * heads * seqlen * seqlen * (d + dv) / 2 * (1 if which == "fwd" else 3.5)
                row = dict(feature="wide", impl=name, headdim=d, headdim_v=dv, seqlen=seqlen, batch=batch,
                           heads=heads, causal=True, ms=ms, tflops=flops / ms / 1e9, **{"pass": which})
                rows.append(row)
                print(json.dumps(row), flush=True)
    return rows


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--seqlen", type=int, nargs="+", default=[2048, 4096, 8192, 16384])
    p.add_argument("--headdim", type=int, nargs="+", default=[64, 128])
    p.add_argument("--pass", dest="passes", nargs="+", default=["fwd", "fwd+bwd"], choices=["fwd", "fwd+bwd"])
    p.add_argument("--wide-seqlen", type=int, default=4096, help="seqlen of the head dim 512 and (192, 128) rows")
    p.add_argument("--skip", nargs="*", default=[], choices=["features", "wide"])
    p.add_argument("--out", help="append the rows to this JSONL file")
    args = p.parse_args(argv)
    rows = []
    if "features" not in args.skip:
        rows += sink_and_chunk_rows(args.seqlen, args.headdim, args.passes)
    if "wide" not in args.skip:
        rows += wide_rows(args.wide_seqlen, args.passes)
    if args.out:
        with open(args.out, "a") as fh:
            fh.writelines(json.dumps(r) + "\n" for r in rows)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())

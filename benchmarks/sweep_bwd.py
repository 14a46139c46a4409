"""Sweep backward launch configs on the GPU against SDPA peers measured in the same process.

    PYTHONPATH=src python3 benchmarks/sweep_bwd.py --out $OUT/sweep-bwd.jsonl

Times ``attention_backward`` alone (preprocess + dk/dv + dq kernels, or the fused
atomic-dQ pass) for each candidate ``BwdConfig``, next to the backward of torch SDPA's
cuDNN and flash backends (``autograd.grad`` with a retained graph, as ``flashtile.bench``
does). Backward FLOPs = 2.5 x forward. Used to fill ``_SM90_BWD`` in
src/flashtile/ops/configs.py; results go to docs/perf-notes.md.
"""

from __future__ import annotations

import argparse
import json
import sys

import torch
from triton.testing import do_bench

from flashtile import autograd as ops
from flashtile.ops.backward import attention_backward
from flashtile.ops.configs import BwdConfig, default_fwd_config
from flashtile.ops.forward import attention_forward
from flashtile.traffic import attention_flops

# (block_m_kv, block_n_kv, block_m_q, block_n_q, warps, stages, fused_dq[, split_phases=1])
DEFAULT_GRID = {
    64: [(64, 128, 128, 64, 8, 2, 0), (64, 128, 128, 64, 8, 3, 0), (64, 64, 64, 64, 4, 3, 0),
         (128, 128, 128, 128, 8, 2, 0), (64, 128, 128, 128, 8, 2, 0), (32, 128, 128, 32, 4, 3, 0),
         (64, 128, 0, 0, 8, 2, 1), (128, 128, 0, 0, 8, 2, 1), (64, 64, 0, 0, 4, 3, 1),
         (64, 64, 64, 64, 4, 3, 0, 0), (64, 128, 128, 64, 8, 3, 0, 0)],
    128: [(64, 128, 128, 64, 8, 2, 0), (64, 128, 128, 64, 8, 1, 0), (32, 128, 128, 32, 8, 2, 0),
          (64, 64, 64, 64, 4, 2, 0), (64, 128, 64, 128, 8, 2, 0), (128, 128, 128, 128, 8, 1, 0),
          (32, 64, 64, 32, 4, 2, 0), (64, 128, 0, 0, 8, 2, 1), (64, 64, 0, 0, 4, 2, 1),
          (128, 128, 0, 0, 8, 1, 1), (64, 64, 64, 64, 4, 2, 0, 0), (64, 64, 64, 64, 8, 2, 0, 0),
          (64, 128, 64, 64, 8, 2, 0, 0)],
    256: [(32, 64, 64, 32, 8, 1, 0), (32, 64, 64, 32, 4, 1, 0), (64, 64, 64, 64, 8, 1, 0),
          (32, 128, 128, 32, 8, 1, 0), (64, 32, 32, 64, 4, 1, 0), (16, 64, 64, 16, 4, 2, 0),
          (32, 64, 0, 0, 8, 1, 1), (64, 64, 0, 0, 8, 1, 1), (64, 64, 64, 64, 8, 2, 0, 0)],
}


def sdpa_bwd_ms(q, k, v, dout, causal, backend):
    from torch.nn.attention import SDPBackend, sdpa_kernel

    qt, kt, vt = (t.transpose(1, 2).contiguous().requires_grad_() for t in (q, k, v))
    with sdpa_kernel(getattr(SDPBackend, backend)):
        out = torch.nn.functional.scaled_dot_product_attention(qt, kt, vt, is_causal=causal)
        do = dout.transpose(1, 2).contiguous()
        fn = lambda: torch.autograd.grad(out, (qt, kt, vt), do, retain_graph=True)
        fn()
        return do_bench(fn, warmup=25, rep=100, return_mode="median")


def main(argv=None) -> int:
    p = argparse.ArgumentParser()
    p.add_argument("--headdim", type=int, nargs="+", default=[64, 128, 256])
    p.add_argument("--seqlen", type=int, nargs="+", default=[4096])
    p.add_argument("--dtype", default="bf16")
    p.add_argument("--configs", default="",
                   help="semicolon list m,n,mq,nq,w,s,fused[,split_phases];... (default: built-in grid)")
    p.add_argument("--out", default=None)
    args = p.parse_args(argv)
    dtype = {"fp16": torch.float16, "bf16": torch.bfloat16}[args.dtype]
    grid = [tuple(map(int, c.split(","))) for c in args.configs.split(";")] if args.configs else None
    out_file = open(args.out, "a") if args.out else None
    best = {}
    for d in args.headdim:
        nheads = 2048 // d
        for S in args.seqlen:
            batch = max(1, 16384 // S)
            q = torch.randn(batch, S, nheads, d, device="cuda", dtype=dtype)
            k, v, dout = torch.randn_like(q), torch.randn_like(q), torch.randn_like(q)
            for causal in (False, True):
                flops = 2.5 * attention_flops(batch, nheads, S, S, d, causal=causal)
                peers = {}
                for name, be in (("sdpa-cudnn", "CUDNN_ATTENTION"), ("sdpa-flash", "FLASH_ATTENTION")):
                    try:
                        peers[name] = sdpa_bwd_ms(q, k, v, dout, causal, be)
                    except Exception as exc:  # noqa: BLE001
                        print(f"  {name} failed: {exc}"[:200])
                q4, k4, v4, do4 = (t.transpose(1, 2) for t in (q, k, v, dout))
                out4, lse = ops._bshd_view(q4), ops._new_lse(q4)
                problem = dict(scale=d ** -0.5, diag_offset=0, window_left=-1, window_right=0 if causal else -1,
                               softcap=0.0, alibi_slopes=None, attn_mask=None)
                fcfg = default_fwd_config((9, 0), d, str(dtype).split(".")[-1], causal, S)
                attention_forward(q4, k4, v4, out4, lse, config=fcfg, **problem)
                dq, dk, dv = ops._bshd_view(q4), ops._bshd_view(k4), ops._bshd_view(v4)
                for c in grid or DEFAULT_GRID[d if d in DEFAULT_GRID else 128]:
                    cfg = BwdConfig(*c[:6], fused_dq=bool(c[6]), split_phases=bool(c[7]) if len(c) > 7 else True)
                    fn = lambda: attention_backward(q4, k4, v4, out4, lse, do4, dq, dk, dv, config=cfg, **problem)
                    try:
                        fn()
                        torch.cuda.synchronize()
                        ms = do_bench(fn, warmup=25, rep=100, return_mode="median")
                    except Exception as exc:  # noqa: BLE001
                        print(f"d{d} S{S} causal={int(causal)} {c}: failed {type(exc).__name__}: {str(exc)[:120]}")
                        continue
                    tf = flops / ms * 1e-9
                    ratios = {n: m / ms for n, m in peers.items()}
                    print(f"d{d} S{S} B{batch} H{nheads} causal={int(causal)} {args.dtype} {c}: {tf:6.1f} TF/s  "
                          + "  ".join(f"x{n}={r:.3f}" for n, r in ratios.items()), flush=True)
                    key = (d, causal, S, bool(c[6]), c[7] if len(c) > 7 else 1)
                    if key not in best or ms < best[key][1]:
                        best[key] = (c, ms, tf, ratios)
                    if out_file:
                        out_file.write(json.dumps(dict(headdim=d, seqlen=S, batch=batch, nheads=nheads, causal=causal,
                                                       dtype=args.dtype, cfg=list(c), ms=ms, tflops=tf,
                                                       peers_ms=peers)) + "\n")
                        out_file.flush()
                for n, m in peers.items():
                    print(f"  peer {n}: {flops / m * 1e-9:6.1f} TF/s", flush=True)
    print("\nbest per shape (split dQ, then atomic dQ; three-phase, then one-loop dk/dv):")
    for (d, causal, S, fused, phases), (c, _ms, tf, ratios) in sorted(best.items()):
        print(f"d{d} causal={int(causal)} S{S} fused={int(fused)} split_phases={phases}: {c} {tf:.1f} TF/s "
              + " ".join(f"x{n}={r:.3f}" for n, r in ratios.items()))
    return 0


if __name__ == "__main__":
    sys.exit(main())

"""Sweep forward launch configs on the GPU against SDPA peers measured in the same process.

    PYTHONPATH=src python3 benchmarks/sweep_fwd.py --out $OUT/sweep.jsonl

Prints one line per (shape, config) with TFLOP/s and the ratio to sdpa-cudnn and
sdpa-flash, then the best config per (head dim, causal). Used to fill the table in
src/flashtile/ops/configs.py; results go to docs/perf-notes.md.
"""

from __future__ import annotations

import argparse
import json
import sys

import torch
from triton.testing import do_bench

from flashtile import autograd as ops
from flashtile.ops.configs import FwdConfig
from flashtile.ops.forward import attention_forward
from flashtile.traffic import attention_flops


DEFAULT_GRID = {
    128: [(128, 64, 4, 3), (128, 64, 8, 3), (128, 128, 8, 2), (128, 128, 8, 3), (64, 64, 4, 3), (128, 64, 4, 4)],
    256: [(128, 64, 8, 2), (128, 32, 8, 3), (64, 64, 4, 2), (64, 32, 4, 3), (128, 64, 8, 3)],
}


def sdpa_ms(q, k, v, causal, backend):
    from torch.nn.attention import SDPBackend, sdpa_kernel

    qt, kt, vt = (t.transpose(1, 2).contiguous() for t in (q, k, v))
    with sdpa_kernel(getattr(SDPBackend, backend)):
        fn = lambda: torch.nn.functional.scaled_dot_product_attention(qt, kt, vt, is_causal=causal)
        fn()
        return do_bench(fn, warmup=25, rep=100, return_mode="median")


def main(argv=None) -> int:
    p = argparse.ArgumentParser()
    p.add_argument("--headdim", type=int, nargs="+", default=[64, 128, 256])
    p.add_argument("--seqlen", type=int, nargs="+", default=[4096])
    p.add_argument("--dtype", default="fp16")
    p.add_argument("--configs", default="", help="semicolon list m,n,w,s;... (default: a built-in grid)")
    p.add_argument("--out", default=None)
    args = p.parse_args(argv)
    dtype = {"fp16": torch.float16, "bf16": torch.bfloat16}[args.dtype]
    if args.configs:
        grid = [FwdConfig(*map(int, c.split(","))) for c in args.configs.split(";")]
    else:
        grid = None
    out_file = open(args.out, "a") if args.out else None
    best = {}
    for d in args.headdim:
        nheads = 2048 // d
        for S in args.seqlen:
            batch = max(1, 16384 // S)
            q = torch.randn(batch, S, nheads, d, device="cuda", dtype=dtype)
            k = torch.randn_like(q)
            v = torch.randn_like(q)
            for causal in (False, True):
                flops = attention_flops(batch, nheads, S, S, d, causal=causal)
                peers = {}
                for name, be in (("sdpa-cudnn", "CUDNN_ATTENTION"), ("sdpa-flash", "FLASH_ATTENTION")):
                    try:
                        peers[name] = sdpa_ms(q, k, v, causal, be)
                    except Exception as exc:  # noqa: BLE001
                        print(f"  {name} failed: {exc}"[:200])
                cands = grid or [FwdConfig(*c, tma) for c in DEFAULT_GRID[min(d, 256) if d > 128 else 128]
                                 for tma in (False, True)]
                q4, k4, v4 = (t.transpose(1, 2) for t in (q, k, v))
                out4 = ops._bshd_view(q4)
                lse = ops._new_lse(q4)
                problem = dict(scale=d ** -0.5, diag_offset=0, window_left=-1, window_right=0 if causal else -1,
                               softcap=0.0, alibi_slopes=None, attn_mask=None)
                for cfg in cands:
                    fn = lambda: attention_forward(q4, k4, v4, out4, lse, config=cfg, **problem)
                    try:
                        fn()
                        torch.cuda.synchronize()
                        ms = do_bench(fn, warmup=25, rep=100, return_mode="median")
                    except Exception as exc:  # noqa: BLE001
                        print(f"d{d} S{S} causal={causal} {cfg}: failed {type(exc).__name__}: {str(exc)[:120]}")
                        continue
                    tf = flops / ms * 1e-9
                    ratios = {n: m / ms for n, m in peers.items()}
                    print(f"d{d} S{S} B{batch} H{nheads} causal={int(causal)} {args.dtype} "
                          f"m{cfg.block_m} n{cfg.block_n} w{cfg.num_warps} s{cfg.num_stages} tma{int(cfg.use_tma)}: {tf:6.1f} TF/s  "
                          + "  ".join(f"x{n}={r:.3f}" for n, r in ratios.items()), flush=True)
                    key = (d, causal, S)
                    if key not in best or ms < best[key][1]:
                        best[key] = (cfg, ms, tf, ratios)
                    if out_file:
                        out_file.write(json.dumps(dict(headdim=d, seqlen=S, batch=batch, nheads=nheads, causal=causal,
                                                       dtype=args.dtype, cfg=cfg.__dict__, ms=ms, tflops=tf,
                                                       peers_ms=peers)) + "\n")
                        out_file.flush()
                for n, m in peers.items():
                    print(f"  peer {n}: {flops / m * 1e-9:6.1f} TF/s")
    print("\nbest per shape:")
    for (d, causal, S), (cfg, _ms, tf, ratios) in sorted(best.items()):
        print(f"d{d} causal={int(causal)} S{S}: {cfg} {tf:.1f} TF/s " + " ".join(f"x{n}={r:.3f}" for n, r in ratios.items()))
    return 0


if __name__ == "__main__":
    sys.exit(main())

"""Sweep forward launch configs on the GPU against SDPA peers measured in the same process.

    PYTHONPATH=src python3 benchmarks/sweep_fwd.py --out $OUT/sweep.jsonl

Prints one line per (shape, config) with TFLOP/s and the ratio to sdpa-cudnn and
sdpa-flash, then the best config per (head dim, causal). Used to fill the table in
src/flashtile/backends/configs.py; results go to docs/perf-notes.md.
"""

from __future__ import annotations

import argparse
import sys

import torch

from flashtile.tools.bench.prefill import make_shape
from flashtile.backends.configs import FwdConfig
from flashtile.backends.run import launch_forward
from sweep_common import Sweep, canonical, peer_ms


DEFAULT_GRID = {
    128: [(128, 64, 4, 3), (128, 64, 8, 3), (128, 128, 8, 2), (128, 128, 8, 3), (64, 64, 4, 3), (128, 64, 4, 4)],
    256: [(128, 64, 8, 2), (128, 32, 8, 3), (64, 64, 4, 2), (64, 32, 4, 3), (128, 64, 8, 3)],
}


def main(argv=None) -> int:
    p = argparse.ArgumentParser()
    p.add_argument("--headdim", type=int, nargs="+", default=[64, 128, 256])
    p.add_argument("--seqlen", type=int, nargs="+", default=[4096])
    p.add_argument("--dtype", default="fp16")
    p.add_argument("--configs", default="", help="semicolon list m,n,w,s;... (default: a built-in grid)")
    p.add_argument("--out", default=None)
    args = p.parse_args(argv)
    dtype = {"fp16": torch.float16, "bf16": torch.bfloat16}[args.dtype]
    grid = [FwdConfig(*map(int, c.split(","))) for c in args.configs.split(";")] if args.configs else None
    sweep = Sweep("fwd", args.out)
    for d in args.headdim:
        for S in args.seqlen:
            shape = make_shape(S, d, False, args.dtype)
            q = torch.randn(shape.batch, S, shape.nheads, d, device="cuda", dtype=dtype)
            k, v = torch.randn_like(q), torch.randn_like(q)
            for causal in (False, True):
                shape = make_shape(S, d, causal, args.dtype)
                peers = peer_ms(shape, "fwd", q, k, v)
                q4, k4, v4, out4, lse, problem = canonical(q, k, v, causal)
                cands = grid or [FwdConfig(*c, tma) for c in DEFAULT_GRID[min(d, 256) if d > 128 else 128]
                                 for tma in (False, True)]
                for cfg in cands:
                    label = f"m{cfg.block_m} n{cfg.block_n} w{cfg.num_warps} s{cfg.num_stages} tma{int(cfg.use_tma)}"
                    sweep.time(shape, label, cfg.__dict__, peers=peers,
                               fn=lambda cfg=cfg: launch_forward(q4, k4, v4, out4, lse, problem, cfg))
                sweep.peer_lines(shape, peers)
    sweep.report()
    return 0


if __name__ == "__main__":
    sys.exit(main())

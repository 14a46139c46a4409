"""Sweep backward launch configs on the GPU against SDPA peers measured in the same process.

    PYTHONPATH=src python3 benchmarks/sweep_bwd.py --out $OUT/sweep-bwd.jsonl

Times ``attention_backward`` alone (preprocess + dk/dv + dq kernels, or the fused
atomic-dQ pass) for each candidate ``BwdConfig``, next to the backward of torch SDPA's
cuDNN and flash backends (``autograd.grad`` with a retained graph, as ``flashtile.tools.bench.prefill``
does). Backward FLOPs = 2.5 x forward. Used to fill ``_SM90_BWD`` in
src/flashtile/backends/configs.py; results go to docs/perf-notes.md.
"""

from __future__ import annotations

import argparse
import sys

import torch

from flashtile.backends import layout
from flashtile.backends.configs import BwdConfig, default_fwd_config
from flashtile.backends.run import launch_backward, launch_forward
from flashtile.tools.bench.prefill import make_shape
from sweep_common import Sweep, canonical, peer_ms

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
    sweep = Sweep("bwd", args.out)
    for d in args.headdim:
        for S in args.seqlen:
            shape = make_shape(S, d, False, args.dtype)
            q = torch.randn(shape.batch, S, shape.nheads, d, device="cuda", dtype=dtype)
            k, v, dout = torch.randn_like(q), torch.randn_like(q), torch.randn_like(q)
            do4 = dout.transpose(1, 2)
            for causal in (False, True):
                shape = make_shape(S, d, causal, args.dtype)
                peers = peer_ms(shape, "bwd", q, k, v)
                q4, k4, v4, out4, lse, problem = canonical(q, k, v, causal)
                fcfg = default_fwd_config((9, 0), d, str(dtype).split(".")[-1], causal, S)
                launch_forward(q4, k4, v4, out4, lse, problem, fcfg)
                dq, dk, dv = (layout.bshd_view(t) for t in (q4, k4, v4))
                for c in grid or DEFAULT_GRID[d if d in DEFAULT_GRID else 128]:
                    split_phases = bool(c[7]) if len(c) > 7 else True
                    cfg = BwdConfig(*c[:6], fused_dq=bool(c[6]), split_phases=split_phases)
                    sweep.time(shape, str(c), list(c), peers=peers,
                               variant=f"fused={int(cfg.fused_dq)} split_phases={int(split_phases)}",
                               fn=lambda cfg=cfg: launch_backward(q4, k4, v4, out4, lse, do4, dq, dk, dv,
                                                                  problem, cfg))
                sweep.peer_lines(shape, peers)
    sweep.report()
    return 0


if __name__ == "__main__":
    sys.exit(main())

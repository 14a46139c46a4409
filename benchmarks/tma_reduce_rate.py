"""How fast can a one-pass backward add its dQ tiles? Bulk TMA reductions against atomics.

    PYTHONPATH=src python3 benchmarks/tma_reduce_rate.py [--seqlen 4096] [--heads 16] [--headdim 128]

A one-pass backward (FA2/FA3: key blocks outer) adds one fp32 (64 x D) dQ tile per
(key block, query block) pair. Runs 30-34 measured that volume capping flashtile's one-pass
kernel at 290-375 TF/s when it went through per-thread atomics (`red.global.add`), about
1.1 TB/s of fp32 reductions at the L2. This times `backends.sm90.tma_reduce.reduce_rate_kernel` (the
same reduction volume, no products) with bulk TMA reductions from 1, 2 or 3 shared-memory
slots and with `gl.atomic_add`, and prints the reduced bytes per second and the backward
TF/s that rate alone would allow: a (64 query x 64 key) tile pair's 5 products are
10 x 64 x 64 x D FLOPs for one 64 x D fp32 reduction. Each variant's sums are checked.
"""

from __future__ import annotations

import argparse
import sys


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--seqlen", type=int, default=4096)
    p.add_argument("--heads", type=int, default=16)
    p.add_argument("--headdim", type=int, default=128)
    p.add_argument("--rep", type=int, default=50)
    args = p.parse_args(argv)

    import torch
    import triton.testing
    from triton.experimental.gluon import language as gl
    from triton.experimental.gluon.nvidia.hopper import TensorDescriptor

    from flashtile.backends.sm90.tma_reduce import reduce_rate_kernel

    rows, d = 64, args.headdim
    n_q = n_k = args.seqlen // rows
    dq = torch.zeros(args.heads * args.seqlen, d, device="cuda")
    layout = gl.NVMMASharedLayout.get_default_for([rows, d], gl.float32)
    desc = TensorDescriptor(dq, list(dq.shape), list(dq.stride()), [rows, d], layout)
    grid = (args.heads * n_k,)
    pairs = args.heads * n_k * n_q
    reduced = pairs * rows * d * 4
    flops = pairs * 10 * rows * rows * d  # the 5 products of a (64 query x 64 key) tile pair
    print(f"# {torch.cuda.get_device_name()}: {args.heads} heads x {args.seqlen} rows x d{d}, "
          f"{pairs} tile pairs, {reduced / 1e9:.2f} GB of fp32 dQ added")
    variants = [("atomic_add", False, 1)] + [(f"tma reduce, {n} slot{'s' if n > 1 else ''}", True, n) for n in (1, 2, 3)]
    for name, use_tma, num_buf in variants:
        def run():
            reduce_rate_kernel[grid](desc, dq, dq.stride(0), n_q, n_k, ROWS=rows, COLS=d, USE_TMA=use_tma,
                                      NUM_BUF=num_buf)
        dq.zero_()
        run()
        torch.cuda.synchronize()
        pid = torch.arange(args.heads * n_k, device="cuda").view(args.heads, n_k)
        want = (pid.remainder(7) + 1).float().sum(1)  # every row of head h: one tile from each key block
        ok = torch.equal(dq.view(args.heads, args.seqlen, d), want[:, None, None].expand(args.heads, args.seqlen, d))
        ms = triton.testing.do_bench(run, warmup=10, rep=args.rep, return_mode="median")
        print(f"{name:22s} {ms * 1e3:9.1f} us  {reduced / ms / 1e6:7.0f} GB/s reduced  "
              f"=> {flops / ms / 1e9:6.0f} TF/s backward ceiling  sum {'ok' if ok else 'WRONG'}", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())

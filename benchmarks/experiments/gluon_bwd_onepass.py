"""Experiment driver (issue 17) for the one-pass Gluon backward, now library code
(``flashtile.backends.sm90.backward_onepass``: read its docstring): its ring sizes next to the
library's backward (which takes it at d64), the Triton backward and cuDNN; a compile
report for sm_90a on the CPU; one shape for Nsight Compute.

    PYTHONPATH=src python3 benchmarks/experiments/gluon_bwd_onepass.py               # GPU: check, time
    PYTHONPATH=src python3 benchmarks/experiments/gluon_bwd_onepass.py --compile     # CPU: sm_90a report
    ncu -k regex:onepass_kernel --launch-skip 1 --launch-count 1 \\
        python3 benchmarks/experiments/gluon_bwd_onepass.py --profile 128,4096,0     # one shape

Variants are (num_buf, dq_buf[, dq_swizzle[, q_rows]]): (Q, dO) ring slots, float32 dQ slots,
the dQ slots' swizzle in bytes (default, or -1, the library's ``DQ_SWIZZLE``; 32 has no bank
conflicts; ``native``: the accumulator's register order, no bank conflicts and one box per
half) and the queries per step (default, or -1, the library's ``Q_ROWS``). History (docs/
perf-notes.md, "One-pass backward"): runs 30-34 reduced dQ from the consumers' registers
(290-375 TF/s at d128); run 80 measured the L2's reduction rate alone (3.6 TB/s); runs
83-85 (session 16) the reducer warp: d64 1.03-1.09x the split kernels, d128 0.90-0.99x
with its register spills; run 96 (session 17), the loop's fixed tiles viewed anew each
step: d128 1.07-1.16x the split kernels, 0.95-1.06x cuDNN (`--variants 2,2`); run 205
(session 37), 128 queries per step at d64 (`--variants "4,2;2,2,-1,128"`, then 64 rows by
default): +12-14% without causal, +5-7% with it, now the default (`Q_ROWS`); run 214
(session 39), causal calls with their masked steps in a loop of their own: 17-33% slower
(the switch is gone; its code is bc7de7f's); run 218 (session 41), dQ in the accumulator's order
(`--variants "2,2;2,2,native"` before it was the default): d128 +3.8 to +5.8%, d64 +1.6 to
+7.2%, now the default (``DQ_SWIZZLE``). ``--deterministic`` (session 42): the kernel's
mode with dQ's sums in a fixed order, for its A/Bs and profiles. The A/B modes of those runs (no reductions,
red.v4 from registers, the serial consumer) are in git history
(benchmarks/experiments/gluon_bwd_onepass.py at 47aaad2). A fifth entry runs a variant in a
mode of its own: ``plain``, ``det`` (deterministic, the library's order), ``rot`` (deterministic,
each key block from a query tile of its own: session 43), ``asc`` (deterministic, every block
from the first tile): `--variants "2,2,-1,-1,plain;2,2,-1,-1,asc;2,2,-1,-1,rot"`, ``qsplit``
(d64: the warpgroups split each step's queries, ``backward_onepass.Q_SPLIT``: session 51,
`--variants "2,1;2,1,-1,-1,qsplit"`) or ``detsplit`` (that, deterministic). Causal shapes run
the deterministic modes in the causal order (rotation is for calls without causal).
"""

from __future__ import annotations

import argparse
import functools
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from gluon_bwd import run  # noqa: E402  (the library experiment's checks and timing)


# a variant's fifth entry: the mode (deterministic, rotate, q_split) it runs in
MODES = {"plain": (False, None, None), "det": (True, None, None), "rot": (True, True, None),
         "asc": (True, False, None), "qsplit": (False, None, True), "detsplit": (True, None, True)}


def onepass_launch(q, k, v, dout, lse, delta, dq, dk, dv, *, causal, diag, variant, deterministic=False):
    from flashtile.backends.sm90.backward_onepass import attention_backward_onepass

    num_buf, dq_buf, swizzle, q_rows, mode = _parts(variant)
    det, rotate, split = MODES[mode] if mode else (deterministic, None, None)
    if causal and rotate:  # rotated sums are for calls without causal: the causal order there
        rotate = None
    attention_backward_onepass(q, k, v, dout, lse, delta, dq, dk, dv, scale=q.shape[-1] ** -0.5,
                               diag_offset=diag, causal=causal, num_buf=num_buf, dq_buf=dq_buf,
                               dq_swizzle=swizzle, q_rows=q_rows, deterministic=det, rotate=rotate, q_split=split)


def _parts(variant):
    """(num_buf, dq_buf[, dq_swizzle[, q_rows[, mode]]]) -> the five, None for a missing or
    -1 entry (the library's ``DQ_SWIZZLE``, ``Q_ROWS``; the mode of ``--deterministic``)."""
    num_buf, dq_buf, *rest = variant
    if len(rest) > 3 or (len(rest) == 3 and rest[2] not in MODES) or any(x in MODES for x in rest[:2]):
        raise ValueError(f"a variant is num_buf,dq_buf[,dq_swizzle[,q_rows[,mode]]] with a mode of {list(MODES)} "
                         f"fifth (-1: the library's swizzle, queries per step), got {variant}")
    rest = [None if isinstance(x, int) and x < 0 else x for x in rest] + [None] * (3 - len(rest))
    return (num_buf, dq_buf, *rest)


def main(argv=None) -> int:
    p = argparse.ArgumentParser()
    p.add_argument("--variants", default="2,2",
                   help="num_buf,dq_buf[,dq_swizzle[,q_rows]];... (d128 fits 2,2 or 3,1; d64 2,2 "
                        "at its default 128 queries per step, 4,2,-1,64 at 64; -1 is the library's; "
                        "dq_swizzle 0, 32, 64, 128 or native)")
    p.add_argument("--shapes", default="128,4096,0;128,4096,1;128,16384,1;64,4096,0;64,16384,1;64,1024,0;128,1024,1",
                   help="headdim,seqlen,causal;...")
    p.add_argument("--compile", action="store_true",
                   help="no GPU: compile every (variant, head dim, causal) for sm_90a and report them")
    p.add_argument("--profile", metavar="D,S,CAUSAL",
                   help="GPU: the first variant on one timing shape, twice, no checks (for ncu --launch-skip 1)")
    p.add_argument("--deterministic", action="store_true",
                   help="the kernel's deterministic mode (dQ's sums in a fixed order: session 42)")
    args = p.parse_args(argv)
    launch = functools.partial(onepass_launch, deterministic=args.deterministic)
    variants = [tuple(x if x == "native" or x in MODES else int(x) for x in v.split(","))
                for v in args.variants.split(";")]
    shapes = [tuple(int(x) for x in sh.split(",")) for sh in args.shapes.split(";")]
    if args.compile:
        from flashtile.tools.sm90_check import compile_backward_onepass

        for variant in variants:
            num_buf, dq_buf, swizzle, q_rows, mode = _parts(variant)
            det, rotate, split = MODES[mode] if mode else (args.deterministic, None, None)
            for d in sorted({sh[0] for sh in shapes}):
                for causal in (False, True):
                    try:
                        c = compile_backward_onepass("bf16", d, causal=causal, num_buf=num_buf, dq_buf=dq_buf,
                                                     dq_swizzle=swizzle, q_rows=q_rows, deterministic=det,
                                                     rotate=bool(rotate) and not causal, q_split=split)
                        regs, spills = c.registers()
                        print(f"{c.name}: shared {c.shared} B, regs {regs}, spills {spills} B, bulk reduces "
                              f"{c.ptx.count('cp.reduce.async.bulk.tensor')}", flush=True)
                    except Exception as exc:  # noqa: BLE001  (an experiment: report and go on)
                        print(f"d{d} causal={causal} {num_buf},{dq_buf}: {type(exc).__name__}: {str(exc)[:300]}",
                              flush=True)
        return 0
    if args.profile:
        import torch

        D, S, causal = (int(x) for x in args.profile.split(","))
        B, H = 16384 // S, 2048 // D  # as run() times it
        q, k, v, dout = (torch.randn(B, H, S, D, device="cuda", dtype=torch.bfloat16) for _ in range(4))
        lse, delta = torch.randn(B, H, S, device="cuda").abs() + 5, torch.randn(B, H, S, device="cuda")
        grads = [torch.empty_like(x) for x in (q, k, v)]
        for _ in range(2):
            launch(q, k, v, dout, lse, delta, *grads, causal=bool(causal), diag=0, variant=variants[0])
        torch.cuda.synchronize()
        return 0
    run(variants, [(d, S, bool(c)) for d, S, c in shapes], launch=launch)
    return 0


if __name__ == "__main__":
    sys.exit(main())

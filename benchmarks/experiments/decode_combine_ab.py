"""Experiment (issue 38): where the decode kernel's fused combine loses its time.

    PYTHONPATH=src python3 benchmarks/experiments/decode_combine_ab.py        # GPU only

Runs 106, 115 and 125 (H100) found the decode kernel with the fused combine (the last split
of each group merges the partials: ``_last_split_combines``) slower than the decode kernel
plus ``combine_kernel``: B1 x 8192 cached, GQA 32/8, d128, 32 splits, 48-50 us against
17.8 us under Nsight Compute, with the same bytes moved, the same registers limit and SMs
active for 24k of the 77k elapsed cycles (20k of 26k without). PC sampling put only ~1% of
its samples in the merge. This script times the variants that split the cost apart, under
CUDA graphs (kernel time) and eagerly:

- ``decode``: the decode kernel alone (no combine: its output is not the answer);
- ``decode+combine``: the library's default under CUDA graphs and above 48 MiB of cache
  (two launches; ``decode.fuse_step``);
- ``fused``: the fused combine (one launch);
- ``fused-arrive``: the fused combine's arrival (the CTA barrier, the acq_rel atomic, the
  ticket broadcast) without any merge: the counters start at 2**30, so no ticket is ever a
  group's last;
- ``fused-eager-buffer``: the fused combine on one counter buffer made before capture (a
  graph otherwise zeroes a fresh one: ``runtime.replay.stream_counter``).
"""

from __future__ import annotations

import argparse


def run(variant: str, q, kc, vc, lens, out, lse, counters):
    """One decode call of ``variant`` (module docstring) into out, lse."""
    from flashtile.backends.triton import decode

    head_dim = q.shape[-1]
    kwargs = dict(new=0, scale=head_dim ** -0.5, softcap=0.0, window_left=-1, window_right=-1, interleaved=False,
                  rotary_local=False, num_splits=0)
    saved_counter, saved_combine = decode.stream_counter, decode.combine
    try:
        if variant == "decode":
            decode.combine = lambda *a, **k: None
        if variant in ("fused-arrive", "fused-eager-buffer"):
            decode.stream_counter = lambda device, size=1: counters
        decode.decode(q, kc, vc, out, lse, lens, None, None, None, None, None, None,
                      fused_combine=variant.startswith("fused"), **kwargs)
    finally:
        decode.stream_counter, decode.combine = saved_counter, saved_combine


VARIANTS = ("decode", "decode+combine", "fused", "fused-arrive", "fused-eager-buffer")
SHAPES = [(1, 4096), (1, 8192), (1, 32768), (4, 8192), (8, 4096), (16, 8192)]


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--rep", type=int, default=100)
    args = p.parse_args(argv)
    import torch
    from triton.testing import do_bench, do_bench_cudagraph

    torch.manual_seed(0)
    for batch, cached in SHAPES:
        q = torch.randn(batch, 1, 32, 128, device="cuda", dtype=torch.bfloat16)
        kc, vc = (torch.randn(batch, cached, 8, 128, device="cuda", dtype=torch.bfloat16) for _ in range(2))
        lens = torch.full((batch,), cached - 96, device="cuda", dtype=torch.int32)
        out = torch.empty_like(q)
        lse = torch.empty(batch, 32, 1, device="cuda", dtype=torch.float32)
        ref = torch.empty_like(q)
        run("decode+combine", q, kc, vc, lens, ref, lse, None)
        line = [f"B{batch:<2d} L{cached:<5d}"]
        for variant in VARIANTS:
            arrive = variant == "fused-arrive"
            counters = torch.full((4096,), 2 ** 30 if arrive else 0, device="cuda", dtype=torch.int32)
            run(variant, q, kc, vc, lens, out, lse, counters)
            if variant.startswith("fused") and not arrive:
                err = (out.float() - ref.float()).abs().max().item()
                if not err <= 1e-2:
                    print(f"{variant} B{batch} L{cached}: max |d out| {err:.2e} FAILED", flush=True)
                    return 1
            if arrive:
                counters.fill_(2 ** 30)
            graph = do_bench_cudagraph(lambda: run(variant, q, kc, vc, lens, out, lse, counters), rep=args.rep)
            eager = do_bench(lambda: run(variant, q, kc, vc, lens, out, lse, counters), rep=args.rep)
            line.append(f"{variant} {graph * 1e3:6.1f}/{eager * 1e3:6.1f}")
        print(" | ".join(line) + "   (us: graphs/eager)", flush=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())

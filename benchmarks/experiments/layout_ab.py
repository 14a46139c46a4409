"""Experiment (session 49): is the SDPA provider's slower long forward its path or its layout?

    PYTHONPATH=src python3 benchmarks/experiments/layout_ab.py [--shapes "128,16384,1"] [--rounds 3]   # GPU only

H100 run 257 (``bench --impl flashtile sdpa-flashtile``) read the provider's calls (SDPA on
(B, H, S, D) tensors, through aten into flashtile) 0.95-1.12x flashtile's direct call in the
forward at S2048-8192 but 0.82-0.91x at S16384 (batch 1), and 0.89-1.00x in the backward. The
two rows differ in two ways: the path (aten, the provider's checks) and the layout (the bench
gives the direct call (B, S, H, D) tensors, so the kernels read other strides). Per shape
(headdim, seqlen, causal; batch 16384 // seqlen, 2048 // headdim heads, bf16, as the bench),
alternating rounds of the ``do_bench`` median of:

- ``bshd``: ``flash_attn_func`` on (B, S, H, D) tensors (the bench's direct row);
- ``bhsd view``: ``flash_attn_func`` on (B, H, S, D) tensors seen as (B, S, H, D) views (the
  provider's layout without its path);
- ``provider``: SDPA with the provider on the (B, H, S, D) tensors (the bench's
  ``sdpa-flashtile`` row).

``bhsd view`` near ``provider``: the layout; near ``bshd``: the path.
"""

from __future__ import annotations

import argparse
import statistics


def rows(head_dim: int, seqlen: int, causal: bool, pass_: str) -> dict:
    """{row name: the call do_bench times} of one shape and pass (module docstring)."""
    import torch

    from flashtile.tools.bench.prefill import Shape, timed_call

    batch, heads = 16384 // seqlen, 2048 // head_dim
    shape = Shape(batch, heads, heads, seqlen, head_dim, causal, "bf16")
    bshd = [torch.randn(batch, seqlen, heads, head_dim, device="cuda", dtype=torch.bfloat16) for _ in range(3)]
    bhsd = [t.transpose(1, 2).contiguous() for t in bshd]
    return {"bshd": timed_call("flashtile", shape, pass_, bshd),
            "bhsd view": timed_call("flashtile", shape, pass_, [t.transpose(1, 2) for t in bhsd]),
            "provider": timed_call("sdpa-flashtile", shape, pass_, bhsd)}


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--shapes", default="128,16384,1;128,16384,0;64,16384,1;128,8192,1",
                   help="headdim,seqlen,causal;...")
    p.add_argument("--pass", dest="passes", nargs="+", default=["fwd", "bwd"], choices=["fwd", "bwd"])
    p.add_argument("--rounds", type=int, default=3)
    args = p.parse_args(argv)
    import torch
    from triton.testing import do_bench

    print(f"{torch.cuda.get_device_name()} torch {torch.__version__}", flush=True)
    for spec in args.shapes.split(";"):
        head_dim, seqlen, causal = (int(x) for x in spec.split(","))
        for pass_ in args.passes:
            calls = rows(head_dim, seqlen, bool(causal), pass_)
            times: dict[str, list[float]] = {name: [] for name in calls}
            for _ in range(args.rounds):
                for name, call in calls.items():
                    times[name].append(do_bench(call, warmup=25, rep=100, return_mode="median") * 1e3)
            med = {name: statistics.median(us) for name, us in times.items()}
            cells = "  ".join(f"{name} {us:8.1f} us ({med['bshd'] / us:.3f})" for name, us in med.items())
            print(f"d{head_dim} S{seqlen} causal={causal} {pass_}: {cells}   [speed against bshd in brackets]",
                  flush=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())

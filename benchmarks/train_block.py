"""Training step of one transformer block (GQA attention + MLP, bf16): flashtile vs SDPA.

    PYTHONPATH=src python3 benchmarks/train_block.py --seqlen 8192 --out $OUT/train-block.jsonl

Issue 4's end-to-end target: at seqlen 8192 the forward + backward of this block must be
faster with flashtile than with the fastest SDPA backend. Only the attention call differs
between the runs; weights, inputs and the upstream gradient are the same.

`--impls ... flashtile-deterministic no-attention` adds two context rows: flashtile's split
backward, and the block with attention replaced by its query (what the other layers cost;
each step's time minus it is that step's attention, forward + backward).

`--rounds N` times every impl N times in one process, the order rotated each round; each round's
attention is its step minus that round's no-attention step. The steps around attention move by a
few percent from row to row (run 253, five processes of one round each: flashtile's step 20.7-21.8
ms, so its attention 3.1-4.3 ms around 3.6 ms of kernels; one GEMM took 3310-3464 us a step in
the profiled rows). `--rep MS` is do_bench's (100: about five steps of 21 ms). The summary gives
the median over rounds of flashtile's attention / cuDNN's.

`--kernels STEPS` also times each step's kernels (``torch.profiler`` over STEPS eager steps):
their sum, the step minus it (gaps: the host and launch latency), and, with no-attention among
the impls, the kernels that step lacks (attention's own: its forward, backward and their
helpers) with their GPU time per step.

`--timeline STEPS` runs STEPS steps as `do_bench` times them (grads set to None, the L2 flushed
before each) under ``torch.profiler`` and reads the kernels' start and end times: the time
per step from the first kernel to the last, how much of it no kernel runs (the GPU idle:
waiting for the host or a sync), and the longest such gaps with the kernels around them.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys

import torch
import torch.nn.functional as F
from triton.testing import do_bench

import flashtile
from sweep_common import breakdown, device_events, device_us


class Block(torch.nn.Module):
    """Pre-norm block: RMSNorm -> GQA attention (causal) -> RMSNorm -> SwiGLU MLP."""

    def __init__(self, hidden: int, nheads: int, nheads_k: int, mlp: int):
        super().__init__()
        self.nheads, self.nheads_k, self.head_dim = nheads, nheads_k, hidden // nheads
        self.qkv = torch.nn.Linear(hidden, (nheads + 2 * nheads_k) * self.head_dim, bias=False)
        self.proj = torch.nn.Linear(hidden, hidden, bias=False)
        self.up = torch.nn.Linear(hidden, 2 * mlp, bias=False)
        self.down = torch.nn.Linear(mlp, hidden, bias=False)
        self.norm1 = torch.nn.RMSNorm(hidden)
        self.norm2 = torch.nn.RMSNorm(hidden)

    def forward(self, x, attention):
        B, S, _ = x.shape
        qkv = self.qkv(self.norm1(x))
        q, k, v = qkv.split([self.nheads * self.head_dim, self.nheads_k * self.head_dim,
                             self.nheads_k * self.head_dim], dim=-1)
        q = q.view(B, S, self.nheads, self.head_dim)
        k = k.view(B, S, self.nheads_k, self.head_dim)
        v = v.view(B, S, self.nheads_k, self.head_dim)
        x = x + self.proj(attention(q, k, v).reshape(B, S, -1))
        gate, up = self.up(self.norm2(x)).chunk(2, dim=-1)
        return x + self.down(F.silu(gate) * up)


def sdpa(backend):
    from torch.nn.attention import SDPBackend, sdpa_kernel

    def attention(q, k, v):
        with sdpa_kernel(getattr(SDPBackend, backend)):
            out = F.scaled_dot_product_attention(q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2),
                                                 is_causal=True, enable_gqa=True)
        return out.transpose(1, 2)

    return attention


def attention_kernels(per: dict[str, float], base: dict[str, float]) -> tuple[dict[str, float], float]:
    """A step's kernels that the no-attention step (``base``) does not launch ({name: us per
    step}), and how much longer the step keeps the GPU busy than ``base`` (us)."""
    return {k: us for k, us in per.items() if k not in base}, sum(per.values()) - sum(base.values())


def kernel_gaps(spans, least_us: float = 2.0, top: int = 6) -> tuple[float, float, list]:
    """Busy and idle microseconds of the GPU between the first start and the last end of
    ``spans`` ((start us, end us, name) of each kernel, memcpy or memset), and the ``top``
    longest idle gaps of at least ``least_us`` as (us, the kernel that ended last before it,
    the kernel after it), longest first."""
    spans = sorted(spans)
    if not spans:
        return 0.0, 0.0, []
    busy = idle = 0.0
    end, last, gaps = spans[0][0], None, []
    for start, stop, name in spans:
        if start > end:
            idle += start - end
            if start - end >= least_us:
                gaps.append((start - end, last, name))
        busy += max(0.0, stop - max(start, end))
        if stop >= end:
            end, last = stop, name
    return busy, idle, sorted(gaps, key=lambda g: -g[0])[:top]


def timeline(step, grads, steps: int) -> tuple[float, float, list]:
    """``kernel_gaps`` of ``steps`` calls of ``step`` as ``do_bench`` makes them (``grads``
    set to None and the L2 flushed before each), per step; the flush's own kernel counts as
    busy, the time between steps as idle."""
    from triton import runtime

    cache = runtime.driver.active.get_empty_cache_for_benchmark()

    def run():
        for _ in range(steps):
            for t in grads:
                t.grad = None
            runtime.driver.active.clear_cache(cache)
            step()

    busy, idle, gaps = kernel_gaps([(e.time_range.start, e.time_range.end, e.name) for e in device_events(run)])
    return busy / steps, idle / steps, gaps


def round_order(names: list, r: int) -> list:
    """The impls in round ``r``'s order: rotated by ``r``, so each takes each place in turn (the
    GPU's clocks and the allocator's state drift within a process)."""
    k = r % len(names) if names else 0
    return names[k:] + names[:k]


def attention_by_round(rows: list) -> dict:
    """{impl: [attention ms of each round]}: each round's step minus that round's no-attention
    step (rows carry ``round``; rounds without a no-attention row are left out)."""
    base = {r["round"]: r["ms"] for r in rows if r["impl"] == "no-attention"}
    att: dict = {}
    for r in rows:
        if r["impl"] != "no-attention" and r["round"] in base:
            att.setdefault(r["impl"], []).append(r["ms"] - base[r["round"]])
    return att


def summary(rows: list) -> list[str]:
    """Lines: each impl's median step, its median attention time, and the median over rounds of
    flashtile's attention / cuDNN's (issue 38's target: <= 0.87)."""
    lines, att = [], attention_by_round(rows)
    for impl in dict.fromkeys(r["impl"] for r in rows):
        ms = [r["ms"] for r in rows if r["impl"] == impl]
        a = att.get(impl)
        lines.append(f"{impl:26s} step median {statistics.median(ms):7.3f} ms over {len(ms)} rounds"
                     + (f"  attention median {statistics.median(a):6.3f} ms" if a else ""))
    f, c = att.get("flashtile"), att.get("sdpa-cudnn")
    if f and c:
        ratios = [a / b for a, b in zip(f, c)]
        lines.append(f"attention flashtile / cuDNN: median {statistics.median(ratios):.3f} over {len(ratios)} rounds "
                     f"(each: {' '.join(f'{x:.3f}' for x in ratios)}; target <= 0.87)")
    return lines


def main(argv=None) -> int:
    p = argparse.ArgumentParser()
    p.add_argument("--seqlen", type=int, default=8192)
    p.add_argument("--batch", type=int, default=1)
    p.add_argument("--hidden", type=int, default=4096)
    p.add_argument("--nheads", type=int, default=32)
    p.add_argument("--nheads-k", type=int, default=8)
    p.add_argument("--mlp", type=int, default=14336)
    p.add_argument("--out", default=None)
    p.add_argument("--rounds", type=int, default=1,
                   help="time every impl this many times in this process, the order rotated each round (module "
                        "docstring); with no-attention, each round's attention is its step minus that round's")
    p.add_argument("--rep", type=int, default=100, metavar="MS",
                   help="do_bench's rep: milliseconds of timed steps per impl and round (100: ~5 steps at S8192)")
    p.add_argument("--kernels", type=int, default=0, metavar="STEPS",
                   help="also each step's kernels over STEPS eager steps, in the first round "
                        "(torch.profiler; module docstring)")
    p.add_argument("--timeline", type=int, default=0, metavar="STEPS",
                   help="also the GPU's idle time inside STEPS do_bench-style steps, in the first round "
                        "(module docstring)")
    p.add_argument("--impls", nargs="+", default=["flashtile", "sdpa-flash", "sdpa-cudnn", "sdpa-efficient"],
                   choices=["flashtile", "sdpa-flash", "sdpa-cudnn", "sdpa-efficient", "flashtile-deterministic",
                            "no-attention"])
    args = p.parse_args(argv)
    if args.rounds < 1 or args.rep < 1:
        p.error(f"--rounds and --rep must be at least 1, got {args.rounds} and {args.rep}")
    torch.manual_seed(0)
    block = Block(args.hidden, args.nheads, args.nheads_k, args.mlp).cuda().to(torch.bfloat16)
    x = torch.randn(args.batch, args.seqlen, args.hidden, device="cuda", dtype=torch.bfloat16, requires_grad=True)
    g = torch.randn_like(x)
    impls = {"flashtile": lambda q, k, v: flashtile.flash_attn_func(q, k, v, causal=True),
             "sdpa-flash": sdpa("FLASH_ATTENTION"), "sdpa-cudnn": sdpa("CUDNN_ATTENTION"),
             "sdpa-efficient": sdpa("EFFICIENT_ATTENTION"),
             # Context rows, not peers: flashtile's split backward (the deterministic path), and
             # the block with attention replaced by its query (what every other layer costs).
             "flashtile-deterministic": lambda q, k, v: flashtile.flash_attn_func(q, k, v, causal=True,
                                                                                  deterministic=True),
             "no-attention": lambda q, k, v: q}
    impls = {name: impls[name] for name in args.impls}
    rows, skipped = [], set()
    for rnd in range(args.rounds):
        profiled = rnd == 0
        for name in round_order(list(impls), rnd):
            if name in skipped:
                continue
            attention = impls[name]

            def step():
                out = block(x, attention)
                torch.autograd.backward(out, g)
            try:
                step()
                ms = do_bench(step, warmup=25, rep=args.rep, return_mode="median",
                              grad_to_none=[x, *block.parameters()])
            except Exception as exc:  # noqa: BLE001  (a backend without a kernel for this shape)
                print(f"{name}: skipped ({type(exc).__name__}: {str(exc)[:160]})")
                skipped.add(name)
                continue
            per = device_us(lambda: [step() for _ in range(args.kernels)], args.kernels) \
                if args.kernels and profiled else {}
            row = dict(impl=name, bench="train_block", pass_="fwd_bwd", dtype="bf16", batch=args.batch,
                       seqlen=args.seqlen, hidden=args.hidden, nheads=args.nheads, nheads_k=args.nheads_k,
                       mlp=args.mlp, ms=ms, round=rnd, rep_ms=args.rep, gpu=torch.cuda.get_device_name(),
                       torch=torch.__version__, triton=__import__("triton").__version__)
            if per:
                row["kernels_us"] = per
            if args.timeline and profiled:
                busy, idle, gaps = timeline(step, [x, *block.parameters()], args.timeline)
                row["timeline_us"] = dict(busy=busy, idle=idle, gaps=gaps)
            rows.append(row)
            print(f"round {rnd} {name:24s} {ms:8.3f} ms")
            if per:
                print(f"{'':32s} {breakdown(ms * 1e3, per, 40)}")
            if "timeline_us" in row:
                print(f"{'':32s} timeline, per step: busy {busy:8.1f} us, idle {idle:7.1f} us; longest gaps: "
                      + ", ".join(f"{g:.1f} us ({a or '-'} -> {b})"[:120] for g, a, b in gaps))
    first = [r for r in rows if r["round"] == 0]
    best_sdpa = min((r["ms"] for r in first if r["impl"].startswith("sdpa-")), default=float("nan"))
    ours = next((r["ms"] for r in first if r["impl"] == "flashtile"), float("nan"))
    print(f"flashtile / fastest SDPA time (round 0): {ours / best_sdpa:.3f} (< 1 means flashtile is faster)")
    base = next((r.get("kernels_us") for r in first if r["impl"] == "no-attention"), None)
    if base is not None:  # attention's kernels: those the no-attention step does not launch
        for r in first:
            if r["impl"] != "no-attention" and "kernels_us" in r:
                own, extra = attention_kernels(r["kernels_us"], base)
                r["attention_kernels_us"] = own
                print(f"{r['impl']:24s} attention kernels {sum(own.values()):8.1f} us (GPU busy +{extra:.1f} us "
                      f"over no-attention): " + ", ".join(f"{k[:40]} {us:.1f}" for k, us in
                                                         sorted(own.items(), key=lambda kv: -kv[1])))
    for line in summary(rows):
        print(line)
    if args.out:
        with open(args.out, "a") as fh:
            for r in rows:
                fh.write(json.dumps(r) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())

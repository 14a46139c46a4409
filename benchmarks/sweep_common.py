"""What the config sweeps (sweep_fwd.py, sweep_bwd.py) share.

Peers are timed with ``flashtile.tools.bench.prefill``'s own calls, so a sweep and the benchmark measure
SDPA the same way. Each candidate gets one untimed call (its compile) and then the
do_bench median. ``Sweep`` prints a line per candidate, appends JSONL rows and reports
the best candidate per (shape, variant) at the end.
"""

from __future__ import annotations

import json
from collections import defaultdict
from typing import Any, Callable, Optional

from flashtile.tools.bench.prefill import Shape

PEERS = ("sdpa-cudnn", "sdpa-flash")


def do_bench_ms(fn: Callable[[], Any]) -> float:
    from triton.testing import do_bench

    return do_bench(fn, warmup=25, rep=100, return_mode="median")


def peer_ms(shape: Shape, pass_: str, q, k, v) -> dict[str, float]:
    """Median ms of each SDPA peer on (B, S, H, D) inputs; a peer that fails is printed and left out."""
    from flashtile.tools.bench.prefill import timed_call

    bhsd = [t.transpose(1, 2).contiguous() for t in (q, k, v)]
    peers = {}
    for name in PEERS:
        try:
            peers[name] = do_bench_ms(timed_call(name, shape, pass_, bhsd))
        except Exception as exc:  # noqa: BLE001  (a backend without a kernel for this shape)
            print(f"  {name} failed: {exc}"[:200])
    return peers


def canonical(q, k, v, causal: bool) -> tuple[Any, Any, Any, Any, Any, Any]:
    """(B, H, S, D) views of (B, S, H, D) inputs, fresh out/LSE buffers and the problem
    (``flashtile.problem.spec.Problem``: plain attention, causal top-left)."""
    from flashtile.backends import layout
    from flashtile.problem.spec import Problem

    q4, k4, v4 = (t.transpose(1, 2) for t in (q, k, v))
    problem = Problem(q.shape[-1] ** -0.5, 0, -1, 0 if causal else -1)
    return q4, k4, v4, layout.bshd_view(q4), layout.new_lse(q4), problem


def device_events(run) -> list:
    """The device's events (kernels, memcpys, memsets) of ``run()`` under ``torch.profiler``:
    each with its ``name``, ``time_range`` (us) and ``device_time_total`` (CUPTI records a
    replayed graph's kernels too)."""
    import torch
    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        run()
        torch.cuda.synchronize()
    return [e for e in prof.events() if e.device_type == torch.autograd.DeviceType.CUDA]


def device_us(run, calls: int) -> dict[str, float]:
    """{kernel name: device us per call} of ``run()``, which makes ``calls`` calls."""
    total: dict[str, float] = defaultdict(float)
    for event in device_events(run):
        total[event.name] += event.device_time_total
    return {name: us / calls for name, us in total.items()}


def breakdown(total_us: float, per: dict[str, float], width: int = 48) -> str:
    """``kernels`` (their sum), ``gaps`` (``total_us`` minus it) and each kernel, longest first."""
    busy = sum(per.values())
    parts = ", ".join(f"{name[:width]} {us:.2f}" for name, us in sorted(per.items(), key=lambda kv: -kv[1]))
    return f"kernels {busy:8.2f}  gaps {total_us - busy:6.2f}  [{parts}]"


class Sweep:
    """Candidates of one pass ("fwd" or "bwd") against the peers of each shape."""

    def __init__(self, pass_: str, out: Optional[str] = None):
        self.pass_ = pass_
        self.out = out
        self.best: dict[tuple, tuple[str, float, float, dict[str, float]]] = {}

    def time(self, shape: Shape, label: str, cfg_row: Any, fn: Callable[[], Any], peers: dict[str, float],
             variant: str = "") -> None:
        """Compile (one call), then time ``fn``; a candidate that fails is printed and skipped."""
        import torch

        try:
            fn()
            torch.cuda.synchronize()
            ms = do_bench_ms(fn)
        except Exception as exc:  # noqa: BLE001  (out of resources, unsupported tile)
            print(f"{shape.label()} {label}: failed {type(exc).__name__}: {str(exc)[:120]}", flush=True)
            return
        self.record(shape, label, cfg_row, ms, peers, variant)

    def record(self, shape: Shape, label: str, cfg_row: Any, ms: float, peers: dict[str, float],
               variant: str = "") -> None:
        tflops = shape.flops(self.pass_) / ms * 1e-9
        ratios = {name: peer / ms for name, peer in peers.items()}
        print(f"{shape.label()} {label}: {tflops:6.1f} TF/s  "
              + "  ".join(f"x{n}={r:.3f}" for n, r in ratios.items()), flush=True)
        key = (shape.headdim, shape.causal, shape.seqlen, variant)
        if key not in self.best or ms < self.best[key][1]:
            self.best[key] = (label, ms, tflops, ratios)
        if self.out:
            row = {"headdim": shape.headdim, "seqlen": shape.seqlen, "batch": shape.batch, "nheads": shape.nheads,
                   "causal": shape.causal, "dtype": shape.dtype, "cfg": cfg_row, "ms": ms, "tflops": tflops,
                   "peers_ms": peers}
            with open(self.out, "a") as fh:
                fh.write(json.dumps(row) + "\n")

    def peer_lines(self, shape: Shape, peers: dict[str, float]) -> None:
        for name, ms in peers.items():
            print(f"  peer {name}: {shape.flops(self.pass_) / ms * 1e-9:6.1f} TF/s", flush=True)

    def report(self) -> None:
        print("\nbest per shape:")
        for (d, causal, seqlen, variant), (label, _ms, tflops, ratios) in sorted(self.best.items()):
            print(f"d{d} causal={int(causal)} S{seqlen} {variant}: {label} {tflops:.1f} TF/s "
                  + " ".join(f"x{n}={r:.3f}" for n, r in ratios.items()))

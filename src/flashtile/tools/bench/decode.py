"""Decode benchmark: ``flashtile bench --decode``.

One decode step (seqlen_q new query tokens, no append) against a KV cache that holds
``seqlen_k`` valid tokens per sequence, bf16, d 128. The cost is reading the cache, so a row
reports bandwidth: bytes that must be read (K and V of every valid cached token, plus q and
the output) / time, next to the read ceiling of this GPU measured in the same process
(``torch.sum`` over 8 GiB: bytes read / time).

Implementations in the same run:
    flashtile    flash_attn_with_kvcache on the cache (contiguous rows, or pages of
                 ``page_size`` tokens through a shuffled block_table)
    sdpa-cudnn   torch SDPA (cuDNN) on (batch, nheads_k, seqlen_k, headdim) K/V, enable_gqa
    sdpa-flash   the same on the flash backend
Each in ``eager`` mode (``triton.testing.do_bench``: the GPU time of one call, the L2
flushed before each) and ``cuda_graph`` mode (``triton.testing.do_bench_cudagraph``: the
kernels alone, back to back) and ``eager_wall`` mode (``wall_ms``: eager calls back to back from
Python, one sync at the end: the wall time per step of an eager generation loop, the
host's cost where it exceeds the GPU's; ``eager`` rows leave the host out). The graph and
wall modes flush nothing, so a cache that fits in L2 (H100 and H200: 50 MB) would be read
partly from L2 on the next call; a model's next decode step reads another layer's cache.
Their rows therefore cycle through copies of the inputs until a cycle reads at least
``COLD_BYTES`` (``cold_copies``; ``--warm-l2``: one copy, as before session 29). Host cost
per eager call alone: ``benchmarks/host_overhead.py``.

Rows go to ``<out>/<tag>.jsonl`` with ``pass: decode``; a summary markdown next to them.
"""

from __future__ import annotations

import argparse
import datetime
import itertools
import statistics
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from flashtile.tools.bench.common import RowWriter, gpu_slug, reason, run_info

IMPLS = ("flashtile", "sdpa-cudnn", "sdpa-flash")
MODES = ("eager", "cuda_graph", "eager_wall")


@dataclass(frozen=True)
class DecodeShape:
    batch: int
    seqlen_k: int
    nheads: int = 32
    nheads_k: int = 8
    headdim: int = 128
    seqlen_q: int = 1
    page_size: int = 0  # 0: contiguous cache rows

    def label(self) -> str:
        page = f" page {self.page_size}" if self.page_size else ""
        return (f"B{self.batch} L{self.seqlen_k} H{self.nheads}/{self.nheads_k} d{self.headdim} "
                f"q{self.seqlen_q}{page}")

    def bytes(self) -> int:
        """K and V of the valid cache, plus q and out (bf16)."""
        kv = 2 * self.batch * self.seqlen_k * self.nheads_k * self.headdim
        qo = 2 * self.batch * self.seqlen_q * self.nheads * self.headdim
        return 2 * (kv + qo)


# A graph row's inputs cycle through copies until one cycle reads this much: 5x an H100's or
# H200's L2 (50 MB), so no replay finds its cache there.
COLD_BYTES = 256 << 20


def cold_copies(shape: "DecodeShape") -> int:
    """Copies of a graph row's inputs (``COLD_BYTES``): 16 at B1 x 4096 (16 MiB), 1 from
    256 MiB on."""
    return max(1, -(-COLD_BYTES // shape.bytes()))


def copies_for(shape: "DecodeShape", mode: str, warm_l2: bool) -> int:
    """The sets of inputs a row of ``mode`` cycles through: ``cold_copies`` for a graph or
    wall row, one for an eager row (do_bench flushes L2 before each call) or with ``warm_l2``."""
    return cold_copies(shape) if mode != "eager" and not warm_l2 else 1


SMALL_BATCHES = (1, 2, 4)
SMALL_BATCH_LENGTHS = (4096, 8192, 16384, 32768)


def shapes() -> list[DecodeShape]:
    """BENCHMARKS.md's decode shapes, MHA, speculative (4 queries), paged caches, then
    small batches (1, 2, 4 at 4k-32k cached tokens: issue 38's split heuristic), page 16
    next to contiguous rows at batch 4."""
    base = [DecodeShape(8, 4096), DecodeShape(8, 32768), DecodeShape(1, 131072), DecodeShape(64, 8192)]
    extra = [DecodeShape(8, 32768, nheads_k=32), DecodeShape(8, 32768, seqlen_q=4),
             DecodeShape(8, 32768, page_size=16), DecodeShape(8, 32768, page_size=256),
             DecodeShape(64, 8192, page_size=16), DecodeShape(64, 8192, page_size=256)]
    small = [DecodeShape(b, n) for b in SMALL_BATCHES for n in SMALL_BATCH_LENGTHS]
    small += [DecodeShape(4, n, page_size=16) for n in SMALL_BATCH_LENGTHS]
    return base + extra + small


def build(impl: str, shape: DecodeShape, num_splits: int = 0, append: bool = False, copies: int = 1):
    """A call that runs one decode step of ``impl`` on fresh inputs of ``shape`` (more than
    one query token: causal, bottom-right). ``append``: flashtile's step also appends the
    new tokens' keys and values (a generation step; the same positions every call, so the
    cache holds ``seqlen_k`` valid tokens after each); the SDPA peers have no cache.
    ``copies``: each call takes the next of that many sets of inputs (captured in a graph,
    each captured call keeps the set it took)."""
    calls = [_build_one(impl, shape, num_splits, append) for _ in range(copies)]
    if copies == 1:
        return calls[0]
    turn = itertools.cycle(calls)
    return lambda: next(turn)()


def _build_one(impl: str, shape: DecodeShape, num_splits: int, append: bool):
    import torch

    import flashtile

    g = torch.Generator(device="cuda").manual_seed(0)
    dev, dt = "cuda", torch.bfloat16
    b, L, h, hk, d, sq = shape.batch, shape.seqlen_k, shape.nheads, shape.nheads_k, shape.headdim, shape.seqlen_q
    q = torch.randn(b, sq, h, d, device=dev, dtype=dt, generator=g)
    if impl == "flashtile":
        seqlens = torch.full((b,), L - sq if append else L, dtype=torch.int32, device=dev)
        new = {}
        if append:
            new = dict(k=torch.randn(b, sq, hk, d, device=dev, dtype=dt, generator=g))
            new["v"] = torch.randn_like(new["k"])
        if shape.page_size:
            per_seq = -(-L // shape.page_size)
            blocks = b * per_seq
            kc = torch.randn(blocks, shape.page_size, hk, d, device=dev, dtype=dt, generator=g)
            vc = torch.randn_like(kc)
            table = torch.randperm(blocks, device=dev, generator=g).reshape(b, per_seq).to(torch.int32)
            return lambda: flashtile.flash_attn_with_kvcache(q, kc, vc, cache_seqlens=seqlens, block_table=table,
                                                             causal=sq > 1, num_splits=num_splits, **new)
        kc = torch.randn(b, L, hk, d, device=dev, dtype=dt, generator=g)
        vc = torch.randn_like(kc)
        return lambda: flashtile.flash_attn_with_kvcache(q, kc, vc, cache_seqlens=seqlens, causal=sq > 1,
                                                         num_splits=num_splits, **new)
    if shape.page_size:
        raise RuntimeError("SDPA has no paged cache")
    from torch.nn.attention import SDPBackend, sdpa_kernel

    backend = {"sdpa-cudnn": SDPBackend.CUDNN_ATTENTION, "sdpa-flash": SDPBackend.FLASH_ATTENTION}[impl]
    kt = torch.randn(b, hk, L, d, device=dev, dtype=dt, generator=g)
    vt = torch.randn_like(kt)
    qt = q.transpose(1, 2)
    causal = sq > 1  # speculative queries: bottom-right causal would need an explicit mask for SDPA

    def call():
        with sdpa_kernel(backend):
            if causal:
                # the last sq keys are the new tokens: query i sees keys [0, L - sq + i]
                return torch.nn.functional.scaled_dot_product_attention(qt, kt, vt, attn_mask=mask, enable_gqa=True)
            return torch.nn.functional.scaled_dot_product_attention(qt, kt, vt, enable_gqa=True)

    mask = None
    if causal:
        i = torch.arange(sq, device=dev)[:, None]
        j = torch.arange(L, device=dev)[None, :]
        mask = j <= L - sq + i
    return call


def read_ceiling(gib: float = 8.0) -> float:
    """TB/s of ``torch.sum`` over ``gib`` GiB of bf16 (a read-only reduction)."""
    import torch
    import triton.testing

    held = [torch.ones(int(gib * 2**30) // 2, dtype=torch.bfloat16, device="cuda")]
    ms = triton.testing.do_bench(lambda: held[0].sum(dtype=torch.float32), warmup=5, rep=50, return_mode="median")
    held.clear()  # freed before empty_cache
    torch.cuda.empty_cache()
    return gib * 2**30 / (ms * 1e-3) / 1e12


WALL_CALLS, WALL_BLOCKS = 200, 5


def wall_ms(call, calls: int = WALL_CALLS, blocks: int = WALL_BLOCKS) -> float:
    """Median over ``blocks`` of the wall ms per call of ``calls`` calls enqueued back to back
    with one sync at the end: max(host, GPU) per step once the queue is in its steady state."""
    import torch

    per_call = []
    for _ in range(blocks):
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        for _ in range(calls):
            call()
        torch.cuda.synchronize()
        per_call.append((time.perf_counter() - t0) * 1e3 / calls)
    return statistics.median(per_call)


def measure(impl: str, shape: DecodeShape, mode: str, warmup: int, rep: int, num_splits: int = 0,
            append: bool = False, warm_l2: bool = False) -> float:
    """Median ms of one step; graph and wall rows read cold inputs unless ``warm_l2`` (module
    docstring). ``warmup`` and ``rep`` are do_bench's ms; a wall row takes ``warmup`` calls
    first, then ``wall_ms``'s blocks."""
    import torch
    import triton.testing

    call = build(impl, shape, num_splits, append, copies_for(shape, mode, warm_l2))
    with torch.no_grad():
        call()
        torch.cuda.synchronize()
        if mode == "cuda_graph":
            return triton.testing.do_bench_cudagraph(call, rep=rep, return_mode="median")
        if mode == "eager_wall":
            for _ in range(warmup):
                call()
            return wall_ms(call)
        return triton.testing.do_bench(call, warmup=warmup, rep=rep, return_mode="median")


def summary_markdown(rows: list[dict[str, Any]], ceiling: float) -> str:
    keys = []
    for r in rows:
        k = (r["label"], r["mode"])
        if k not in keys:
            keys.append(k)

    def tb(key, impl):
        r = next((r for r in rows if (r["label"], r["mode"]) == key and r["impl"] == impl), None)
        return None if r is None or r.get("tb_per_s") is None else r["tb_per_s"]

    lines = [f"read ceiling (torch.sum over 8 GiB): {ceiling:.2f} TB/s\n",
             "| shape | mode | flashtile TB/s | % ceiling | sdpa-cudnn | sdpa-flash | vs cudnn | vs flash |",
             "|---|---|---|---|---|---|---|---|"]
    for key in keys:
        f, c, fl = tb(key, "flashtile"), tb(key, "sdpa-cudnn"), tb(key, "sdpa-flash")

        def fmt(x):
            return "-" if x is None else f"{x:.2f}"

        def ratio(a, b_):
            return "-" if a is None or b_ is None else f"{a / b_:.2f}"

        pct = "-" if f is None else f"{100 * f / ceiling:.0f}%"
        lines.append(f"| {key[0]} | {key[1]} | {fmt(f)} | {pct} | {fmt(c)} | {fmt(fl)} | {ratio(f, c)} | "
                     f"{ratio(f, fl)} |")
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="flashtile bench --decode", description=__doc__.split("\n\n")[0])
    p.add_argument("--decode", action="store_true", help=argparse.SUPPRESS)
    p.add_argument("--impl", choices=IMPLS, nargs="+", default=list(IMPLS))
    p.add_argument("--mode", choices=MODES, nargs="+", default=list(MODES))
    p.add_argument("--only", nargs="+", type=int, help="indices into the shape list (see --dry-run)")
    p.add_argument("--out", type=Path)
    p.add_argument("--tag")
    p.add_argument("--warmup", type=int, default=25)
    p.add_argument("--rep", type=int, default=100)
    p.add_argument("--dry-run", action="store_true", help="print the shapes and their bytes only")
    p.add_argument("--append", action="store_true",
                   help="flashtile's steps also append the new tokens (a generation step; rows say append: true)")
    p.add_argument("--warm-l2", action="store_true",
                   help="graph and wall rows take one set of inputs (a cache under 50 MB then partly read from L2)")
    args = p.parse_args(argv)
    todo = shapes()
    if args.only:
        todo = [todo[i] for i in args.only]
    for i, s in enumerate(todo):
        print(f"{i}: {s.label()}: {s.bytes() / 2**20:.1f} MiB to read, {cold_copies(s)} graph copies")
    if args.dry_run:
        return 0
    import torch

    if not torch.cuda.is_available():
        p.error("no CUDA device (use --dry-run to see the plan)")
    info = run_info(False)
    tag = args.tag or f"bench-decode-{datetime.datetime.now():%Y-%m-%d-%H%M}"
    out = args.out or Path("benchmarks/results") / gpu_slug(info.gpu)
    writer = RowWriter(out / f"{tag}.jsonl")
    ceiling = read_ceiling()
    print(f"read ceiling: {ceiling:.2f} TB/s", flush=True)
    for shape in todo:
        for mode in args.mode:
            for impl in args.impl:
                row = {"impl": impl, "pass": "decode", "mode": mode, "label": shape.label(), "dtype": "bf16",
                       "batch": shape.batch, "seqlen_q": shape.seqlen_q, "seqlen_k": shape.seqlen_k,
                       "nheads": shape.nheads, "nheads_k": shape.nheads_k, "headdim": shape.headdim,
                       "page_size": shape.page_size, "bytes": shape.bytes(), "ms": None, "tb_per_s": None,
                       "ceiling_tb_per_s": ceiling, "append": args.append and impl == "flashtile",
                       "l2": "warm" if args.warm_l2 and mode != "eager" else "cold",
                       "copies": copies_for(shape, mode, args.warm_l2),
                       **info.row_fields()}
                try:
                    ms = measure(impl, shape, mode, args.warmup, args.rep, append=args.append, warm_l2=args.warm_l2)
                    row["ms"] = ms
                    row["tb_per_s"] = shape.bytes() / (ms * 1e-3) / 1e12
                except Exception as err:
                    row["skipped"] = reason(err)
                torch.cuda.empty_cache()
                writer.write(row)
                what = row.get("skipped") or f"{row['ms'] * 1e3:8.1f} us {row['tb_per_s']:5.2f} TB/s"
                print(f"{shape.label():40s} {mode:10s} {impl:11s} {what}", flush=True)
    summary = summary_markdown(writer.rows, ceiling)
    (out / f"{tag}-summary.md").write_text(
        f"# {tag}: {info.gpu}, torch {info.torch}, triton {info.triton}, flashtile {info.commit}\n\n"
        f"Decode bandwidth: bytes that must be read (K, V of the valid cache, q, out) / time, bf16; "
        f"graph and wall rows {'on one set of inputs (L2 warm)' if args.warm_l2 else 'on cold inputs (cold_copies)'}; "
        f"eager_wall: wall time per step of eager calls back to back (the host included).\n\n"
        + summary)
    print(summary, flush=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())

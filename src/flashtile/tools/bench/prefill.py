"""Prefill attention benchmark: flashtile against torch SDPA backends, FlexAttention and naive.

Shapes follow the FlashAttention papers (see BENCHMARKS.md): hidden size 2048, so
``nheads = 2048 // headdim``, and 16384 tokens per batch, so ``batch = 16384 // seqlen``.
Every measurement is one long-format JSON row appended (and flushed) to
``<out>/<tag>.jsonl``; the summary table and the PNG plots are drawn from those rows.

    python -m flashtile.tools.bench --quick --pass fwd bwd --out $OUT/bench
    python -m flashtile.tools.bench --dry-run            # no CUDA: the plan and fake rows
    python -m flashtile.tools.bench --plot-only FILE.jsonl
"""
from __future__ import annotations

import argparse
import datetime
import sys
import tempfile
import time
from dataclasses import dataclass
from functools import partial
from pathlib import Path
from typing import Any, Callable, Iterable

from flashtile.tools.bench.common import (HIDDEN, SDPA_BACKENDS, TOKENS, RowWriter, compiled_flex, gpu_slug, read_rows,
                                          reason, run_info)
from flashtile.traffic import attention_flops

IMPLS = ("flashtile", "sdpa-flash", "sdpa-cudnn", "sdpa-efficient", "flex", "naive", "sdpa-flashtile",
         "flashtile-det")
# On request: sdpa-flashtile (SDPA's flash backend through flashtile's provider) and
# flashtile-det (flashtile with deterministic=True: the one-pass kernel's ordered dQ sums, or the
# split kernels for causal calls below 2048 queries).
DEFAULT_IMPLS = IMPLS[:-2]
DIRECT = ("flashtile", "flashtile-det")  # flashtile's own API: (B, S, H, D) inputs
PASSES = ("fwd", "bwd", "fwd_bwd")
_DTYPES = ("fp16", "bf16")
# naive materialises the fp32 softmax: above this it is minutes per call or an OOM.
NAIVE_SCORES_LIMIT_BYTES = 40 * 2**30
# Dry-run only: plausible H200 fp16 rates so summaries and plots look like real ones.
_FAKE_TFLOPS = {"flashtile": 450.0, "sdpa-flash": 320.0, "sdpa-cudnn": 560.0,
                "sdpa-efficient": 165.0, "flex": 420.0, "naive": 40.0, "sdpa-flashtile": 440.0,
                "flashtile-det": 420.0}


class SkipMeasurement(Exception):
    """Raised when a measurement is known not to run (the reason goes into the row)."""


@dataclass(frozen=True)
class Shape:
    """One attention problem; q is (batch, seqlen, nheads, headdim), k/v use nheads_k."""

    batch: int
    nheads: int
    nheads_k: int
    seqlen: int
    headdim: int
    causal: bool
    dtype: str  # "fp16" | "bf16"

    def label(self) -> str:
        heads = f"H{self.nheads}" + (f"/{self.nheads_k}" if self.nheads_k != self.nheads else "")
        return f"d{self.headdim} S{self.seqlen} B{self.batch} {heads} {'causal' if self.causal else 'full'} {self.dtype}"

    def row_fields(self) -> dict[str, Any]:
        return {"dtype": self.dtype, "batch": self.batch, "nheads": self.nheads,
                "nheads_k": self.nheads_k, "seqlen_q": self.seqlen, "seqlen_k": self.seqlen,
                "headdim": self.headdim, "causal": self.causal}

    def flops(self, pass_: str) -> float:
        return attention_flops(self.batch, self.nheads, self.seqlen, self.seqlen,
                               self.headdim, causal=self.causal, pass_=pass_)

    def scores_bytes(self) -> int:
        """Bytes of the fp32 (batch, nheads, seqlen, seqlen) matrix naive attention builds."""
        return self.batch * self.nheads * self.seqlen * self.seqlen * 4


def make_shape(seqlen: int, headdim: int, causal: bool, dtype: str, batch: int | None = None,
               gqa: int = 1) -> Shape:
    """The sweep's shape: hidden 2048 (nheads = 2048 // headdim), 16384 tokens; MHA, or GQA
    with ``gqa`` query heads per key/value head (nheads_k = nheads // gqa)."""
    nheads = HIDDEN // headdim
    if gqa < 1 or nheads % gqa:
        raise ValueError(f"gqa must divide nheads = {nheads} (headdim {headdim}), got {gqa}")
    return Shape(batch if batch is not None else max(1, TOKENS // seqlen),
                 nheads, nheads // gqa, seqlen, headdim, causal, dtype)


def _provider(on: bool) -> None:
    """flashtile's SDPA provider active for "sdpa-flashtile" and off for PyTorch's own
    backends, from the building of an impl's call until the next impl's (its backward too)."""
    from flashtile.integrations import torch_sdpa
    if on != torch_sdpa.active():
        (torch_sdpa.activate if on else torch_sdpa.deactivate)()


def build_forward(impl: str, shape: Shape, q: Any, k: Any, v: Any) -> Callable[[], Any]:
    """A zero-argument forward call for `impl`. q/k/v are (B, S, H, D) for flashtile and
    (B, H, S, D) contiguous for every other impl; the output has the same layout."""
    import torch
    causal = shape.causal
    gqa = shape.nheads_k != shape.nheads
    if impl in DIRECT:
        import flashtile
        deterministic = impl == "flashtile-det"
        return lambda: flashtile.flash_attn_func(q, k, v, causal=causal, deterministic=deterministic)
    if impl in SDPA_BACKENDS or impl == "sdpa-flashtile":
        from torch.nn.attention import SDPBackend, sdpa_kernel
        backend = getattr(SDPBackend, SDPA_BACKENDS.get(impl, "FLASH_ATTENTION"))
        _provider(impl == "sdpa-flashtile")

        def sdpa() -> Any:
            with sdpa_kernel(backend):
                return torch.nn.functional.scaled_dot_product_attention(q, k, v, is_causal=causal, enable_gqa=gqa)
        return sdpa
    if impl == "flex":
        from torch.nn.attention.flex_attention import create_block_mask
        flex = compiled_flex()
        mask = (create_block_mask(lambda b, h, qi, kv: qi >= kv, None, None,
                                  shape.seqlen, shape.seqlen, device=q.device) if causal else None)
        return lambda: flex(q, k, v, block_mask=mask, enable_gqa=gqa)
    if impl == "naive":
        if shape.scores_bytes() > NAIVE_SCORES_LIMIT_BYTES:
            raise SkipMeasurement(f"naive: fp32 scores need {shape.scores_bytes() / 2**30:.0f} GiB "
                                  f"> {NAIVE_SCORES_LIMIT_BYTES // 2**30} GiB")
        scale = shape.headdim ** -0.5
        above = (torch.ones(shape.seqlen, shape.seqlen, dtype=torch.bool, device=q.device).triu(1)
                 if causal else None)

        group = shape.nheads // shape.nheads_k

        def naive() -> Any:
            kk, vv = (t.repeat_interleave(group, dim=1) for t in (k, v)) if gqa else (k, v)
            scores = (q @ kk.transpose(-2, -1)) * scale
            if above is not None:
                scores = scores.masked_fill(above, float("-inf"))
            return torch.softmax(scores.float(), dim=-1).to(q.dtype) @ vv
        return naive
    raise ValueError(f"unknown impl {impl!r}")


def _first(out: Any) -> Any:
    return out[0] if isinstance(out, (tuple, list)) else out


def _sync_wall(fn: Callable[[], Any]) -> tuple[Any, float]:
    import torch
    torch.cuda.synchronize()
    start = time.perf_counter()
    out = fn()
    torch.cuda.synchronize()
    return out, time.perf_counter() - start


def _reference_slice(shape: Shape, q: Any, k: Any, v: Any) -> Any:
    """fp32 attention for the last batch element and last head, (S, D): an offset slice, so
    stride bugs show. q/k/v are (B, S, H, D)."""
    import torch
    qs, ks, vs = (t[-1, :, -1, :].float() for t in (q, k, v))
    scores = (qs @ ks.T) * shape.headdim ** -0.5
    if shape.causal:
        scores.masked_fill_(torch.ones_like(scores, dtype=torch.bool).triu(1), float("-inf"))
    return torch.softmax(scores, dim=-1) @ vs


def measure_shape(shape: Shape, impls: list[str], passes: list[str], warmup: int, rep: int,
                  emit: Callable[[str, str, dict[str, Any]], None], cuda_graph: bool = False) -> None:
    """Every (impl, pass) for one shape on CUDA. `emit(impl, pass, fields)` writes a row.
    Per impl: one untimed-by-do_bench first forward (wall time -> first_call row, output ->
    max_abs_diff against the fp32 slice), then do_bench median of each pass; with
    ``cuda_graph``, do_bench_cudagraph's (the calls captured once and replayed: no host
    cost, the kernels' own time; a bwd row is forward + backward less the forward; rows
    carry ``"cuda_graph": true``)."""
    import torch
    import triton.testing
    dt = {"fp16": torch.float16, "bf16": torch.bfloat16}[shape.dtype]
    torch.manual_seed(0)
    bshd = [torch.randn(shape.batch, shape.seqlen, h, shape.headdim, dtype=dt, device="cuda")
            for h in (shape.nheads, shape.nheads_k, shape.nheads_k)]
    bhsd = [t.transpose(1, 2).contiguous() for t in bshd]
    ref = _reference_slice(shape, *bshd)
    for impl in impls:
        inputs = bshd if impl in DIRECT else bhsd
        try:
            out, first_s = _sync_wall(build_forward(impl, shape, *inputs))
            out = _first(out)
            got = out[-1, :, -1, :] if impl in DIRECT else out[-1, -1]
            diff = (got.float() - ref).abs().max().item()
            del out, got
            emit(impl, "first_call", {"first_call_s": first_s, "max_abs_diff": diff})
            failed = ""
        except Exception as err:  # unsupported shape/backend: skip every pass of this impl
            failed = reason(err)
        if failed:  # outside the except block, so the traceback no longer pins OOM'd tensors
            torch.cuda.empty_cache()
            for pass_ in passes:
                emit(impl, pass_, {"skipped": failed, "max_abs_diff": None})
            continue
        for pass_ in passes:
            try:
                fn = timed_call(impl, shape, pass_, inputs)
                if cuda_graph and pass_ == "bwd":
                    # autograd runs a backward on its forward's stream, and do_bench_cudagraph
                    # captures on a side stream: capture forward + backward, less the forward
                    graph = lambda p: triton.testing.do_bench_cudagraph(
                        timed_call(impl, shape, p, inputs), rep=rep, return_mode="median")
                    ms = graph("fwd_bwd") - graph("fwd")
                elif cuda_graph:
                    ms = triton.testing.do_bench_cudagraph(fn, rep=rep, return_mode="median")
                else:
                    ms = triton.testing.do_bench(fn, warmup=warmup, rep=rep, return_mode="median")
                emit(impl, pass_, {"ms": ms, "max_abs_diff": diff, **({"cuda_graph": True} if cuda_graph else {})})
            except Exception as err:  # e.g. flashtile's NotImplementedError backward, OOM
                emit(impl, pass_, {"skipped": reason(err), "max_abs_diff": diff})
            torch.cuda.empty_cache()
    del bshd, bhsd, ref
    torch.cuda.empty_cache()


def timed_call(impl: str, shape: Shape, pass_: str, inputs: list[Any]) -> Callable[[], Any]:
    """What do_bench times: the forward, the backward on a retained graph, or both."""
    import torch
    if pass_ == "fwd":
        return build_forward(impl, shape, *inputs)
    leaves = tuple(t.detach().requires_grad_(True) for t in inputs)
    forward = build_forward(impl, shape, *leaves)
    out = _first(forward())
    dout = torch.randn_like(out)
    if pass_ == "bwd":
        return lambda: torch.autograd.grad(out, leaves, dout, retain_graph=True)
    return lambda: torch.autograd.grad(_first(forward()), leaves, dout)


def memory_rows(shape: Shape, impls: list[str], emit: Callable[[str, str, dict[str, Any]], None]) -> None:
    """fwd_mem rows: peak memory (MiB) one forward allocates beyond its inputs; fwd_bwd_mem
    rows: the same for one training step (forward, then the gradients of q, k and v for a
    given upstream gradient). Measured after a warm-up call so compilation and autotuning
    buffers stay out of the peak. ``output_lse_mib`` / ``out_lse_grads_mib``: what a fused
    kernel must allocate at least (out and LSE; plus dq, dk, dv)."""
    import torch
    dt = {"fp16": torch.float16, "bf16": torch.bfloat16}[shape.dtype]
    for impl in impls:
        dims = [(shape.batch, shape.seqlen, h, shape.headdim) if impl in DIRECT
                else (shape.batch, h, shape.seqlen, shape.headdim)
                for h in (shape.nheads, shape.nheads_k, shape.nheads_k)]
        for pass_ in ("fwd_mem", "fwd_bwd_mem"):
            train = pass_ == "fwd_bwd_mem"
            try:
                q, k, v = (torch.randn(*dim, dtype=dt, device="cuda", requires_grad=train) for dim in dims)
                forward = build_forward(impl, shape, q, k, v)
                dout = torch.randn_like(q) if train else None

                def step(q=q, k=k, v=v, dout=dout, forward=forward):  # bound: the names are deleted below
                    out = _first(forward())
                    return torch.autograd.grad(out, (q, k, v), dout) if train else out

                step()
                torch.cuda.synchronize()
                torch.cuda.empty_cache()
                torch.cuda.reset_peak_memory_stats()
                base = torch.cuda.memory_allocated()
                result = step()
                torch.cuda.synchronize()
                fields = {"extra_mib": (torch.cuda.max_memory_allocated() - base) / 2**20}
                fields["out_lse_grads_mib" if train else "output_lse_mib"] = (
                    output_lse_mib(shape) + (_grads_mib(shape) if train else 0.0))
                del result, forward, q, k, v, dout, step
            except Exception as err:
                fields = {"skipped": reason(err)}
            torch.cuda.empty_cache()
            emit(impl, pass_, fields)


def _tensor_mib(shape: Shape) -> float:
    """One (B, S, H, D) 2-byte tensor (q, or a gradient of it), MiB."""
    return shape.batch * shape.seqlen * shape.nheads * shape.headdim * 2 / 2**20


def _grads_mib(shape: Shape) -> float:
    """dq, dk and dv (2-byte; dk and dv have nheads_k heads), MiB."""
    return _tensor_mib(shape) * (shape.nheads + 2 * shape.nheads_k) / shape.nheads


def output_lse_mib(shape: Shape) -> float:
    """Size of what a fused forward must write: the output plus the fp32 log-sum-exp."""
    return _tensor_mib(shape) + shape.batch * shape.nheads * shape.seqlen * 4 / 2**20


# ---------------------------------------------------------------- tables and plots
def _last_by_key(rows: list[dict[str, Any]], keys: tuple[str, ...]) -> dict[tuple, dict[str, Any]]:
    return {tuple(r.get(k) for k in keys): r for r in rows}


def summary_markdown(rows: list[dict[str, Any]]) -> str:
    """TFLOP/s per shape (one column per impl) with flashtile's ratio to sdpa-flash and
    sdpa-cudnn; first-call seconds and forward and training-step memory tables when those
    rows exist."""
    shape_keys = ("headdim", "seqlen_q", "batch", "causal", "dtype", "pass")
    timed = [r for r in rows if r["pass"] in PASSES]
    impls = [i for i in IMPLS if any(r["impl"] == i for r in rows)]
    cells = _last_by_key(timed, shape_keys + ("impl",))

    def tf(key: tuple, impl: str) -> str:
        row = cells.get(key + (impl,))
        return "" if row is None else ("skip" if row.get("skipped") else f"{row['tflops']:.0f}")

    def ratio(key: tuple, peer: str, impl: str = "flashtile") -> str:
        a, b = cells.get(key + (impl,)), cells.get(key + (peer,))
        ok = a and b and a.get("tflops") and b.get("tflops")
        return f"{a['tflops'] / b['tflops']:.2f}x" if ok else ""

    def diff(key: tuple) -> str:
        value = (cells.get(key + ("flashtile",)) or {}).get("max_abs_diff")
        return f"{value:.1e}" if isinstance(value, (int, float)) else str(value or "")

    lines: list[str] = []
    for pass_name, field, unit, fmt in (("first_call", "first_call_s", "first call, s", ".2f"),
                                        ("fwd_mem", "extra_mib", "fwd extra memory, MiB", ".0f"),
                                        ("fwd_bwd_mem", "extra_mib", "training step (fwd + bwd) extra memory, MiB",
                                         ".0f")):
        sub = _last_by_key([r for r in rows if r["pass"] == pass_name],
                           ("headdim", "seqlen_q", "batch", "causal", "dtype", "impl"))
        if not sub:
            continue
        keys = sorted({k[:-1] for k in sub}, key=lambda k: (_DTYPES.index(k[4]), k[0], k[1], k[3]))
        lines += [f"### {unit}", "", "| d | seqlen | batch | causal | dtype | " + " | ".join(impls) + " |",
                  "|---" * (5 + len(impls)) + "|"]
        for k in keys:
            vals = [sub.get(k + (i,)) for i in impls]
            txt = ["" if r is None else "skip" if r.get("skipped") else f"{r[field]:{fmt}}" for r in vals]
            lines.append(f"| {k[0]} | {k[1]} | {k[2]} | {'yes' if k[3] else 'no'} | {k[4]} | "
                         + " | ".join(txt) + " |")
        lines.append("")
    keys = sorted({k[:-1] for k in cells}, key=lambda k: (PASSES.index(k[5]), _DTYPES.index(k[4]), k[0], k[1], k[3]))
    # The provider's speed, and the deterministic call's, as a share of the direct call's.
    shares = [i for i in ("sdpa-flashtile", "flashtile-det") if i in impls]
    lines += ["### TFLOP/s (do_bench median)", "",
              "| d | seqlen | batch | causal | dtype | pass | " + " | ".join(impls)
              + " | flashtile/sdpa-flash | flashtile/sdpa-cudnn |" + "".join(f" {i}/flashtile |" for i in shares)
              + " flashtile max abs diff |",
              "|---" * (9 + len(impls) + len(shares)) + "|"]
    for k in keys:
        lines.append(f"| {k[0]} | {k[1]} | {k[2]} | {'yes' if k[3] else 'no'} | {k[4]} | {k[5]} | "
                     + " | ".join(tf(k, i) for i in impls)
                     + f" | {ratio(k, 'sdpa-flash')} | {ratio(k, 'sdpa-cudnn')} |"
                     + "".join(f" {ratio(k, 'flashtile', i)} |" for i in shares) + f" {diff(k)} |")
    return "\n".join(lines) + "\n"


def plot_results(jsonl_paths: Iterable[str | Path], out_dir: str | Path, prefix: str | None = None) -> list[Path]:
    """One PNG per (headdim, causal, dtype, pass): TFLOP/s against seqlen, a line per impl.
    Later rows of the same measurement replace earlier ones. Returns the files written."""
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    paths = [Path(p) for p in jsonl_paths]
    prefix = prefix or paths[0].stem
    rows = [r for r in read_rows(paths) if r["pass"] in PASSES and r.get("tflops")]
    latest = _last_by_key(rows, ("headdim", "causal", "dtype", "pass", "impl", "seqlen_q", "batch"))
    groups: dict[tuple, list[dict[str, Any]]] = {}
    for row in latest.values():
        groups.setdefault((row["headdim"], row["causal"], row["dtype"], row["pass"]), []).append(row)
    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    written = []
    for (headdim, causal, dtype, pass_), group in sorted(groups.items(), key=str):
        fig, ax = plt.subplots(figsize=(7, 4.5))
        for impl in IMPLS:
            pts = sorted((r["seqlen_q"], r["tflops"]) for r in group if r["impl"] == impl)
            if pts:
                ax.plot(*zip(*pts), marker="o", label=impl)
        seqlens = sorted({r["seqlen_q"] for r in group})
        ax.set_xscale("log", base=2)
        ax.set_xticks(seqlens, [str(s) for s in seqlens])
        ax.set_xlabel("seqlen (batch x seqlen = 16384 tokens)")
        ax.set_ylabel("TFLOP/s")
        ax.set_ylim(bottom=0)
        ax.grid(alpha=0.3)
        ax.legend(fontsize=8, framealpha=0.8)
        r0 = group[0]
        ax.set_title(f"{r0['gpu']}: {pass_} d={headdim} {'causal' if causal else 'non-causal'} {dtype}\n"
                     f"torch {r0['torch']}, triton {r0['triton']}, flashtile {r0['commit']}", fontsize=9)
        fig.tight_layout()
        path = out_dir / f"{prefix}-d{headdim}-{'causal' if causal else 'full'}-{dtype}-{pass_}.png"
        fig.savefig(path, dpi=110)
        plt.close(fig)
        written.append(path)
    return written


# ---------------------------------------------------------------- the driver
def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="flashtile bench", description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    p.add_argument("--headdim", type=int, nargs="+", help="default 64 128 256 (--quick: 64 128)")
    p.add_argument("--seqlen", type=int, nargs="+",
                   help="default 512 .. 16384 (--quick: 1024 4096 16384)")
    p.add_argument("--causal", choices=("both", "yes", "no"), default="both")
    p.add_argument("--dtype", choices=_DTYPES, nargs="+", default=list(_DTYPES))
    p.add_argument("--pass", dest="passes", choices=PASSES, nargs="+", default=["fwd"])
    p.add_argument("--impl", choices=IMPLS, nargs="+", default=list(DEFAULT_IMPLS),
                   help="sdpa-flashtile: SDPA's flash backend with flashtile's provider active; flashtile-det: "
                        "deterministic=True (neither by default)")
    p.add_argument("--out", type=Path, help="default benchmarks/results/<gpu>/ (dry run: a temp dir)")
    p.add_argument("--tag", help="file stem of the rows, summary and plots (default bench-<date>)")
    p.add_argument("--warmup", type=int, default=25, help="do_bench warm-up, ms")
    p.add_argument("--rep", type=int, default=100, help="do_bench repetitions, ms")
    p.add_argument("--memory", action="store_true",
                   help="also measure peak extra memory at batch 1 of one forward (pass fwd_mem) and "
                        "of one training step (pass fwd_bwd_mem)")
    p.add_argument("--cuda-graph", action="store_true",
                   help="time captured CUDA graphs (do_bench_cudagraph): the kernels without host cost")
    p.add_argument("--gqa", type=int, default=1, metavar="G",
                   help="query heads per key/value head (default 1: MHA); must divide 2048 // headdim")
    p.add_argument("--quick", action="store_true", help="seqlen 1024 4096 16384, headdim 64 128")
    p.add_argument("--dry-run", action="store_true", help="no CUDA: print the plan, write fake rows")
    p.add_argument("--no-plot", action="store_true")
    p.add_argument("--plot-only", nargs="+", metavar="FILE.jsonl",
                   help="only draw plots and the summary from existing rows")
    return p


def _progress(items: list[Any]) -> tuple[Iterable[Any], Callable[[str], None]]:
    """A tqdm bar and its safe print, or the bare list and print without tqdm. The bar is
    off when stderr is no terminal (a remote log), where the per-row lines show progress."""
    try:
        from tqdm import tqdm
    except ImportError:
        return items, lambda s: print(s, flush=True)
    return tqdm(items, disable=None, mininterval=2.0, dynamic_ncols=True), lambda s: tqdm.write(s)


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    if args.plot_only:
        out = args.out or Path(args.plot_only[0]).parent
        print(summary_markdown(read_rows(args.plot_only)))
        for path in plot_results(args.plot_only, out, args.tag):
            print(f"plot: {path}")
        return 0
    headdims = args.headdim or ([64, 128] if args.quick else [64, 128, 256])
    seqlens = args.seqlen or ([1024, 4096, 16384] if args.quick else [512, 1024, 2048, 4096, 8192, 16384])
    bad = [d for d in headdims if d <= 0 or HIDDEN % d] + [s for s in seqlens if s <= 0]
    if bad or args.warmup < 0 or args.rep <= 0:
        parser.error(f"headdim must divide {HIDDEN}, seqlen and rep must be positive (got {bad})")
    causals = {"both": [False, True], "yes": [True], "no": [False]}[args.causal]
    try:
        shapes = [make_shape(s, d, c, dt, gqa=args.gqa)
                  for dt in args.dtype for d in headdims for s in seqlens for c in causals]
        mem_shapes = ([make_shape(s, d, False, dt, batch=1, gqa=args.gqa)
                       for dt in args.dtype for d in headdims for s in seqlens]
                      if args.memory else [])
    except ValueError as err:  # --gqa that does not divide a head count
        parser.error(f"--gqa: {err}")

    info = run_info(args.dry_run)
    tag = args.tag or f"bench-{datetime.datetime.now():%Y-%m-%d-%H%M}"
    out = args.out or (Path(tempfile.mkdtemp(prefix="flashtile-bench-")) if args.dry_run
                       else Path("benchmarks/results") / gpu_slug(info.gpu))
    writer = RowWriter(out / f"{tag}.jsonl")
    n_measure = len(shapes) * len(args.impl) * len(args.passes) + 2 * len(mem_shapes) * len(args.impl)
    print(f"flashtile bench: {len(shapes)} shapes x {len(args.impl)} impls x {len(args.passes)} passes"
          f" + {2 * len(mem_shapes) * len(args.impl)} memory = {n_measure} measurements on {info.gpu}"
          f" (torch {info.torch}, triton {info.triton}, commit {info.commit}) -> {writer.path}", flush=True)

    items, log = _progress(shapes + mem_shapes)

    def emit(shape: Shape, impl: str, pass_: str, fields: dict[str, Any]) -> None:
        row: dict[str, Any] = {"impl": impl, "pass": pass_, **shape.row_fields(), "ms": None,
                               "tflops": None, **info.row_fields(), "max_abs_diff": None, **fields}
        if pass_ in PASSES and row["ms"] is not None:
            row["tflops"] = shape.flops(pass_) / (row["ms"] * 1e-3) / 1e12
        writer.write(row)
        what = (f"skipped: {row['skipped']}" if "skipped" in row else
                f"{row['first_call_s']:.3f} s first call" if pass_ == "first_call" else
                f"{row['extra_mib']:.0f} MiB extra" if pass_ in ("fwd_mem", "fwd_bwd_mem") else
                f"{row['ms']:.3f} ms {row['tflops']:6.1f} TFLOP/s")
        diff = row["max_abs_diff"]
        log(f"[{done[0]}/{len(shapes) + len(mem_shapes)}] {shape.label():34s} {pass_:10s} {impl:15s} {what}"
            + (f"  max|diff| {diff:.2e}" if isinstance(diff, float) else ""))

    if not args.dry_run:
        import torch
        if not torch.cuda.is_available():
            parser.error("no CUDA device (use --dry-run to check the plan on a CPU)")
        warm = torch.ones(256, 256, device="cuda", dtype=torch.float16)
        (warm @ warm).sum().item()  # CUDA context and cuBLAS handle stay out of first-call times
    done = [0]  # shapes started, for the progress prefix of each log line
    for idx, shape in enumerate(items):
        done[0] = idx + 1
        passes = args.passes if idx < len(shapes) else ["fwd_mem"]  # a memory shape: fwd_mem and fwd_bwd_mem
        shape_emit = partial(emit, shape)
        if args.dry_run:
            _dry_run_rows(shape, args.impl, passes, shape_emit)
        elif passes == ["fwd_mem"]:
            memory_rows(shape, args.impl, shape_emit)
        else:
            measure_shape(shape, args.impl, passes, args.warmup, args.rep, shape_emit, args.cuda_graph)
    if hasattr(items, "close"):
        items.close()

    summary = summary_markdown(writer.rows)
    (out / f"{tag}-summary.md").write_text(
        f"# {tag}: {info.gpu}, torch {info.torch}, triton {info.triton}, flashtile {info.commit}\n\n" + summary)
    if not args.no_plot:
        try:
            plots = plot_results([writer.path], out, tag)
            print(f"{len(plots)} plots in {out}")
        except ImportError as err:
            print(f"no plots: {err}")
    print(f"rows: {writer.path}\n\n## {tag} on {info.gpu} (torch {info.torch}, triton {info.triton}, "
          f"flashtile {info.commit})\n\n{summary}", flush=True)
    return 0


def _dry_run_rows(shape: Shape, impls: list[str], passes: list[str],
                  emit: Callable[[str, str, dict[str, Any]], None]) -> None:
    """Fake rows in place of measurements: ms from a plausible rate per impl."""
    for impl in impls:
        if impl == "naive" and shape.scores_bytes() > NAIVE_SCORES_LIMIT_BYTES:
            # The memory marker pass stands for both memory passes, as in ``memory_rows``.
            for pass_ in (("fwd_mem", "fwd_bwd_mem") if passes == ["fwd_mem"] else passes):
                emit(impl, pass_, {"skipped": "dry-run: naive fp32 scores over the memory limit"})
        elif passes == ["fwd_mem"]:
            extra = shape.scores_bytes() * 2.5 / 2**20 if impl == "naive" else output_lse_mib(shape)
            emit(impl, "fwd_mem", {"extra_mib": extra, "output_lse_mib": output_lse_mib(shape)})
            minimum = output_lse_mib(shape) + _grads_mib(shape)
            extra = shape.scores_bytes() * 4 / 2**20 if impl == "naive" else minimum
            emit(impl, "fwd_bwd_mem", {"extra_mib": extra, "out_lse_grads_mib": minimum})
        else:
            emit(impl, "first_call", {"first_call_s": 0.5, "max_abs_diff": 0.0})
            for pass_ in passes:
                ms = shape.flops(pass_) / (_FAKE_TFLOPS[impl] * 1e12) * 1e3
                emit(impl, pass_, {"ms": ms, "max_abs_diff": 0.0})


if __name__ == "__main__":
    sys.exit(main())

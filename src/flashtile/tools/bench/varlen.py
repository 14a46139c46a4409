"""Packed-sequence (varlen) benchmark: ``flashtile bench --varlen``.

16384 tokens per batch as documents of random lengths (fixed seeds), bf16, hidden 2048
(nheads = 2048 // headdim). FLOPs are counted over visible (query, key) pairs only:
4 * H * D * pairs forward, 2.5x that backward (the papers' convention, without their
causal halving: a document of n tokens has n (n + 1) / 2 causal pairs). Every
implementation is charged the same FLOPs, so TFLOP/s compare useful work.

Implementations in the same run:
    flashtile        flash_attn_varlen_func on the packed batch
    flashtile-fixed  flashtile's fixed-length flash_attn_func on the same token count as
                     equal documents of the token-weighted mean length (same work shape;
                     for the ``equal`` distribution exactly the same documents)
    flashtile-docs   the fixed-length kernel at each document's own length: for every
                     distinct length n, flash_attn_func on TOKENS // n sequences of n
                     tokens (a full GPU, as ``flashtile bench`` runs fixed lengths), and
                     the batch's documents charged at those rates (``same_documents_rate``).
                     For mixed lengths this is the fair reference: the mean-length one
                     runs longer sequences than the batch holds, where the kernel is
                     faster per FLOP
    flex             FlexAttention with a document mask (block mask from document ids)
    varlen_attn      torch.nn.attention.varlen.varlen_attn, where the installed torch has it
    sdpa-*           torch SDPA backends on the padded batch (causal: is_causal, which is
                     exact for right padding; full: a key-padding mask)

Rows go to ``<out>/<tag>.jsonl`` (``layout: varlen``, ``dist``, the lengths), a summary
markdown next to them.
"""

from __future__ import annotations

import argparse
import datetime
import inspect
import random
from pathlib import Path
from typing import Any

from flashtile.tools.bench.common import SDPA_BACKENDS as _SDPA
from flashtile.tools.bench.common import HIDDEN, RowWriter, gpu_slug, reason, run_info

TOKENS = 16384
IMPLS = ("flashtile", "flashtile-fixed", "flashtile-docs", "flex", "varlen_attn", "sdpa-flash", "sdpa-cudnn",
         "sdpa-efficient")
DISTS = ("equal", "uniform", "longtail")


def lengths_for(dist: str, tokens: int = TOKENS, seed: int = 0) -> list[int]:
    """Document lengths summing to ``tokens``: ``equal`` 8 x 2048; ``uniform`` in [128, 4096];
    ``longtail`` mostly short (log-uniform 32..1024) with a few long ones (up to 8192)."""
    rng = random.Random(seed)
    if dist == "equal":
        return [2048] * (tokens // 2048)
    out: list[int] = []
    while sum(out) < tokens:
        if dist == "uniform":
            n = rng.randint(128, 4096)
        elif dist == "longtail":
            n = int(2 ** rng.uniform(5, 10)) if rng.random() < 0.95 else rng.randint(2048, 8192)
        else:
            raise ValueError(f"unknown distribution {dist!r}")
        out.append(min(n, tokens - sum(out)))
    return out


def visible_pairs(lengths: list[int], causal: bool) -> int:
    return sum(n * (n + 1) // 2 if causal else n * n for n in lengths)


def flops(lengths: list[int], nheads: int, headdim: int, causal: bool, pass_: str) -> float:
    return 4.0 * nheads * headdim * visible_pairs(lengths, causal) * {"fwd": 1.0, "bwd": 2.5}[pass_]


def same_documents_rate(lengths: list[int], causal: bool, rate_at) -> float:
    """TFLOP/s of a batch whose document of n tokens runs at ``rate_at(n)`` TFLOP/s: the
    FLOP-weighted harmonic mean (each document's time is its FLOPs over its rate; FLOPs
    are proportional to its visible pairs)."""
    pairs = [visible_pairs([n], causal) for n in lengths]
    return sum(pairs) / sum(p / rate_at(n) for p, n in zip(pairs, lengths))


def _varlen_attn_call(q, k, v, cu, max_len, causal):
    """torch's varlen_attn, whichever of its two signatures the installed torch has."""
    from torch.nn.attention.varlen import varlen_attn

    params = inspect.signature(varlen_attn).parameters
    if "is_causal" in params:
        return lambda: varlen_attn(q, k, v, cu, cu, max_len, max_len, is_causal=causal)
    return lambda: varlen_attn(q, k, v, cu, cu, max_len, max_len, window_size=(-1, 0) if causal else (-1, -1))


def build(impl: str, lengths: list[int], nheads: int, headdim: int, causal: bool, leaves: bool):
    """(call, inputs): ``call()`` runs the forward on ``inputs`` (the tensors to
    differentiate when ``leaves``); every impl gets the same values for the same tokens."""
    import torch

    dt = torch.bfloat16
    total = sum(lengths)
    gen = torch.Generator(device="cuda").manual_seed(0)
    q, k, v = (torch.randn(total, nheads, headdim, device="cuda", dtype=dt, generator=gen) for _ in range(3))
    cu = torch.tensor([0] + [sum(lengths[:i + 1]) for i in range(len(lengths))], dtype=torch.int32, device="cuda")
    max_len = max(lengths)
    if impl == "flashtile":
        import flashtile

        ins = [t.requires_grad_(leaves) for t in (q, k, v)]
        return (lambda: flashtile.flash_attn_varlen_func(*ins, cu, cu, max_len, max_len, causal=causal)), ins
    if impl == "flashtile-fixed":
        import flashtile

        if len(set(lengths)) == 1:  # equal documents: exactly these (``flashtile-docs`` too)
            seqlen, batch = lengths[0], len(lengths)
        else:
            weighted = sum(n * n for n in lengths) / total
            seqlen = max(64, int(round(weighted / 64)) * 64)
            batch = max(1, total // seqlen)
        ins = [t[:batch * seqlen].reshape(batch, seqlen, nheads, headdim).detach().requires_grad_(leaves)
               for t in (q, k, v)]
        return (lambda: flashtile.flash_attn_func(*ins, causal=causal)), ins
    if impl == "varlen_attn":
        ins = [t.requires_grad_(leaves) for t in (q, k, v)]
        return _varlen_attn_call(*ins, cu, max_len, causal), ins
    if impl == "flex":
        from torch.nn.attention.flex_attention import create_block_mask

        from flashtile.tools.bench.common import compiled_flex

        doc = torch.repeat_interleave(torch.arange(len(lengths), device="cuda"),
                                      torch.tensor(lengths, device="cuda"))

        def document(b, h, qi, kv):
            return doc[qi] == doc[kv]

        def document_causal(b, h, qi, kv):
            return (doc[qi] == doc[kv]) & (qi >= kv)

        mask = create_block_mask(document_causal if causal else document, None, None, total, total, device="cuda")
        flex = compiled_flex()
        ins = [t.transpose(0, 1).unsqueeze(0).contiguous().requires_grad_(leaves) for t in (q, k, v)]
        return (lambda: flex(*ins, block_mask=mask)), ins
    if impl in _SDPA:
        from torch.nn.attention import SDPBackend, sdpa_kernel

        batch = len(lengths)
        padded = []
        for t in (q, k, v):
            p = torch.zeros(batch, max_len, nheads, headdim, device="cuda", dtype=dt)
            for b, n in enumerate(lengths):
                p[b, :n] = t[cu[b]:cu[b] + n]
            padded.append(p.transpose(1, 2).contiguous().requires_grad_(leaves))
        mask = None
        if not causal:
            valid = torch.arange(max_len, device="cuda")[None, :] < torch.tensor(lengths, device="cuda")[:, None]
            mask = valid[:, None, None, :]
        backend = getattr(SDPBackend, _SDPA[impl])

        def sdpa():
            with sdpa_kernel(backend):
                return torch.nn.functional.scaled_dot_product_attention(*padded, attn_mask=mask, is_causal=causal)
        return sdpa, padded
    raise ValueError(f"unknown impl {impl!r}")


def measure(impl, lengths, nheads, headdim, causal, pass_, warmup, rep) -> float:
    """Milliseconds of one call (``flashtile-docs``: the time the batch would take at the
    fixed-length rates of its document lengths, each measured here)."""
    if impl == "flashtile-docs":
        rates = {}
        for n in sorted(set(lengths)):
            batch = max(1, TOKENS // n)
            ms = measure("flashtile-fixed", [n] * batch, nheads, headdim, causal, pass_, warmup, rep)
            rates[n] = flops([n] * batch, nheads, headdim, causal, pass_) / (ms * 1e-3) / 1e12
        rate = same_documents_rate(lengths, causal, rates.__getitem__)
        return flops(lengths, nheads, headdim, causal, pass_) / (rate * 1e12) * 1e3
    import torch
    import triton.testing

    call, ins = build(impl, lengths, nheads, headdim, causal, pass_ != "fwd")
    if pass_ == "fwd":
        with torch.no_grad():
            call()
            return triton.testing.do_bench(call, warmup=warmup, rep=rep, return_mode="median")
    out = call()
    out = out[0] if isinstance(out, tuple) else out
    dout = torch.randn_like(out)
    return triton.testing.do_bench(lambda: torch.autograd.grad(out, ins, dout, retain_graph=True),
                                   warmup=warmup, rep=rep, return_mode="median")


def summary_markdown(rows: list[dict[str, Any]]) -> str:
    keys = sorted({(r["dist"], r["headdim"], r["causal"], r["pass"]) for r in rows},
                  key=lambda k: (k[3], DISTS.index(k[0]) if k[0] in DISTS else 9, k[1], k[2]))
    impls = [i for i in IMPLS if any(r["impl"] == i for r in rows)]
    cells = {(r["dist"], r["headdim"], r["causal"], r["pass"], r["impl"]): r for r in rows}

    def tf(key, impl):
        r = cells.get(key + (impl,))
        return None if r is None or r.get("tflops") is None else r["tflops"]

    lines = ["| dist | docs | d | causal | pass | " + " | ".join(impls)
             + " | vs fixed | vs docs | vs flex | vs best sdpa |", "|---" * (9 + len(impls)) + "|"]
    for key in keys:
        mine = tf(key, "flashtile")
        sdpa = [x for x in (tf(key, i) for i in _SDPA) if x]
        docs = next(r["docs"] for r in rows if (r["dist"], r["headdim"], r["causal"], r["pass"]) == key)

        def ratio(x):
            return f"{mine / x:.2f}x" if mine and x else ""

        lines.append(f"| {key[0]} | {docs} | {key[1]} | {'yes' if key[2] else 'no'} | {key[3]} | "
                     + " | ".join("skip" if tf(key, i) is None else f"{tf(key, i):.0f}" for i in impls)
                     + f" | {ratio(tf(key, 'flashtile-fixed'))} | {ratio(tf(key, 'flashtile-docs'))} | "
                     + f"{ratio(tf(key, 'flex'))} | "
                     + f"{ratio(max(sdpa) if sdpa else None)} |")
    return "\n".join(lines) + "\n"


def plot(rows: list[dict[str, Any]], out_dir: Path, tag: str) -> list[Path]:
    """One PNG per pass: TFLOP/s of every implementation, a group of bars per
    (distribution, head dim, causal). Returns the files written."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    written = []
    for pass_ in ("fwd", "bwd"):
        sub = [r for r in rows if r["pass"] == pass_]
        if not sub:
            continue
        groups = sorted({(r["dist"], r["headdim"], r["causal"]) for r in sub},
                        key=lambda g: (DISTS.index(g[0]) if g[0] in DISTS else 9, g[1], g[2]))
        impls = [i for i in IMPLS if any(r["impl"] == i for r in sub)]
        cells = {(r["dist"], r["headdim"], r["causal"], r["impl"]): r.get("tflops") or 0.0 for r in sub}
        fig, ax = plt.subplots(figsize=(max(8, 1.1 * len(groups)), 4.5))
        width = 0.8 / len(impls)
        for n, impl in enumerate(impls):
            ax.bar([g + n * width for g in range(len(groups))], [cells.get(k + (impl,), 0.0) for k in groups],
                   width, label=impl)
        ax.set_xticks([g + 0.4 - width / 2 for g in range(len(groups))],
                      [f"{d}\nd{h} {'causal' if c else 'full'}" for d, h, c in groups], fontsize=7)
        ax.set_ylabel("TFLOP/s (visible pairs)")
        ax.grid(axis="y", alpha=0.3)
        ax.legend(fontsize=7, ncol=4)
        r0 = sub[0]
        ax.set_title(f"{r0['gpu']}: varlen {pass_}, bf16, {TOKENS} tokens; torch {r0['torch']}, "
                     f"triton {r0['triton']}, flashtile {r0['commit']}", fontsize=9)
        fig.tight_layout()
        path = Path(out_dir) / f"{tag}-{pass_}.png"
        fig.savefig(path, dpi=110)
        plt.close(fig)
        written.append(path)
    return written


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="flashtile bench --varlen", description=__doc__.split("\n\n")[0])
    p.add_argument("--varlen", action="store_true", help=argparse.SUPPRESS)
    p.add_argument("--headdim", type=int, nargs="+", default=[64, 128])
    p.add_argument("--dist", choices=DISTS, nargs="+", default=list(DISTS))
    p.add_argument("--causal", choices=("both", "yes", "no"), default="both")
    p.add_argument("--pass", dest="passes", choices=("fwd", "bwd"), nargs="+", default=["fwd", "bwd"])
    p.add_argument("--impl", choices=IMPLS, nargs="+", default=list(IMPLS))
    p.add_argument("--out", type=Path)
    p.add_argument("--tag")
    p.add_argument("--warmup", type=int, default=25)
    p.add_argument("--rep", type=int, default=100)
    p.add_argument("--dry-run", action="store_true", help="print the plan (documents per distribution) only")
    p.add_argument("--plot-only", nargs="+", metavar="FILE.jsonl", help="summary and plots from existing rows")
    args = p.parse_args(argv)
    if args.plot_only:
        from flashtile.tools.bench.common import read_rows

        rows = read_rows(args.plot_only)
        out = args.out or Path(args.plot_only[0]).parent
        print(summary_markdown(rows))
        for path in plot(rows, out, args.tag or Path(args.plot_only[0]).stem):
            print(f"plot: {path}")
        return 0
    for dist in args.dist:
        lengths = lengths_for(dist)
        print(f"{dist}: {len(lengths)} documents, max {max(lengths)}, min {min(lengths)}, "
              f"token-weighted mean {sum(n * n for n in lengths) / sum(lengths):.0f}")
    if args.dry_run:
        return 0
    import torch

    if not torch.cuda.is_available():
        p.error("no CUDA device (use --dry-run to see the plan)")
    info = run_info(False)
    tag = args.tag or f"bench-varlen-{datetime.datetime.now():%Y-%m-%d-%H%M}"
    out = args.out or Path("benchmarks/results") / gpu_slug(info.gpu)
    writer = RowWriter(out / f"{tag}.jsonl")
    causals = {"both": [False, True], "yes": [True], "no": [False]}[args.causal]
    for dist in args.dist:
        lengths = lengths_for(dist)
        for headdim in args.headdim:
            nheads = HIDDEN // headdim
            for causal in causals:
                for pass_ in args.passes:
                    for impl in args.impl:
                        row = {"impl": impl, "pass": pass_, "layout": "varlen", "dist": dist, "docs": len(lengths),
                               "lengths": lengths, "dtype": "bf16", "nheads": nheads, "headdim": headdim,
                               "causal": causal, "tokens": sum(lengths), "ms": None, "tflops": None,
                               **info.row_fields()}
                        try:
                            ms = measure(impl, lengths, nheads, headdim, causal, pass_, args.warmup, args.rep)
                            row["ms"] = ms
                            row["tflops"] = flops(lengths, nheads, headdim, causal, pass_) / (ms * 1e-3) / 1e12
                        except Exception as err:
                            row["skipped"] = reason(err)
                        torch.cuda.empty_cache()
                        writer.write(row)
                        what = row.get("skipped") or f"{row['ms']:.3f} ms {row['tflops']:6.1f} TFLOP/s"
                        print(f"{dist:9s} d{headdim} {'causal' if causal else 'full  '} {pass_} {impl:15s} {what}",
                              flush=True)
    summary = summary_markdown(writer.rows)
    (out / f"{tag}-summary.md").write_text(
        f"# {tag}: {info.gpu}, torch {info.torch}, triton {info.triton}, flashtile {info.commit}\n\n"
        f"TFLOP/s over visible pairs, bf16, {TOKENS} tokens per batch.\n\n" + summary)
    try:
        plot(writer.rows, out, tag)
    except ImportError as err:
        print(f"no plots: {err}")
    print(summary, flush=True)
    return 0

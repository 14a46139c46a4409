"""FlexAttention benchmark: flashtile.flex_attention against torch's compiled flex_attention,
flashtile's built-in kernel where the same attention exists, and cuDNN SDPA with a dense mask.

    python -m flashtile.tools.bench --flex [--headdim 64 128] [--seqlen 2048 ... 16384]
        [--pattern causal window document prefix alibi softcap relbias] [--pass fwd bwd]

Shapes as the prefill benchmark (hidden 2048, 16384 tokens per batch); "document" packs
random document lengths into one 32768-token sequence (batch 1). Rows: one JSON object per
(pattern, shape, impl, pass) with ms and TFLOP/s (FLOPs of the visible elements: the
block mask's density times the dense count), appended to ``<out>/<tag>.jsonl``; the table
prints each impl's speed relative to torch's flex. The first call of each impl (compile
included) is timed apart (``first_ms``).
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

from flashtile.tools.bench.common import HIDDEN, TOKENS, RowWriter, compiled_flex, reason, run_info

PATTERNS = ("causal", "window", "document", "prefix", "alibi", "softcap", "relbias")
IMPLS = ("torch-flex", "flashtile-flex", "flashtile-flex-ready", "flashtile-builtin", "sdpa-cudnn-mask")  # torch-flex first: the ratios' base


def _pattern(name: str, batch: int, nheads: int, seqlen: int, device):
    """(score_mod, mask_mod, builtin kwargs of flash_attn_func or None, needs a dense mask)."""
    import torch

    from flashtile.api import mods

    g = torch.Generator(device="cpu").manual_seed(0)
    if name == "causal":
        return None, mods.causal, dict(causal=True)
    if name == "window":
        return None, mods.sliding_window(1024), dict(causal=True, window_size=(1024, 0))
    if name == "document":
        lengths, total = [], 0
        while total < seqlen:
            n = min(seqlen - total, int(torch.randint(256, 4096, (1,), generator=g)))
            lengths.append(n)
            total += n
        cu = torch.tensor([0] + lengths, device=device).cumsum(0)
        doc_ids = torch.repeat_interleave(torch.arange(len(lengths), device=device),
                                          torch.tensor(lengths, device=device))
        doc_mask = mods.and_masks(mods.document(doc_ids), mods.causal)
        return None, doc_mask, dict(causal=True, cu_seqlens=cu.to(torch.int32), max_seqlen=max(lengths))
    if name == "prefix":
        return None, mods.prefix_lm(seqlen // 4), None
    if name == "alibi":
        slopes = torch.rand(nheads, generator=g).to(device)
        return mods.alibi(slopes), mods.causal, dict(causal=True, alibi_slopes=slopes)
    if name == "softcap":
        return mods.softcap(30.0), mods.causal, dict(causal=True, softcap=30.0)
    if name == "relbias":
        table = (torch.randn(nheads, 2 * seqlen - 1, generator=g) * 0.1).to(device)
        return mods.relative_bias(table, seqlen), mods.causal, None
    raise ValueError(name)


def _density(block_mask) -> float:
    if block_mask is None:
        return 1.0
    return 1.0 - float(block_mask.sparsity()) / 100.0


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(prog="flashtile bench --flex", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--flex", action="store_true")
    parser.add_argument("--headdim", type=int, nargs="+", default=[64, 128])
    parser.add_argument("--seqlen", type=int, nargs="+", default=[2048, 4096, 8192, 16384])
    parser.add_argument("--pattern", nargs="+", default=list(PATTERNS), choices=PATTERNS)
    parser.add_argument("--impl", nargs="+", default=list(IMPLS), choices=IMPLS)
    parser.add_argument("--pass", dest="passes", nargs="+", default=["fwd", "bwd"], choices=["fwd", "bwd"])
    parser.add_argument("--dtype", default="bf16", choices=["bf16", "fp16"])
    parser.add_argument("--warmup", type=int, default=5)
    parser.add_argument("--rep", type=int, default=30)
    parser.add_argument("--out", default="bench-results")
    parser.add_argument("--tag", default="flex")
    args = parser.parse_args(argv)

    import torch
    import triton

    import flashtile
    from flashtile.traffic import attention_flops

    info = run_info(False)
    writer = RowWriter(Path(args.out) / f"{args.tag}.jsonl")
    dtype = torch.bfloat16 if args.dtype == "bf16" else torch.float16
    device = "cuda"
    print("| pattern | d | S | B | pass | impl | ms | TFLOP/s | vs torch-flex | first call ms |")
    print("|---|---|---|---|---|---|---|---|---|---|")
    for headdim in args.headdim:
        nheads = HIDDEN // headdim
        for pattern in args.pattern:
            seqlens = [32768] if pattern == "document" else args.seqlen
            for seqlen in seqlens:
                batch = 1 if pattern == "document" else max(1, TOKENS // seqlen)
                score_mod, mask_mod, builtin = _pattern(pattern, batch, nheads, seqlen, device)
                from torch.nn.attention.flex_attention import create_block_mask

                # torch's builder for both Flex calls: flashtile runs its flex kernels on it. flashtile's
                # builder ("flashtile-flex-ready") sends ready-made mods to the built-in kernels.
                block_mask = create_block_mask(mask_mod, None, None, seqlen, seqlen, device=device)
                ready_mask = flashtile.create_block_mask(mask_mod, None, None, seqlen, seqlen, device=device)
                density = _density(block_mask)
                q, k, v = (torch.randn(batch, nheads, seqlen, headdim, device=device, dtype=dtype) for _ in range(3))
                dout = torch.randn_like(q)
                torch_flex = compiled_flex()
                dense = None
                calls = {
                    "flashtile-flex": lambda q, k, v: flashtile.flex_attention(q, k, v, score_mod=score_mod,
                                                                               block_mask=block_mask),
                    "torch-flex": lambda q, k, v: torch_flex(q, k, v, score_mod=score_mod, block_mask=block_mask),
                }
                if getattr(mask_mod, "flashtile_builtin", None) and getattr(score_mod, "flashtile_builtin", True):
                    calls["flashtile-flex-ready"] = lambda q, k, v: flashtile.flex_attention(
                        q, k, v, score_mod=score_mod, block_mask=ready_mask)
                if builtin is not None:
                    if "cu_seqlens" in builtin:
                        kw = dict(builtin)
                        cu, mx = kw.pop("cu_seqlens"), kw.pop("max_seqlen")

                        def run_builtin(q, k, v, cu=cu, mx=mx, kw=kw):
                            t = (x.transpose(1, 2).reshape(seqlen, nheads, headdim) for x in (q, k, v))
                            out = flashtile.flash_attn_varlen_func(*t, cu, cu, mx, mx, **kw)
                            return out.reshape(1, seqlen, nheads, headdim).transpose(1, 2)
                    else:
                        def run_builtin(q, k, v, kw=builtin):
                            return flashtile.flash_attn_func(*(x.transpose(1, 2) for x in (q, k, v)),
                                                             **kw).transpose(1, 2)
                    calls["flashtile-builtin"] = run_builtin
                if score_mod is None and seqlen * seqlen * batch <= 2**31:
                    i = torch.arange(seqlen, device=device)
                    b = torch.arange(batch, device=device).view(-1, 1, 1, 1)
                    dense = mask_mod(b, torch.zeros(1, 1, 1, 1, dtype=torch.long, device=device),
                                     i.view(1, 1, -1, 1), i.view(1, 1, 1, -1))
                    from torch.nn.attention import SDPBackend, sdpa_kernel

                    def run_cudnn(q, k, v, dense=dense):
                        with sdpa_kernel(SDPBackend.CUDNN_ATTENTION):
                            return torch.nn.functional.scaled_dot_product_attention(q, k, v, attn_mask=dense)
                    calls["sdpa-cudnn-mask"] = run_cudnn
                base_ms = {}
                for impl in [i for i in IMPLS if i in args.impl and i in calls]:
                    fn = calls[impl]
                    leaves = [t.clone().requires_grad_("bwd" in args.passes) for t in (q, k, v)]
                    row = dict(info.row_fields(), pattern=pattern, headdim=headdim, seqlen=seqlen, batch=batch,
                               nheads=nheads, dtype=args.dtype, impl=impl, density=density)
                    try:
                        torch.cuda.synchronize()
                        t0 = time.perf_counter()
                        out = fn(*leaves)
                        torch.cuda.synchronize()
                        first = (time.perf_counter() - t0) * 1e3
                    except Exception as err:  # a peer that cannot take the shape: the row says why
                        writer.write(dict(row, error=reason(err)))
                        print(f"| {pattern} | {headdim} | {seqlen} | {batch} | - | {impl} | error: {reason(err)} |")
                        continue
                    for pass_ in args.passes:
                        try:
                            if pass_ == "fwd":
                                with torch.no_grad():
                                    ms = triton.testing.do_bench(lambda: fn(*leaves), warmup=args.warmup,
                                                                 rep=args.rep, return_mode="median")
                            else:
                                out = fn(*leaves)
                                ms = triton.testing.do_bench(
                                    lambda out=out, leaves=leaves, dout=dout: torch.autograd.grad(
                                        out, leaves, dout, retain_graph=True),
                                    warmup=args.warmup, rep=args.rep, return_mode="median")
                        except Exception as err:
                            writer.write(dict(row, error=reason(err), **{"pass": pass_}))
                            print(f"| {pattern} | {headdim} | {seqlen} | {batch} | {pass_} | {impl} | error: "
                                  f"{reason(err)} |")
                            continue
                        flops = attention_flops(batch, nheads, seqlen, seqlen, headdim, causal=False,
                                                pass_=pass_) * density
                        tflops = flops / ms * 1e-9
                        if impl == "torch-flex":
                            base_ms[pass_] = ms
                        ratio = base_ms[pass_] / ms if pass_ in base_ms else float("nan")
                        writer.write(dict(row, ms=ms, tflops=tflops, first_ms=first, vs_torch_flex=ratio,
                                          **{"pass": pass_}))
                        print(f"| {pattern} | {headdim} | {seqlen} | {batch} | {pass_} | {impl} | {ms:.3f} | "
                              f"{tflops:.0f} | {ratio:.2f} | {first:.0f} |", flush=True)
                    out = leaves = None
                q = k = v = dout = dense = None
                torch.cuda.empty_cache()
    return 0


if __name__ == "__main__":
    sys.exit(main())

"""What the fixed-length kernel would do on the varlen bench's own documents, from rows
already measured: each document at the fixed-length rate of its length.

    python3 benchmarks/varlen_same_documents.py [--fixed FIXED.jsonl] [--varlen VARLEN.jsonl]

``flashtile bench --varlen`` compares a packed batch with ``flash_attn_func`` on equal
documents of the token-weighted mean length (its ``flashtile-fixed`` column). For mixed
lengths that reference runs longer sequences than the batch holds (2816 tokens for
``uniform``, whose documents are 128..4096), where the fixed-length kernel does more
FLOPs per second. This prints the other reference beside it: every document of the
distribution at the rate ``flashtile bench`` measured for fixed-length sequences of that
length (16384 tokens per batch, log-interpolated between the measured lengths), the
FLOP-weighted harmonic mean over documents; and the varlen rate against both.

The fixed-length rates come from another run (by default run 52, session 8); the kernel has
changed since, so read the ``equal`` rows first: there both references are the same
documents (2048 tokens), and their difference is that drift (d128 forward: 597 then, 642
in run 81, so the same-documents figures are up to ~7% generous). The right reference is
these rates measured in the same run: ``flashtile bench --varlen`` does that since session
15 (its ``flashtile-docs`` impl and "vs docs" column); this script estimates it from rows
measured before.
"""

from __future__ import annotations

import argparse
import json
import math
from pathlib import Path

from flashtile.tools.bench.varlen import same_documents_rate

RESULTS = Path(__file__).resolve().parent / "results" / "h200"


def fixed_rates(path: Path) -> dict:
    """{(pass, head dim, causal, seqlen): TFLOP/s} of flashtile's fixed-length rows."""
    out = {}
    for line in path.read_text().splitlines():
        r = json.loads(line)
        if r["impl"] == "flashtile" and r["seqlen_q"] == r["seqlen_k"]:
            out[(r["pass"], r["headdim"], r["causal"], r["seqlen_q"])] = r["tflops"]
    return out


def rate_at(rates: dict, key: tuple, length: int) -> float:
    """The rate at ``length``, log-linear between the measured lengths (clamped at the ends)."""
    lengths = sorted(k[3] for k in rates if k[:3] == key)
    if length <= lengths[0]:
        return rates[key + (lengths[0],)]
    if length >= lengths[-1]:
        return rates[key + (lengths[-1],)]
    for a, b in zip(lengths, lengths[1:]):
        if a <= length <= b:
            t = (math.log(length) - math.log(a)) / (math.log(b) - math.log(a))
            return rates[key + (a,)] * (1 - t) + rates[key + (b,)] * t
    raise AssertionError("unreachable")


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--fixed", type=Path, default=RESULTS / "h200-bf16-run52.jsonl")
    p.add_argument("--varlen", type=Path, default=RESULTS / "h200-varlen-run81.jsonl")
    args = p.parse_args(argv)
    rates = fixed_rates(args.fixed)
    print("| dist | pass | d | causal | varlen | fixed, same documents | ratio | fixed, mean length | ratio |")
    print("|---|---|---|---|---|---|---|---|---|")
    rows = [json.loads(line) for line in args.varlen.read_text().splitlines()]
    got = {(r["dist"], r["pass"], r["headdim"], r["causal"], r["impl"]): r for r in rows}
    for (dist, pass_, d, causal, impl), r in got.items():
        if impl != "flashtile":
            continue
        same = same_documents_rate(r["lengths"], causal, lambda n: rate_at(rates, (pass_, d, causal), n))
        mean = got.get((dist, pass_, d, causal, "flashtile-fixed"), {}).get("tflops")
        mean_cols = f"{mean:.0f} | {r['tflops'] / mean:.2f}x" if mean else "- | -"
        print(f"| {dist} | {pass_} | {d} | {'yes' if causal else 'no'} | {r['tflops']:.0f} | {same:.0f} | "
              f"{r['tflops'] / same:.2f}x | {mean_cols} |")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())

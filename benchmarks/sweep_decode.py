"""flashtile's decode kernel at fixed split counts (CUDA graphs: the kernels alone), per
decode shape of ``flashtile.tools.bench.decode``: which split count each shape wants, next to
the one ``backends.triton.decode.choose_splits`` picks (num_splits=0).

    PYTHONPATH=src python3 benchmarks/sweep_decode.py [--only 0 1 2] [--shapes 16x4096 4x8192p16]
        [--append] [--rounds 2]

``--append``: generation steps (the new token appended: under CUDA graphs ``auto`` takes the
spread check there, as ``flashtile bench --decode --append`` does); ``--shapes``: more GQA
32/8 d128 rows as batch x cached tokens (``4x4096p16``: in pages of 16); ``--rounds``: every
count again, in turn, so that the differences can be read against the rounds' spread.
"""
from __future__ import annotations

import argparse
import os

# Launch plans replay what a key's first call launched, and the key does not hold
# backends.triton.decode.STAGES: with plans on, every --stages-paged value after the first would time
# the first one's kernel (H200 run 68 did); --stages-rows likewise. CUDA-graph timing has no host cost to save.
os.environ["FLASHTILE_PLANS"] = "0"

from flashtile.tools.bench.decode import DecodeShape, measure, read_ceiling, shapes

SPLITS = (0, 1, 2, 3, 4, 6, 8, 12, 16, 24, 32, 48, 64, 96, 128)


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--only", nargs="*", type=int,
                   help="rows of bench --decode (default: every row, or none when --shapes is given)")
    p.add_argument("--splits", nargs="+", type=int, default=list(SPLITS))
    p.add_argument("--shapes", nargs="+", default=[],
                   help="more rows, batch x cached tokens: 16x4096, or 4x4096p16 with pages of 16")
    p.add_argument("--append", action="store_true", help="generation steps (decode + append)")
    p.add_argument("--rounds", type=int, default=1)
    p.add_argument("--rep", type=int, default=50)
    p.add_argument("--stages-paged", type=int, nargs="+", help="num_stages of the paged kernel (each in turn)")
    p.add_argument("--stages-rows", type=int, nargs="+", help="num_stages of the row-cache kernel (each in turn)")
    p.add_argument("--page-slice", type=int, nargs="+",
                   help="decode.PAGE_SLICE_MAX values (each in turn; 0: the per-tile table read); the "
                        "heuristic's count (0) follows it: a page gather takes at least the splits its slice needs")
    args = p.parse_args()
    from flashtile.backends.triton import decode

    for page_slice in args.page_slice or [None]:
        if page_slice is not None:
            decode.PAGE_SLICE_MAX = page_slice
            print(f"page slice max {page_slice}", flush=True)
        for stages in args.stages_paged or [None]:
            if stages is not None:
                decode.STAGES["tile"] = decode.STAGES["gather"] = stages
                print(f"paged num_stages {stages}", flush=True)
            for rows in args.stages_rows or [None]:
                if rows is not None:
                    decode.STAGES["rows"] = rows
                    print(f"row-cache num_stages {rows}", flush=True)
                sweep(args)


def parse_shape(text: str) -> DecodeShape:
    """``16x4096`` (batch x cached tokens, contiguous rows) or ``4x4096p16`` (pages of 16)."""
    rows, _, page = text.partition("p")
    batch, seqlen_k = map(int, rows.split("x"))
    return DecodeShape(batch, seqlen_k, page_size=int(page or 0))


def heuristic_splits(shape: DecodeShape, device="cuda") -> int:
    """The splits ``choose_splits`` gives ``shape`` (num_splits=0) on ``device``'s SM count,
    after ``split_plan`` rounds the split size to key tiles (expanded 0-d tensors: no cache
    is allocated)."""
    import torch

    from flashtile.backends.triton import decode

    one = torch.empty((), device=device, dtype=torch.bfloat16)
    q = one.expand(shape.batch, shape.seqlen_q, shape.nheads, shape.headdim)
    table = None
    if shape.page_size:
        pages = -(-shape.seqlen_k // shape.page_size)
        cache = one.expand(shape.batch * pages, shape.page_size, shape.nheads_k, shape.headdim)
        table = torch.empty((), device=device, dtype=torch.int32).expand(shape.batch, pages)
    else:
        cache = one.expand(shape.batch, shape.seqlen_k, shape.nheads_k, shape.headdim)
    return decode.split_plan(q, cache, table, 0)[0]


def sweep(args) -> None:
    todo = shapes()
    if args.only is not None or args.shapes:  # run 187 meant only its --shapes and timed out in the rows
        todo = [todo[i] for i in args.only or []]
    todo += [parse_shape(s) for s in args.shapes]
    ceiling = read_ceiling()
    print(f"read ceiling {ceiling:.2f} TB/s{' (generation steps)' if args.append else ''}", flush=True)
    for shape in todo:
        times = {n: [] for n in args.splits}
        for r in range(args.rounds):
            for n in args.splits:
                ms = measure("flashtile", shape, "cuda_graph", 10, args.rep, num_splits=n, append=args.append)
                times[n].append(ms)
                tb = shape.bytes() / (ms * 1e-3) / 1e12
                print(f"{shape.label():40s} splits {n:3d}: {ms * 1e3:8.2f} us {tb:5.2f} TB/s "
                      f"({100 * tb / ceiling:.0f}%) round {r + 1}", flush=True)
        mean = {n: sum(t) / len(t) for n, t in times.items()}
        best = min((n for n in mean if n), key=mean.get, default=None)
        spread = max(max(t) - min(t) for t in times.values()) * 1e3
        line = f"{shape.label():40s} best: {best} splits, {mean[best] * 1e3:.2f} us" if best else shape.label()
        if 0 in mean:
            line += f"; the heuristic's ({heuristic_splits(shape)} splits) {mean[0] * 1e3:.2f} us"
        print(f"{line}; rounds within {spread:.2f} us", flush=True)


if __name__ == "__main__":
    main()

"""How many programs of one head add into the same float32 dQ tile at once in the one-pass
backward (``backends/sm90/backward_onepass.py``), in two toy models of its schedule. Reductions
into one tile at the same time serialize at the L2. A program's query steps follow the
kernel's ``step_range`` (causal: from the block of its diagonal up) and its rotation
``q_rot = (nb * nq) // num_n_blocks``; ``rotate=False`` models causal loops without it (each
walking up from its diagonal). CPU only, no torch::

    python3 benchmarks/experiments/dq_collisions.py [--seqlen 2048 16384] [--q-rows 128]

- ``lockstep``: every key block's program of one head starts together and takes one query
  step per tick;
- ``scheduled``: the whole grid (pair-major, as the kernel runs MHA) on 132 SMs, one program
  per SM, each step taking 1 +- jitter, a program's start 2 +- jitter, the next program
  starting when one ends.

Each prints the most programs on one tile at any time and the mean number of programs per
touched tile, weighted by time (1.00: every program on a tile of its own). Session 37
(docs/perf-notes.md, "Causal rotation"): the models disagree, so neither is a prediction.
"""

from __future__ import annotations

import argparse
import collections
import heapq
import random
import sys

KEYS = 128  # keys per program (2 warpgroups x 64)
SMS = 132


def loops(seqlen: int, q_rows: int, causal: bool, rotate: bool) -> list[list[int]]:
    """The query blocks each key block's program visits, in order (diag_offset 0)."""
    n_blocks = -(-seqlen // KEYS)
    n_q = -(-seqlen // q_rows)
    out = []
    for nb in range(n_blocks):
        q_lo = (nb * KEYS) // q_rows if causal else 0
        nq = max(n_q - q_lo, 0)
        q_rot = (nb * nq) // n_blocks if rotate or not causal else 0
        out.append([q_lo + (t + q_rot) % nq for t in range(nq)])
    return out


def lockstep(seqlen: int, q_rows: int, causal: bool, rotate: bool) -> tuple[int, float]:
    """(most programs on one tile at a tick, mean programs per touched tile) of one head."""
    steps = loops(seqlen, q_rows, causal, rotate)
    worst, means = 0, []
    for t in range(max(map(len, steps))):
        tiles = collections.Counter(s[t] for s in steps if t < len(s))
        worst = max(worst, max(tiles.values()))
        means.append(sum(c * c for c in tiles.values()) / sum(tiles.values()))
    return worst, sum(means) / len(means)


def scheduled(seqlen: int, q_rows: int, causal: bool, rotate: bool, heads: int, jitter: float = 0.2,
              seed: int = 0) -> tuple[int, float]:
    """(most programs on one tile at once, time-weighted mean programs per touched tile) of
    ``heads`` heads' programs, pair-major, on ``SMS`` SMs with random step times."""
    rng = random.Random(seed)
    per_head = loops(seqlen, q_rows, causal, rotate)
    free = [(0.0, sm) for sm in range(SMS)]
    events = []
    for head in range(heads):
        for steps in per_head:
            if not steps:
                continue
            t, sm = heapq.heappop(free)
            t += 2.0 * rng.uniform(1 - jitter, 1 + jitter)
            for block in steps:
                d = rng.uniform(1 - jitter, 1 + jitter)
                events += [(t, 1, head, block), (t + d, -1, head, block)]
                t += d
            heapq.heappush(free, (t + 1.0, sm))
    events.sort(key=lambda e: (e[0], e[1]))
    on = collections.Counter()
    weighted = time = 0.0
    squares = count = worst = 0
    last = 0.0
    for t, delta, head, block in events:
        if count:
            weighted += squares * (t - last)
            time += count * (t - last)
        last = t
        c = on[head, block]
        squares += (c + delta) ** 2 - c * c
        count += delta
        on[head, block] = c + delta
        worst = max(worst, c + delta)
    return worst, weighted / time


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--seqlen", type=int, nargs="+", default=[2048, 8192, 16384])
    p.add_argument("--q-rows", type=int, nargs="+", default=[128])
    p.add_argument("--jitter", type=float, default=0.2)
    args = p.parse_args(argv)
    for seqlen in args.seqlen:
        heads = 2048 * 256 // seqlen  # the bench's d64 shapes: batch x heads = 524288 / seqlen
        for q_rows in args.q_rows:
            for causal, rotate in ((False, True), (True, True), (True, False)):
                name = "plain" if not causal else "causal, rotated" if rotate else "causal, from the diagonal"
                w1, m1 = lockstep(seqlen, q_rows, causal, rotate)
                w2, m2 = scheduled(seqlen, q_rows, causal, rotate, heads, args.jitter)
                print(f"S{seqlen:<6} {q_rows:>3} rows  {name:<26} lockstep most {w1:>3} mean {m1:.2f}   "
                      f"scheduled ({heads} heads) most {w2:>3} mean {m2:.2f}", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())

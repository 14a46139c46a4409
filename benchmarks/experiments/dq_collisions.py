"""How many programs of one head add into the same float32 dQ tile at once in the one-pass
backward (``backends/sm90/backward_onepass.py``), in a lockstep model: every key block's
program of one (batch, head) starts together and takes one query step per tick. A program's
steps follow the kernel's ``step_range`` (causal: from the block of its diagonal) and its
rotation ``q_rot`` (``(nb * nq) // num_n_blocks``, or 0 for causal calls when
``CAUSAL_ROTATION`` is off). Reductions into one tile at the same time serialize at the L2.
CPU only, no torch::

    python3 benchmarks/experiments/dq_collisions.py [--seqlen 2048 16384] [--q-rows 64 128]

Prints, per shape, the most programs on one tile at any tick and the average number of
programs per touched tile (1.00: every program on a tile of its own). Session 37's numbers in
docs/perf-notes.md ("Causal rotation"). The model ignores staggered starts.
"""

from __future__ import annotations

import argparse
import collections
import sys

KEYS = 128  # keys per program (2 warpgroups x 64)


def collisions(seqlen: int, q_rows: int, causal: bool, rotate: bool) -> tuple[int, float]:
    """(most programs on one dQ tile at a tick, mean programs per touched tile) for one
    head of seqlen queries and keys (diag_offset 0)."""
    n_blocks = -(-seqlen // KEYS)
    n_q = -(-seqlen // q_rows)
    loops = []
    for nb in range(n_blocks):
        q_lo = (nb * KEYS) // q_rows if causal else 0
        nq = max(n_q - q_lo, 0)
        q_rot = (nb * nq) // n_blocks if rotate or not causal else 0
        loops.append((q_lo, nq, q_rot))
    worst, means = 0, []
    for t in range(max(nq for _, nq, _ in loops)):
        tiles = collections.Counter()
        for q_lo, nq, q_rot in loops:
            if t < nq:
                r = t + q_rot
                tiles[q_lo + (r - nq if r >= nq else r)] += 1
        worst = max(worst, max(tiles.values()))
        means.append(sum(c * c for c in tiles.values()) / sum(tiles.values()))
    return worst, sum(means) / len(means)


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--seqlen", type=int, nargs="+", default=[2048, 4096, 8192, 16384])
    p.add_argument("--q-rows", type=int, nargs="+", default=[64, 128])
    args = p.parse_args(argv)
    for seqlen in args.seqlen:
        for q_rows in args.q_rows:
            for causal, rotate in ((False, True), (True, True), (True, False)):
                worst, mean = collisions(seqlen, q_rows, causal, rotate)
                name = "plain" if not causal else "causal, rotated" if rotate else "causal, from the diagonal"
                print(f"S{seqlen:<6} {q_rows:>3} rows  {name:<26} most {worst:>3}  mean {mean:.2f}")
    return 0


if __name__ == "__main__":
    sys.exit(main())

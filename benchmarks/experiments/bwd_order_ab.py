"""A/B of the one-pass backward's grid order (issue 17, run 104): a benchmark run with
``backward_sm90_onepass.keys_outer`` fixed for this process (plans record the launch, so one
order per process). ORDER is pair (pair-major, each (batch, kv head)'s key blocks side by
side), block (block-major: every pair's heaviest blocks first) or group:G (session 46, never
run: block-major within groups of G pairs, one group after another: ``PAIR_GROUP``). block
and group:G apply to causal calls, MHA included; pair and non-causal calls are pair-major.

    PYTHONPATH=src python3 benchmarks/experiments/bwd_order_ab.py ORDER bench --gqa 4 --causal yes ...
    PYTHONPATH=src python3 benchmarks/experiments/bwd_order_ab.py ORDER benchmarks/train_block.py ...
"""

import runpy
import sys

from flashtile.tools.bench import prefill as bench
from flashtile.backends.sm90 import backward_onepass as op

if __name__ == "__main__":
    order, what, argv = sys.argv[1], sys.argv[2], sys.argv[3:]
    kind, _, group = order.partition(":")
    block = {"pair": False, "block": True, "group": True}[kind]
    op.keys_outer = lambda causal, group_size: causal and block
    op.PAIR_GROUP = int(group) if kind == "group" else 0
    if what == "bench":
        sys.exit(bench.main(argv))
    sys.argv = [what, *argv]
    runpy.run_path(what, run_name="__main__")

"""A/B of the one-pass backward's grid order (issue 17, run 104; session 47's groups): a
benchmark run with ``backward_onepass.PAIR_GROUP`` fixed for this process (plans record the
launch, so one order per process). ORDER is auto (the library's rule, ``pair_group``: about
a wave of programs a group), pair (pair-major: each (batch, kv head)'s key blocks side by
side), block (block-major over the whole grid: every pair's heaviest blocks first; causal
GQA's order before session 47), group:G (block-major within groups of G pairs, one group
after another) or wave (the rule for causal MHA too: ``GROUP_MHA``; auto leaves causal MHA
pair-major). The order applies to causal calls; calls without causal are pair-major.
split:ORDER sets the d256 dV and dK kernels' order instead (``backward_split.PAIR_GROUP``;
auto, their default since session 48 (H100 run 252), is the rule for causal GQA and pair-major
for causal MHA; split:wave is split:auto, and group:G applies to MHA too).

    PYTHONPATH=src python3 benchmarks/experiments/bwd_order_ab.py ORDER bench --gqa 4 --causal yes ...
    PYTHONPATH=src python3 benchmarks/experiments/bwd_order_ab.py ORDER benchmarks/train_block.py ...
"""

import runpy
import sys

from flashtile.tools.bench import prefill as bench
from flashtile.backends.sm90 import backward_onepass as op
from flashtile.backends.sm90 import backward_split as split

if __name__ == "__main__":
    order, what, argv = sys.argv[1], sys.argv[2], sys.argv[3:]
    module = op
    if order.startswith("split:"):
        module, order = split, order[len("split:"):]
    kind, _, group = order.partition(":")
    module.PAIR_GROUP = {"auto": None, "wave": None, "pair": 1, "block": 0}[kind] if kind != "group" else int(group)
    op.GROUP_MHA = kind == "wave"
    if what == "bench":
        sys.exit(bench.main(argv))
    sys.argv = [what, *argv]
    runpy.run_path(what, run_name="__main__")

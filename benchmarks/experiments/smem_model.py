"""Shared-memory bytes per step of the one-pass Gluon backward's consumers, against its FLOPs
(session 51; docs/perf-notes.md "Session 51"). A model, checked against ncu and the compiled code:

    python3 benchmarks/experiments/smem_model.py            # the table (no GPU, no compile)
    python3 benchmarks/experiments/smem_model.py --check    # also count each kernel's wgmmas in its
                                                            # sm_90a SASS against the model (CPU, ~30 s)

Each step of the kernel's loop runs five tile products on two consumer warpgroups. A wgmma
m64nNk16 reads its A tile (64 x 16) from shared memory unless it comes from registers, and its
B tile (N x 16) always; a product with M = 128 is two m64 instructions, each reading B again.
Besides the products, shared memory takes the consumers' stores (P, dS, the float32 dQ slots),
the loader's TMA writes of Q and dO, and the reducer's bulk reads of the dQ slots. At 128 bytes
per clock per SM for shared memory and 4096 dense 16-bit FLOP per clock per SM for the tensor
cores (an H100 SXM: 989 TFLOP/s at 1.83 GHz on 132 SMs), the tensor pipe can be busy at most
FLOP time / shared-memory time as often as shared memory is. Run 253's ncu readings
(``NCU_RUN253``: tensor pipe and L1/TEX throughput, % of peak) sit at that ratio within 2-4%.
"""

from __future__ import annotations

import argparse
import sys
from collections import Counter
from typing import NamedTuple

SMEM_BYTES_PER_CLOCK = 128
TENSOR_FLOP_PER_CLOCK = 4096
# run 253 (H100, docs/perf-notes.md "Session 49"): (tensor pipe %, L1/TEX throughput %)
NCU_RUN253 = {"d64": (48.9, 76.6), "d128": (60.7, 76.0)}


class Product(NamedTuple):
    """One warpgroup's tile product in a step: (M x K) @ (K x N), A from shared memory or
    registers, B from shared memory; ``phases``: where the kernel issues it besides the loop
    ("first": the peeled step 0, "last": after the loop)."""
    name: str
    m: int
    n: int
    k: int
    a_in_registers: bool = False
    phases: tuple[str, ...] = ()

    def instructions(self) -> int:
        return self.m // 64 * (self.k // 16)

    def smem_bytes(self) -> int:
        a = 0 if self.a_in_registers else 64 * 16 * 2
        return self.instructions() * (a + self.n * 16 * 2)

    def flops(self) -> int:
        return 2 * self.m * self.n * self.k


class Design(NamedTuple):
    """A kernel's step: its products per warpgroup, the bytes each warpgroup stores, the
    bytes the loader writes (Q, dO) and the reducer reads (dQ), and whether ``sm90_check``
    compiles it with ``q_split``."""
    label: str
    head_dim: int
    products: tuple[Product, ...]
    stores: int
    tma_in: int
    reducer: int
    q_split: bool = False

    def smem_bytes(self) -> int:
        return 2 * (sum(p.smem_bytes() for p in self.products) + self.stores) + self.tma_in + self.reducer

    def flops(self) -> int:
        return 2 * sum(p.flops() for p in self.products)

    def bound(self) -> float:
        """FLOP time / shared-memory time: the tensor pipe's busy share when shared memory is saturated."""
        return (self.flops() / TENSOR_FLOP_PER_CLOCK) / (self.smem_bytes() / SMEM_BYTES_PER_CLOCK)

    def wgmma_counts(self) -> Counter:
        """wgmma instructions by (shape, A in registers) in the whole kernel: two warpgroups,
        each issuing its products in the loop and in the phases named."""
        counts = Counter()
        for p in self.products:
            counts[(f"64x{p.n}x16", p.a_in_registers)] += 2 * p.instructions() * (1 + len(p.phases))
        return counts


def designs() -> dict[str, Design]:
    """Today's d64 and d128 kernels and session 51's d64 query split (``Q_SPLIT``)."""
    first, last = ("first",), ("last",)
    d64 = Design("d64: 128 q x 128 keys, warpgroups split the keys (default)", 64, (
        Product("S = Q K_w^T", 128, 64, 64, phases=first), Product("dP = dO V_w^T", 128, 64, 64, phases=first),
        Product("dV_w += P_w^T dO", 64, 64, 128, phases=last), Product("dK_w += dS_w^T Q", 64, 64, 128, phases=last),
        Product("dQ[:, half] = dS K[:, half]", 128, 32, 128, phases=last)),
        stores=2 * 128 * 64 * 2 + 128 * 32 * 4, tma_in=2 * 128 * 64 * 2, reducer=128 * 64 * 4)
    d128 = Design("d128: 64 q x 128 keys, warpgroups split the keys (default)", 128, (
        Product("S = Q K_w^T", 64, 64, 128, phases=first), Product("dP = dO V_w^T", 64, 64, 128, phases=first),
        Product("dV_w += P_w^T dO", 64, 128, 64, phases=last), Product("dK_w += dS_w^T Q", 64, 128, 64, phases=last),
        Product("dQ[:, half] = dS K[:, half]", 64, 64, 128, phases=last)),
        stores=2 * 64 * 64 * 2 + 64 * 64 * 4, tma_in=2 * 64 * 128 * 2, reducer=64 * 128 * 4)
    split = Design("d64: 128 q x 128 keys, warpgroups split the queries (Q_SPLIT)", 64, (
        Product("S_w = Q_w K^T", 64, 128, 64, phases=first), Product("dP_w = dO_w V^T", 64, 128, 64, phases=first),
        Product("dV_w += P[:, w]^T dO", 64, 64, 128, phases=last),
        Product("dK_w += dS[:, w]^T Q", 64, 64, 128, phases=last),
        Product("dQ_w = dS_w K", 64, 64, 128, a_in_registers=True, phases=first)),
        stores=2 * 64 * 128 * 2 + 64 * 64 * 4, tma_in=2 * 128 * 64 * 2, reducer=128 * 64 * 4,
        q_split=True)
    return {"d64": d64, "d128": d128, "d64-split": split}


def table() -> list[str]:
    lines = ["| kernel | smem KB a step | of it, products | MFLOP a step | FLOP time / smem time | ncu tensor / L1 |",
             "|---|---|---|---|---|---|"]
    for key, d in designs().items():
        ncu = NCU_RUN253.get(key)
        seen = f"{ncu[0]} / {ncu[1]} = {ncu[0] / ncu[1]:.2f}" if ncu else "not run"
        products = 2 * sum(p.smem_bytes() for p in d.products)
        lines.append(f"| {d.label} | {d.smem_bytes() // 1024} | {products // 1024} | {d.flops() / 1e6:.2f} | "
                     f"{d.bound():.2f} | {seen} |")
    return lines


def sass_counts(sass: str) -> Counter:
    """wgmma instructions by (shape, A in registers) in sm_90a SASS."""
    counts = Counter()
    for line in sass.splitlines():
        if "HGMMA." in line:
            shape, operands = line.split("HGMMA.", 1)[1].split(None, 1)
            counts[(shape.split(".")[0], operands.split(",")[1].strip().startswith("R"))] += 1
    return counts


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--check", action="store_true",
                   help="compile each kernel for sm_90a (CPU) and compare its wgmmas with the model")
    args = p.parse_args(argv)
    print("\n".join(table()))
    if not args.check:
        return 0
    from flashtile.tools.sm90_check import compile_backward_onepass

    failures = 0
    for key, d in designs().items():
        got = sass_counts(compile_backward_onepass("bf16", d.head_dim, causal=False, q_split=d.q_split).sass())
        ok = got == d.wgmma_counts()
        failures += not ok
        print(f"{key}: wgmmas {'as modelled' if ok else 'DIFFER'}: {dict(got)}" + ("" if ok else
                                                                                f" (model {dict(d.wgmma_counts())})"))
    return 1 if failures else 0


if __name__ == "__main__":
    sys.exit(main())

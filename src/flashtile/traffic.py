"""HBM traffic and FLOP model of attention, and a roofline estimate.

The one place flashtile defines how many FLOPs an attention call does and how many bytes
it moves; tests, benchmarks and the CLI import these numbers instead of re-deriving them.
NumPy only at import time (matplotlib is imported inside `plot_traffic`).

The model (derivation and a worked example: docs/traffic-model.md):
- `memory_work` is per (batch, head): Q, O, dO, dQ are N x d, K, V, dK, dV are M x d with
  M = seqlen_k, and an "N x N" array is N x M. Bytes = elements * dtype_bytes, except LSE
  and D = rowsum(dO * O), which are fp32, and the dQ accumulator, which is fp32.
- On-chip SRAM holds one Q tile (Br x d) and one K/V tile (Bc x d); everything else lives
  in HBM. Traffic that a cache could absorb (the same tile read again by a later tile
  pair, dQ atomics) is not hidden: it gets its own ledger line whose name ends in "(L2 or
  HBM)", and `sram_kv_reuse` says whether it counts. By default it does not ("l2"): the
  L2 absorbs those re-reads, so FlashAttention's HBM bytes grow linearly in N, as the
  lesson says and the H200's DRAM counters measured (docs/traffic-model.md);
  `sram_kv_reuse="hbm"` is the every-re-read-from-HBM bound.
- Causal masks are aligned bottom-right (query r sees keys c <= r + M - N, the flash-attn
  convention); with N == M this is the usual lower triangle including the diagonal.
"""

from __future__ import annotations

import math
import sys
from dataclasses import dataclass, fields
from pathlib import Path
from typing import Any, Iterable, Literal, TextIO

import numpy as np

__all__ = [
    "AlgorithmWork",
    "DQ_ACCUM_BYTES",
    "GPUSpec",
    "H200",
    "H200_MEASURED",
    "LedgerLine",
    "MemoryWork",
    "REREAD_TAG",
    "RooflineEstimate",
    "STATS_BYTES",
    "attention_flops",
    "attention_roofline",
    "format_ledger",
    "memory_work",
    "min_hbm_bytes",
    "plot_traffic",
    "print_traffic_table",
    "roofline_time",
]

REREAD_TAG = "(L2 or HBM)"  # suffix of ledger lines a cache could absorb
STATS_BYTES = 4  # LSE and D are fp32 whatever the input dtype, as in FlashAttention
DQ_ACCUM_BYTES = 4  # FA2 accumulates dQ across K/V tiles in fp32 (fp16 atomics lose too much)
# Backward = 5 matmuls (QK^T recomputed, dV, dP, dQ, dK) against the forward's 2.
_PASS_FACTOR = {"fwd": 1.0, "bwd": 2.5, "fwd_bwd": 3.5}
_MB = 1e6  # tables print decimal megabytes, like the TB/s of the bandwidth ceilings


def _size(name: str, value: Any) -> int:
    """Return `value` as a positive int; TypeError/ValueError naming `name` otherwise."""
    if isinstance(value, bool) or not isinstance(value, (int, np.integer)):
        raise TypeError(f"{name} must be an int, got {value!r} ({type(value).__name__})")
    if value <= 0:
        raise ValueError(f"{name} must be positive, got {value!r}")
    return int(value)


def _pass(pass_: str) -> str:
    if pass_ not in _PASS_FACTOR:
        raise ValueError(f"pass_ must be one of {tuple(_PASS_FACTOR)}, got {pass_!r}")
    return pass_


# ---------------------------------------------------------------------------------------
# Convention FLOPs and the compulsory-bytes floor (whole batch, all heads)
# ---------------------------------------------------------------------------------------


def attention_flops(
    batch: int,
    nheads: int,
    seqlen_q: int,
    seqlen_k: int,
    headdim: int,
    causal: bool = False,
    pass_: str = "fwd",
) -> float:
    """FLOPs of one attention call by the FlashAttention-2/3 papers' convention (FLOP).

    Forward = 4 * B * H * Sq * Sk * D (two matmuls, QK^T and PV, 2 FLOP per multiply-add),
    halved when causal (the convention halves; it does not count the diagonal exactly).
    "bwd" = 2.5 x forward (5 matmuls, one the recomputation of QK^T); "fwd_bwd" = 3.5 x.
    Softmax exponentials and rescales are not counted. This is the number benchmarks
    divide by time to report TFLOP/s, so that rows compare with published tables.
    """
    sizes = [_size(n, v) for n, v in (("batch", batch), ("nheads", nheads),
             ("seqlen_q", seqlen_q), ("seqlen_k", seqlen_k), ("headdim", headdim))]
    factor = _PASS_FACTOR[_pass(pass_)]
    fwd = 4.0 * math.prod(sizes)
    return fwd * (0.5 if causal else 1.0) * factor


def min_hbm_bytes(
    batch: int,
    nheads: int,
    nheads_k: int,
    seqlen_q: int,
    seqlen_k: int,
    headdim: int,
    dtype_bytes: int = 2,
    pass_: str = "fwd",
) -> int:
    """Compulsory HBM bytes of one attention call: every tensor it needs, moved once.

    fwd: read q [B, Sq, H, D], k and v [B, Sk, Hk, D]; write out [B, Sq, H, D] and the fp32
    LSE [B, H, Sq]. bwd: read q, k, v, out, dout and LSE; write dq, dk, dv. "fwd_bwd" is the
    sum of the two passes. GQA/MQA: k, v, dk, dv have `nheads_k` heads. The backward's
    D = rowsum(dout * out) (fp32, written once, read per tile) is an implementation choice
    of FlashAttention, not compulsory, so it is left out; so are tile re-reads. No real
    kernel moves fewer bytes than this, so bytes / time against it is a lower bound on the
    bandwidth achieved.
    """
    batch, nheads, nheads_k, seqlen_q, seqlen_k, headdim, dtype_bytes = (
        _size(n, v) for n, v in (("batch", batch), ("nheads", nheads), ("nheads_k", nheads_k),
                                 ("seqlen_q", seqlen_q), ("seqlen_k", seqlen_k),
                                 ("headdim", headdim), ("dtype_bytes", dtype_bytes)))
    if nheads % nheads_k:
        raise ValueError(f"nheads_k must divide nheads={nheads}, got nheads_k={nheads_k}")
    q = batch * nheads * seqlen_q * headdim * dtype_bytes  # also out, dout, dq
    kv = batch * nheads_k * seqlen_k * headdim * dtype_bytes  # each of k, v, dk, dv
    lse = batch * nheads * seqlen_q * STATS_BYTES
    fwd = 2 * q + 2 * kv + lse  # read q, k, v; write out, lse
    bwd = 4 * q + 4 * kv + lse  # read q, k, v, out, dout, lse; write dq, dk, dv
    return {"fwd": fwd, "bwd": bwd, "fwd_bwd": fwd + bwd}[_pass(pass_)]


# ---------------------------------------------------------------------------------------
# Per-head ledger: naive three-kernel attention against the tiled (FlashAttention-2) one
# ---------------------------------------------------------------------------------------


class _ItemAccess:
    """`obj["field"]` for a dataclass, so results read like the dicts of the lesson."""

    def __getitem__(self, key: str) -> Any:
        if key not in self.keys():
            raise KeyError(f"{key!r}; known keys: {self.keys()}")
        return getattr(self, key)

    def keys(self) -> tuple[str, ...]:
        return tuple(f.name for f in fields(self))  # type: ignore[arg-type]


@dataclass(frozen=True)
class LedgerLine(_ItemAccess):
    """HBM bytes one tensor (or one kind of repeated access to it) costs."""

    tensor: str
    reads_bytes: int
    writes_bytes: int
    note: str = ""

    @property
    def total_bytes(self) -> int:
        return self.reads_bytes + self.writes_bytes

    @property
    def is_reread(self) -> bool:
        """True for traffic a cache could absorb (name ends in REREAD_TAG)."""
        return self.tensor.endswith(REREAD_TAG)


@dataclass(frozen=True)
class AlgorithmWork(_ItemAccess):
    """Modelled cost of one algorithm for one (batch, head).

    nxn_touches: elements of full N x M score-sized arrays read or written (the lesson's
        count: it grows as N^2 for naive attention and is 0 for FlashAttention).
    nxn_arrays: how many such full arrays are read or written (4 forward, 7 with the
        backward, for naive attention; nxn_touches = nxn_arrays * N * M).
    hbm_bytes: sum of the ledger, without the "(L2 or HBM)" lines when sram_kv_reuse="l2".
    compulsory_bytes: `min_hbm_bytes` of the problem, the same floor for both algorithms.
    flops: useful matmul FLOPs, counting only visible score elements exactly.
    executed_flops: matmul FLOPs the algorithm really issues (full tiles, full squares).
    """

    name: str
    nxn_touches: int
    hbm_bytes: int
    compulsory_bytes: int
    flops: int
    executed_flops: int
    ledger: tuple[LedgerLine, ...]
    nxn_arrays: int = 0

    @property
    def reread_bytes(self) -> int:
        return sum(line.total_bytes for line in self.ledger if line.is_reread)

    def line(self, tensor: str) -> LedgerLine:
        """The ledger line named `tensor` (KeyError if absent)."""
        for entry in self.ledger:
            if entry.tensor == tensor:
                return entry
        raise KeyError(f"no ledger line {tensor!r} in {self.name}")


@dataclass(frozen=True)
class MemoryWork(_ItemAccess):
    """`memory_work` result: `naive` and `flash` AlgorithmWork, by attribute or key."""

    naive: AlgorithmWork
    flash: AlgorithmWork

    @property
    def ratio(self) -> float:
        """naive HBM bytes / flash HBM bytes."""
        return self.naive.hbm_bytes / self.flash.hbm_bytes


def _visible_elements(n: int, m: int, causal: bool) -> int:
    """Score elements a query can see: N*M, or under the bottom-right causal mask
    sum over rows r of max(0, r + M - N + 1), a run of consecutive integers ending at M.
    N == M gives N(N+1)/2."""
    if not causal:
        return n * m
    lo = max(m - n + 1, 1)
    return (m + lo) * (m - lo + 1) // 2


@dataclass(frozen=True)
class _TileGrid:
    rows: np.ndarray  # height of each Q tile (Br, the last one shorter)
    cols: np.ndarray  # width of each K/V tile (Bc, the last one shorter)
    kv_per_q: np.ndarray  # K/V tiles with at least one visible element, per Q tile
    q_per_kv: np.ndarray  # Q tiles that visit each K/V tile


def _tile_grid(n: int, m: int, br: int, bc: int, causal: bool) -> _TileGrid:
    """Which (Q tile, K/V tile) pairs a tiled kernel visits, in O(N/Br + M/Bc).

    Causal: the last row of Q tile i sees the most keys, r_last + M - N, so the tile visits
    K/V tiles 0 .. (r_last + M - N) // Bc (none if that is negative): the lower-triangle
    tiles including the diagonal ones, whatever the divisibility of N and M.
    """
    tr, tc = -(-n // br), -(-m // bc)
    rows = np.full(tr, br, dtype=np.int64)
    rows[-1] = n - br * (tr - 1)
    cols = np.full(tc, bc, dtype=np.int64)
    cols[-1] = m - bc * (tc - 1)
    if causal:
        last_key = np.minimum(np.arange(1, tr + 1, dtype=np.int64) * br, n) - 1 + (m - n)
        kv_per_q = np.where(last_key >= 0, np.minimum(last_key // bc + 1, tc), 0)
    else:
        kv_per_q = np.full(tr, tc, dtype=np.int64)
    # K/V tile j is visited by every Q tile i with kv_per_q[i] > j.
    q_per_kv = tr - np.cumsum(np.bincount(kv_per_q, minlength=tc + 1))[:tc]
    return _TileGrid(rows, cols, kv_per_q, q_per_kv)


def _naive_ledger(n: int, m: int, d: int, b: int, backward: bool) -> tuple[list[LedgerLine], int]:
    """Three PyTorch-style kernels; the forward saves P for the backward (autograd does)."""
    q, kv, nm = n * d * b, m * d * b, n * m * b
    if not backward:
        # S = QK^T (write S); P = softmax(S) (read S, write P); O = PV (read P). A causal
        # mask is applied to the full S, so causal moves the same bytes.
        return [
            LedgerLine("Q", q, 0, "read by the QK^T kernel"),
            LedgerLine("K", kv, 0, "read by the QK^T kernel"),
            LedgerLine("V", kv, 0, "read by the PV kernel"),
            LedgerLine("S", nm, nm, "written by QK^T, read by softmax"),
            LedgerLine("P", nm, nm, "written by softmax, read by PV (and kept for backward)"),
            LedgerLine("O", 0, q, "written by PV"),
            LedgerLine("LSE", 0, 0, "not stored: the backward uses the saved P"),
        ], 4
    # dV = P^T dO; dP = dO V^T; dS = P * (dP - rowsum(P * dP)) in one softmax-backward
    # kernel; dQ = dS K; dK = dS^T Q. Nothing is recomputed: P comes from the forward.
    return [
        LedgerLine("Q", q, 0, "read by dK = dS^T Q"),
        LedgerLine("K", kv, 0, "read by dQ = dS K"),
        LedgerLine("V", kv, 0, "read by dP = dO V^T"),
        LedgerLine("O", 0, 0, "not needed: the softmax backward uses rowsum(P * dP)"),
        LedgerLine("dO", 2 * q, 0, "read by dV = P^T dO and by dP = dO V^T"),
        LedgerLine("LSE", 0, 0, "not needed: P was saved"),
        LedgerLine("D", 0, 0, "rowsum(P * dP) stays inside the softmax-backward kernel"),
        LedgerLine("P", 2 * nm, 0, "saved by the forward; read by dV and the softmax backward"),
        LedgerLine("dP", nm, nm, "written by dO V^T, read by the softmax backward"),
        LedgerLine("dS", 2 * nm, nm, "written by the softmax backward, read by dQ and dK"),
        LedgerLine("dQ", 0, q, "written by dS K"),
        LedgerLine("dK", 0, kv, "written by dS^T Q"),
        LedgerLine("dV", 0, kv, "written by P^T dO"),
    ], 7


def _flash_ledger(
    n: int, m: int, d: int, b: int, grid: _TileGrid, backward: bool
) -> list[LedgerLine]:
    """FlashAttention-2 loop orders; the first touch of a tensor is compulsory, repeats
    are "(L2 or HBM)" lines."""
    q, kv, tile = n * d * b, m * d * b, "Br x Bc tile in SRAM, never in HBM"
    if not backward:
        # Q tiles outer: each Q tile streams every visible K/V tile once.
        kv_extra = int((grid.cols * np.maximum(grid.q_per_kv - 1, 0)).sum()) * d * b
        why = f"each of the {len(grid.rows)} Q tiles streams every visible K/V tile again"
        return [
            LedgerLine("Q", q, 0, "one Q tile at a time, kept in SRAM for the whole K/V sweep"),
            LedgerLine("K", kv, 0, "first pass"),
            LedgerLine(f"K re-reads {REREAD_TAG}", kv_extra, 0, why),
            LedgerLine("V", kv, 0, "first pass"),
            LedgerLine(f"V re-reads {REREAD_TAG}", kv_extra, 0, why),
            LedgerLine("S", 0, 0, tile),
            LedgerLine("P", 0, 0, tile),
            LedgerLine("O", 0, q, "accumulated in registers, written once"),
            LedgerLine("LSE", 0, n * STATS_BYTES, "fp32 per query row, saved for the backward"),
        ]
    # K/V tiles outer, Q tiles inner: K_j, V_j stay in SRAM; each visible Q tile brings
    # Q_i, dO_i, LSE_i, D_i again and adds its share of dQ_i with fp32 atomics.
    loads = int((grid.rows * grid.kv_per_q).sum())  # Q-tile rows loaded over all pairs
    extra = int((grid.rows * np.maximum(grid.kv_per_q - 1, 0)).sum())
    why = f"each of the {len(grid.cols)} K/V tiles loads every visible Q-side tile again"
    stats = n * STATS_BYTES
    acc = loads * d * DQ_ACCUM_BYTES
    return [
        LedgerLine("Q", q, 0, "first load"),
        LedgerLine(f"Q re-reads {REREAD_TAG}", extra * d * b, 0, why),
        LedgerLine("K", kv, 0, "loaded once per outer K/V tile, kept in SRAM"),
        LedgerLine("V", kv, 0, "loaded once per outer K/V tile, kept in SRAM"),
        LedgerLine("O", q, 0, "read once by the preprocessing kernel that forms D"),
        LedgerLine("dO", q, 0, "read once by the preprocessing kernel that forms D"),
        LedgerLine(f"dO re-reads {REREAD_TAG}", loads * d * b, 0, "every visible tile pair"),
        LedgerLine("LSE", stats, 0, "fp32, first load"),
        LedgerLine(f"LSE re-reads {REREAD_TAG}", extra * STATS_BYTES, 0, why),
        LedgerLine("D", stats, stats, "rowsum(dO * O), fp32; not compulsory (FA2 choice)"),
        LedgerLine(f"D re-reads {REREAD_TAG}", extra * STATS_BYTES, 0, why),
        LedgerLine("S/P", 0, 0, "recomputed from Q, K and LSE; " + tile),
        LedgerLine("dS/dP", 0, 0, tile),
        LedgerLine("dQ accumulator", n * d * DQ_ACCUM_BYTES, n * d * DQ_ACCUM_BYTES,
                   "fp32 zero-fill, then one read to convert to the output dtype"),
        LedgerLine(f"dQ atomics {REREAD_TAG}", acc, acc,
                   "fp32 read-modify-write of dQ_i per visible tile pair"),
        LedgerLine("dQ", 0, q, "final write in the output dtype"),
        LedgerLine("dK", 0, kv, "written once per K/V tile"),
        LedgerLine("dV", 0, kv, "written once per K/V tile"),
    ]


def memory_work(
    N: int,
    d: int,
    *,
    dtype_bytes: int = 4,
    Br: int = 64,
    Bc: int = 64,
    causal: bool = False,
    backward: bool = False,
    seqlen_k: int | None = None,
    sram_kv_reuse: Literal["hbm", "l2"] = "l2",
) -> MemoryWork:
    """HBM traffic and FLOPs of naive vs tiled attention for one (batch, head).

    N: query length; seqlen_k: key length M (default N); d: head dim; dtype_bytes: bytes
    per element of Q/K/V/O and their gradients (4 = fp32, the lesson's default; 2 = fp16).
    Br x Bc: Q-tile rows x K/V-tile columns. backward=True models the backward pass
    alone (the forward's saved tensors are inputs). sram_kv_reuse="l2" (the default) takes
    the cache to serve every "(L2 or HBM)" line, so hbm_bytes leaves them out (they stay in
    the ledger): FlashAttention's bytes grow linearly in N, as the H200's DRAM counters
    measured; "hbm" counts them in hbm_bytes (the bound with nothing cached).

    Naive: three kernels (QK^T, softmax, PV), N x M arrays S and P go through HBM: 4
    touches forward; backward reads the saved P, no recomputation: 7 touches. Flash: 0
    touches; forward = Q outer / K,V inner, backward = K,V outer / Q inner (FA2). FLOPs:
    4 * visible * d forward, 10 * visible * d backward (2.5 x), visible = N*M or N(N+1)/2
    causal (exact count, unlike `attention_flops`' halving).
    """
    n, d = _size("N", N), _size("d", d)
    m = n if seqlen_k is None else _size("seqlen_k", seqlen_k)
    b, br, bc = _size("dtype_bytes", dtype_bytes), _size("Br", Br), _size("Bc", Bc)
    if sram_kv_reuse not in ("hbm", "l2"):
        raise ValueError(f"sram_kv_reuse must be 'hbm' or 'l2', got {sram_kv_reuse!r}")
    grid = _tile_grid(n, m, br, bc, bool(causal))
    per_element = 10 if backward else 4  # matmul FLOPs per score element and head dim
    compulsory = min_hbm_bytes(1, 1, 1, n, m, d, b, "bwd" if backward else "fwd")

    def total(ledger: list[LedgerLine]) -> int:
        return sum(x.total_bytes for x in ledger if not (x.is_reread and sram_kv_reuse == "l2"))

    useful = per_element * _visible_elements(n, m, bool(causal)) * d
    naive_ledger, touches = _naive_ledger(n, m, d, b, backward)
    # Naive computes the whole square (a mask only zeroes it) and skips the recomputation.
    naive = AlgorithmWork("naive", touches * n * m, total(naive_ledger), compulsory, useful,
                          (8 if backward else 4) * n * m * d, tuple(naive_ledger), touches)
    flash_ledger = _flash_ledger(n, m, d, b, grid, backward)
    # Flash computes every element of each visited tile, masked or not.
    computed = int((grid.rows * np.minimum(grid.kv_per_q * bc, m)).sum())
    flash = AlgorithmWork("flash", 0, total(flash_ledger), compulsory, useful,
                          per_element * computed * d, tuple(flash_ledger))
    return MemoryWork(naive, flash)


def format_ledger(work: AlgorithmWork) -> str:
    """The ledger of `work` as an aligned text table (bytes in MB = 1e6 bytes)."""
    out = [f"{'tensor':<22} {'read MB':>10} {'write MB':>10}  note"]
    for x in work.ledger:
        out.append(f"{x.tensor:<22} {x.reads_bytes / _MB:>10.3f} "
                   f"{x.writes_bytes / _MB:>10.3f}  {x.note}")
    out.append(f"{'total HBM':<22} {work.hbm_bytes / _MB:>21.3f}")
    return "\n".join(out)


def print_traffic_table(
    seq_lengths: Iterable[int] = (128, 256, 512, 1024, 2048, 4096, 8192, 16384),
    d: int = 64,
    dtype_bytes: int = 4,
    Br: int = 64,
    Bc: int = 64,
    causal: bool = False,
    file: TextIO | None = None,
) -> list[dict[str, Any]]:
    """Print naive vs flash forward traffic per head for each N; return the rows.

    Columns: N; naive N x N elements touched (4 * N^2); naive HBM MB; flash compulsory MB;
    flash MB including the K/V re-reads; naive / flash with re-reads (`ratio`, about
    2 * Br / d: both are quadratic in N) and naive / flash compulsory (`ratio_compulsory`,
    grows like N: what a cache that absorbs every re-read would give). MB = 1e6 bytes.
    """
    file = sys.stdout if file is None else file
    rows = []
    for n in seq_lengths:
        # the every-re-read-from-HBM bound: the table's "flash+reread" column
        w = memory_work(n, d, dtype_bytes=dtype_bytes, Br=Br, Bc=Bc, causal=causal, sram_kv_reuse="hbm")
        rows.append({
            "N": int(n),
            "naive_nxn_elements": w.naive.nxn_touches,
            "naive_hbm_bytes": w.naive.hbm_bytes,
            "flash_compulsory_bytes": w.flash.compulsory_bytes,
            "flash_hbm_bytes": w.flash.hbm_bytes,
            "ratio": w.ratio,
            "ratio_compulsory": w.naive.hbm_bytes / w.flash.compulsory_bytes,
        })
    print(f"HBM traffic per head, forward: d={d}, {dtype_bytes} B/element, Br={Br}, Bc={Bc}, "
          f"causal={bool(causal)} (MB = 1e6 bytes)", file=file)
    print(f"{'N':>7} | {'naive NxN elems':>15} | {'naive MB':>10} | {'flash min MB':>12} | "
          f"{'flash+reread MB':>15} | {'naive/flash':>11} | {'naive/min':>9}", file=file)
    for r in rows:
        print(f"{r['N']:>7} | {r['naive_nxn_elements']:>15,} | "
              f"{r['naive_hbm_bytes'] / _MB:>10.2f} | "
              f"{r['flash_compulsory_bytes'] / _MB:>12.3f} | {r['flash_hbm_bytes'] / _MB:>15.3f} | "
              f"{r['ratio']:>10.1f}x | {r['ratio_compulsory']:>8.1f}x", file=file)
    return rows


def plot_traffic(
    seq_lengths: Iterable[int],
    path: str | Path,
    d: int = 64,
    dtype_bytes: int = 4,
    Br: int = 64,
    Bc: int = 64,
) -> Path:
    """Log-log PNG of forward HBM bytes per head vs N: naive, flash compulsory, flash with
    K/V re-reads. Needs matplotlib (`pip install flashtile[plot]`). Returns the path."""
    try:
        from matplotlib.backends.backend_agg import FigureCanvasAgg
        from matplotlib.figure import Figure
    except ImportError as exc:  # optional dependency
        raise ImportError("plot_traffic needs matplotlib: pip install flashtile[plot]") from exc
    ns = [_size("seq_lengths item", n) for n in seq_lengths]
    if not ns:
        raise ValueError("seq_lengths must not be empty, got an empty sequence")
    works = [memory_work(n, d, dtype_bytes=dtype_bytes, Br=Br, Bc=Bc, sram_kv_reuse="hbm") for n in ns]
    # A bare Figure on the Agg canvas: no pyplot, so no global backend switch for the caller.
    fig = Figure(figsize=(6.4, 4.4))
    FigureCanvasAgg(fig)
    ax = fig.add_subplot()
    ax.loglog(ns, [w.naive.hbm_bytes for w in works], "o-", label="naive (S, P through HBM)")
    ax.loglog(ns, [w.flash.hbm_bytes for w in works], "s-",
              label=f"flash incl. K/V re-reads (Br={Br})")
    ax.loglog(ns, [w.flash.compulsory_bytes for w in works], "^--", label="flash compulsory")
    ax.set_xlabel("sequence length N")
    ax.set_ylabel("HBM bytes per head (forward)")
    ax.set_title(f"Attention HBM traffic, d={d}, {dtype_bytes} B/element")
    ax.grid(True, which="both", alpha=0.3)
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    return Path(path)


# ---------------------------------------------------------------------------------------
# Roofline
# ---------------------------------------------------------------------------------------


@dataclass(frozen=True)
class GPUSpec:
    """Ceilings of one GPU: HBM bandwidth (bytes/s) and dense matmul throughput (FLOP/s)."""

    name: str
    hbm_bytes_per_s: float
    matmul_flops_per_s: float

    @property
    def ridge_flops_per_byte(self) -> float:
        """Arithmetic intensity where the two ceilings meet (FLOP/byte)."""
        return self.matmul_flops_per_s / self.hbm_bytes_per_s


H200 = GPUSpec("NVIDIA H200", 4.8e12, 989e12)  # datasheet: HBM3e, dense fp16/bf16
# Measured in BENCHMARKS.md: device-to-device copy (read + write bytes), bf16 8192^3 matmul.
H200_MEASURED = GPUSpec("NVIDIA H200 (measured copy/matmul)", 4.24e12, 775e12)


@dataclass(frozen=True)
class RooflineEstimate:
    """Roofline time (s): the larger of compute_s and memory_s; `bound` names which."""

    seconds: float
    compute_s: float
    memory_s: float
    bound: Literal["compute", "memory"]


def roofline_time(flops: float, bytes_: float, gpu: GPUSpec = H200) -> RooflineEstimate:
    """Lower-bound time of a kernel doing `flops` FLOP and moving `bytes_` HBM bytes,
    assuming compute and memory overlap perfectly: max(flops / peak, bytes / bandwidth)."""
    for name, value in (("flops", flops), ("bytes_", bytes_)):
        if isinstance(value, bool) or not isinstance(value, (int, float, np.integer, np.floating)):
            raise TypeError(f"{name} must be a number, got {value!r}")
        if not math.isfinite(value) or value < 0:
            raise ValueError(f"{name} must be finite and >= 0, got {value!r}")
    compute_s = float(flops) / gpu.matmul_flops_per_s
    memory_s = float(bytes_) / gpu.hbm_bytes_per_s
    bound: Literal["compute", "memory"] = "compute" if compute_s >= memory_s else "memory"
    return RooflineEstimate(max(compute_s, memory_s), compute_s, memory_s, bound)


def attention_roofline(
    batch: int,
    nheads: int,
    nheads_k: int,
    seqlen_q: int,
    seqlen_k: int,
    headdim: int,
    causal: bool = False,
    dtype_bytes: int = 2,
    pass_: str = "fwd",
    gpu: GPUSpec = H200,
) -> RooflineEstimate:
    """Roofline of one attention call: `attention_flops` against `min_hbm_bytes`.

    Both are floors (no re-reads, convention FLOPs), so this is the fastest any kernel
    could be; measured time / this = how far from the ceiling a kernel runs.
    """
    flops = attention_flops(batch, nheads, seqlen_q, seqlen_k, headdim, causal, pass_)
    bytes_ = min_hbm_bytes(batch, nheads, nheads_k, seqlen_q, seqlen_k, headdim, dtype_bytes, pass_)
    return roofline_time(flops, bytes_, gpu)

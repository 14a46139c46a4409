"""Hopper one-pass backward in Gluon (sm90, fp16/bf16, plain or causal): FA3's design, dQ
by bulk TMA reductions into a float32 buffer. The default backward at head dims 64 and 128
unless the call asks for determinism (``scope.onepass_scope``; ``backends.registry``);
packed sequences (a work list of key blocks, as the split kernels take them) only with
``FLASHTILE_BWD_DQ=onepass`` until a GPU has measured them (compiled, session 23).

The same algebra as ``backward.py`` (read its docstring first) and the same scope as
``backward_split`` (read its docstring second), in one kernel with 5 tile products per tile
pair instead of the split kernels' 7. One program owns a block of 2 x 64 keys of one
(batch, kv head) and streams every query block that sees those keys, for every query head
of the GQA group (so dK and dV are summed over the group in registers). A step takes
QROWS queries (``Q_ROWS``): 128 at d64 (FA3's d64 tiling), 64 at d128 and for packed
sequences. Programs run pair-major (a (batch, kv head)'s key blocks side by side), or
block-major within groups of about a wave's worth of pairs for causal GQA (``pair_group``).
Partitions:

    loader   (1 warp)  K and V of the block once, then (Q_s, dO_s) tiles of QROWS queries
                       through a NUM_BUF-slot ring by TMA
    consumer (2 x 4 warps; warpgroup w owns keys w*64 .. w*64+63), per step s:
        issue  S_s = Q_s K_w^T,  dP_s = dO_s V_w^T                   (async wgmma)
        issue  dV_w += P_{s-1}^T dO_{s-1},  dK_w += dS_{s-1}^T Q_{s-1}   (async)
        wait for S_s, dP_s only
        P_s = exp2(S_s * c - lse),  dS_s = P_s (dP_s - Delta)   (under step s-1's products)
        issue  dQ_{s-1}[:, half w] = dS_{s-1} K[:, half w]     (both warpgroups' dS)
        wait; store dQ_{s-1}'s half (scaled) in a float32 shared-memory slot for the reducer
    reducer  (1 warp) per step: once both halves are in the step's slot, two bulk TMA
             reductions (``tma_reduce``: cp.reduce.async.bulk.tensor add) into the float32
             dQ; it frees the slot when the next step's reductions are issued and the
             slot's have been read (one step's reductions stay in flight)

then a small Triton kernel (``_dq_convert``) casts the float32 dQ into dq. The two
warpgroups split the dQ product by head-dim halves, each reading both warpgroups' dS;
two mbarriers hand dS between them (``ds_full``: both halves stored; ``ds_empty``: both
dQ products have read them). Neighbouring key blocks start their query loop at different
query blocks (``_step_coords``), so their reductions do not all hit one dQ tile at once.
``Q_SPLIT`` (session 51, off until a GPU has measured it) splits d64's steps by queries
instead: ``_qsplit_consumer``, 416 KB of shared memory a step against 512
(benchmarks/experiments/smem_model.py).

The float32 sums of dQ arrive in an order that varies between runs, so dQ is not bitwise
reproducible (dK and dV are: each program owns its keys). ``deterministic=True`` and
``torch.use_deterministic_algorithms(True)`` take this kernel in its deterministic mode
(``scope.onepass_scope``: fixed lengths; without causal at every length, causal from
``scope.DETERMINISTIC_ONEPASS_MIN_SEQLEN`` queries on, any fixed length with
``FLASHTILE_BWD_DQ=onepass``), else the split kernels of ``backward_split`` (FA3's mode;
sessions 42-43, H100 runs 232-237): each (query head, query tile) has an int32 counter;
the reducer waits until the counter reads its key block's turn (``_det_turn``), adds,
waits until its sums are in global memory and adds 1. Without causal, where
``det_rotate``'s rule allows it (a pair's key blocks on half the SMs: S <= 8448 on an H100
or H200), each block keeps the plain kernel's staggered start and each tile's sums come in
arrival order (``_rotated_turn``): a block waits only for the one that was at its tile a
step before (H100 run 237, kernel alone: 0.93-0.97 of the plain kernel, from 0.81-0.94
with every block from the first tile). Otherwise every block streams the query tiles from
the first (no rotation), so the blocks of a tile reach it in turn order; with causal
masking the higher blocks (which see a tile first) go first and are launched first, so no
block waits for one that cannot start.

Speed (H200, session 16, docs/perf-notes.md "One-pass backward", runs 83-88): at d64, in
``flashtile bench``, 1.03-1.09x the split kernels without causal and 0.99-1.04x with it
(bf16, S512-16384), 0.81-0.87x cuDNN (bf16 and fp16, run 92). At d128 the wgmma
descriptors of the fixed tiles (K, V, P, dS and the dQ halves of K: one per tile and
k-step) were hoisted out of the loop and spilled (1,292 B; ncu: 3.2 GB of local loads per
call at S4096, 40% of the stall cycles on L1TEX), and it lost to the split kernels
(0.90-0.99x). Its loop now makes those views anew each step from an index the compiler
cannot fold (312 B of spills; 1.27 GB of local loads): 1.07-1.16x the split kernels and
0.95-1.06x cuDNN, bf16, the kernels alone (H200 run 96), so d128 takes it too. At d64,
steps of 128 queries instead of 64 (H100 runs 205-207, session 37): the kernel alone
+12-14% without causal and +5-7% with it (S2048-16384); ``flashtile bench`` bf16 0.92-1.01x
cuDNN at S >= 2048 (0.85-0.91x before, run 194). Since session 41 the consumers store dQ in
their accumulator registers' own order (``DQ_SWIZZLE``, ``native_offset_bases``): H100 runs
220-221, ``flashtile bench`` bf16 S2048-16384 d64 0.95-1.04x cuDNN, d128 1.01-1.05x.

Triton 3.6 turns constexprs passed through ``gl.warp_specialize`` into tensors, so the
partitions read compile-time sizes from descriptor and shared-memory types (CAUSAL: the
kv_bar array has a third, unused entry).
"""

from __future__ import annotations

import triton
import triton.language as tl
from triton.experimental import gluon
from triton.experimental.gluon import language as gl
from triton.experimental.gluon.language.nvidia.hopper import (
    fence_async_shared,
    mbarrier,
    tma,
    warpgroup_mma,
    warpgroup_mma_wait,
)

from flashtile.backends.sm90.backward_split import BLOCK, CONSUMER_REGS, LOADER_REGS, ROWS
from flashtile.backends.sm90.common import (dkdv_step_products, grouped_coords, step_range, store_grad_tile,
                                           tma_descriptor, varlen_item)
from flashtile.backends.sm90.common import pair_group as common_pair_group
from flashtile.backends.sm90.tma_reduce import async_reduce_add_shared_to_global
from flashtile.backends.triton.scores import C_LOG2E, LOG2E
from flashtile.runtime.device import sm_count
from flashtile.runtime.launch import Launcher

HEAD_DIMS = (64, 128)  # what it compiles for (the default at both: scope.ONEPASS_HEAD_DIMS)
NUM_BUF = {64: 4, 128: 2}  # (Q, dO) ring slots of 64 rows (half as many of 128 rows)
# float32 dQ slots (QROWS x D each). d64 takes one since session 42 (library A/B, H100, four rounds:
# +0.8 to +3.2% against two but -0.8% at one row); d128 keeps two (one read -2.6 to +1.2%).
DQ_BUF = {64: 1, 128: 2}
# deterministic calls: two at d64 too (a slot more lets the consumers run ahead while the
# reducer waits its turn; H100 run 233: causal +3 to +9%, without causal 0 to -3%)
DQ_BUF_DETERMINISTIC = {64: 2, 128: 2}
# packed sequences keep two (their 64-row steps with one slot were tested, run 229, not timed)
DQ_BUF_PACKED = {64: 2, 128: 2}
# Deterministic calls without causal: each key block from a query tile of its own (``det_rotate``,
# ``_rotated_turn``: session 43) where the rule allows it. H100 run 237 (bf16, kernel alone, against
# every block from the first tile): d64 +19% at S2048, +7% at S8192; d128 +9%, +1.5%.
DET_ROTATE_DEFAULT = True
# Causal GQA calls run block-major within groups of (batch, kv head) pairs, the groups one
# after another (``pair_group``: about one wave of programs a group), causal MHA pair-major
# unless ``GROUP_MHA``; None: that rule, else this many pairs a group for every causal call (0:
# every pair in one group, block-major as H200 run 104 measured it; 1: pair-major). Experiments'
# knobs (``benchmarks/experiments/bwd_order_ab.py``); GROUP_MHA waits for an MHA A/B (runs
# 248-249: groups of 2 and 4 at S2048 d128 2-3% slower than pair-major, S4096 0.4-1.4% faster).
PAIR_GROUP: int | None = None
GROUP_MHA = False
# The dQ slots' layout. ``DQ_NATIVE`` ("native", the default for fixed-length calls since
# session 41): each thread stores its wgmma accumulator registers in their own order
# (``native_offset_bases``: st.shared.v4, no bank conflicts, one TMA box per half); H100
# runs 218-221 (docs/perf-notes.md, "Session 41"), the kernel alone against the swizzles
# below: d128 +3.8 to +5.8% (S16384 causal -0.2%), d64 +1.6 to +7.2%; the library's bf16
# backward +0.3 to +11% (S2048-16384, causal and not; 0.95-1.05x cuDNN, from 0.92-1.06x).
# Else a swizzle in bytes (0: none): the accumulator's st.shared.v2 stores are 2-way
# bank-conflicted at 128 and 64, 4-way at 0, conflict-free at 32 (gl.bank_conflicts,
# sm_90a), and a 32-byte swizzle cuts each slot's TMA reduction into 8-column boxes; H100
# runs 117, 123, 124: 32 bytes won at d64 (+3.5 to +9.7%) and lost 0-3% at d128. Packed
# sequences (a query tile may start at any row) keep those: ``DQ_SWIZZLE_PACKED``.
DQ_NATIVE = "native"
DQ_SWIZZLE = {64: DQ_NATIVE, 128: DQ_NATIVE}
DQ_SWIZZLE_PACKED = {64: 32, 128: 128}
REDUCER_REGS = 24
# The warpgroups split each step's queries for S, dP and dQ at d64 (``_qsplit_consumer``: m64n128
# products for S and dP, dQ from dS in registers, 416 KB of shared-memory reads and writes a step
# against 512; session 51, compiled only) instead of its keys. Off until a GPU has measured it.
Q_SPLIT = False
# Queries per step (the Q, dO tiles' rows) of fixed-length calls: 2 x BLOCK at d64, FA3's d64
# tiling (128 queries x 128 keys a step: S and dP of 128 x 64 per warpgroup, half the steps
# and barriers per FLOP; 2 ring slots of 128 rows, 229,888 B of shared memory). H100 run 205,
# the kernel alone, bf16 d64 S2048-16384: +12-14% without causal, +5-7% with it, against 64
# (docs/perf-notes.md, session 37). d128 has no room for it; packed sequences keep BLOCK.
Q_ROWS = {64: 2 * BLOCK, 128: BLOCK}


@triton.constexpr_function
def native_offset_bases(rows: int, cols: int) -> list[list[int]]:
    """The dQ slots' layout under ``dq_swizzle="native"`` (FA3's dQ accumulation): the
    (row, col) of a (rows x cols) float32 slot at each bit of its shared-memory offset, so
    that thread t of the warpgroup stores its wgmma accumulator registers 4i .. 4i + 3 at
    floats 4 (128 i + t) .. + 3 (one ``st.shared.v4`` per 4 registers, a warp's 32 stores
    512 contiguous bytes: no bank conflicts, which ``_dq_finish`` asserts at compile time
    with ``gl.bank_conflicts``). The accumulator (``NVMMADistributedLayout`` [3, 0], 4 warps,
    instr_shape [16, cols, 16]), as triton 3.6's linear layout of it reads: register bits
    (col 1, row 8, then col 8 .. cols / 2, then row 64 .. rows / 2), lane bits (col 2,
    col 4, row 1, row 2, row 4), warp bits (row 16, row 32). The bulk reduction copies a
    slot's bytes as they are (a [rows, cols] box without swizzle), so the float32 dQ holds
    each (query tile, half) in this order too; ``_dq_convert`` puts the rows and columns
    back (each basis is one bit of a row or a column, so its inverse is a sum of shifts)."""
    if rows % 64 or rows & (rows - 1) or cols < 16 or cols & (cols - 1):
        raise ValueError(f"a native dQ slot is rows (64 x a power of two) x cols (a power of two >= 16), "
                         f"got {rows} x {cols}")
    reg = [[0, 1], [8, 0]] + [[0, 8 << i] for i in range((cols // 8).bit_length() - 1)]
    reg += [[64 << i, 0] for i in range((rows // 64).bit_length() - 1)]
    lane = [[0, 2], [0, 4], [1, 0], [2, 0], [4, 0]]
    warp = [[16, 0], [32, 0]]
    return reg[:2] + lane + warp + reg[2:]


@triton.constexpr_function
def _dq_slot_layout(native, rows, cols, tma_layout):
    """The dQ slots' shared layout: the accumulator's own order (``native_offset_bases``), or
    the TMA box's swizzled layout."""
    return gl.SharedLinearLayout(native_offset_bases(rows, cols)) if native else tma_layout


@triton.constexpr_function
def _is_native(layout):
    return isinstance(layout, gl.SharedLinearLayout)


def pair_group(causal: bool, num_n_blocks: int, num_pairs: int, sms: int, gqa: bool) -> int:
    """This kernel's grid order: ``common.pair_group`` under ``PAIR_GROUP`` and ``GROUP_MHA``.
    H100 runs 248-249 (bf16 causal, S2048-16384; docs/perf-notes.md, session 47): the rule's
    groups gained GQA 4 3-15% at S2048-8192 against block-major over the whole grid (H200 run
    104's choice for GQA, whose pair-major tail cost 6-10%); run 250 confirmed it in the
    library's form, and read pair-major (the rule at S16384) 2-8% ahead of block-major there."""
    return common_pair_group(PAIR_GROUP, causal, num_n_blocks, num_pairs, sms, gqa=gqa, group_mha=GROUP_MHA)


@gluon.jit
def _step_coords(s, q_lo, nq, q_rot, kvh, group_size, QROWS: gl.constexpr):
    """Step s -> (query head, first query row). Within a head the query blocks (of QROWS
    rows) run from q_lo + q_rot, wrapping around."""
    r = s % nq + q_rot
    r = gl.where(r >= nq, r - nq, r)
    return kvh * group_size + s // nq, (q_lo + r) * QROWS


@gluon.jit
def _step_tiles(s, q_lo, nq, q_rot, kvh, group_size, q_smem, do_smem, q_ready):
    """Step s: the query head, the first query row, and the (Q, dO) tiles once they have
    landed."""
    NUM_BUF: gl.constexpr = q_smem.type.shape[0]
    QROWS: gl.constexpr = q_smem.type.shape[3]
    HEAD_D: gl.constexpr = q_smem.type.shape[4]
    slot = s % NUM_BUF
    mbarrier.wait(q_ready.index(slot), (s // NUM_BUF) & 1)
    hq, m0 = _step_coords(s, q_lo, nq, q_rot, kvh, group_size, QROWS)
    return hq, m0, q_smem.index(slot).reshape([QROWS, HEAD_D]), do_smem.index(slot).reshape([QROWS, HEAD_D])


@gluon.jit
def _p_and_ds(s, dp, Lse, Delta, b, hq, nheads, seqlen_q, nk, m0, diag_offset, qk_scale, q_row, seqlen_k,
              lse_stride, CAUSAL: gl.constexpr, VARLEN: gl.constexpr, dtype: gl.constexpr,
              s_layout: gl.constexpr):
    """P = exp2(S * c - lse) on a (queries x keys) tile (0 right of the diagonal when
    causal) and dS = P (dP - Delta), in the input dtype for the products. Rows past
    seqlen_q get lse = +inf, so their P is 0 (their Q and dO are zero-filled, or the next
    document's rows); rows that see no key (lse -inf) only meet diagonal tiles, where the
    mask zeroes them. Keys past seqlen_k: zero-filled K and V in a fixed-length call (their
    dS adds 0 to dQ, their dK and dV rows are clipped); the next document's keys in a
    packed one, so P is masked there (causal: the diagonal's mask already does, since every
    row's last key is at most seqlen_k - 1)."""
    QROWS: gl.constexpr = s.shape[0]
    KEYS: gl.constexpr = s.shape[1]  # ROWS, or both warpgroups' keys (``_qsplit_step``)
    rows = m0 + gl.arange(0, QROWS, layout=gl.SliceLayout(1, s_layout))
    # (B, H, Sq) rows lse_stride apart; packed: (1, H, total_q), the sequence's from q_row on
    row_off = (b * nheads + hq).to(gl.int64) * lse_stride + q_row
    lse2 = gl.load(Lse + row_off + rows, mask=rows < seqlen_q, other=float("inf")) * C_LOG2E
    delta = gl.load(Delta + row_off + rows, mask=rows < seqlen_q, other=0.0)
    if CAUSAL and KEYS > ROWS:  # the query split's wide tiles
        p = _wide_causal_p(s, lse2, rows, nk, m0, diag_offset, qk_scale, s_layout)
    else:
        p = gl.exp2(s * qk_scale - lse2[:, None])
        if CAUSAL:
            if nk + KEYS - 1 > m0 + diag_offset:  # a tile on (or past) the diagonal
                keys = nk + gl.arange(0, KEYS, layout=gl.SliceLayout(0, s_layout))
                p = gl.where(keys[None, :] <= rows[:, None] + diag_offset, p, 0.0)
        elif VARLEN:
            if nk + KEYS > seqlen_k:  # the sequence's last key tile
                keys = nk + gl.arange(0, KEYS, layout=gl.SliceLayout(0, s_layout))
                p = gl.where(keys[None, :] < seqlen_k, p, 0.0)
    ds = p * (dp - delta[:, None])
    return p.to(dtype), ds.to(dtype)


@gluon.jit
def _wide_causal_p(s, lse2, rows, nk, m0, diag_offset, qk_scale, s_layout: gl.constexpr):
    """P of a causal (queries x 128 keys) tile of the query split: on diagonal tiles exp2's
    argument is masked to -inf right of the diagonal (after the scale, which may be 0 or
    negative), elsewhere P is plain; each side of the branch computes P from S, so only S
    is live across it. Rows that see no key (lse -inf) take an lse of +inf, so their P is 0
    (every key of theirs is masked). Compiled (sm_90a): 16 B of spills, none in the
    consumers' loops; P masked after exp2 in a branch, as ``_p_and_ds`` does for 64-key
    tiles, spilled 1.6 KB here (64 values of P live across the branch), and the argument
    masked across a branch 492 B; the mask at every step rematerialized the column indices
    (about 250 instructions a step)."""
    KEYS: gl.constexpr = s.shape[1]
    lse2 = gl.where(lse2 == float("-inf"), float("inf"), lse2)
    if nk + KEYS - 1 > m0 + diag_offset:  # a tile on (or past) the diagonal
        cols = gl.arange(0, KEYS, layout=gl.SliceLayout(0, s_layout))
        # masked after the scale, which may be 0 or negative
        p = gl.exp2(gl.where(cols[None, :] <= (rows + (diag_offset - nk))[:, None], s * qk_scale - lse2[:, None],
                             float("-inf")))
    else:
        p = gl.exp2(s * qk_scale - lse2[:, None])
    return p


@gluon.jit
def _dq_issue(WG: gl.constexpr, t, k_smem, ds_smem, ds_full, z):
    """Issue dQ of step t for this warpgroup's half of the head dim, from both warpgroups'
    dS (async; the caller waits). ``z`` is 0 (see ``_consumer``'s loop)."""
    HEAD_D: gl.constexpr = k_smem.type.shape[4]
    HALF_D: gl.constexpr = HEAD_D // 2
    QROWS: gl.constexpr = ds_smem.type.shape[1]
    dq_layout: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[4, 1],
                                                        instr_shape=[16, HALF_D, 16])
    mbarrier.wait(ds_full.index(0), t & 1)
    dq = warpgroup_mma(ds_smem.index(z), k_smem.index(z).reshape([ROWS, HEAD_D]).slice(WG * HALF_D, HALF_D, dim=1),
                       gl.zeros([QROWS, HALF_D], gl.float32, dq_layout), use_acc=False, is_async=True)
    return warpgroup_mma(ds_smem.index(1 + z), k_smem.index(1 + z).reshape([ROWS, HEAD_D]).slice(WG * HALF_D, HALF_D,
                                                                                             dim=1),
                         dq, is_async=True)


@gluon.jit
def _dq_finish(WG: gl.constexpr, dq, t, ds_empty, scale, dq_smem, dq_full, dq_empty):
    """Once step t's dQ product is done: tell the other warpgroup its dS was read, then
    hand this warpgroup's half to the reducer through slot t % DQ_BUF (wait until the
    slot's last reductions have read it, store, fence, arrive)."""
    mbarrier.arrive(ds_empty.index(0), count=1)
    _dq_hand_off(WG, dq, t, scale, dq_smem, dq_full, dq_empty)


@gluon.jit
def _dq_hand_off(WG: gl.constexpr, dq, t, scale, dq_smem, dq_full, dq_empty):
    """Hand this warpgroup's part of step t's dQ (a column half, or a row half under
    ``_qsplit_step``) to the reducer through slot t % DQ_BUF: wait until the slot's last
    reductions have read it, store it scaled, fence, arrive."""
    DQ_BUF: gl.constexpr = dq_smem.type.shape[0] // 2
    slot = t % DQ_BUF
    mbarrier.wait(dq_empty.index(slot), ((t // DQ_BUF) & 1) ^ 1)  # a fresh barrier passes phase 1
    half = dq_smem.index(2 * slot + WG)
    if _is_native(dq_smem.type.layout):  # the registers in their own order: no bank conflicts
        gl.static_assert(gl.bank_conflicts(dq.type, half.type) == 0)
    half.store(dq * scale)
    fence_async_shared()
    mbarrier.arrive(dq_full.index(slot), count=1)


@gluon.jit
def _step(WG: gl.constexpr, s, dk, dv, Lse, Delta, q_smem, do_smem, k_smem, v_smem, p_smem, ds_smem, q_ready,
          q_empty, ds_full, ds_empty, dq_smem, dq_full, dq_empty, b, kvh, q_lo, nq, q_rot, group_size, nheads,
          seqlen_q, nk, diag_offset, qk_scale, scale, q_row, seqlen_k, lse_stride, CAUSAL: gl.constexpr,
          VARLEN: gl.constexpr, dtype: gl.constexpr):
    """One step s >= 1 of ``_consumer``'s loop: S_s and dP_s issued, step s-1's dV and dK
    products in flight over P_s and dS_s, then dQ_{s-1}; returns (dk, dv). CAUSAL and VARLEN
    say which masks ``_p_and_ds`` applies."""
    HEAD_D: gl.constexpr = q_smem.type.shape[4]
    QROWS: gl.constexpr = q_smem.type.shape[3]
    NUM_BUF: gl.constexpr = q_smem.type.shape[0]
    s_layout: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[4, 1],
                                                       instr_shape=[16, ROWS, 16])
    prev = (s - 1) % NUM_BUF
    # At d128, z = 0 (s < 2**30) but not to the compiler: the fixed tiles' views are
    # then made anew each step instead of their wgmma descriptors (one per tile and
    # k-step, ~40 words) being hoisted out of the loop and spilled (ptxas: 1,292 -> 312
    # B of spills; H200 run 96: 7-16% faster). d64's 128-row steps too (2,136 -> 236 B,
    # 408 causal); its 64-row steps (packed sequences) do not spill: their code is as before.
    if HEAD_D > 64 or QROWS > ROWS:
        z = s >> 30
    else:
        z = 0
    k_tile = k_smem.index(WG + z).reshape([ROWS, HEAD_D])
    v_tile = v_smem.index(WG + z).reshape([ROWS, HEAD_D])
    p_tile = p_smem.index(WG + z)
    ds_tile = ds_smem.index(WG + z)
    hq, m0, q_t, do_t = _step_tiles(s, q_lo, nq, q_rot, kvh, group_size, q_smem, do_smem, q_ready)
    st, dpt, dk, dv = dkdv_step_products(q_t, do_t, k_tile, v_tile, p_tile, ds_tile, q_smem, do_smem, prev,
                                         dk, dv, s_layout)
    pt, dst = _p_and_ds(st, dpt, Lse, Delta, b, hq, nheads, seqlen_q, nk, m0, diag_offset, qk_scale, q_row,
                        seqlen_k, lse_stride, CAUSAL, VARLEN, dtype, s_layout)
    dk, dv = warpgroup_mma_wait(num_outstanding=0, deps=(dk, dv))
    mbarrier.arrive(q_empty.index(prev), count=1)  # Q_{s-1} and dO_{s-1} are read
    p_tile.store(pt)  # P_{s-1} is read (only this warpgroup reads it)
    dq = warpgroup_mma_wait(num_outstanding=0, deps=(_dq_issue(WG, s - 1, k_smem, ds_smem, ds_full, z),))
    _dq_finish(WG, dq, s - 1, ds_empty, scale, dq_smem, dq_full, dq_empty)
    mbarrier.wait(ds_empty.index(0), (s - 1) & 1)  # the other warpgroup has read dS_{s-1} too
    ds_tile.store(dst)
    fence_async_shared()
    mbarrier.arrive(ds_full.index(0), count=1)
    return dk, dv


@gluon.jit
def _consumer(WG: gl.constexpr, q_desc, k_desc, v_desc, do_desc, dk_desc, dv_desc, Lse, Delta, Sem, q_smem, do_smem,
              k_smem, v_smem, p_smem, ds_smem, kv_bar, q_ready, q_empty, ds_full, ds_empty, b, kvh, n0, q_rot,
              group_size, nheads, seqlen_q, diag_offset, qk_scale, scale, dq_desc, dq_smem, dq_full, dq_empty,
              dq_rows, q_row, k_row, seqlen_k, lse_stride, Items, Dk, dk_sh, dk_sm, Dv, dv_sh, dv_sm):
    HEAD_D: gl.constexpr = q_desc.block_type.shape[3]
    QROWS: gl.constexpr = q_desc.block_type.shape[2]
    NUM_BUF: gl.constexpr = q_smem.type.shape[0]
    CAUSAL: gl.constexpr = kv_bar.type.shape[0] == 3
    VARLEN: gl.constexpr = Items.dtype.element_ty == gl.int32
    dtype: gl.constexpr = q_desc.dtype
    s_layout: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[4, 1],
                                                       instr_shape=[16, ROWS, 16])
    o_layout: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[4, 1],
                                                       instr_shape=[16, HEAD_D, 16])
    nk = n0 + WG * ROWS  # first key of this warpgroup
    k_tile = k_smem.index(WG).reshape([ROWS, HEAD_D])
    v_tile = v_smem.index(WG).reshape([ROWS, HEAD_D])
    q_lo, nq = step_range(n0, seqlen_q, diag_offset, QROWS, CAUSAL)
    n_steps = nq * group_size

    # P and dS (queries x keys) of the previous step wait in shared memory for their
    # products, which read them transposed (dV, dK) or as they are (dQ).
    p_tile = p_smem.index(WG)
    ds_tile = ds_smem.index(WG)
    dk = gl.zeros([ROWS, HEAD_D], gl.float32, o_layout)
    dv = gl.zeros([ROWS, HEAD_D], gl.float32, o_layout)
    mbarrier.wait(kv_bar.index(0), 0)  # dQ reads both warpgroups' K
    mbarrier.wait(kv_bar.index(1), 0)
    if n_steps > 0:  # step 0: nothing to overlap with yet
        hq, m0, q_t, do_t = _step_tiles(0, q_lo, nq, q_rot, kvh, group_size, q_smem, do_smem, q_ready)
        st = warpgroup_mma(q_t, k_tile.permute((1, 0)), gl.zeros([QROWS, ROWS], gl.float32, s_layout),
                           use_acc=False, is_async=True)
        dpt = warpgroup_mma(do_t, v_tile.permute((1, 0)), gl.zeros([QROWS, ROWS], gl.float32, s_layout),
                            use_acc=False, is_async=True)
        st, dpt = warpgroup_mma_wait(num_outstanding=0, deps=(st, dpt))
        pt, dst = _p_and_ds(st, dpt, Lse, Delta, b, hq, nheads, seqlen_q, nk, m0, diag_offset, qk_scale, q_row,
                            seqlen_k, lse_stride, CAUSAL, VARLEN, dtype, s_layout)
        p_tile.store(pt)
        ds_tile.store(dst)
        fence_async_shared()
        mbarrier.arrive(ds_full.index(0), count=1)
    for s in range(1, n_steps):
        dk, dv = _step(WG, s, dk, dv, Lse, Delta, q_smem, do_smem, k_smem, v_smem, p_smem, ds_smem, q_ready,
                       q_empty, ds_full, ds_empty, dq_smem, dq_full, dq_empty, b, kvh, q_lo, nq, q_rot,
                       group_size, nheads, seqlen_q, nk, diag_offset, qk_scale, scale, q_row, seqlen_k,
                       lse_stride, CAUSAL, VARLEN, dtype)

    if n_steps > 0:
        last = (n_steps - 1) % NUM_BUF
        dv = warpgroup_mma(p_tile.permute((1, 0)), do_smem.index(last).reshape([QROWS, HEAD_D]), dv, is_async=True)
        dk = warpgroup_mma(ds_tile.permute((1, 0)), q_smem.index(last).reshape([QROWS, HEAD_D]), dk, is_async=True)
        dk, dv = warpgroup_mma_wait(num_outstanding=0, deps=(dk, dv))
        mbarrier.arrive(q_empty.index(last), count=1)
        dq = warpgroup_mma_wait(num_outstanding=0, deps=(_dq_issue(WG, n_steps - 1, k_smem, ds_smem, ds_full, 0),))
        _dq_finish(WG, dq, n_steps - 1, ds_empty, scale, dq_smem, dq_full, dq_empty)
        # The other warpgroup's last dQ product reads this warpgroup's K tile, which is
        # about to stage dK.
        mbarrier.wait(ds_empty.index(0), (n_steps - 1) & 1)

    # K and V are no longer read: their tiles stage dK and dV for the TMA stores, which
    # clip rows past seqlen_k; a packed sequence's last tile goes from registers instead,
    # its rows masked (``common.store_grad_tile``: TMA would write the next document's).
    if VARLEN:
        store_grad_tile((dk * scale).to(dtype), k_smem.index(WG), dk_desc, Dk, dk_sh, dk_sm, b, kvh, k_row, nk,
                    seqlen_k, True)
        store_grad_tile(dv.to(dtype), v_smem.index(WG), dv_desc, Dv, dv_sh, dv_sm, b, kvh, k_row, nk, seqlen_k, True)
    else:
        _store_dkdv(WG, dk, dv, scale, k_smem, v_smem, dk_desc, dv_desc, b, kvh, nk)
    tma.store_wait(pendings=0)


@gluon.jit
def _store_dkdv(WG: gl.constexpr, dk, dv, scale, k_smem, v_smem, dk_desc, dv_desc, b, kvh, nk):
    """dK (scaled) and dV of this warpgroup's keys nk .. into its K and V tiles, which no
    product reads any more, then out by TMA (which clips rows past seqlen_k); wait with
    ``tma.store_wait`` before the tiles are reused."""
    HEAD_D: gl.constexpr = k_smem.type.shape[4]
    dtype: gl.constexpr = k_smem.type.element_ty
    k_smem.index(WG).reshape([ROWS, HEAD_D]).store((dk * scale).to(dtype))
    v_smem.index(WG).reshape([ROWS, HEAD_D]).store(dv.to(dtype))
    fence_async_shared()
    tma.async_copy_shared_to_global(dk_desc, [b, kvh, nk, 0], k_smem.index(WG))
    tma.async_copy_shared_to_global(dv_desc, [b, kvh, nk, 0], v_smem.index(WG))


@triton.constexpr_function
def _flat_layout(layout):
    """The 2-D form of a (1, 1, rows, D) tile's NVMMA layout (the same swizzle: it repeats
    every 8 rows, so consecutive tiles read as one taller tile)."""
    if layout.transposed:
        raise ValueError("a transposed NVMMA layout has no taller form here")
    return gl.NVMMASharedLayout(swizzle_byte_width=layout.swizzle_byte_width,
                                element_bitwidth=layout.element_bitwidth, rank=2)


@gluon.jit
def _both_tiles(kv_smem, z):
    """Both warpgroups' K (or V) tiles, (2, 1, 1, ROWS, D) in shared memory, viewed as one
    (2 x ROWS, D) tile. ``z`` is 0 (see ``_step``)."""
    flat = kv_smem._reinterpret(kv_smem.type.element_ty, [1, 2 * ROWS, kv_smem.type.shape[4]],
                                _flat_layout(kv_smem.type.layout))
    return flat.index(z)


@gluon.jit
def _qsplit_products(WG: gl.constexpr, q_t, do_t, k_smem, v_smem, z):
    """S and dP of this warpgroup's half of the step's queries (rows WG * QROWS / 2 ..) against
    both warpgroups' 128 keys: one m64n128 product each (async)."""
    HALF_Q: gl.constexpr = q_t.type.shape[0] // 2
    KEYS: gl.constexpr = 2 * ROWS
    s_layout: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[4, 1],
                                                       instr_shape=[16, KEYS, 16])
    k_all = _both_tiles(k_smem, z)
    v_all = _both_tiles(v_smem, z)
    st = warpgroup_mma(q_t.slice(WG * HALF_Q, HALF_Q, dim=0), k_all.permute((1, 0)),
                       gl.zeros([HALF_Q, KEYS], gl.float32, s_layout), use_acc=False, is_async=True)
    dpt = warpgroup_mma(do_t.slice(WG * HALF_Q, HALF_Q, dim=0), v_all.permute((1, 0)),
                        gl.zeros([HALF_Q, KEYS], gl.float32, s_layout), use_acc=False, is_async=True)
    return st, dpt


@gluon.jit
def _qsplit_dq_issue(dst, k_smem, z):
    """dQ of this warpgroup's query rows: dS (its rows x 128 keys, from registers) times K
    (both warpgroups' keys), async; returns (dq, the A operand), both for the wait's deps."""
    HEAD_D: gl.constexpr = k_smem.type.shape[4]
    HALF_Q: gl.constexpr = dst.type.shape[0]
    dq_layout: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[4, 1],
                                                        instr_shape=[16, HEAD_D, 16])
    ds_op: gl.constexpr = gl.DotOperandLayout(operand_index=0, parent=dq_layout, k_width=2)
    ds_a = gl.convert_layout(dst, ds_op)
    dq = warpgroup_mma(ds_a, _both_tiles(k_smem, z), gl.zeros([HALF_Q, HEAD_D], gl.float32, dq_layout),
                       use_acc=False, is_async=True)
    return dq, ds_a


@gluon.jit
def _qsplit_dkdv_issue(WG: gl.constexpr, t, dk, dv, p_smem, ds_smem, q_smem, do_smem, pds_full, z):
    """Once both warpgroups have stored their rows of P_t and dS_t: dV += P_t^T dO_t and
    dK += dS_t^T Q_t for this warpgroup's keys (the columns WG * ROWS .. of P and dS), async."""
    HEAD_D: gl.constexpr = q_smem.type.shape[4]
    QROWS: gl.constexpr = q_smem.type.shape[3]
    NUM_BUF: gl.constexpr = q_smem.type.shape[0]
    slot = t % NUM_BUF
    mbarrier.wait(pds_full.index(0), t & 1)
    dv = warpgroup_mma(p_smem.index(z).slice(WG * ROWS, ROWS, dim=1).permute((1, 0)),
                       do_smem.index(slot).reshape([QROWS, HEAD_D]), dv, is_async=True)
    dk = warpgroup_mma(ds_smem.index(z).slice(WG * ROWS, ROWS, dim=1).permute((1, 0)),
                       q_smem.index(slot).reshape([QROWS, HEAD_D]), dk, is_async=True)
    return dk, dv


@gluon.jit
def _qsplit_store_pds(WG: gl.constexpr, pt, dst, p_smem, ds_smem, pds_full, z):
    """This warpgroup's rows of P and dS into the shared tiles both warpgroups' dV and dK read."""
    HALF_Q: gl.constexpr = pt.type.shape[0]
    p_smem.index(z).slice(WG * HALF_Q, HALF_Q, dim=0).store(pt)
    ds_smem.index(z).slice(WG * HALF_Q, HALF_Q, dim=0).store(dst)
    fence_async_shared()
    mbarrier.arrive(pds_full.index(0), count=1)


@gluon.jit
def _qsplit_step(WG: gl.constexpr, s, dk, dv, Lse, Delta, q_smem, do_smem, k_smem, v_smem, p_smem, ds_smem, q_ready,
                 q_empty, pds_full, pds_empty, dq_smem, dq_full, dq_empty, b, kvh, q_lo, nq, q_rot, group_size,
                 nheads, seqlen_q, n0, diag_offset, qk_scale, scale, q_row, seqlen_k, lse_stride,
                 CAUSAL: gl.constexpr, dtype: gl.constexpr):
    """One step s >= 1 of ``_qsplit_consumer``: S_s and dP_s of this warpgroup's queries
    issued, then step s-1's dV and dK (both warpgroups' P and dS rows) in flight over the
    softmax; dQ_s from registers; returns (dk, dv)."""
    NUM_BUF: gl.constexpr = q_smem.type.shape[0]
    HALF_Q: gl.constexpr = q_smem.type.shape[3] // 2
    s_layout: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[4, 1],
                                                       instr_shape=[16, 2 * ROWS, 16])
    prev = (s - 1) % NUM_BUF
    z = s >> 30  # 0: the fixed tiles' views made anew each step, as in ``_step``
    hq, m0, q_t, do_t = _step_tiles(s, q_lo, nq, q_rot, kvh, group_size, q_smem, do_smem, q_ready)
    st, dpt = _qsplit_products(WG, q_t, do_t, k_smem, v_smem, z)
    dk, dv = _qsplit_dkdv_issue(WG, s - 1, dk, dv, p_smem, ds_smem, q_smem, do_smem, pds_full, z)
    st, dpt = warpgroup_mma_wait(num_outstanding=2, deps=(st, dpt))  # dV and dK stay in flight
    pt, dst = _p_and_ds(st, dpt, Lse, Delta, b, hq, nheads, seqlen_q, n0, m0 + WG * HALF_Q, diag_offset, qk_scale,
                        q_row, seqlen_k, lse_stride, CAUSAL, False, dtype, s_layout)
    dq, ds_a = _qsplit_dq_issue(dst, k_smem, z)
    dk, dv = warpgroup_mma_wait(num_outstanding=1, deps=(dk, dv))  # dQ_s stays in flight
    mbarrier.arrive(q_empty.index(prev), count=1)  # Q_{s-1} and dO_{s-1} are read
    mbarrier.arrive(pds_empty.index(0), count=1)  # this warpgroup has read P_{s-1} and dS_{s-1}
    mbarrier.wait(pds_empty.index(0), (s - 1) & 1)  # and so has the other one
    _qsplit_store_pds(WG, pt, dst, p_smem, ds_smem, pds_full, z)
    dq, ds_a = warpgroup_mma_wait(num_outstanding=0, deps=(dq, ds_a))
    _dq_hand_off(WG, dq, s, scale, dq_smem, dq_full, dq_empty)
    return dk, dv


@gluon.jit
def _qsplit_consumer(WG: gl.constexpr, q_desc, k_desc, v_desc, do_desc, dk_desc, dv_desc, Lse, Delta, Sem, q_smem,
                     do_smem, k_smem, v_smem, p_smem, ds_smem, kv_bar, q_ready, q_empty, ds_full, ds_empty, b, kvh,
                     n0, q_rot, group_size, nheads, seqlen_q, diag_offset, qk_scale, scale, dq_desc, dq_smem,
                     dq_full, dq_empty, q_row, seqlen_k, lse_stride):
    """The consumer with the step's products split by queries (``q_split``; d64, 128-query
    steps, fixed lengths): warpgroup w takes S, dP, P, dS and dQ of query rows w * 64 ..
    w * 64 + 63 against all 128 keys of the block (S and dP as m64n128 products, dQ = dS K
    with dS from registers, so dS is not read back for dQ), and dK, dV of keys w * 64 .. as
    before, from both warpgroups' rows of P and dS in shared memory. Per step it reads 416 KB
    of shared memory where ``_consumer`` reads 512 (docs/perf-notes.md, session 51). Two
    barriers hand P and dS between the warpgroups (``ds_full``: both rows stored; ``ds_empty``:
    both dV and dK products have read them); each warpgroup hands its 64 x 64 dQ rows to the
    reducer (slot half WG)."""
    HEAD_D: gl.constexpr = q_desc.block_type.shape[3]
    QROWS: gl.constexpr = q_desc.block_type.shape[2]
    HALF_Q: gl.constexpr = QROWS // 2
    NUM_BUF: gl.constexpr = q_smem.type.shape[0]
    CAUSAL: gl.constexpr = kv_bar.type.shape[0] == 3
    dtype: gl.constexpr = q_desc.dtype
    o_layout: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[4, 1],
                                                       instr_shape=[16, HEAD_D, 16])
    s_layout: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[4, 1],
                                                       instr_shape=[16, 2 * ROWS, 16])
    q_lo, nq = step_range(n0, seqlen_q, diag_offset, QROWS, CAUSAL)
    n_steps = nq * group_size
    dk = gl.zeros([ROWS, HEAD_D], gl.float32, o_layout)
    dv = gl.zeros([ROWS, HEAD_D], gl.float32, o_layout)
    mbarrier.wait(kv_bar.index(0), 0)  # every product reads both warpgroups' K or V
    mbarrier.wait(kv_bar.index(1), 0)
    if n_steps > 0:  # step 0: no dV and dK to overlap with yet
        hq, m0, q_t, do_t = _step_tiles(0, q_lo, nq, q_rot, kvh, group_size, q_smem, do_smem, q_ready)
        st, dpt = _qsplit_products(WG, q_t, do_t, k_smem, v_smem, 0)
        st, dpt = warpgroup_mma_wait(num_outstanding=0, deps=(st, dpt))
        pt, dst = _p_and_ds(st, dpt, Lse, Delta, b, hq, nheads, seqlen_q, n0, m0 + WG * HALF_Q, diag_offset,
                            qk_scale, q_row, seqlen_k, lse_stride, CAUSAL, False, dtype, s_layout)
        dq, ds_a = _qsplit_dq_issue(dst, k_smem, 0)
        _qsplit_store_pds(WG, pt, dst, p_smem, ds_smem, ds_full, 0)
        dq, ds_a = warpgroup_mma_wait(num_outstanding=0, deps=(dq, ds_a))
        _dq_hand_off(WG, dq, 0, scale, dq_smem, dq_full, dq_empty)
    for s in range(1, n_steps):
        dk, dv = _qsplit_step(WG, s, dk, dv, Lse, Delta, q_smem, do_smem, k_smem, v_smem, p_smem, ds_smem, q_ready,
                              q_empty, ds_full, ds_empty, dq_smem, dq_full, dq_empty, b, kvh, q_lo, nq, q_rot,
                              group_size, nheads, seqlen_q, n0, diag_offset, qk_scale, scale, q_row, seqlen_k,
                              lse_stride, CAUSAL, dtype)
    if n_steps > 0:
        dk, dv = _qsplit_dkdv_issue(WG, n_steps - 1, dk, dv, p_smem, ds_smem, q_smem, do_smem, ds_full, 0)
        dk, dv = warpgroup_mma_wait(num_outstanding=0, deps=(dk, dv))
        mbarrier.arrive(q_empty.index((n_steps - 1) % NUM_BUF), count=1)
        # Once both warpgroups are here, neither reads K or V again: their tiles stage dK and dV.
        mbarrier.arrive(ds_empty.index(0), count=1)
        mbarrier.wait(ds_empty.index(0), (n_steps - 1) & 1)
    _store_dkdv(WG, dk, dv, scale, k_smem, v_smem, dk_desc, dv_desc, b, kvh, n0 + WG * ROWS)
    tma.store_wait(pendings=0)


@gluon.jit
def _consumer_of(WG: gl.constexpr, q_desc, k_desc, v_desc, do_desc, dk_desc, dv_desc, Lse, Delta, Sem, q_smem, do_smem,
                 k_smem, v_smem, p_smem, ds_smem, kv_bar, q_ready, q_empty, ds_full, ds_empty, b, kvh, n0, q_rot,
                 group_size, nheads, seqlen_q, diag_offset, qk_scale, scale, dq_desc, dq_smem, dq_full, dq_empty,
                 dq_rows, q_row, k_row, seqlen_k, lse_stride, Items, Dk, dk_sh, dk_sm, Dv, dv_sh, dv_sm):
    """Warpgroup WG's consumer: ``_qsplit_consumer`` when the dQ slots hold whole rows (the query
    split), else ``_consumer``."""
    if dq_smem.type.shape[2] == q_desc.block_type.shape[3]:
        _qsplit_consumer(WG, q_desc, k_desc, v_desc, do_desc, dk_desc, dv_desc, Lse, Delta, Sem, q_smem, do_smem,
                         k_smem, v_smem, p_smem, ds_smem, kv_bar, q_ready, q_empty, ds_full, ds_empty, b, kvh, n0,
                         q_rot, group_size, nheads, seqlen_q, diag_offset, qk_scale, scale, dq_desc, dq_smem,
                         dq_full, dq_empty, q_row, seqlen_k, lse_stride)
    else:
        _consumer(WG, q_desc, k_desc, v_desc, do_desc, dk_desc, dv_desc, Lse, Delta, Sem, q_smem, do_smem, k_smem,
                  v_smem, p_smem, ds_smem, kv_bar, q_ready, q_empty, ds_full, ds_empty, b, kvh, n0, q_rot, group_size,
                  nheads, seqlen_q, diag_offset, qk_scale, scale, dq_desc, dq_smem, dq_full, dq_empty, dq_rows,
                  q_row, k_row, seqlen_k, lse_stride, Items, Dk, dk_sh, dk_sm, Dv, dv_sh, dv_sm)


@gluon.jit
def _consumer0(q_desc, k_desc, v_desc, do_desc, dk_desc, dv_desc, Lse, Delta, Sem, q_smem, do_smem, k_smem, v_smem,
               p_smem, ds_smem, kv_bar, q_ready, q_empty, ds_full, ds_empty, b, kvh, n0, q_rot, group_size, nheads,
               seqlen_q, diag_offset, qk_scale, scale, dq_desc, dq_smem, dq_full, dq_empty, dq_rows,
               q_row, k_row, seqlen_k, lse_stride, Items, Dk, dk_sh, dk_sm, Dv, dv_sh, dv_sm):
    _consumer_of(0, q_desc, k_desc, v_desc, do_desc, dk_desc, dv_desc, Lse, Delta, Sem, q_smem, do_smem, k_smem, v_smem,
                 p_smem, ds_smem, kv_bar, q_ready, q_empty, ds_full, ds_empty, b, kvh, n0, q_rot, group_size, nheads,
                 seqlen_q, diag_offset, qk_scale, scale, dq_desc, dq_smem, dq_full, dq_empty, dq_rows,
                 q_row, k_row, seqlen_k, lse_stride, Items, Dk, dk_sh, dk_sm, Dv, dv_sh, dv_sm)


@gluon.jit
def _consumer1(q_desc, k_desc, v_desc, do_desc, dk_desc, dv_desc, Lse, Delta, Sem, q_smem, do_smem, k_smem, v_smem,
               p_smem, ds_smem, kv_bar, q_ready, q_empty, ds_full, ds_empty, b, kvh, n0, q_rot, group_size, nheads,
               seqlen_q, diag_offset, qk_scale, scale, dq_desc, dq_smem, dq_full, dq_empty, dq_rows,
               q_row, k_row, seqlen_k, lse_stride, Items, Dk, dk_sh, dk_sm, Dv, dv_sh, dv_sm):
    _consumer_of(1, q_desc, k_desc, v_desc, do_desc, dk_desc, dv_desc, Lse, Delta, Sem, q_smem, do_smem, k_smem, v_smem,
                 p_smem, ds_smem, kv_bar, q_ready, q_empty, ds_full, ds_empty, b, kvh, n0, q_rot, group_size, nheads,
                 seqlen_q, diag_offset, qk_scale, scale, dq_desc, dq_smem, dq_full, dq_empty, dq_rows,
                 q_row, k_row, seqlen_k, lse_stride, Items, Dk, dk_sh, dk_sm, Dv, dv_sh, dv_sm)


@gluon.jit
def _loader(q_desc, k_desc, v_desc, do_desc, dk_desc, dv_desc, Lse, Delta, Sem, q_smem, do_smem, k_smem, v_smem,
            p_smem, ds_smem, kv_bar, q_ready, q_empty, ds_full, ds_empty, b, kvh, n0, q_rot, group_size, nheads,
            seqlen_q, diag_offset, qk_scale, scale, dq_desc, dq_smem, dq_full, dq_empty, dq_rows,
            q_row, k_row, seqlen_k, lse_stride, Items, Dk, dk_sh, dk_sm, Dv, dv_sh, dv_sm):
    NUM_BUF: gl.constexpr = q_smem.type.shape[0]
    QROWS: gl.constexpr = q_smem.type.shape[3]
    CAUSAL: gl.constexpr = kv_bar.type.shape[0] == 3
    k0 = k_row + n0  # a packed sequence's keys from row k_row on, its queries from row q_row on (else 0)
    for wg in gl.static_range(2):
        mbarrier.expect(kv_bar.index(wg), k_desc.block_type.nbytes + v_desc.block_type.nbytes)
        tma.async_copy_global_to_shared(k_desc, [b, kvh, k0 + wg * ROWS, 0], kv_bar.index(wg), k_smem.index(wg))
        tma.async_copy_global_to_shared(v_desc, [b, kvh, k0 + wg * ROWS, 0], kv_bar.index(wg), v_smem.index(wg))
    q_lo, nq = step_range(n0, seqlen_q, diag_offset, QROWS, CAUSAL)
    for s in range(nq * group_size):
        slot = s % NUM_BUF
        hq, m0 = _step_coords(s, q_lo, nq, q_rot, kvh, group_size, QROWS)
        m0 = q_row + m0
        mbarrier.wait(q_empty.index(slot), ((s // NUM_BUF) & 1) ^ 1)  # fresh barriers pass phase 1
        mbarrier.expect(q_ready.index(slot), q_desc.block_type.nbytes + do_desc.block_type.nbytes)
        tma.async_copy_global_to_shared(q_desc, [b, hq, m0, 0], q_ready.index(slot), q_smem.index(slot))
        tma.async_copy_global_to_shared(do_desc, [b, hq, m0, 0], q_ready.index(slot), do_smem.index(slot))


@gluon.jit
def _reducer(q_desc, k_desc, v_desc, do_desc, dk_desc, dv_desc, Lse, Delta, Sem, q_smem, do_smem, k_smem, v_smem,
             p_smem, ds_smem, kv_bar, q_ready, q_empty, ds_full, ds_empty, b, kvh, n0, q_rot, group_size, nheads,
             seqlen_q, diag_offset, qk_scale, scale, dq_desc, dq_smem, dq_full, dq_empty, dq_rows,
             q_row, k_row, seqlen_k, lse_stride, Items, Dk, dk_sh, dk_sm, Dv, dv_sh, dv_sm):
    """For every step, once both warpgroups have stored their dQ halves in the step's slot:
    add them into the float32 dQ (a (B * H * dq_rows, D) matrix) with two bulk TMA
    reductions; then wait until the previous step's reductions have read their slot and
    free it (so one step's reductions stay in flight; with one slot, wait for this step's).
    Rows are int32: B * H * dq_rows < 2**31, as TMA coordinates are (the host checks).
    Slots in the accumulator's own order (``native_offset_bases``) go whole into the dQ
    viewed as (2 * B * H * dq_rows, D / 2): a query tile's two halves one after the other.
    Under the query split (``_qsplit_consumer``) a slot's halves are its two 64-row halves of
    all D columns, each added onto its own rows of the dQ viewed as (B * H * dq_rows, D)."""
    DQ_BUF: gl.constexpr = dq_smem.type.shape[0] // 2
    QROWS: gl.constexpr = q_smem.type.shape[3]
    SLOT_ROWS: gl.constexpr = dq_smem.type.shape[1]  # QROWS, or QROWS / 2 under the query split
    SLOT_COLS: gl.constexpr = dq_smem.type.shape[2]  # D / 2, or D under the query split
    QSPLIT: gl.constexpr = SLOT_COLS == q_smem.type.shape[4]
    NATIVE: gl.constexpr = _is_native(dq_smem.type.layout)
    CAUSAL: gl.constexpr = kv_bar.type.shape[0] == 3
    DET: gl.constexpr = Sem.dtype.element_ty == gl.int32
    ROTATE: gl.constexpr = ds_full.type.shape[0] == 2  # DET_ROTATE (an unused second barrier)
    q_lo, nq = step_range(n0, seqlen_q, diag_offset, QROWS, CAUSAL)
    nb = n0 // (2 * ROWS)
    num_n_blocks = gl.cdiv(seqlen_k, 2 * ROWS)
    for t in range(nq * group_size):
        slot = t % DQ_BUF
        mbarrier.wait(dq_full.index(slot), (t // DQ_BUF) & 1)
        hq, m0 = _step_coords(t, q_lo, nq, q_rot, kvh, group_size, QROWS)
        row = (b * nheads + hq) * dq_rows + q_row + m0  # packed: b = 0, the sequence's rows from q_row on
        if DET:
            # this block's turn at the tile, in the order the blocks reach it (``_det_turn``)
            lock = Sem + (b * nheads + hq) * gl.cdiv(seqlen_q, QROWS) + m0 // QROWS
            _wait_turn(lock, _det_turn(nb, num_n_blocks, m0, nq, diag_offset, QROWS, CAUSAL, ROTATE))
        for half in gl.static_range(2):
            if NATIVE:  # the slot's bytes as they are (a box without swizzle)
                src = dq_smem.index(2 * slot + half)._reinterpret(gl.float32, [SLOT_ROWS, SLOT_COLS], dq_desc.layout)
                if QSPLIT:  # row half ``half`` onto its own rows of the (rows, D) dQ
                    async_reduce_add_shared_to_global(dq_desc, [row + half * SLOT_ROWS, 0], src)
                else:
                    async_reduce_add_shared_to_global(dq_desc, [2 * row + half * QROWS, 0], src)
            else:
                async_reduce_add_shared_to_global(dq_desc, [row, half * SLOT_COLS], dq_smem.index(2 * slot + half))
        if DET:
            tma.store_wait(pendings=0)  # the slot was read
            mbarrier.arrive(dq_empty.index(slot), count=1)
            _pass_turn(lock)  # once the sums are in global memory
        elif DQ_BUF > 1:
            tma.store_wait(pendings=2)  # step t - 1's two reductions have read their slot
            if t > 0:
                mbarrier.arrive(dq_empty.index((t + DQ_BUF - 1) % DQ_BUF), count=1)
        else:
            tma.store_wait(pendings=0)
            mbarrier.arrive(dq_empty.index(slot), count=1)
    tma.store_wait(pendings=0)  # nothing may still read shared memory when the program ends


@gluon.jit
def _det_turn(nb, num_n_blocks, m0, nq, diag_offset, QROWS: gl.constexpr, CAUSAL: gl.constexpr,
              ROTATE: gl.constexpr):
    """How many key blocks add to the dQ tile of query rows m0.. before block nb in the
    deterministic order, which is the order in which the blocks reach the tile, so that a
    block rarely waits. Without causal and without ``ROTATE`` every block streams the query
    tiles in the same order from the first: ascending blocks (block nb's first sum waits
    for nb others). ``ROTATE`` (without causal): each block starts at its own tile, as
    the plain kernel does (``_rotated_turn``). With causal each block streams the tiles
    from its diagonal on (``step_range``), so the blocks that see a tile are 0 .. last, and
    a higher block reaches it earlier: the order is last, last - 1, .., 0 (FA3's), and the
    grid starts the higher blocks first (``onepass_kernel``)."""
    if CAUSAL:
        last = gl.minimum(num_n_blocks, gl.cdiv(m0 + QROWS + diag_offset, 2 * ROWS)) - 1
        return last - nb
    elif ROTATE:
        return _rotated_turn(nb, num_n_blocks, m0 // QROWS, nq)
    return nb


@gluon.jit
def _rotated_turn(nb, num_n_blocks, r, nq):
    """Block nb's turn at query tile r (of nq) when block j starts its query loop at tile
    (j * nq) // num_n_blocks (``onepass_kernel``'s q_rot) and wraps around: the blocks that
    reach tile r first go first, and of two that reach it at the same step the higher one.
    Blocks 0 .. last (the ones that start at or before r) reach it in the order last .. 0,
    then blocks num_n_blocks - 1 .. last + 1. So a block waits only for blocks that reached
    the tile a step before it, or at the same step and above it: none may wait for a block
    that has not started, as long as a (batch, kv head)'s blocks fit on the GPU at once
    (``det_rotate``). Plain operators on non-negative ints: tests call it as Python
    (``_rotated_turn.fn``)."""
    last = ((r + 1) * num_n_blocks + nq - 1) // nq - 1
    return last - nb + (nb > last) * num_n_blocks


@gluon.jit
def _wait_turn(lock, turn):
    """Spin until the int32 at ``lock`` reads ``turn`` (lane 0 polls with acquire
    semantics; the warp leaves the loop with the value it read)."""
    layout: gl.constexpr = gl.BlockedLayout([1], [32], [1], [0])
    lane = gl.arange(0, 32, layout=layout)
    seen = turn - 1
    while seen != turn:
        old = gl.atomic_add(lock + lane * 0, gl.zeros([32], gl.int32, layout), mask=lane == 0, sem="acquire",
                            scope="gpu")
        seen = gl.max(gl.where(lane == 0, old, -1), axis=0)


@gluon.jit
def _pass_turn(lock):
    """Wait until this thread's bulk reductions have been applied in global memory (not
    only read from shared memory, as ``tma.store_wait`` waits for), then add 1 at
    ``lock`` (release): the next block's reductions start after this one's are done."""
    layout: gl.constexpr = gl.BlockedLayout([1], [32], [1], [0])
    lane = gl.arange(0, 32, layout=layout)
    one = gl.inline_asm_elementwise("cp.async.bulk.wait_group 0;\n\tmov.u32 $0, 1;", "=r,r", [lane],
                                    dtype=gl.int32, is_pure=False, pack=1)  # ``lane``: a shape for the result
    gl.atomic_add(lock + lane * 0, one, mask=lane == 0, sem="release", scope="gpu")


@gluon.jit
def onepass_kernel(q_desc, k_desc, v_desc, do_desc, dk_desc, dv_desc, Lse, Delta, Sem, nheads, nheads_k, group_size,
                    seqlen_q, num_n_blocks, diag_offset, qk_scale, scale, dq_desc, dq_rows, seqlen_k, pair_group, Items,
                    item_cap, Dk, dk_sh, dk_sm, Dv, dv_sh, dv_sm, CAUSAL: gl.constexpr, NUM_BUF: gl.constexpr,
                    DQ_BUF: gl.constexpr, CONSUMER_REGS: gl.constexpr, LOADER_REGS: gl.constexpr,
                    REDUCER_REGS: gl.constexpr, KEYS_OUTER: gl.constexpr, DQ_NATIVE: gl.constexpr,
                    DET_ROTATE: gl.constexpr):
    HEAD_D: gl.constexpr = q_desc.block_type.shape[3]
    QROWS: gl.constexpr = q_desc.block_type.shape[2]  # queries per step (ROWS, or 2 x ROWS at d64: Q_ROWS)
    dtype: gl.constexpr = q_desc.dtype
    DET: gl.constexpr = Sem.dtype.element_ty == gl.int32  # deterministic dQ sums (fixed lengths only)
    # rotated sums need a pair's blocks launched side by side (``det_rotate``): pair-major, no causal
    gl.static_assert(not DET_ROTATE or (DET and not CAUSAL and not KEYS_OUTER))
    pid = gl.program_id(0)  # flat grid over (batch, kv head) pairs and blocks of 2 * ROWS keys
    lse_stride = seqlen_q
    if Items.dtype.element_ty == gl.int32:
        # Packed sequences (B = 1): (kv head, work item over key blocks), heads outer as in
        # ``common.work_item``; the item's sequence from its first rows (q_row, k_row), with
        # its own lengths and bottom-right diagonal. Lse and Delta are (1, H, total_q).
        count = gl.load(Items)
        if pid >= count * nheads_k:
            return
        kvh = pid // count
        seq, nb, q_row, seqlen_q, k_row, seqlen_k = varlen_item(Items, pid % count, item_cap)
        diag_offset = seqlen_k - seqlen_q
        num_n_blocks = gl.cdiv(seqlen_k, 2 * ROWS)
        b = seq * 0
    else:
        if KEYS_OUTER:  # block-major within groups of pair_group pairs (``pair_group``), one group after another
            nb, bk = grouped_coords(pid, gl.num_programs(0) // num_n_blocks, num_n_blocks, pair_group)
        else:  # pair-major: a pair's blocks run side by side (its Q and dO shared in L2)
            nb = pid % num_n_blocks
            bk = pid // num_n_blocks
        if DET and CAUSAL:  # a block waits for the higher ones (``_det_turn``): they start first
            nb = num_n_blocks - 1 - nb
        b = bk // nheads_k
        kvh = bk % nheads_k
        q_row = b * 0
        k_row = q_row
    n0 = nb * (2 * ROWS)
    q_lo, nq = step_range(n0, seqlen_q, diag_offset, QROWS, CAUSAL)
    q_rot = (nb * nq) // num_n_blocks
    if DET and not DET_ROTATE:  # every block streams the query tiles from its first (``_det_turn``)
        q_rot = 0

    q_smem = gl.allocate_shared_memory(dtype, [NUM_BUF, 1, 1, QROWS, HEAD_D], q_desc.layout)
    do_smem = gl.allocate_shared_memory(dtype, [NUM_BUF, 1, 1, QROWS, HEAD_D], do_desc.layout)
    k_smem = gl.allocate_shared_memory(dtype, [2, 1, 1, ROWS, HEAD_D], k_desc.layout)
    v_smem = gl.allocate_shared_memory(dtype, [2, 1, 1, ROWS, HEAD_D], v_desc.layout)
    # DQ_BUF slots of both warpgroups' float32 dQ halves (slot s's half h at 2 s + h), each a box of
    # the dQ's descriptor: QROWS x D/2, or QROWS/2 x D when the warpgroups split the queries (``q_split``)
    SLOT_ROWS: gl.constexpr = dq_desc.block_type.shape[0]
    SLOT_COLS: gl.constexpr = dq_desc.block_type.shape[1]
    if SLOT_COLS == HEAD_D:  # the query split: P and dS of the step's queries x both warpgroups' keys
        gl.static_assert(DQ_NATIVE and QROWS == 2 * ROWS and SLOT_ROWS == ROWS)
        gl.static_assert(Items.dtype.element_ty != gl.int32)  # fixed lengths only (``split_plan``)
        pds_layout: gl.constexpr = gl.NVMMASharedLayout.get_default_for([QROWS, 2 * ROWS], dtype)
        p_smem = gl.allocate_shared_memory(dtype, [1, QROWS, 2 * ROWS], pds_layout)
        ds_smem = gl.allocate_shared_memory(dtype, [1, QROWS, 2 * ROWS], pds_layout)
    else:
        pds_layout: gl.constexpr = gl.NVMMASharedLayout.get_default_for([QROWS, ROWS], dtype)
        p_smem = gl.allocate_shared_memory(dtype, [2, QROWS, ROWS], pds_layout)
        ds_smem = gl.allocate_shared_memory(dtype, [2, QROWS, ROWS], pds_layout)
    dq_smem = gl.allocate_shared_memory(gl.float32, [DQ_BUF * 2, SLOT_ROWS, SLOT_COLS],
                                        _dq_slot_layout(DQ_NATIVE, SLOT_ROWS, SLOT_COLS, dq_desc.layout))
    kv_bar = gl.allocate_shared_memory(gl.int64, [3 if CAUSAL else 2, 1], mbarrier.MBarrierLayout())
    q_ready = gl.allocate_shared_memory(gl.int64, [NUM_BUF, 1], mbarrier.MBarrierLayout())
    q_empty = gl.allocate_shared_memory(gl.int64, [NUM_BUF, 1], mbarrier.MBarrierLayout())
    # DET_ROTATE: a second entry, unused, tells the reducer (constexprs reach partitions as tensors)
    ds_full = gl.allocate_shared_memory(gl.int64, [2 if DET_ROTATE else 1, 1], mbarrier.MBarrierLayout())
    ds_empty = gl.allocate_shared_memory(gl.int64, [1, 1], mbarrier.MBarrierLayout())
    dq_full = gl.allocate_shared_memory(gl.int64, [DQ_BUF, 1], mbarrier.MBarrierLayout())
    dq_empty = gl.allocate_shared_memory(gl.int64, [DQ_BUF, 1], mbarrier.MBarrierLayout())
    for i in gl.static_range(2):
        mbarrier.init(kv_bar.index(i), count=1)
    for i in gl.static_range(NUM_BUF):
        mbarrier.init(q_ready.index(i), count=1)
        mbarrier.init(q_empty.index(i), count=2)  # both consumers release a slot
    mbarrier.init(ds_full.index(0), count=2)
    mbarrier.init(ds_empty.index(0), count=2)
    for i in gl.static_range(DQ_BUF):
        mbarrier.init(dq_full.index(i), count=2)  # both warpgroups' halves
        mbarrier.init(dq_empty.index(i), count=1)  # the reducer

    args = (q_desc, k_desc, v_desc, do_desc, dk_desc, dv_desc, Lse, Delta, Sem, q_smem, do_smem, k_smem, v_smem,
            p_smem, ds_smem, kv_bar, q_ready, q_empty, ds_full, ds_empty, b, kvh, n0, q_rot, group_size, nheads,
            seqlen_q, diag_offset, qk_scale, scale, dq_desc, dq_smem, dq_full, dq_empty, dq_rows,
            q_row, k_row, seqlen_k, lse_stride, Items, Dk, dk_sh, dk_sm, Dv, dv_sh, dv_sm)
    gl.warp_specialize([(_consumer0, args), (_consumer1, args), (_loader, args), (_reducer, args)],
                       [4, 1, 1], [CONSUMER_REGS, LOADER_REGS, REDUCER_REGS])


@triton.jit
def _dq_convert(Acc, Dq, nheads, seqlen_q, acc_rows, stride_b, stride_h, stride_m,
                BLOCK_M: tl.constexpr, HEAD_D: tl.constexpr, QROWS: tl.constexpr, NATIVE: tl.constexpr):
    """The postprocess: rows of the float32 dQ (B, H, acc_rows, D), contiguous, cast into
    dq (B, H, Sq, D) with unit last stride. Grid (cdiv(Sq, BLOCK_M), B * H). NATIVE: each
    tile of QROWS rows holds its two halves of D / 2 columns one after the other, each in
    the order of ``native_offset_bases``. (Under the query split each 64-row half of a step
    holds its D = 64 columns in ``native_offset_bases(64, 64)``'s order: the same offsets as
    QROWS = 64's two halves, whose second half starts at 64 x 32, the offset of column 32.)"""
    bh = tl.program_id(1)
    b = bh // nheads
    h = bh % nheads
    rows = tl.program_id(0) * BLOCK_M + tl.arange(0, BLOCK_M)
    cols = tl.arange(0, HEAD_D)
    ok = (rows < seqlen_q)[:, None]
    if NATIVE:
        HALF: tl.constexpr = HEAD_D // 2
        r = rows % QROWS
        c = cols % HALF
        # native_offset_bases inverted: every row and column bit to its offset bit (row 1, 2, 4
        # to 16, 32, 64; row 8 to 2; row 16, 32 to 128, 256; row 64 past the column bits; col
        # 1 to 1; col 2, 4 to 4, 8; col 8 .. to 512 ..)
        g = ((r & 7) << 4) | ((r & 8) >> 2) | ((r & 48) << 3) | ((r >> 6) * (64 * HALF))
        f = ((c & 1) | ((c & 6) << 1) | ((c >> 3) << 9)) + (cols // HALF) * (QROWS * HALF)
        offs = ((rows - r) * HEAD_D + g)[:, None] + f[None, :]
    else:
        offs = rows[:, None] * HEAD_D + cols[None, :]
    acc = tl.load(Acc + bh.to(tl.int64) * acc_rows * HEAD_D + offs, mask=ok)
    out = Dq + b.to(tl.int64) * stride_b + h.to(tl.int64) * stride_h + rows[:, None].to(tl.int64) * stride_m
    tl.store(out + cols[None, :], acc.to(Dq.dtype.element_ty), mask=ok)


_launch = Launcher(onepass_kernel)
_launch_convert = Launcher(_dq_convert)


def dq_accumulator_layout(head_dim: int, swizzle: int | str | None = None):
    """The shared-memory layout of a (q_rows, D / 2) float32 dQ slot's TMA box: ``swizzle``
    bytes (None: ``DQ_SWIZZLE[head_dim]``), none for ``DQ_NATIVE`` (whose slots the
    consumers write in ``native_offset_bases``' order)."""
    swizzle = DQ_SWIZZLE[head_dim] if swizzle is None else swizzle
    if swizzle not in (0, 32, 64, 128, DQ_NATIVE):
        raise ValueError(f"a dQ swizzle is 0, 32, 64 or 128 bytes or {DQ_NATIVE!r}, got {swizzle!r}")
    return gl.NVMMASharedLayout(swizzle_byte_width=0 if swizzle == DQ_NATIVE else swizzle, element_bitwidth=32,
                                rank=2)


def dq_slot_swizzle(head_dim: int, swizzle: int | str | None, packed: bool) -> int | str:
    """A call's dQ slot swizzle: ``swizzle``, else ``DQ_SWIZZLE[head_dim]``. ``DQ_NATIVE``
    needs fixed lengths (a packed sequence's query tiles start at any row, not at a multiple
    of the tile): asked for with packed sequences it is refused; as the default, packed
    calls take ``DQ_SWIZZLE_PACKED[head_dim]``."""
    if swizzle == DQ_NATIVE and packed:
        raise ValueError(f"dq_swizzle={DQ_NATIVE!r} takes fixed-length calls: a packed sequence's query tiles "
                         f"start at any row")
    swizzle = DQ_SWIZZLE[head_dim] if swizzle is None else swizzle
    return DQ_SWIZZLE_PACKED[head_dim] if swizzle == DQ_NATIVE and packed else swizzle


def dq_slots(head_dim: int, dq_buf: int | None, packed: bool, deterministic: bool) -> int:
    """A call's float32 dQ slots: ``dq_buf``, else ``DQ_BUF_DETERMINISTIC[head_dim]`` when
    deterministic, ``DQ_BUF_PACKED[head_dim]`` for packed sequences, ``DQ_BUF[head_dim]``."""
    if dq_buf is not None:
        return dq_buf
    return (DQ_BUF_DETERMINISTIC if deterministic else DQ_BUF_PACKED if packed else DQ_BUF)[head_dim]


def step_plan(head_dim: int, packed: bool, q_rows: int | None = None, num_buf: int | None = None) -> tuple[int, int]:
    """(queries per step, (Q, dO) ring slots) of a call, the defaults filled in: ``Q_ROWS[D]``
    (BLOCK for packed sequences) and ``NUM_BUF[D]`` slots of BLOCK rows (half as many of
    2 x BLOCK). Refuses other step sizes, and 2 x BLOCK but at d64 without packed sequences."""
    q_rows = q_rows or (BLOCK if packed else Q_ROWS[head_dim])
    if q_rows not in (BLOCK, 2 * BLOCK) or (q_rows != BLOCK and (packed or head_dim != 64)):
        raise ValueError(f"q_rows is {BLOCK}, or {2 * BLOCK} at head dim 64 without packed sequences, got {q_rows}")
    return q_rows, num_buf or NUM_BUF[head_dim] * BLOCK // q_rows


def accumulator(q, q_rows: int | None = None):
    """An uninitialised float32 dQ for ``attention_backward_onepass(dq_accum=)``: (B, H, Sq
    rounded up to q_rows (default ``Q_ROWS[D]``, the fixed-length calls' steps), D) of a q
    (B, H, Sq, D). The backward's Delta preprocess zeroes it in its own launch
    (``triton.backward.preprocess(accumulator=)``: fixed lengths; packed sequences' calls
    allocate their own, of BLOCK rows)."""
    import torch

    batch, nheads, seqlen_q, head_dim = q.shape
    q_rows = q_rows or Q_ROWS[head_dim]
    return torch.empty((batch, nheads, triton.cdiv(seqlen_q, q_rows) * q_rows, head_dim), dtype=torch.float32,
                       device=q.device)


def split_plan(head_dim: int, q_rows: int, native: bool, packed: bool, q_split: bool | None) -> bool:
    """Whether a call's warpgroups split each step's queries (``_qsplit_consumer``):
    ``q_split``, else ``Q_SPLIT`` where it applies. It applies at d64 with 128 queries per
    step, the native dQ slots and fixed lengths (deterministic calls too: the reducer's turns
    are per step, whichever warpgroup stored which part); asked for elsewhere, it is refused."""
    applies = head_dim == 64 and q_rows == 2 * BLOCK and native and not packed
    if q_split and not applies:
        raise ValueError(f"q_split=True takes head dim 64 with {2 * BLOCK} queries per step, dq_swizzle="
                         f"{DQ_NATIVE!r} and fixed lengths")
    return applies and Q_SPLIT if q_split is None else bool(q_split)


def dq_box(head_dim: int, q_rows: int, q_split: bool) -> list[int]:
    """A dQ slot's box (one warpgroup's part of a step): q_rows x D / 2, or q_rows / 2 x D
    under the query split."""
    return [q_rows // 2, head_dim] if q_split else [q_rows, head_dim // 2]


def det_rotate(causal: bool, num_n_blocks: int, sm_count: int) -> bool:
    """Whether a deterministic call's key blocks start their query loops at tiles of their
    own (``_rotated_turn``, the plain kernel's order), not all at the first: without causal,
    when a (batch, kv head)'s ``num_n_blocks`` blocks fit on half the ``sm_count`` SMs (one
    program per SM). A block may then wait for a higher block of its pair, which launches
    after it. Blocks launch in order and the grid is pair-major, so one launch completes
    once ``num_n_blocks`` SMs are free for it; the other half covers a second such launch
    at once or other work. A kernel that holds more than half the SMs until this one ends
    (none of flashtile's) could hang it. The sums' order, so the bits, depend on this rule:
    the same on every GPU with the SM count, not across SM counts near the line."""
    return not causal and 2 * num_n_blocks <= sm_count


def attention_backward_onepass(q, k, v, dout, lse, delta, dq, dk, dv, *, scale: float, diag_offset: int,
                               causal: bool, num_buf: int | None = None, dq_buf: int | None = None,
                               dq_swizzle: int | str | None = None, varlen=None, dq_accum=None,
                               q_rows: int | None = None, deterministic: bool = False,
                               rotate: bool | None = None, q_split: bool | None = None) -> None:
    """Launch the one-pass kernel and the dQ postprocess; the caller checked
    ``scope.backward_scope`` and TMA alignment (``backends.registry.backward``).

    Args:
        q, dout, dq: (B, H, Sq, D); k, v, dk, dv: (B, Hk, Sk, D); 16-byte-aligned bases and
            strides, unit stride along D, D in HEAD_DIMS, fp16 or bf16.
        lse, delta: (B, H, Sq) float32 contiguous (natural log; delta = rowsum(dO * O),
            minus the LSE's own upstream gradient if any).
        causal: key j visible to query i iff j <= i + diag_offset.
        num_buf, dq_buf: (Q, dO) ring slots (default ``NUM_BUF[D]`` of 64 rows: half as many
            of 128) and float32 dQ slots (default: ``dq_slots``);
            dq_swizzle: the dQ slots' swizzle (default ``DQ_SWIZZLE[D]``), or ``DQ_NATIVE``:
            the accumulator's register order, without packed sequences (experiments:
            benchmarks/experiments/gluon_bwd_onepass.py).
        q_rows: queries per step, BLOCK, or 2 x BLOCK at D 64 (default ``Q_ROWS[D]``;
            packed sequences take BLOCK).
        varlen: None, or (Varlen, key table, ...) for packed sequences (B = 1; Sq and Sk the
            total rows), as ``backward_split.attention_backward_ws`` takes it: the work list of
            blocks of 2 * BLOCK keys (``backends.worklist.build_work_items``); further
            tables are ignored. Each sequence's causal diagonal is its bottom-right one
            (``diag_offset`` is not read). dK and dV rows outside every sequence are not
            written; dQ's are written as zeros (the postprocess casts every row).
        dq_accum: None, or ``accumulator(q, q_rows)`` already zeroed (the library's path: the
            preprocess zeroed it), else the call allocates and zeroes one.

        deterministic: dQ's float32 sums in a fixed order (bitwise reproducible): each
            (query head, query tile) has an int32 counter, and a key block adds its part
            only when the blocks before it in ``_det_turn``'s order have added theirs, then
            passes the turn once its sums are in global memory. Fixed lengths only.
        rotate: deterministic calls only: each key block starts at a query tile of its own
            (``_rotated_turn``) or all at the first; None: ``DET_ROTATE_DEFAULT`` where
            ``det_rotate``'s rule allows it. True where the rule says no is refused (a block
            could wait for one that cannot start).
        q_split: the warpgroups split each step's queries instead of its keys for S, dP and
            dQ (``_qsplit_consumer``): d64, 128 queries per step, the native dQ slots, fixed
            lengths; None: ``Q_SPLIT`` where those hold.

    Memory: a float32 dQ of B x H x Sq (rounded up to q_rows) x D; deterministic: an int32
    counter per (B, H, query tile) more.
    """
    import torch
    from triton.experimental.gluon.nvidia.hopper import TensorDescriptor

    batch, nheads, seqlen_q, head_dim = q.shape
    nheads_k, seqlen_k = k.shape[1], k.shape[2]
    if head_dim not in HEAD_DIMS:
        raise ValueError(f"the one-pass backward takes head dims {HEAD_DIMS}, got {head_dim}")
    if deterministic and varlen is not None:
        raise ValueError("deterministic=True: the one-pass backward orders dQ's sums for fixed-length calls only")
    if rotate is not None and not deterministic:
        raise ValueError("rotate= orders a deterministic call's dQ sums; pass deterministic=True")
    if deterministic:
        blocks = triton.cdiv(seqlen_k, 2 * BLOCK)
        allowed = not causal and det_rotate(causal, blocks, sm_count(q.device.index))  # no device query if causal
        if rotate and not allowed:
            raise ValueError(f"rotate=True needs no causal mask and at most half the SMs' worth of key blocks "
                             f"({blocks} blocks of {2 * BLOCK} keys here)")
        rotate = allowed and DET_ROTATE_DEFAULT if rotate is None else rotate
    q_rows, num_buf = step_plan(head_dim, varlen is not None, q_rows, num_buf)
    dq_buf = dq_slots(head_dim, dq_buf, varlen is not None, deterministic)
    if num_buf < 2 or dq_buf < 1:
        raise ValueError(f"need num_buf >= 2 and dq_buf >= 1, got {num_buf} and {dq_buf}")
    dq_swizzle = dq_slot_swizzle(head_dim, dq_swizzle, varlen is not None)
    native = dq_swizzle == DQ_NATIVE
    box = dq_box(head_dim, q_rows, split_plan(head_dim, q_rows, native, varlen is not None, q_split))
    # the dQ as its TMA descriptor sees it: native boxes lie whole one after another (a query tile's
    # halves, or its row halves in place), (rows, D) else
    width = box[1] if native else head_dim
    rows = triton.cdiv(seqlen_q, q_rows) * q_rows  # padded: the last query block's reductions need no mask
    if batch * nheads * rows * (head_dim // width) >= 2 ** 31:
        raise ValueError(f"batch x heads x padded seqlen_q = {batch * nheads * rows} exceeds the int32 rows "
                         f"of a TMA coordinate" + (f" (halved: dq_swizzle={DQ_NATIVE!r})" if width < head_dim
                                                   else ""))
    if dq_accum is not None and (dq_accum.shape != (batch, nheads, rows, head_dim) or dq_accum.dtype != torch.float32):
        raise ValueError(f"dq_accum must be float32 {(batch, nheads, rows, head_dim)} (accumulator(q, q_rows)), got "
                         f"{dq_accum.dtype} {tuple(dq_accum.shape)}")
    acc = accumulator(q, q_rows).zero_() if dq_accum is None else dq_accum
    flat = acc.view(-1, width)
    dq_desc = TensorDescriptor(flat, list(flat.shape), list(flat.stride()), box,
                               dq_accumulator_layout(head_dim, dq_swizzle))
    # the turn counters of a deterministic call; else an unread float32 pointer (its dtype selects the plain kernel)
    sem = torch.zeros(batch * nheads * triton.cdiv(seqlen_q, q_rows), dtype=torch.int32,
                      device=q.device) if deterministic else lse
    group = 1  # pairs a group of the grid's order (``pair_group``); packed sequences: heads outer
    if varlen is None:
        num_n_blocks = triton.cdiv(seqlen_k, 2 * BLOCK)
        grid = num_n_blocks * batch * nheads_k
        group = pair_group(causal, num_n_blocks, batch * nheads_k, sm_count(q.device.index), nheads > nheads_k)
        items = (lse, 0, dk, 0, 0, dv, 0, 0)  # unread: Items' float dtype selects the fixed-length path
    else:
        if batch != 1:
            raise ValueError(f"packed sequences come as one batch row, got batch {batch}")
        kv_table, kv_cap = varlen[1]
        num_n_blocks, grid = 0, kv_cap * nheads_k
        items = (kv_table, kv_cap, dk, dk.stride(1), dk.stride(2), dv, dv.stride(1), dv.stride(2))
    _launch((grid,),
            (tma_descriptor(q, q_rows), tma_descriptor(k, BLOCK), tma_descriptor(v, BLOCK),
             tma_descriptor(dout, q_rows), tma_descriptor(dk, BLOCK), tma_descriptor(dv, BLOCK), lse, delta, sem,
             nheads, nheads_k, nheads // nheads_k, seqlen_q, num_n_blocks, diag_offset, scale * LOG2E, scale,
             dq_desc, rows, seqlen_k, group, *items),
            dict(CAUSAL=causal, NUM_BUF=num_buf, DQ_BUF=dq_buf, CONSUMER_REGS=CONSUMER_REGS,
                 LOADER_REGS=LOADER_REGS, REDUCER_REGS=REDUCER_REGS,
                 KEYS_OUTER=group > 1, DQ_NATIVE=native, DET_ROTATE=bool(rotate)), 4, 1)
    _launch_convert((triton.cdiv(seqlen_q, BLOCK), batch * nheads),
                    (acc, dq, nheads, seqlen_q, rows, *dq.stride()[:3]),
                    dict(BLOCK_M=BLOCK, HEAD_D=head_dim, QROWS=box[0], NATIVE=native), 4, 1)

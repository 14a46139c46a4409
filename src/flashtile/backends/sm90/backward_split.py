"""Hopper backward in Gluon: warp-specialized kernels, FA3-style (sm90, fp16/bf16, head
dim 64/128/256, plain or causal, no softcap/alibi/mask/dropout).

The same algebra as ``backward.py`` (read its docstring first), split like it into a dK/dV
kernel and a dQ kernel, so there are no atomics and gradients are bitwise reproducible:
the deterministic backward of causal calls below 2048 queries (elsewhere the one-pass
kernel's ordered dQ sums), varlen's, and the default at head dim 256. At d64 and d128 the default is the
one-pass kernel of ``backward_onepass`` (dQ by bulk TMA
reductions, 5 products per tile pair instead of 7: 3-16% faster there, H200 runs 86, 96).

dK/dV (``dkdv_kernel``): one program owns 2 x 64 keys of one (batch, kv head):

    loader   (1 warp)  K and V once, then (Q_s, dO_s) tiles of 64 queries, for every query
                       head of the GQA group, through a DKDV_NUM_BUF-slot ring by TMA
    consumer (2 x 4 warps; warpgroup w owns keys w*64 .. w*64+63), per step s:
        issue  S_s = Q_s K_w^T,  dP_s = dO_s V_w^T                 (async wgmma)
        issue  dV_w += P_{s-1}^T dO_{s-1},  dK_w += dS_{s-1}^T Q_{s-1}   (async)
        wait for S_s, dP_s only
        P_s = exp2(S_s * c - lse),  dS_s = P_s (dP_s - Delta)    (under step s-1's products)
        wait for dV, dK; release slot s-1; store P_s, dS_s to shared memory

dQ (``dq_kernel``): one program owns 2 x 64 queries of one (batch, head), like the forward:

    loader   (1 warp)  Q and dO once, then K_j and V_j through a DQ_NUM_BUF-slot ring
    consumer (2 x 4 warps, 64 queries each), per key tile j:
        issue  S_j = Q K_j^T,  dP_j = dO V_j^T                      (async)
        issue  dQ += dS_{j-1} K_{j-1}                  (async, dS from registers)
        wait for S_j, dP_j; release V_j; P_j, dS_j (under the dQ product)
        wait for dQ; release K_{j-1}

So the elementwise work of a step runs while the tensor cores do the previous step's
products, in both kernels. 7 tile products per tile pair (S and dP are computed twice),
against FA2/FA3's 5 with a dQ reduction.

Head dim 256: a warpgroup cannot hold both 64 x 256 float32 accumulators, so the dK/dV
kernel becomes two (``dv_kernel``: 2 warpgroups, S then dV += P^T dO; ``dk_kernel``:
1 warpgroup, S and dP then dK += dS^T Q; 8 products per tile pair), and the dQ kernel
takes 32-key tiles. Q and dO load through rings of their own there (``DV_RING``,
``DK_RING``). 1.8-2.1x the Triton kernels at d256 on the H200 (runs 45 and 50).

Queries are the rows of every score tile, so LSE and Delta are row vectors (2 registers
per thread each). dK and dQ come out scaled by the softmax scale at the end. Inputs are
(B, H, S, D) views with 16-byte-aligned strides (4-D TMA descriptors; any seqlen:
zero-filled loads, clipped stores). Causal is bottom-right by ``diag_offset``; rows that
see no key have lse -inf and get P = 0 (the causal mask), so dQ = 0 there.

Triton 3.6 turns constexprs passed through ``gl.warp_specialize`` into tensors, so the
partitions read compile-time sizes from descriptor and shared-memory types (CAUSAL: a
barrier array has a third, unused entry).
"""

from __future__ import annotations

import triton
from triton.experimental import gluon
from triton.experimental.gluon import language as gl
from triton.experimental.gluon.language.nvidia.hopper import (
    fence_async_shared,
    mbarrier,
    tma,
    warpgroup_mma,
    warpgroup_mma_wait,
)

from flashtile.backends.sm90.common import (dkdv_step_products, grouped_coords, load_kv_tiles, pair_group,
                                           step_range, store_grad_tile, tma_descriptor, varlen_item, work_item)
from flashtile.backends.sm90.scope import SPLIT_HEAD_DIMS
from flashtile.backends.triton.scores import C_LOG2E, LOG2E
from flashtile.runtime.device import sm_count
from flashtile.runtime.launch import Launcher

BLOCK = 64  # rows per consumer warpgroup (keys in dK/dV, queries in dQ), queries per dK/dV step
ROWS = gl.constexpr(BLOCK)
# (Q, dO) ring slots of the dK/dV kernel: the step in use, the previous one (its products
# in flight) and two loading. 4, not 3: the modulo-3 slot arithmetic made d128 spill.
DKDV_NUM_BUF = 4
DQ_NUM_BUF = 3  # K/V ring slots of the dQ kernel (H200 run 35: 3 beat 2 by 17-30%)
LOADER_REGS = 24
CONSUMER_REGS = 240
# The split kernels give Q and dO rings of their own, each slot released as soon as its
# tile is read, so a step's loads start a step ahead (one shared (Q, dO) ring of 2 slots
# could load step s + 1 only when step s - 1 was done with both: H200 run 50, the dV
# kernel +28-47% and the dK kernel +13-49% with these rings):
#   dV kernel (2 warpgroups): Q_s is read by S_s only, dO_s by step s + 1's dV product:
#       (2 Q slots, 2 dO slots). Shared memory (bf16): Q 64 KB + dO 64 KB + K of 2 x 64
#       keys 64 KB + P 16 KB = 208 KB.
#   dK kernel (1 warpgroup): Q_s is read by S_s and by step s + 1's dK product, dO_s by
#       dP_s only: (3 Q slots, 1 dO slot). Q 96 KB + dO 32 KB + K and V of 64 keys 64 KB +
#       dS 8 KB = 200 KB (two warpgroups would need K and V of 128 keys and two dS: 272 KB).
DV_RING = (2, 2)
DK_RING = (3, 1)
# The d256 dV and dK kernels' grid order for causal calls (``split_pair_group``): None the
# one-pass kernel's default (causal GQA calls in groups of about a wave of programs,
# ``common.pair_group``; causal MHA ones pair-major), 1 pair-major for every call (each (batch,
# kv head)'s key blocks side by side, block 0 first), G block-major within groups of G pairs for
# every causal call. H100 run 252 (docs/perf-notes.md, session 48): the rule's groups gained
# causal GQA 4 6-13% at S2048-8192 against pair-major; MHA moved -1 to +1.5%, within the spread.
PAIR_GROUP: int | None = None


def dkdv_steps(head_dim: int, varlen: bool, block_q: int | None = None,
               num_buf: int | None = None) -> tuple[int, int]:
    """(queries per step, (Q, dO) ring slots) of the dK/dV kernel, the caller's where given.
    Defaults: 128 and 3 at d64 without packed sequences (H100 run 215, the split backward
    alone: +3-9% over 64 and 4 at S2048-16k, causal or not; 128 with 2 slots lost), else
    BLOCK and DKDV_NUM_BUF; a caller's step size other than the default takes DKDV_NUM_BUF."""
    default = (2 * BLOCK, 3) if head_dim <= 64 and not varlen else (BLOCK, DKDV_NUM_BUF)
    block_q = block_q or default[0]
    return block_q, num_buf or (default[1] if block_q == default[0] else DKDV_NUM_BUF)


def default_dq_block_n(head_dim: int) -> int:
    """Keys per tile of the dQ kernel: 128 at d64 (+1-2.5% over 64, H200 runs 36 and 39),
    64 at d128 (3 ring slots of 128 keys do not fit shared memory), 32 at d256 (3 slots of
    64 keys would need 262 KB; 3 slots of 32 beat 2 by 55-60%, H200 run 45)."""
    return 128 if head_dim <= 64 else 64 if head_dim <= 128 else 32


@gluon.jit
def _row_stats(Lse, Delta, bh, rows, seqlen_q, lse_stride, q_row):
    """LSE (in base 2) and Delta of query rows ``rows`` of head row bh = b * nheads + h
    (``lse_stride`` apart; a varlen sequence's rows from q_row on). Rows past seqlen_q get
    lse = +inf, so their P is 0 (their Q and dO are zero-filled, or the next document's)."""
    row_off = bh.to(gl.int64) * lse_stride + q_row
    lse2 = gl.load(Lse + row_off + rows, mask=rows < seqlen_q, other=float("inf")) * C_LOG2E
    delta = gl.load(Delta + row_off + rows, mask=rows < seqlen_q, other=0.0)
    return lse2, delta


@gluon.jit
def _probs(s, lse2, rows, keys, seqlen_k, diag_offset, qk_scale, MASK: gl.constexpr, CAUSAL: gl.constexpr):
    """P = exp2(S * c - lse) on a (queries x keys) tile, 0 where key j is past seqlen_k or
    (causal) right of row i's diagonal. The mask is applied to P, not to S: a row that sees
    no key has lse = -inf, and -inf - -inf would be NaN."""
    p = gl.exp2(s * qk_scale - lse2[:, None])
    if MASK:
        ok = keys[None, :] < seqlen_k
        if CAUSAL:
            ok = ok & (keys[None, :] <= rows[:, None] + diag_offset)
        p = gl.where(ok, p, 0.0)
    return p


# ---------------------------------------------------------------------------- dK / dV


@gluon.jit
def _step_rows(s, q_lo, nq, kvh, group_size, QROWS: gl.constexpr):
    """Step s of a key block's walk over the queries: its query head and first query row
    (the heads of the kv head's GQA group outer, the query blocks from q_lo inner)."""
    return kvh * group_size + s // nq, (q_lo + s % nq) * QROWS


@gluon.jit
def _step_tiles(s, q_lo, nq, kvh, group_size, q_smem, do_smem, q_ready):
    """Step s = (query head of the group, query block): the head, the first query row, and
    the (Q, dO) tiles once they have landed."""
    NUM_BUF: gl.constexpr = q_smem.type.shape[0]
    QROWS: gl.constexpr = q_smem.type.shape[3]
    HEAD_D: gl.constexpr = q_smem.type.shape[4]
    slot = s % NUM_BUF
    mbarrier.wait(q_ready.index(slot), (s // NUM_BUF) & 1)
    hq, m0 = _step_rows(s, q_lo, nq, kvh, group_size, QROWS)
    return hq, m0, q_smem.index(slot).reshape([QROWS, HEAD_D]), do_smem.index(slot).reshape([QROWS, HEAD_D])


@gluon.jit
def _p_and_ds(s, dp, Lse, Delta, b, hq, nheads, seqlen_q, seqlen_k, nk, m0, diag_offset, qk_scale, lse_stride, q_row,
              CAUSAL: gl.constexpr, dtype: gl.constexpr, s_layout: gl.constexpr):
    """P and dS = P (dP - Delta) of a (queries x keys) tile, in the input dtype for the
    dV/dK products; element masks only on a tile that reaches past the keys or (causal)
    the diagonal. Both paths end in the conversions: the caller's wait for the previous
    step's products then starts a new basic block, and ptxas, which schedules within
    one, cannot hoist that wait above this work (it did, with one path: no overlap)."""
    QROWS: gl.constexpr = s.shape[0]
    rows = m0 + gl.arange(0, QROWS, layout=gl.SliceLayout(1, s_layout))
    keys = nk + gl.arange(0, ROWS, layout=gl.SliceLayout(0, s_layout))
    lse2, delta = _row_stats(Lse, Delta, b * nheads + hq, rows, seqlen_q, lse_stride, q_row)
    # Causal: keys past seqlen_k only reach their own (clipped) dK/dV rows, so only the
    # diagonal needs masks.
    if CAUSAL:
        edge = nk + ROWS - 1 > m0 + diag_offset  # a tile on (or past) the diagonal
        key_end = 2147483647
    else:
        edge = nk + ROWS > seqlen_k
        key_end = seqlen_k
    if edge:
        p = _probs(s, lse2, rows, keys, key_end, diag_offset, qk_scale, True, CAUSAL)
        ds = p * (dp - delta[:, None])
        pt, dst = p.to(dtype), ds.to(dtype)
    else:
        p = _probs(s, lse2, rows, keys, key_end, diag_offset, qk_scale, False, CAUSAL)
        ds = p * (dp - delta[:, None])
        pt, dst = p.to(dtype), ds.to(dtype)
    return pt, dst


@gluon.jit
def _dkdv_consumer(WG: gl.constexpr, q_desc, k_desc, v_desc, do_desc, dk_desc, dv_desc, Lse, Delta,
                   q_smem, do_smem, k_smem, v_smem, p_smem, ds_smem, kv_bar, q_ready, q_empty,
                   b, kvh, n0, group_size, nheads, seqlen_q, seqlen_k, diag_offset, qk_scale, scale, q_row, k_row, lse_stride, Items, Dk, dk_sh, dk_sm, Dv, dv_sh, dv_sm):
    HEAD_D: gl.constexpr = q_desc.block_type.shape[3]
    NUM_BUF: gl.constexpr = q_smem.type.shape[0]
    CAUSAL: gl.constexpr = kv_bar.type.shape[0] == 3
    dtype: gl.constexpr = q_desc.dtype
    s_layout: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[4, 1],
                                                       instr_shape=[16, ROWS, 16])
    o_layout: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[4, 1],
                                                       instr_shape=[16, HEAD_D, 16])
    QROWS: gl.constexpr = q_smem.type.shape[3]  # queries per step
    nk = n0 + WG * ROWS  # first key of this warpgroup
    k_tile = k_smem.index(WG).reshape([ROWS, HEAD_D])
    v_tile = v_smem.index(WG).reshape([ROWS, HEAD_D])
    q_lo, nq = step_range(n0, seqlen_q, diag_offset, QROWS, CAUSAL)
    n_steps = nq * group_size

    # P and dS (queries x keys) of the previous step wait in shared memory for their dV/dK
    # products, which read them transposed (as register operands they kept 32 more
    # registers live: spills at d128).
    p_tile = p_smem.index(WG)
    ds_tile = ds_smem.index(WG)
    dk = gl.zeros([ROWS, HEAD_D], gl.float32, o_layout)
    dv = gl.zeros([ROWS, HEAD_D], gl.float32, o_layout)
    mbarrier.wait(kv_bar.index(WG), 0)
    if n_steps > 0:  # step 0: nothing to overlap with yet
        hq, m0, q_t, do_t = _step_tiles(0, q_lo, nq, kvh, group_size, q_smem, do_smem, q_ready)
        st = warpgroup_mma(q_t, k_tile.permute((1, 0)), gl.zeros([QROWS, ROWS], gl.float32, s_layout),
                           use_acc=False, is_async=True)
        dpt = warpgroup_mma(do_t, v_tile.permute((1, 0)), gl.zeros([QROWS, ROWS], gl.float32, s_layout),
                            use_acc=False, is_async=True)
        st, dpt = warpgroup_mma_wait(num_outstanding=0, deps=(st, dpt))
        pt, dst = _p_and_ds(st, dpt, Lse, Delta, b, hq, nheads, seqlen_q, seqlen_k, nk, m0, diag_offset,
                            qk_scale, lse_stride, q_row, CAUSAL, dtype, s_layout)
        p_tile.store(pt)
        ds_tile.store(dst)
        fence_async_shared()
    for s in range(1, n_steps):
        prev = (s - 1) % NUM_BUF
        # 128-query steps (dkdv_block_q=128): z = 0 (s < 2**30) but not to the compiler, so the
        # fixed tiles' views are made anew each step instead of their wgmma descriptors being
        # hoisted out of the loop and spilled (the one-pass kernel's trick, backward_onepass;
        # sm_90a, d64 bf16: 324 -> 0 B of spills, 828 -> 16 B causal). 64-query steps do not
        # spill: their code is as before.
        if QROWS > ROWS:
            z = s >> 30
            k_tile = k_smem.index(WG + z).reshape([ROWS, HEAD_D])
            v_tile = v_smem.index(WG + z).reshape([ROWS, HEAD_D])
            p_tile = p_smem.index(WG + z)
            ds_tile = ds_smem.index(WG + z)
        hq, m0, q_t, do_t = _step_tiles(s, q_lo, nq, kvh, group_size, q_smem, do_smem, q_ready)
        st, dpt, dk, dv = dkdv_step_products(q_t, do_t, k_tile, v_tile, p_tile, ds_tile, q_smem, do_smem, prev,
                                             dk, dv, s_layout)
        pt, dst = _p_and_ds(st, dpt, Lse, Delta, b, hq, nheads, seqlen_q, seqlen_k, nk, m0, diag_offset,
                            qk_scale, lse_stride, q_row, CAUSAL, dtype, s_layout)
        dk, dv = warpgroup_mma_wait(num_outstanding=0, deps=(dk, dv))
        mbarrier.arrive(q_empty.index(prev), count=1)  # Q_{s-1} and dO_{s-1} are read
        p_tile.store(pt)
        ds_tile.store(dst)
        fence_async_shared()

    if n_steps > 0:
        last = (n_steps - 1) % NUM_BUF
        dv = warpgroup_mma(p_tile.permute((1, 0)), do_smem.index(last).reshape([QROWS, HEAD_D]), dv, is_async=True)
        dk = warpgroup_mma(ds_tile.permute((1, 0)), q_smem.index(last).reshape([QROWS, HEAD_D]), dk, is_async=True)
        dk, dv = warpgroup_mma_wait(num_outstanding=0, deps=(dk, dv))
        mbarrier.arrive(q_empty.index(last), count=1)

    # K and V are no longer read: their tiles stage dK and dV for the TMA stores.
    VARLEN: gl.constexpr = Items.dtype.element_ty == gl.int32
    store_grad_tile((dk * scale).to(dtype), k_smem.index(WG), dk_desc, Dk, dk_sh, dk_sm, b, kvh, k_row, nk,
                    seqlen_k, VARLEN)
    store_grad_tile(dv.to(dtype), v_smem.index(WG), dv_desc, Dv, dv_sh, dv_sm, b, kvh, k_row, nk, seqlen_k, VARLEN)
    tma.store_wait(pendings=0)


@gluon.jit
def _dkdv_consumer0(q_desc, k_desc, v_desc, do_desc, dk_desc, dv_desc, Lse, Delta, q_smem, do_smem, k_smem, v_smem,
                    p_smem, ds_smem, kv_bar, q_ready, q_empty, b, kvh, n0, group_size, nheads, seqlen_q, seqlen_k,
                    diag_offset, qk_scale, scale, q_row, k_row, lse_stride, Items, Dk, dk_sh, dk_sm, Dv, dv_sh, dv_sm):
    _dkdv_consumer(0, q_desc, k_desc, v_desc, do_desc, dk_desc, dv_desc, Lse, Delta, q_smem, do_smem, k_smem, v_smem,
                   p_smem, ds_smem, kv_bar, q_ready, q_empty, b, kvh, n0, group_size, nheads, seqlen_q, seqlen_k,
                   diag_offset, qk_scale, scale, q_row, k_row, lse_stride, Items, Dk, dk_sh, dk_sm, Dv, dv_sh, dv_sm)


@gluon.jit
def _dkdv_consumer1(q_desc, k_desc, v_desc, do_desc, dk_desc, dv_desc, Lse, Delta, q_smem, do_smem, k_smem, v_smem,
                    p_smem, ds_smem, kv_bar, q_ready, q_empty, b, kvh, n0, group_size, nheads, seqlen_q, seqlen_k,
                    diag_offset, qk_scale, scale, q_row, k_row, lse_stride, Items, Dk, dk_sh, dk_sm, Dv, dv_sh, dv_sm):
    _dkdv_consumer(1, q_desc, k_desc, v_desc, do_desc, dk_desc, dv_desc, Lse, Delta, q_smem, do_smem, k_smem, v_smem,
                   p_smem, ds_smem, kv_bar, q_ready, q_empty, b, kvh, n0, group_size, nheads, seqlen_q, seqlen_k,
                   diag_offset, qk_scale, scale, q_row, k_row, lse_stride, Items, Dk, dk_sh, dk_sm, Dv, dv_sh, dv_sm)


@gluon.jit
def _dkdv_loader(q_desc, k_desc, v_desc, do_desc, dk_desc, dv_desc, Lse, Delta, q_smem, do_smem, k_smem, v_smem,
                 p_smem, ds_smem, kv_bar, q_ready, q_empty, b, kvh, n0, group_size, nheads, seqlen_q, seqlen_k,
                 diag_offset, qk_scale, scale, q_row, k_row, lse_stride, Items, Dk, dk_sh, dk_sm, Dv, dv_sh, dv_sm):
    CAUSAL: gl.constexpr = kv_bar.type.shape[0] == 3
    for wg in gl.static_range(2):
        mbarrier.expect(kv_bar.index(wg), k_desc.block_type.nbytes + v_desc.block_type.nbytes)
        tma.async_copy_global_to_shared(k_desc, [b, kvh, k_row + n0 + wg * ROWS, 0], kv_bar.index(wg),
                                        k_smem.index(wg))
        tma.async_copy_global_to_shared(v_desc, [b, kvh, k_row + n0 + wg * ROWS, 0], kv_bar.index(wg),
                                        v_smem.index(wg))
    _load_qdo_steps(q_desc, do_desc, q_smem, do_smem, q_ready, q_empty, b, kvh, n0, group_size, seqlen_q,
                    diag_offset, CAUSAL, q_row)


@gluon.jit
def _load_qdo_steps(q_desc, do_desc, q_smem, do_smem, q_ready, q_empty, b, kvh, n0, group_size, seqlen_q,
                    diag_offset, CAUSAL: gl.constexpr, q_row):
    """The (Q, dO) tiles of every step of key block n0 (``_step_tiles``' order) into the
    ring, each slot once its consumers have released it (a fresh barrier passes phase 1)."""
    NUM_BUF: gl.constexpr = q_smem.type.shape[0]
    QROWS: gl.constexpr = q_smem.type.shape[3]
    q_lo, nq = step_range(n0, seqlen_q, diag_offset, QROWS, CAUSAL)
    for s in range(nq * group_size):
        slot = s % NUM_BUF
        hq, m0 = _step_rows(s, q_lo, nq, kvh, group_size, QROWS)
        mbarrier.wait(q_empty.index(slot), ((s // NUM_BUF) & 1) ^ 1)
        mbarrier.expect(q_ready.index(slot), q_desc.block_type.nbytes + do_desc.block_type.nbytes)
        tma.async_copy_global_to_shared(q_desc, [b, hq, q_row + m0, 0], q_ready.index(slot), q_smem.index(slot))
        tma.async_copy_global_to_shared(do_desc, [b, hq, q_row + m0, 0], q_ready.index(slot), do_smem.index(slot))


@gluon.jit
def dkdv_kernel(q_desc, k_desc, v_desc, do_desc, dk_desc, dv_desc, Lse, Delta, nheads, nheads_k, group_size,
                 seqlen_q, seqlen_k, num_n_blocks, diag_offset, qk_scale, scale, Items, item_cap,
                 Dk, dk_sh, dk_sm, Dv, dv_sh, dv_sm, CAUSAL: gl.constexpr, NUM_BUF: gl.constexpr, CONSUMER_REGS: gl.constexpr,
                 LOADER_REGS: gl.constexpr):
    HEAD_D: gl.constexpr = q_desc.block_type.shape[3]
    dtype: gl.constexpr = q_desc.dtype
    pid = gl.program_id(0)  # flat grid: (batch, kv head, block of 2 * ROWS keys)
    lse_stride = seqlen_q
    if Items.dtype.element_ty == gl.int32:
        # Varlen: (work item over key blocks, kv head); batch row 0 from the sequence's
        # first rows, its own lengths and diagonal (dK/dV: see ``common.store_grad_tile``).
        count = gl.load(Items)  # (kv head, item), heads outer: see common.work_item
        if pid >= count * nheads_k:
            return
        kvh = pid // count
        item = pid % count
        seq, blk, q_row, seqlen_q, k_row, seqlen_k = varlen_item(Items, item, item_cap)
        diag_offset = seqlen_k - seqlen_q
        n0 = blk * (2 * ROWS)
        b = seq * 0
    else:
        bk = pid // num_n_blocks
        n0 = (pid % num_n_blocks) * (2 * ROWS)
        b = bk // nheads_k
        kvh = bk % nheads_k
        q_row = b * 0
        k_row = q_row

    QROWS: gl.constexpr = q_desc.block_type.shape[2]  # queries per step
    q_smem = gl.allocate_shared_memory(dtype, [NUM_BUF, 1, 1, QROWS, HEAD_D], q_desc.layout)
    do_smem = gl.allocate_shared_memory(dtype, [NUM_BUF, 1, 1, QROWS, HEAD_D], do_desc.layout)
    k_smem = gl.allocate_shared_memory(dtype, [2, 1, 1, ROWS, HEAD_D], k_desc.layout)
    v_smem = gl.allocate_shared_memory(dtype, [2, 1, 1, ROWS, HEAD_D], v_desc.layout)
    pds_layout: gl.constexpr = gl.NVMMASharedLayout.get_default_for([QROWS, ROWS], dtype)
    p_smem = gl.allocate_shared_memory(dtype, [2, QROWS, ROWS], pds_layout)
    ds_smem = gl.allocate_shared_memory(dtype, [2, QROWS, ROWS], pds_layout)
    kv_bar = gl.allocate_shared_memory(gl.int64, [3 if CAUSAL else 2, 1], mbarrier.MBarrierLayout())
    q_ready = gl.allocate_shared_memory(gl.int64, [NUM_BUF, 1], mbarrier.MBarrierLayout())
    q_empty = gl.allocate_shared_memory(gl.int64, [NUM_BUF, 1], mbarrier.MBarrierLayout())
    for i in gl.static_range(2):
        mbarrier.init(kv_bar.index(i), count=1)
    for i in gl.static_range(NUM_BUF):
        mbarrier.init(q_ready.index(i), count=1)
        mbarrier.init(q_empty.index(i), count=2)  # both consumers release a slot

    args = (q_desc, k_desc, v_desc, do_desc, dk_desc, dv_desc, Lse, Delta, q_smem, do_smem, k_smem, v_smem,
            p_smem, ds_smem, kv_bar, q_ready, q_empty, b, kvh, n0, group_size, nheads, seqlen_q, seqlen_k, diag_offset,
            qk_scale, scale, q_row, k_row, lse_stride, Items, Dk, dk_sh, dk_sm, Dv, dv_sh, dv_sm)
    gl.warp_specialize([(_dkdv_consumer0, args), (_dkdv_consumer1, args), (_dkdv_loader, args)], [4, 1],
                       [CONSUMER_REGS, LOADER_REGS])


# ---------------------------------------------------------------------------- dQ


@gluon.jit
def _dq_consumer(WG: gl.constexpr, q_desc, k_desc, v_desc, do_desc, dq_desc, Lse, Delta, q_smem, do_smem,
                 k_smem, v_smem, q_ready, k_ready, k_empty, v_ready, v_empty, num_m_blocks, num_bh, nheads,
                 group_size, seqlen_q, seqlen_k, diag_offset, qk_scale, scale, Items, item_cap, Dq, dq_sh, dq_sm):
    HEAD_D: gl.constexpr = q_desc.block_type.shape[3]
    BLOCK_N: gl.constexpr = k_desc.block_type.shape[2]
    NUM_BUF: gl.constexpr = k_smem.type.shape[0]
    CAUSAL: gl.constexpr = q_ready.type.shape[0] == 3
    dtype: gl.constexpr = q_desc.dtype
    s_layout: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[4, 1],
                                                       instr_shape=[16, BLOCK_N, 16])
    o_layout: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[4, 1],
                                                       instr_shape=[16, HEAD_D, 16])
    ds_layout: gl.constexpr = gl.DotOperandLayout(operand_index=0, parent=o_layout, k_width=2)
    lse_stride = seqlen_q
    b, h, kvh, bh, m0, n_tiles, q_row, k_row, seqlen_q, seqlen_k, diag_offset = work_item(
        gl.program_id(0), num_m_blocks, num_bh, nheads, group_size, seqlen_q, seqlen_k, diag_offset, Items, item_cap,
        ROWS, BLOCK_N, CAUSAL)
    mq = m0 + WG * ROWS  # first query row of this warpgroup
    # A key tile needs element masks iff it reaches past the keys or past the diagonal of
    # this warpgroup's first row.
    mask_from = seqlen_k - BLOCK_N
    if CAUSAL:
        mask_from = gl.minimum(mask_from, mq + diag_offset - BLOCK_N + 1)
    rows = mq + gl.arange(0, ROWS, layout=gl.SliceLayout(1, s_layout))
    cols = gl.arange(0, BLOCK_N, layout=gl.SliceLayout(0, s_layout))
    lse2, delta = _row_stats(Lse, Delta, bh, rows, seqlen_q, lse_stride, q_row)
    q_tile = q_smem.index(WG).reshape([ROWS, HEAD_D])
    do_tile = do_smem.index(WG).reshape([ROWS, HEAD_D])
    zeros_s = gl.zeros([ROWS, BLOCK_N], gl.float32, s_layout)
    dq = gl.zeros([ROWS, HEAD_D], gl.float32, o_layout)
    ds = gl.zeros([ROWS, BLOCK_N], dtype, s_layout)
    mbarrier.wait(q_ready.index(WG), 0)
    if n_tiles > 0:  # tile 0: nothing to overlap with yet
        mbarrier.wait(k_ready.index(0), 0)
        mbarrier.wait(v_ready.index(0), 0)
        s = warpgroup_mma(q_tile, k_smem.index(0).reshape([BLOCK_N, HEAD_D]).permute((1, 0)), zeros_s,
                          use_acc=False, is_async=True)
        dp = warpgroup_mma(do_tile, v_smem.index(0).reshape([BLOCK_N, HEAD_D]).permute((1, 0)), zeros_s,
                           use_acc=False, is_async=True)
        s, dp = warpgroup_mma_wait(num_outstanding=0, deps=(s, dp))
        mbarrier.arrive(v_empty.index(0), count=1)
        if mask_from < 0:
            p = _probs(s, lse2, rows, cols, seqlen_k, diag_offset, qk_scale, True, CAUSAL)
        else:
            p = _probs(s, lse2, rows, cols, seqlen_k, diag_offset, qk_scale, False, CAUSAL)
        ds = (p * (dp - delta[:, None])).to(dtype)
    for j in range(1, n_tiles):
        slot = j % NUM_BUF
        prev = (j - 1) % NUM_BUF
        mbarrier.wait(k_ready.index(slot), (j // NUM_BUF) & 1)
        mbarrier.wait(v_ready.index(slot), (j // NUM_BUF) & 1)
        s = warpgroup_mma(q_tile, k_smem.index(slot).reshape([BLOCK_N, HEAD_D]).permute((1, 0)), zeros_s,
                          use_acc=False, is_async=True)
        dp = warpgroup_mma(do_tile, v_smem.index(slot).reshape([BLOCK_N, HEAD_D]).permute((1, 0)), zeros_s,
                           use_acc=False, is_async=True)
        dq = warpgroup_mma(gl.convert_layout(ds, ds_layout), k_smem.index(prev).reshape([BLOCK_N, HEAD_D]), dq,
                           is_async=True)
        s, dp = warpgroup_mma_wait(num_outstanding=1, deps=(s, dp))  # dS_{j-1} K_{j-1} stays in flight
        mbarrier.arrive(v_empty.index(slot), count=1)
        n0 = j * BLOCK_N
        if n0 > mask_from:
            p = _probs(s, lse2, rows, n0 + cols, seqlen_k, diag_offset, qk_scale, True, CAUSAL)
        else:
            p = _probs(s, lse2, rows, n0 + cols, seqlen_k, diag_offset, qk_scale, False, CAUSAL)
        ds = (p * (dp - delta[:, None])).to(dtype)
        dq = warpgroup_mma_wait(num_outstanding=0, deps=(dq,))
        mbarrier.arrive(k_empty.index(prev), count=1)
    if n_tiles > 0:
        last = (n_tiles - 1) % NUM_BUF
        dq = warpgroup_mma(gl.convert_layout(ds, ds_layout), k_smem.index(last).reshape([BLOCK_N, HEAD_D]), dq,
                           is_async=True)
        dq = warpgroup_mma_wait(num_outstanding=0, deps=(dq,))
        mbarrier.arrive(k_empty.index(last), count=1)
    # dO is no longer read: its tile stages dQ for the TMA store.
    store_grad_tile((dq * scale).to(dtype), do_smem.index(WG), dq_desc, Dq, dq_sh, dq_sm, b, h, q_row, mq,
                    seqlen_q, Items.dtype.element_ty == gl.int32)
    tma.store_wait(pendings=0)


@gluon.jit
def _dq_consumer0(q_desc, k_desc, v_desc, do_desc, dq_desc, Lse, Delta, q_smem, do_smem, k_smem, v_smem, q_ready,
                  k_ready, k_empty, v_ready, v_empty, num_m_blocks, num_bh, nheads, group_size, seqlen_q, seqlen_k,
                  diag_offset, qk_scale, scale, Items, item_cap, Dq, dq_sh, dq_sm):
    _dq_consumer(0, q_desc, k_desc, v_desc, do_desc, dq_desc, Lse, Delta, q_smem, do_smem, k_smem, v_smem, q_ready,
                 k_ready, k_empty, v_ready, v_empty, num_m_blocks, num_bh, nheads, group_size, seqlen_q, seqlen_k,
                 diag_offset, qk_scale, scale, Items, item_cap, Dq, dq_sh, dq_sm)


@gluon.jit
def _dq_consumer1(q_desc, k_desc, v_desc, do_desc, dq_desc, Lse, Delta, q_smem, do_smem, k_smem, v_smem, q_ready,
                  k_ready, k_empty, v_ready, v_empty, num_m_blocks, num_bh, nheads, group_size, seqlen_q, seqlen_k,
                  diag_offset, qk_scale, scale, Items, item_cap, Dq, dq_sh, dq_sm):
    _dq_consumer(1, q_desc, k_desc, v_desc, do_desc, dq_desc, Lse, Delta, q_smem, do_smem, k_smem, v_smem, q_ready,
                 k_ready, k_empty, v_ready, v_empty, num_m_blocks, num_bh, nheads, group_size, seqlen_q, seqlen_k,
                 diag_offset, qk_scale, scale, Items, item_cap, Dq, dq_sh, dq_sm)


@gluon.jit
def _dq_loader(q_desc, k_desc, v_desc, do_desc, dq_desc, Lse, Delta, q_smem, do_smem, k_smem, v_smem, q_ready,
               k_ready, k_empty, v_ready, v_empty, num_m_blocks, num_bh, nheads, group_size, seqlen_q, seqlen_k,
               diag_offset, qk_scale, scale, Items, item_cap, Dq, dq_sh, dq_sm):
    BLOCK_N: gl.constexpr = k_desc.block_type.shape[2]
    CAUSAL: gl.constexpr = q_ready.type.shape[0] == 3
    b, h, kvh, bh, m0, n_tiles, q_row, k_row, seqlen_q, seqlen_k, diag_offset = work_item(
        gl.program_id(0), num_m_blocks, num_bh, nheads, group_size, seqlen_q, seqlen_k, diag_offset, Items, item_cap,
        ROWS, BLOCK_N, CAUSAL)
    for wg in gl.static_range(2):
        mbarrier.expect(q_ready.index(wg), q_desc.block_type.nbytes + do_desc.block_type.nbytes)
        tma.async_copy_global_to_shared(q_desc, [b, h, q_row + m0 + wg * ROWS, 0], q_ready.index(wg),
                                        q_smem.index(wg))
        tma.async_copy_global_to_shared(do_desc, [b, h, q_row + m0 + wg * ROWS, 0], q_ready.index(wg),
                                        do_smem.index(wg))
    load_kv_tiles(k_desc, v_desc, k_smem, v_smem, k_ready, k_empty, v_ready, v_empty, b, kvh, 0, n_tiles, k_row)


@gluon.jit
def dq_kernel(q_desc, k_desc, v_desc, do_desc, dq_desc, Lse, Delta, nheads, group_size, seqlen_q, seqlen_k,
               num_m_blocks, num_bh, diag_offset, qk_scale, scale, Items, item_cap, Dq, dq_sh, dq_sm,
               CAUSAL: gl.constexpr, NUM_BUF: gl.constexpr, CONSUMER_REGS: gl.constexpr,
               LOADER_REGS: gl.constexpr):
    """One program per work item (2 x ROWS queries of one (batch, head)), in the forward's
    order (``common.fixed_item``: head by head, causal heads from their last block);
    varlen (Items an int32 work list): one program per (item, head), as ``common.work_item``."""
    if Items.dtype.element_ty == gl.int32:
        if gl.program_id(0) >= gl.load(Items) * nheads:
            return
    HEAD_D: gl.constexpr = q_desc.block_type.shape[3]
    BLOCK_N: gl.constexpr = k_desc.block_type.shape[2]
    dtype: gl.constexpr = q_desc.dtype
    q_smem = gl.allocate_shared_memory(dtype, [2, 1, 1, ROWS, HEAD_D], q_desc.layout)
    do_smem = gl.allocate_shared_memory(dtype, [2, 1, 1, ROWS, HEAD_D], do_desc.layout)
    k_smem = gl.allocate_shared_memory(dtype, [NUM_BUF, 1, 1, BLOCK_N, HEAD_D], k_desc.layout)
    v_smem = gl.allocate_shared_memory(dtype, [NUM_BUF, 1, 1, BLOCK_N, HEAD_D], v_desc.layout)
    q_ready = gl.allocate_shared_memory(gl.int64, [3 if CAUSAL else 2, 1], mbarrier.MBarrierLayout())
    k_ready = gl.allocate_shared_memory(gl.int64, [NUM_BUF, 1], mbarrier.MBarrierLayout())
    k_empty = gl.allocate_shared_memory(gl.int64, [NUM_BUF, 1], mbarrier.MBarrierLayout())
    v_ready = gl.allocate_shared_memory(gl.int64, [NUM_BUF, 1], mbarrier.MBarrierLayout())
    v_empty = gl.allocate_shared_memory(gl.int64, [NUM_BUF, 1], mbarrier.MBarrierLayout())
    for i in gl.static_range(2):
        mbarrier.init(q_ready.index(i), count=1)
    for i in gl.static_range(NUM_BUF):
        mbarrier.init(k_ready.index(i), count=1)
        mbarrier.init(v_ready.index(i), count=1)
        mbarrier.init(k_empty.index(i), count=2)  # both consumers release a slot
        mbarrier.init(v_empty.index(i), count=2)

    args = (q_desc, k_desc, v_desc, do_desc, dq_desc, Lse, Delta, q_smem, do_smem, k_smem, v_smem, q_ready,
            k_ready, k_empty, v_ready, v_empty, num_m_blocks, num_bh, nheads, group_size, seqlen_q, seqlen_k,
            diag_offset, qk_scale, scale, Items, item_cap, Dq, dq_sh, dq_sm)
    gl.warp_specialize([(_dq_consumer0, args), (_dq_consumer1, args), (_dq_loader, args)], [4, 1],
                       [CONSUMER_REGS, LOADER_REGS])


# ---------------------------------------------------------------------------- dV and dK apart (d256)
# At head dim 256 one warpgroup cannot hold both 64 x 256 float32 accumulators (dK and dV:
# 256 registers per thread), so dV and dK come from separate kernels, one accumulator each,
# with Q and dO rings of their own (DV_RING, DK_RING: shared memory at their definition).
# 8 tile products per tile pair instead of 7: the dV kernel recomputes S.


@gluon.jit
def _p_only(s, Lse, Delta, b, hq, nheads, seqlen_q, seqlen_k, nk, m0, diag_offset, qk_scale,
            CAUSAL: gl.constexpr, dtype: gl.constexpr, s_layout: gl.constexpr):
    """P of a (queries x keys) tile: ``_p_and_ds`` with S standing in for dP; the unused
    dS and its Delta loads are dead code the compiler drops."""
    pt, _ = _p_and_ds(s, s, Lse, Delta, b, hq, nheads, seqlen_q, seqlen_k, nk, m0, diag_offset, qk_scale,
                      seqlen_q, 0, CAUSAL, dtype, s_layout)
    return pt


@gluon.jit
def _ring_tile(smem, s):
    """Step s's tile of a ring (slot s % slots) as a (ROWS, D) view; the caller has waited
    for it to land."""
    HEAD_D: gl.constexpr = smem.type.shape[4]
    return smem.index(s % smem.type.shape[0]).reshape([ROWS, HEAD_D])


@gluon.jit
def _wait_tile(smem, ready, s):
    """Step s's tile of a ring once it has landed, as a (ROWS, D) view."""
    NUM: gl.constexpr = smem.type.shape[0]
    mbarrier.wait(ready.index(s % NUM), (s // NUM) & 1)
    return _ring_tile(smem, s)


@gluon.jit
def _release_tile(smem, empty, s):
    """This warpgroup is done with step s's tile of a ring: its slot may be reloaded."""
    mbarrier.arrive(empty.index(s % smem.type.shape[0]), count=1)


@gluon.jit
def _split_consumer(WG: gl.constexpr, DK: gl.constexpr, q_desc, k_desc, v_desc, do_desc, out_desc, Lse, Delta,
                    q_smem, do_smem, k_smem, v_smem, t_smem, kv_bar, q_ready, q_empty, do_ready, do_empty, b, kvh,
                    n0, group_size, nheads, seqlen_q, seqlen_k, diag_offset, qk_scale, scale):
    """Warpgroup WG's 64 keys: dV (DK False: S, P, dV += P^T dO) or dK (DK True: S, dP, dS,
    dK += dS^T Q), the previous step's product in flight while this step's P or dS is made."""
    HEAD_D: gl.constexpr = q_desc.block_type.shape[3]
    NUM_WG: gl.constexpr = k_smem.type.shape[0]
    CAUSAL: gl.constexpr = kv_bar.type.shape[0] == NUM_WG + 1
    dtype: gl.constexpr = q_desc.dtype
    s_layout: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[4, 1],
                                                       instr_shape=[16, ROWS, 16])
    o_layout: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[4, 1],
                                                       instr_shape=[16, HEAD_D, 16])
    nk = n0 + WG * ROWS
    k_tile = k_smem.index(WG).reshape([ROWS, HEAD_D])
    v_tile = v_smem.index(WG).reshape([ROWS, HEAD_D])
    t_tile = t_smem.index(WG)  # P (dV) or dS (dK), queries x keys, read transposed
    q_lo, nq = step_range(n0, seqlen_q, diag_offset, ROWS, CAUSAL)
    n_steps = nq * group_size
    zeros_s = gl.zeros([ROWS, ROWS], gl.float32, s_layout)
    acc = gl.zeros([ROWS, HEAD_D], gl.float32, o_layout)
    mbarrier.wait(kv_bar.index(WG), 0)
    if n_steps > 0:  # step 0: nothing to overlap with yet
        hq, m0 = _step_rows(0, q_lo, nq, kvh, group_size, ROWS)
        st = warpgroup_mma(_wait_tile(q_smem, q_ready, 0), k_tile.permute((1, 0)), zeros_s, use_acc=False,
                           is_async=True)
        if DK:
            dpt = warpgroup_mma(_wait_tile(do_smem, do_ready, 0), v_tile.permute((1, 0)), zeros_s, use_acc=False,
                                is_async=True)
            st, dpt = warpgroup_mma_wait(num_outstanding=0, deps=(st, dpt))
            _release_tile(do_smem, do_empty, 0)
            pt, tt = _p_and_ds(st, dpt, Lse, Delta, b, hq, nheads, seqlen_q, seqlen_k, nk, m0, diag_offset,
                               qk_scale, seqlen_q, 0, CAUSAL, dtype, s_layout)
        else:
            st = warpgroup_mma_wait(num_outstanding=0, deps=(st,))
            _release_tile(q_smem, q_empty, 0)
            tt = _p_only(st, Lse, Delta, b, hq, nheads, seqlen_q, seqlen_k, nk, m0, diag_offset, qk_scale, CAUSAL,
                         dtype, s_layout)
        t_tile.store(tt)
        fence_async_shared()
    for s in range(1, n_steps):
        hq, m0 = _step_rows(s, q_lo, nq, kvh, group_size, ROWS)
        st = warpgroup_mma(_wait_tile(q_smem, q_ready, s), k_tile.permute((1, 0)), zeros_s, use_acc=False,
                           is_async=True)
        if DK:
            dpt = warpgroup_mma(_wait_tile(do_smem, do_ready, s), v_tile.permute((1, 0)), zeros_s, use_acc=False,
                                is_async=True)
            # Q_{s-1} landed before S_{s-1} was issued: no wait.
            acc = warpgroup_mma(t_tile.permute((1, 0)), _ring_tile(q_smem, s - 1), acc, is_async=True)
            st, dpt = warpgroup_mma_wait(num_outstanding=1, deps=(st, dpt))  # dK product in flight
            _release_tile(do_smem, do_empty, s)  # dO_s is read
            pt, tt = _p_and_ds(st, dpt, Lse, Delta, b, hq, nheads, seqlen_q, seqlen_k, nk, m0, diag_offset,
                               qk_scale, seqlen_q, 0, CAUSAL, dtype, s_layout)
            acc = warpgroup_mma_wait(num_outstanding=0, deps=(acc,))
            _release_tile(q_smem, q_empty, s - 1)  # Q_{s-1} is read (S_{s-1} and the dK product)
        else:
            acc = warpgroup_mma(t_tile.permute((1, 0)), _wait_tile(do_smem, do_ready, s - 1), acc, is_async=True)
            st = warpgroup_mma_wait(num_outstanding=1, deps=(st,))  # dV product in flight
            _release_tile(q_smem, q_empty, s)  # Q_s is read
            tt = _p_only(st, Lse, Delta, b, hq, nheads, seqlen_q, seqlen_k, nk, m0, diag_offset, qk_scale, CAUSAL,
                         dtype, s_layout)
            acc = warpgroup_mma_wait(num_outstanding=0, deps=(acc,))
            _release_tile(do_smem, do_empty, s - 1)  # dO_{s-1} is read
        t_tile.store(tt)
        fence_async_shared()
    if n_steps > 0:
        last = n_steps - 1
        if DK:
            acc = warpgroup_mma(t_tile.permute((1, 0)), _ring_tile(q_smem, last), acc, is_async=True)
            acc = warpgroup_mma_wait(num_outstanding=0, deps=(acc,))
            _release_tile(q_smem, q_empty, last)
        else:
            acc = warpgroup_mma(t_tile.permute((1, 0)), _wait_tile(do_smem, do_ready, last), acc, is_async=True)
            acc = warpgroup_mma_wait(num_outstanding=0, deps=(acc,))
            _release_tile(do_smem, do_empty, last)
    # K is no longer read: its tile stages the result for the TMA store (clips rows past seqlen_k).
    if DK:
        k_tile.store((acc * scale).to(dtype))
    else:
        k_tile.store(acc.to(dtype))
    fence_async_shared()
    tma.async_copy_shared_to_global(out_desc, [b, kvh, nk, 0], k_smem.index(WG))
    tma.store_wait(pendings=0)


@gluon.jit
def _split_loader(LOAD_V: gl.constexpr, q_desc, k_desc, v_desc, do_desc, out_desc, Lse, Delta, q_smem, do_smem,
                  k_smem, v_smem, t_smem, kv_bar, q_ready, q_empty, do_ready, do_empty, b, kvh, n0, group_size,
                  nheads, seqlen_q, seqlen_k, diag_offset, qk_scale, scale):
    """K (and V) of the program's keys once, then every step's Q and dO tiles into their
    rings, Q_s then dO_s, each once its slot is released (a fresh barrier passes phase 1).
    One warp issues both in step order, so a load may wait behind the other ring's
    (dK's single dO slot: Q_{s+1} waits until dO_s's slot is free)."""
    NUM_WG: gl.constexpr = k_smem.type.shape[0]
    CAUSAL: gl.constexpr = kv_bar.type.shape[0] == NUM_WG + 1
    NQ: gl.constexpr = q_smem.type.shape[0]
    ND: gl.constexpr = do_smem.type.shape[0]
    for wg in gl.static_range(NUM_WG):
        if LOAD_V:
            mbarrier.expect(kv_bar.index(wg), k_desc.block_type.nbytes + v_desc.block_type.nbytes)
            tma.async_copy_global_to_shared(k_desc, [b, kvh, n0 + wg * ROWS, 0], kv_bar.index(wg), k_smem.index(wg))
            tma.async_copy_global_to_shared(v_desc, [b, kvh, n0 + wg * ROWS, 0], kv_bar.index(wg), v_smem.index(wg))
        else:
            mbarrier.expect(kv_bar.index(wg), k_desc.block_type.nbytes)
            tma.async_copy_global_to_shared(k_desc, [b, kvh, n0 + wg * ROWS, 0], kv_bar.index(wg), k_smem.index(wg))
    q_lo, nq = step_range(n0, seqlen_q, diag_offset, ROWS, CAUSAL)
    for s in range(nq * group_size):
        hq, m0 = _step_rows(s, q_lo, nq, kvh, group_size, ROWS)
        mbarrier.wait(q_empty.index(s % NQ), ((s // NQ) & 1) ^ 1)
        mbarrier.expect(q_ready.index(s % NQ), q_desc.block_type.nbytes)
        tma.async_copy_global_to_shared(q_desc, [b, hq, m0, 0], q_ready.index(s % NQ), q_smem.index(s % NQ))
        mbarrier.wait(do_empty.index(s % ND), ((s // ND) & 1) ^ 1)
        mbarrier.expect(do_ready.index(s % ND), do_desc.block_type.nbytes)
        tma.async_copy_global_to_shared(do_desc, [b, hq, m0, 0], do_ready.index(s % ND), do_smem.index(s % ND))


@gluon.jit
def _dv_consumer0(q_desc, k_desc, v_desc, do_desc, out_desc, Lse, Delta, q_smem, do_smem, k_smem, v_smem, t_smem,
                  kv_bar, q_ready, q_empty, do_ready, do_empty, b, kvh, n0, group_size, nheads, seqlen_q, seqlen_k,
                  diag_offset, qk_scale, scale):
    _split_consumer(0, False, q_desc, k_desc, v_desc, do_desc, out_desc, Lse, Delta, q_smem, do_smem, k_smem,
                    v_smem, t_smem, kv_bar, q_ready, q_empty, do_ready, do_empty, b, kvh, n0, group_size, nheads,
                    seqlen_q, seqlen_k, diag_offset, qk_scale, scale)


@gluon.jit
def _dv_consumer1(q_desc, k_desc, v_desc, do_desc, out_desc, Lse, Delta, q_smem, do_smem, k_smem, v_smem, t_smem,
                  kv_bar, q_ready, q_empty, do_ready, do_empty, b, kvh, n0, group_size, nheads, seqlen_q, seqlen_k,
                  diag_offset, qk_scale, scale):
    _split_consumer(1, False, q_desc, k_desc, v_desc, do_desc, out_desc, Lse, Delta, q_smem, do_smem, k_smem,
                    v_smem, t_smem, kv_bar, q_ready, q_empty, do_ready, do_empty, b, kvh, n0, group_size, nheads,
                    seqlen_q, seqlen_k, diag_offset, qk_scale, scale)


@gluon.jit
def _dk_consumer0(q_desc, k_desc, v_desc, do_desc, out_desc, Lse, Delta, q_smem, do_smem, k_smem, v_smem, t_smem,
                  kv_bar, q_ready, q_empty, do_ready, do_empty, b, kvh, n0, group_size, nheads, seqlen_q, seqlen_k,
                  diag_offset, qk_scale, scale):
    _split_consumer(0, True, q_desc, k_desc, v_desc, do_desc, out_desc, Lse, Delta, q_smem, do_smem, k_smem,
                    v_smem, t_smem, kv_bar, q_ready, q_empty, do_ready, do_empty, b, kvh, n0, group_size, nheads,
                    seqlen_q, seqlen_k, diag_offset, qk_scale, scale)


@gluon.jit
def _dv_loader(q_desc, k_desc, v_desc, do_desc, out_desc, Lse, Delta, q_smem, do_smem, k_smem, v_smem, t_smem,
               kv_bar, q_ready, q_empty, do_ready, do_empty, b, kvh, n0, group_size, nheads, seqlen_q, seqlen_k,
               diag_offset, qk_scale, scale):
    _split_loader(False, q_desc, k_desc, v_desc, do_desc, out_desc, Lse, Delta, q_smem, do_smem, k_smem, v_smem,
                  t_smem, kv_bar, q_ready, q_empty, do_ready, do_empty, b, kvh, n0, group_size, nheads, seqlen_q,
                  seqlen_k, diag_offset, qk_scale, scale)


@gluon.jit
def _dk_loader(q_desc, k_desc, v_desc, do_desc, out_desc, Lse, Delta, q_smem, do_smem, k_smem, v_smem, t_smem,
               kv_bar, q_ready, q_empty, do_ready, do_empty, b, kvh, n0, group_size, nheads, seqlen_q, seqlen_k,
               diag_offset, qk_scale, scale):
    _split_loader(True, q_desc, k_desc, v_desc, do_desc, out_desc, Lse, Delta, q_smem, do_smem, k_smem, v_smem,
                  t_smem, kv_bar, q_ready, q_empty, do_ready, do_empty, b, kvh, n0, group_size, nheads, seqlen_q,
                  seqlen_k, diag_offset, qk_scale, scale)


@gluon.jit
def _rings(q_desc, do_desc, NUM_Q: gl.constexpr, NUM_DO: gl.constexpr, NUM_WG: gl.constexpr):
    """The Q and dO rings of the split kernels and their barriers (every consumer
    warpgroup releases each slot)."""
    HEAD_D: gl.constexpr = q_desc.block_type.shape[3]
    dtype: gl.constexpr = q_desc.dtype
    q_smem = gl.allocate_shared_memory(dtype, [NUM_Q, 1, 1, ROWS, HEAD_D], q_desc.layout)
    do_smem = gl.allocate_shared_memory(dtype, [NUM_DO, 1, 1, ROWS, HEAD_D], do_desc.layout)
    q_ready = gl.allocate_shared_memory(gl.int64, [NUM_Q, 1], mbarrier.MBarrierLayout())
    q_empty = gl.allocate_shared_memory(gl.int64, [NUM_Q, 1], mbarrier.MBarrierLayout())
    do_ready = gl.allocate_shared_memory(gl.int64, [NUM_DO, 1], mbarrier.MBarrierLayout())
    do_empty = gl.allocate_shared_memory(gl.int64, [NUM_DO, 1], mbarrier.MBarrierLayout())
    for i in gl.static_range(NUM_Q):
        mbarrier.init(q_ready.index(i), count=1)
        mbarrier.init(q_empty.index(i), count=NUM_WG)
    for i in gl.static_range(NUM_DO):
        mbarrier.init(do_ready.index(i), count=1)
        mbarrier.init(do_empty.index(i), count=NUM_WG)
    return q_smem, do_smem, q_ready, q_empty, do_ready, do_empty


@gluon.jit
def _block_coords(pid, num_n_blocks, pair_group, KEYS_OUTER: gl.constexpr):
    """Program pid's (key block, (batch, kv head) pair) in the d256 kernels' grids: pair-major
    (a pair's blocks side by side, block 0 first), or with ``KEYS_OUTER`` block-major within
    groups of pair_group pairs (``common.grouped_coords``; ``PAIR_GROUP``)."""
    if KEYS_OUTER:
        nb, bk = grouped_coords(pid, gl.num_programs(0) // num_n_blocks, num_n_blocks, pair_group)
    else:
        nb = pid % num_n_blocks
        bk = pid // num_n_blocks
    return nb, bk


@gluon.jit
def dv_kernel(q_desc, k_desc, do_desc, dv_desc, Lse, Delta, nheads, nheads_k, group_size, seqlen_q, seqlen_k,
               num_n_blocks, diag_offset, qk_scale, scale, pair_group,
               CAUSAL: gl.constexpr, NUM_Q: gl.constexpr, NUM_DO: gl.constexpr, CONSUMER_REGS: gl.constexpr,
               LOADER_REGS: gl.constexpr, KEYS_OUTER: gl.constexpr):
    """dV of 2 x 64 keys of one (batch, kv head) per program (flat grid, key blocks fastest;
    ``KEYS_OUTER``: in groups of pair_group pairs, ``_block_coords``)."""
    HEAD_D: gl.constexpr = q_desc.block_type.shape[3]
    dtype: gl.constexpr = q_desc.dtype
    nb, bk = _block_coords(gl.program_id(0), num_n_blocks, pair_group, KEYS_OUTER)
    n0 = nb * (2 * ROWS)
    b = bk // nheads_k
    kvh = bk % nheads_k
    q_smem, do_smem, q_ready, q_empty, do_ready, do_empty = _rings(q_desc, do_desc, NUM_Q, NUM_DO, 2)
    k_smem = gl.allocate_shared_memory(dtype, [2, 1, 1, ROWS, HEAD_D], k_desc.layout)
    t_layout: gl.constexpr = gl.NVMMASharedLayout.get_default_for([ROWS, ROWS], dtype)
    t_smem = gl.allocate_shared_memory(dtype, [2, ROWS, ROWS], t_layout)
    kv_bar = gl.allocate_shared_memory(gl.int64, [3 if CAUSAL else 2, 1], mbarrier.MBarrierLayout())
    for i in gl.static_range(2):
        mbarrier.init(kv_bar.index(i), count=1)
    # V is not needed: K's descriptor and tiles stand in for it (never read).
    args = (q_desc, k_desc, k_desc, do_desc, dv_desc, Lse, Delta, q_smem, do_smem, k_smem, k_smem, t_smem, kv_bar,
            q_ready, q_empty, do_ready, do_empty, b, kvh, n0, group_size, nheads, seqlen_q, seqlen_k, diag_offset,
            qk_scale, scale)
    gl.warp_specialize([(_dv_consumer0, args), (_dv_consumer1, args), (_dv_loader, args)], [4, 1],
                       [CONSUMER_REGS, LOADER_REGS])


@gluon.jit
def dk_kernel(q_desc, k_desc, v_desc, do_desc, dk_desc, Lse, Delta, nheads, nheads_k, group_size, seqlen_q,
               seqlen_k, num_n_blocks, diag_offset, qk_scale, scale, pair_group,
               CAUSAL: gl.constexpr, NUM_Q: gl.constexpr, NUM_DO: gl.constexpr, LOADER_REGS: gl.constexpr,
               KEYS_OUTER: gl.constexpr):
    """dK of 64 keys of one (batch, kv head) per program: one consumer warpgroup (grid as
    ``dv_kernel``'s)."""
    HEAD_D: gl.constexpr = q_desc.block_type.shape[3]
    dtype: gl.constexpr = q_desc.dtype
    nb, bk = _block_coords(gl.program_id(0), num_n_blocks, pair_group, KEYS_OUTER)
    n0 = nb * ROWS
    b = bk // nheads_k
    kvh = bk % nheads_k
    q_smem, do_smem, q_ready, q_empty, do_ready, do_empty = _rings(q_desc, do_desc, NUM_Q, NUM_DO, 1)
    k_smem = gl.allocate_shared_memory(dtype, [1, 1, 1, ROWS, HEAD_D], k_desc.layout)
    v_smem = gl.allocate_shared_memory(dtype, [1, 1, 1, ROWS, HEAD_D], v_desc.layout)
    t_layout: gl.constexpr = gl.NVMMASharedLayout.get_default_for([ROWS, ROWS], dtype)
    t_smem = gl.allocate_shared_memory(dtype, [1, ROWS, ROWS], t_layout)
    kv_bar = gl.allocate_shared_memory(gl.int64, [2 if CAUSAL else 1, 1], mbarrier.MBarrierLayout())
    mbarrier.init(kv_bar.index(0), count=1)
    args = (q_desc, k_desc, v_desc, do_desc, dk_desc, Lse, Delta, q_smem, do_smem, k_smem, v_smem, t_smem, kv_bar,
            q_ready, q_empty, do_ready, do_empty, b, kvh, n0, group_size, nheads, seqlen_q, seqlen_k, diag_offset,
            qk_scale, scale)
    gl.warp_specialize([(_dk_consumer0, args), (_dk_loader, args)], [1], [LOADER_REGS])


# ---------------------------------------------------------------------------- host

_launch_dkdv = Launcher(dkdv_kernel)
_launch_dq = Launcher(dq_kernel)
_launch_dv = Launcher(dv_kernel)
_launch_dk = Launcher(dk_kernel)


def split_pair_group(causal: bool, num_n_blocks: int, num_pairs: int, device, gqa: bool) -> int:
    """The d256 dV and dK kernels' grid order: ``common.pair_group`` under ``PAIR_GROUP``."""
    return pair_group(PAIR_GROUP, causal, num_n_blocks, num_pairs, sm_count(device.index), gqa=gqa)


def attention_backward_ws(q, k, v, dout, lse, delta, dq, dk, dv, *, scale: float, diag_offset: int, causal: bool,
                          dkdv_num_buf: int | None = None, dq_block_n: int | None = None,
                          dq_num_buf: int = DQ_NUM_BUF, dkdv_block_q: int | None = None,
                          kernels: tuple = ("dkdv", "dq"), varlen=None) -> None:
    """Launch the dK/dV kernel (at d256: the dV and the dK kernel) and the dQ kernel; the
    registry checked their scope (``scope.backward_scope``) and TMA alignment.

    Args:
        q, dout, dq: (B, H, Sq, D); k, v, dk, dv: (B, Hk, Sk, D); 16-byte-aligned bases and
            strides, unit stride along D, D in scope.HEAD_DIMS, fp16 or bf16.
        lse, delta: (B, H, Sq) float32 contiguous (natural log; delta = rowsum(dO * O),
            minus the LSE's own upstream gradient if any).
        causal: key j visible to query i iff j <= i + diag_offset.
        dkdv_num_buf, dq_block_n, dq_num_buf: ring slots and key tile (experiments;
            defaults: ``dkdv_steps``, ``default_dq_block_n``, DQ_NUM_BUF). The split
            kernels of d256 have fixed rings (DV_RING, DK_RING): dkdv_num_buf is refused there.
        dkdv_block_q: queries per step of the dK/dV kernel, 64 or 128 (not d256; default
            ``dkdv_steps``).
        kernels: which kernels to launch: ("dkdv", "dq"), or a part to time it alone
            (benchmarks/experiments/gluon_bwd.py --split); at d256 also "dv" or "dk".
        varlen: None, or (Varlen, key table, query table) for packed sequences (B = 1,
            head dims 64/128): the work lists of blocks of 2 * BLOCK keys and queries
            (``backends.worklist.build_work_items``). The kernels store dQ, dK, dV in place, a
            tile that reaches past its sequence's end from registers (``common.store_grad_tile``);
            rows outside every sequence are not written.
    """
    batch, nheads, seqlen_q, head_dim = q.shape
    split = head_dim in SPLIT_HEAD_DIMS
    allowed = {"dkdv", "dq", "dv", "dk"} if split else {"dkdv", "dq"}
    if not set(kernels) <= allowed:
        raise ValueError(f"kernels must be among {sorted(allowed)} at head dim {head_dim}, got {kernels!r}")
    if split and dkdv_num_buf is not None:
        raise ValueError(f"dkdv_num_buf does not apply at head dim {head_dim}: its dV and dK kernels have fixed "
                         f"rings (DV_RING={DV_RING}, DK_RING={DK_RING})")
    dkdv_block_q, dkdv_num_buf = dkdv_steps(head_dim, varlen is not None, dkdv_block_q, dkdv_num_buf)
    if dkdv_num_buf < 2 or dq_num_buf < 2:  # one slot: the loader waits for a release that never comes
        raise ValueError(f"ring slots must be >= 2, got dkdv_num_buf={dkdv_num_buf}, dq_num_buf={dq_num_buf}")
    if dkdv_block_q not in (BLOCK, 2 * BLOCK) or (split and dkdv_block_q != BLOCK):
        raise ValueError(f"dkdv_block_q must be {BLOCK}, or {2 * BLOCK} below head dim 256; got {dkdv_block_q}")
    nheads_k, seqlen_k = k.shape[1], k.shape[2]
    if varlen is not None and split:
        raise ValueError(f"no varlen Gluon backward at head dim {head_dim}")
    dq_block_n = dq_block_n or default_dq_block_n(head_dim)
    built = {}

    def desc(t, rows):  # each (tensor, box rows) once per call: K and V recur across the kernels
        key = (id(t), rows)
        if key not in built:
            built[key] = tma_descriptor(t, rows)
        return built[key]

    q_d, do_d = desc(q, BLOCK), desc(dout, BLOCK)
    regs = dict(CONSUMER_REGS=CONSUMER_REGS, LOADER_REGS=LOADER_REGS)
    sizes = (lse, delta, nheads, nheads_k, nheads // nheads_k, seqlen_q, seqlen_k)
    if split and {"dkdv", "dv"} & set(kernels):
        nb = triton.cdiv(seqlen_k, 2 * BLOCK)
        group = split_pair_group(causal, nb, batch * nheads_k, q.device, nheads > nheads_k)
        _launch_dv((nb * batch * nheads_k,),
                   (q_d, desc(k, BLOCK), do_d, desc(dv, BLOCK), *sizes, nb, diag_offset, scale * LOG2E, scale, group),
                   dict(CAUSAL=causal, NUM_Q=DV_RING[0], NUM_DO=DV_RING[1], KEYS_OUTER=group > 1, **regs), 4, 1)
    if split and {"dkdv", "dk"} & set(kernels):
        nb = triton.cdiv(seqlen_k, BLOCK)
        group = split_pair_group(causal, nb, batch * nheads_k, q.device, nheads > nheads_k)
        _launch_dk((nb * batch * nheads_k,),
                   (q_d, desc(k, BLOCK), desc(v, BLOCK), do_d, desc(dk, BLOCK), *sizes, nb, diag_offset,
                    scale * LOG2E, scale, group),
                   dict(CAUSAL=causal, NUM_Q=DK_RING[0], NUM_DO=DK_RING[1], LOADER_REGS=LOADER_REGS,
                        KEYS_OUTER=group > 1), 4, 1)
    if varlen is not None:
        _backward_varlen_ws(q, k, v, dout, lse, delta, dq, dk, dv, scale, causal, varlen, desc, dkdv_num_buf,
                            dq_block_n, dq_num_buf, dkdv_block_q, regs)
        return
    if not split and "dkdv" in kernels:
        num_n_blocks = triton.cdiv(seqlen_k, 2 * BLOCK)
        _launch_dkdv((num_n_blocks * batch * nheads_k,),
                     (desc(q, dkdv_block_q), desc(k, BLOCK), desc(v, BLOCK), desc(dout, dkdv_block_q), desc(dk, BLOCK),
                      desc(dv, BLOCK), *sizes,
                      num_n_blocks, diag_offset, scale * LOG2E, scale, lse, 0, dk, 0, 0, dv, 0, 0),
                     dict(CAUSAL=causal, NUM_BUF=dkdv_num_buf, **regs), 4, 1)
    if "dq" not in kernels:
        return
    num_m_blocks = triton.cdiv(seqlen_q, 2 * BLOCK)
    _launch_dq((num_m_blocks * batch * nheads,),
               (q_d, desc(k, dq_block_n), desc(v, dq_block_n), do_d, desc(dq, BLOCK), lse, delta,
                nheads, nheads // nheads_k, seqlen_q, seqlen_k, num_m_blocks, batch * nheads, diag_offset,
                scale * LOG2E, scale, lse, 0, dq, 0, 0),
               dict(CAUSAL=causal, NUM_BUF=dq_num_buf, **regs), 4, 1)


def _backward_varlen_ws(q, k, v, dout, lse, delta, dq, dk, dv, scale, causal, varlen, desc, dkdv_num_buf,
                        dq_block_n, dq_num_buf, dkdv_block_q, regs):
    """The dK/dV and dQ kernels on work lists; see ``attention_backward_ws``."""
    _, (kv_table, kv_cap), (q_table, q_cap) = varlen
    _, nheads, total_q, _ = q.shape
    nheads_k = k.shape[1]
    sizes = (lse, delta, nheads, nheads_k, nheads // nheads_k, total_q, 0)
    _launch_dkdv((kv_cap * nheads_k,),
                 (desc(q, dkdv_block_q), desc(k, BLOCK), desc(v, BLOCK), desc(dout, dkdv_block_q), desc(dk, BLOCK),
                  desc(dv, BLOCK), *sizes, 0, 0, scale * LOG2E, scale, kv_table, kv_cap,
                  dk, dk.stride(1), dk.stride(2), dv, dv.stride(1), dv.stride(2)),
                 dict(CAUSAL=causal, NUM_BUF=dkdv_num_buf, **regs), 4, 1)
    _launch_dq((q_cap * nheads,),
               (desc(q, BLOCK), desc(k, dq_block_n), desc(v, dq_block_n), desc(dout, BLOCK), desc(dq, BLOCK), lse,
                delta, nheads, nheads // nheads_k, total_q, 0, 0, 0, 0, scale * LOG2E, scale, q_table, q_cap,
                dq, dq.stride(1), dq.stride(2)),
               dict(CAUSAL=causal, NUM_BUF=dq_num_buf, **regs), 4, 1)

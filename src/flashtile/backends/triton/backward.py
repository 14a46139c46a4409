"""Triton FlashAttention backward: dq, dk, dv from q, k, v, out, dout and the saved LSE.

Same canonical problem as ``forward.py`` (read its docstring first). The scores of a tile
are recomputed from the LSE (P = exp(S - lse)), never stored. Three kernels:

1. ``preprocess_kernel``: Delta_i = rowsum(dO_i * O_i), the softmax-Jacobian term (taken
   from a tile matmul, so it rounds like dP: see the kernel). With a sink (a logit in the
   denominator only, already in the LSE) dQ, dK, dV need nothing more; its own gradient
   is ``sink_grad_kernel``'s: dsink_h = -sum_i exp(sink_h - lse_i) Delta_i.
2. ``dkdv_kernel``: one program per (batch, key/value head, block of BLOCK_N keys).
   It holds K_j, V_j and the fp32 accumulators dK_j, dV_j on chip and streams the query
   tiles that see those keys, for every query head of the GQA group, so dK/dV come out
   summed over the group without atomics::

       S^T = K_j Q_i^T      P^T = exp2(S^T - lse_i)      dV_j += P^T dO_i
       dP^T = V_j dO_i^T    dS^T = P^T * (dP^T - Delta_i)      dK_j += dS^T Q_i

3. ``dq_kernel``: one program per (batch, head, block of BLOCK_M queries), streaming
   the key tiles that block sees: dQ_i += dS K_j. With ``BwdConfig.fused_dq`` the dk/dv
   kernel instead adds dS K_j into a float32 dQ with atomics (FA2's single pass: 5 tile
   matmuls, not 7, but the summation order varies between runs).

Without ``fused_dq`` there are no atomics: every output element is written by exactly
one program, in a fixed order, so gradients are bitwise reproducible. The price is
recomputing S and dP in both kernels (7 tile matmuls instead of FA2's 5).

Softcap: s = c * tanh(scale * q.k / c), so ds/d(q.k) = scale * (1 - tanh^2): the factor
``dfac`` of ``scores.scores``. ALiBi and float masks are additive constants: they shift S
but have no gradient with respect to q or k (mask gradients are not computed; see
flashtile.dispatch).
"""

from __future__ import annotations

import triton
import triton.language as tl

from flashtile.backends.configs import BwdConfig
from flashtile.backends.triton.scores import (C_LOG2E, LOG2E, chunk_start, dropout_keep, key_tiles, mask_arguments,
                                              row_lse2, scores)
from flashtile.backends.worklist import build_work_items, program_item, varlen_item
from flashtile.problem.window import launch_window
from flashtile.runtime.launch import Launcher


@triton.jit
def preprocess_kernel(
    Out, DO, Delta, Items, Acc,
    stride_ob, stride_oh, stride_om,
    stride_db, stride_dh, stride_dm,
    nheads, seqlen_q, head_dim, num_m_blocks, item_cap, acc_rows,
    BLOCK_M: tl.constexpr, BLOCK_D: tl.constexpr, IEEE_DOT: tl.constexpr, VARLEN: tl.constexpr,
    ZERO_ACC: tl.constexpr,
):
    # Delta_i = O_i . dO_i, taken from the diagonal of the tile matmul O dO^T rather than
    # an elementwise sum: the same tl.dot (same operand roles, same reduction order over
    # the head dim) as dP^T = V dO^T in the dk/dv kernel. Where a row's output is one
    # value row (a single visible key: O_i == V_j bitwise), dP_ij - Delta_i is then exactly
    # 0, as in plain PyTorch, instead of two fp32 sums of ~sqrt(d) that differ by rounding
    # (seen on the H200: dk off by 1e-5..5e-5 at seqlen_k = 1). Cost: BLOCK_M^2 * D FLOPs
    # per BLOCK_M rows, negligible next to the attention itself.
    # Varlen: one program per (query block of a sequence, head), the blocks aligned to the
    # sequence's start as in a fixed-length call, so a document's Delta (and gradients)
    # do not depend on what it is packed with.
    pid = tl.program_id(0)
    if VARLEN:
        item = pid // nheads
        h = (pid % nheads).to(tl.int64)
        if item >= tl.load(Items):
            return
        total = seqlen_q  # Delta is (1, H, total_q); the host passes total_q as seqlen_q
        _, m_block, start_q, seqlen_q, _, _ = varlen_item(Items, item, item_cap)
        b = (m_block * 0).to(tl.int64)
        row = start_q.to(tl.int64)
        bh = h
    else:
        bh = pid // num_m_blocks
        m_block = pid % num_m_blocks
        b = (bh // nheads).to(tl.int64)
        h = (bh % nheads).to(tl.int64)
        row = b * 0
        total = seqlen_q
    offs_m = m_block * BLOCK_M + tl.arange(0, BLOCK_M)
    offs_d = tl.arange(0, BLOCK_D)
    ok = (offs_m[:, None] < seqlen_q) & (offs_d[None, :] < head_dim)
    rows = row + offs_m[:, None].to(tl.int64)
    o = tl.load(Out + b * stride_ob + h * stride_oh + rows * stride_om + offs_d[None, :], mask=ok, other=0.0)
    do = tl.load(DO + b * stride_db + h * stride_dh + rows * stride_dm + offs_d[None, :], mask=ok, other=0.0)
    if IEEE_DOT:
        gram = tl.dot(o, tl.trans(do), input_precision="ieee")
    else:
        gram = tl.dot(o, tl.trans(do))
    diag = tl.arange(0, BLOCK_M)[:, None] == tl.arange(0, BLOCK_M)[None, :]
    delta = tl.sum(tl.where(diag, gram, 0.0), 0)
    tl.store(Delta + bh.to(tl.int64) * total + row + offs_m, delta, mask=offs_m < seqlen_q)
    if ZERO_ACC:
        # The one-pass backward's float32 dQ (B, H, acc_rows, head_dim), contiguous, acc_rows
        # a multiple of BLOCK_M from num_m_blocks * BLOCK_M up: this program's rows, zeroed here
        # instead of by a memset launch; the last block's program zeroes the padding after them.
        base = Acc + bh.to(tl.int64) * acc_rows * head_dim
        zeros = tl.zeros([BLOCK_M, BLOCK_D], tl.float32)
        tl.store(base + offs_m[:, None] * head_dim + offs_d[None, :], zeros, mask=offs_d[None, :] < head_dim)
        if m_block == num_m_blocks - 1:
            for r0 in range(num_m_blocks * BLOCK_M, acc_rows, BLOCK_M):
                rows_pad = r0 + tl.arange(0, BLOCK_M)
                tl.store(base + rows_pad[:, None] * head_dim + offs_d[None, :], zeros,
                         mask=offs_d[None, :] < head_dim)


@triton.jit
def _dq_tiles(
    dq, q, do, lse2, tail, delta,
    k_base, v_base, mask_base, n_start, n_end,
    offs_m, offs_n0, offs_d, offs_dv,
    stride_kn, stride_vn, stride_mn, seqlen_q, seqlen_k, head_dim, head_dim_v,
    qk_scale, sm_scale, softcap_in, softcap_out, alibi_slope,
    diag_offset, window_left, window_right, chunk, seed, bh, dropout_p,
    BLOCK_N: tl.constexpr, EVEN_D: tl.constexpr, EVEN_DV: tl.constexpr, SAME_DV: tl.constexpr,
    BOUNDARY: tl.constexpr,
    WINDOW_LEFT: tl.constexpr, WINDOW_RIGHT: tl.constexpr,
    SOFTCAP: tl.constexpr, HAS_ALIBI: tl.constexpr, MASK_MODE: tl.constexpr, IEEE_DOT: tl.constexpr,
    DROPOUT: tl.constexpr, CHUNK: tl.constexpr,
):
    if EVEN_D:
        d_ok = offs_d < offs_d.shape[0]
    else:
        d_ok = offs_d < head_dim
    if EVEN_DV:
        dv_ok = offs_dv < offs_dv.shape[0]
    else:
        dv_ok = offs_dv < head_dim_v
    for n0 in range(n_start, n_end, BLOCK_N):
        offs_n = n0 + offs_n0
        row = tl.cast(n0, tl.int64)
        kv_ok = (offs_n[:, None] < seqlen_k) & d_ok[None, :]
        k = tl.load(k_base + row * stride_kn + offs_n0[:, None] * stride_kn + offs_d[None, :], mask=kv_ok, other=0.0)
        if SAME_DV:  # v's head dim is q's: the same mask (and the machine code of before)
            v_ok = kv_ok
        else:
            v_ok = (offs_n[:, None] < seqlen_k) & dv_ok[None, :]
        v = tl.load(v_base + row * stride_vn + offs_n0[:, None] * stride_vn + offs_dv[None, :], mask=v_ok, other=0.0)
        if IEEE_DOT:
            raw = tl.dot(q, tl.trans(k), input_precision="ieee")
            dp = tl.dot(do, tl.trans(v), input_precision="ieee")
        else:
            raw = tl.dot(q, tl.trans(k))
            dp = tl.dot(do, tl.trans(v))
        s, dfac = scores(
            raw, offs_m[:, None], offs_n[None, :], None, mask_base + offs_n0[None, :] * stride_mn, None, 0,
            seqlen_q, seqlen_k, qk_scale, sm_scale, softcap_in, softcap_out, alibi_slope, diag_offset, window_left,
            window_right, chunk, BOUNDARY, WINDOW_LEFT, WINDOW_RIGHT, SOFTCAP, HAS_ALIBI, MASK_MODE, CHUNK)
        if MASK_MODE == 2:
            p = tl.exp2((s - lse2[:, None]) - tail[:, None])
        else:
            p = tl.exp2(s - lse2[:, None])
        if DROPOUT:
            # dO reaches P only through the kept, rescaled entries; Delta already holds them.
            keep = dropout_keep(seed, bh, offs_m[:, None], offs_n[None, :], dropout_p)
            dp = tl.where(keep, dp / (1.0 - dropout_p), 0.0)
        ds = p * (dp - delta[:, None])
        if SOFTCAP:
            ds = ds * dfac
        if IEEE_DOT:
            dq = tl.dot(ds.to(k.dtype), k, dq, input_precision="ieee")
        else:
            dq = tl.dot(ds.to(k.dtype), k, dq)
        mask_base += BLOCK_N * stride_mn
    return dq


@triton.jit
def dq_kernel(
    Q, K, V, DO, Lse, Delta, DQ, Mask, Alibi, Seed, Items,
    stride_qb, stride_qh, stride_qm,
    stride_kb, stride_kh, stride_kn,
    stride_vb, stride_vh, stride_vn,
    stride_dob, stride_doh, stride_dom,
    stride_dqb, stride_dqh, stride_dqm,
    stride_mb, stride_mh, stride_mm, stride_mn,
    stride_ab, stride_ah, stride_lb, stride_lh,
    nheads, group_size, seqlen_q, seqlen_k, head_dim, head_dim_v, num_m_blocks, item_cap,
    qk_scale, sm_scale, softcap_in, softcap_out,
    diag_offset, window_left, window_right, dropout_p, chunk,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_D: tl.constexpr,
    EVEN_D: tl.constexpr, BLOCK_DV: tl.constexpr, EVEN_DV: tl.constexpr, SAME_DV: tl.constexpr,
    WINDOW_LEFT: tl.constexpr, WINDOW_RIGHT: tl.constexpr,
    SOFTCAP: tl.constexpr, HAS_ALIBI: tl.constexpr, MASK_MODE: tl.constexpr, IEEE_DOT: tl.constexpr,
    DROPOUT: tl.constexpr, VARLEN: tl.constexpr, CHUNK: tl.constexpr,
):
    pid = tl.program_id(0)
    count = 0
    if VARLEN:
        count = tl.load(Items)
        if pid >= count * nheads:
            return
    b, h, m_block, bh, b_ptr, q_row, k_row, seqlen_q, seqlen_k, diag_offset = program_item(
        pid, Items, item_cap, count, nheads, num_m_blocks, seqlen_q, seqlen_k, diag_offset, True, VARLEN)
    b64, h64, kvh64 = b.to(tl.int64), h.to(tl.int64), (h // group_size).to(tl.int64)
    m0 = m_block * BLOCK_M
    offs_m0 = tl.arange(0, BLOCK_M)
    offs_m = m0 + offs_m0
    offs_n0 = tl.arange(0, BLOCK_N)
    offs_d = tl.arange(0, BLOCK_D)
    m_ok = offs_m < seqlen_q
    ok = m_ok[:, None] & (offs_d[None, :] < head_dim)
    if SAME_DV:
        offs_dv = offs_d
        ok_v = ok
    else:
        offs_dv = tl.arange(0, BLOCK_DV)
        ok_v = m_ok[:, None] & (offs_dv[None, :] < head_dim_v)
    row0 = q_row + m0
    q = tl.load(Q + b_ptr * stride_qb + h64 * stride_qh + row0 * stride_qm + offs_m0[:, None] * stride_qm
                + offs_d[None, :], mask=ok, other=0.0)
    do = tl.load(DO + b_ptr * stride_dob + h64 * stride_doh + row0 * stride_dom + offs_m0[:, None] * stride_dom
                 + offs_dv[None, :], mask=ok_v, other=0.0)
    lse_row = b_ptr * stride_lb + h64 * stride_lh + q_row
    lse = tl.load(Lse + lse_row + offs_m, mask=m_ok, other=float("inf"))
    lse2, tail = row_lse2(lse, MASK_MODE)
    delta = tl.load(Delta + lse_row + offs_m, mask=m_ok, other=0.0)
    k_base = K + b_ptr * stride_kb + kvh64 * stride_kh + k_row * stride_kn
    v_base = V + b_ptr * stride_vb + kvh64 * stride_vh + k_row * stride_vn
    mask_base = Mask
    if MASK_MODE != 0:
        mask_base = Mask + b64 * stride_mb + h64 * stride_mh + row0 * stride_mm + offs_m0[:, None] * stride_mm
    alibi_slope = 0.0
    if HAS_ALIBI:
        alibi_slope = tl.load(Alibi + b64 * stride_ab + h64 * stride_ah) * C_LOG2E
    seed = 0
    if DROPOUT:
        seed = tl.load(Seed)

    # The same key range and interior split as the forward kernel.
    lo_tile, inner_lo, inner_hi, hi = key_tiles(
        m0, seqlen_q, seqlen_k, diag_offset, window_left, window_right, chunk,
        BLOCK_M, BLOCK_N, WINDOW_LEFT, WINDOW_RIGHT, CHUNK)

    dq = tl.zeros([BLOCK_M, BLOCK_D], dtype=tl.float32)
    if WINDOW_LEFT or CHUNK:
        dq = _dq_tiles(dq, q, do, lse2, tail, delta, k_base, v_base, mask_base + tl.cast(lo_tile, tl.int64) * stride_mn, lo_tile, inner_lo,
                       offs_m, offs_n0, offs_d, offs_dv, stride_kn, stride_vn, stride_mn, seqlen_q, seqlen_k,
                       head_dim, head_dim_v,
                       qk_scale, sm_scale, softcap_in, softcap_out, alibi_slope,
                       diag_offset, window_left, window_right, chunk, seed, bh, dropout_p,
                       BLOCK_N, EVEN_D, EVEN_DV, SAME_DV, True, WINDOW_LEFT, WINDOW_RIGHT, SOFTCAP, HAS_ALIBI, MASK_MODE, IEEE_DOT, DROPOUT,
                       CHUNK)
    dq = _dq_tiles(dq, q, do, lse2, tail, delta, k_base, v_base, mask_base + tl.cast(inner_lo, tl.int64) * stride_mn, inner_lo, inner_hi,
                   offs_m, offs_n0, offs_d, offs_dv, stride_kn, stride_vn, stride_mn, seqlen_q, seqlen_k,
                       head_dim, head_dim_v,
                   qk_scale, sm_scale, softcap_in, softcap_out, alibi_slope,
                   diag_offset, window_left, window_right, chunk, seed, bh, dropout_p,
                   BLOCK_N, EVEN_D, EVEN_DV, SAME_DV, False, WINDOW_LEFT, WINDOW_RIGHT, SOFTCAP, HAS_ALIBI, MASK_MODE, IEEE_DOT, DROPOUT,
                       CHUNK)
    dq = _dq_tiles(dq, q, do, lse2, tail, delta, k_base, v_base, mask_base + tl.cast(inner_hi, tl.int64) * stride_mn, inner_hi, hi,
                   offs_m, offs_n0, offs_d, offs_dv, stride_kn, stride_vn, stride_mn, seqlen_q, seqlen_k,
                       head_dim, head_dim_v,
                   qk_scale, sm_scale, softcap_in, softcap_out, alibi_slope,
                   diag_offset, window_left, window_right, chunk, seed, bh, dropout_p,
                   BLOCK_N, EVEN_D, EVEN_DV, SAME_DV, True, WINDOW_LEFT, WINDOW_RIGHT, SOFTCAP, HAS_ALIBI, MASK_MODE, IEEE_DOT, DROPOUT,
                       CHUNK)
    if not SOFTCAP:
        dq = dq * sm_scale
    tl.store(DQ + b_ptr * stride_dqb + h64 * stride_dqh + row0 * stride_dqm + offs_m0[:, None] * stride_dqm
             + offs_d[None, :], dq.to(DQ.dtype.element_ty), mask=ok)


@triton.jit
def _dkdv_tiles(
    dk, dv, k, v,
    q_base, do_base, lse_base, delta_base, mask_base, dq_base, m_start, m_end,
    offs_n, offs_m0, offs_d, offs_dv,
    stride_qm, stride_dom, stride_mm, stride_dqm, seqlen_q, seqlen_k, head_dim, head_dim_v,
    qk_scale, sm_scale, softcap_in, softcap_out, alibi_slope,
    diag_offset, window_left, window_right, chunk, seed, bh, dropout_p,
    BLOCK_M: tl.constexpr, EVEN_D: tl.constexpr, EVEN_DV: tl.constexpr, SAME_DV: tl.constexpr,
    BOUNDARY: tl.constexpr,
    WINDOW_LEFT: tl.constexpr, WINDOW_RIGHT: tl.constexpr,
    SOFTCAP: tl.constexpr, HAS_ALIBI: tl.constexpr, MASK_MODE: tl.constexpr, IEEE_DOT: tl.constexpr,
    DROPOUT: tl.constexpr, FUSED_DQ: tl.constexpr, CHUNK: tl.constexpr,
):
    if EVEN_D:
        d_ok = offs_d < offs_d.shape[0]
    else:
        d_ok = offs_d < head_dim
    if EVEN_DV:
        dv_ok = offs_dv < offs_dv.shape[0]
    else:
        dv_ok = offs_dv < head_dim_v
    for m0 in range(m_start, m_end, BLOCK_M):
        offs_m = m0 + offs_m0
        row = tl.cast(m0, tl.int64)
        m_ok = offs_m < seqlen_q
        ok = m_ok[:, None] & d_ok[None, :]
        q = tl.load(q_base + row * stride_qm + offs_m0[:, None] * stride_qm + offs_d[None, :], mask=ok, other=0.0)
        if SAME_DV:
            do_ok = ok
        else:
            do_ok = m_ok[:, None] & dv_ok[None, :]
        do = tl.load(do_base + row * stride_dom + offs_m0[:, None] * stride_dom + offs_dv[None, :], mask=do_ok,
                     other=0.0)
        lse = tl.load(lse_base + offs_m, mask=m_ok, other=float("inf"))
        lse2, tail = row_lse2(lse, MASK_MODE)
        delta = tl.load(delta_base + offs_m, mask=m_ok, other=0.0)
        if IEEE_DOT:
            raw_t = tl.dot(k, tl.trans(q), input_precision="ieee")
            dp_t = tl.dot(v, tl.trans(do), input_precision="ieee")
        else:
            raw_t = tl.dot(k, tl.trans(q))
            dp_t = tl.dot(v, tl.trans(do))
        s_t, dfac = scores(
            raw_t, offs_m[None, :], offs_n[:, None], None,
            mask_base + row * stride_mm + offs_m0[None, :] * stride_mm, None, 0, seqlen_q, seqlen_k,
            qk_scale, sm_scale, softcap_in, softcap_out, alibi_slope, diag_offset, window_left, window_right, chunk,
            BOUNDARY, WINDOW_LEFT, WINDOW_RIGHT, SOFTCAP, HAS_ALIBI, MASK_MODE, CHUNK)
        if MASK_MODE == 2:
            p_t = tl.exp2((s_t - lse2[None, :]) - tail[None, :])
        else:
            p_t = tl.exp2(s_t - lse2[None, :])
        pv_t = p_t
        if DROPOUT:
            keep_t = dropout_keep(seed, bh, offs_m[None, :], offs_n[:, None], dropout_p)
            pv_t = tl.where(keep_t, p_t / (1.0 - dropout_p), 0.0)
            dp_t = tl.where(keep_t, dp_t / (1.0 - dropout_p), 0.0)
        ds_t = p_t * (dp_t - delta[None, :])
        if SOFTCAP:
            ds_t = ds_t * dfac
        if IEEE_DOT:
            dv = tl.dot(pv_t.to(do.dtype), do, dv, input_precision="ieee")
            dk = tl.dot(ds_t.to(q.dtype), q, dk, input_precision="ieee")
        else:
            dv = tl.dot(pv_t.to(do.dtype), do, dv)
            dk = tl.dot(ds_t.to(q.dtype), q, dk)
        if FUSED_DQ:
            # FA2's single-pass variant: this key block's share of dQ goes straight into a
            # float32 accumulator. Faster (5 tile matmuls, not 7) but the order of the
            # atomic adds varies from run to run, so it is never used when determinism
            # is asked for.
            if IEEE_DOT:
                dq_part = tl.dot(tl.trans(ds_t.to(k.dtype)), k, input_precision="ieee")
            else:
                dq_part = tl.dot(tl.trans(ds_t.to(k.dtype)), k)
            if not SOFTCAP:
                dq_part = dq_part * sm_scale
            tl.atomic_add(dq_base + row * stride_dqm + offs_m0[:, None] * stride_dqm + offs_d[None, :], dq_part,
                          mask=ok, sem="relaxed")
    return dk, dv


@triton.jit
def dkdv_kernel(
    Q, K, V, DO, Lse, Delta, DK, DV, Mask, Alibi, Seed, DQacc, Items,
    stride_qb, stride_qh, stride_qm,
    stride_kb, stride_kh, stride_kn,
    stride_vb, stride_vh, stride_vn,
    stride_dob, stride_doh, stride_dom,
    stride_dkb, stride_dkh, stride_dkn,
    stride_dvb, stride_dvh, stride_dvn,
    stride_mb, stride_mh, stride_mm, stride_mn,
    stride_ab, stride_ah,
    stride_qab, stride_qah, stride_qam, stride_lb, stride_lh,
    nheads, nheads_k, group_size, seqlen_q, seqlen_k, head_dim, head_dim_v, num_n_blocks, item_cap,
    qk_scale, sm_scale, softcap_in, softcap_out,
    diag_offset, window_left, window_right, dropout_p, chunk,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_D: tl.constexpr,
    EVEN_D: tl.constexpr, BLOCK_DV: tl.constexpr, EVEN_DV: tl.constexpr, SAME_DV: tl.constexpr,
    WINDOW_LEFT: tl.constexpr, WINDOW_RIGHT: tl.constexpr,
    SOFTCAP: tl.constexpr, HAS_ALIBI: tl.constexpr, MASK_MODE: tl.constexpr, IEEE_DOT: tl.constexpr,
    DROPOUT: tl.constexpr, FUSED_DQ: tl.constexpr, SPLIT_PHASES: tl.constexpr, VARLEN: tl.constexpr,
    CHUNK: tl.constexpr,
):
    # One program per (batch, key/value head, key block), or (key/value head, work item
    # over key blocks) of a packed call (``program_item``).
    pid = tl.program_id(0)
    count = 0
    if VARLEN:
        count = tl.load(Items)
        if pid >= count * nheads_k:
            return
    b, kvh, n_block, _, b_ptr, q_row, k_row, seqlen_q, seqlen_k, diag_offset = program_item(
        pid, Items, item_cap, count, nheads_k, num_n_blocks, seqlen_q, seqlen_k, diag_offset, False, VARLEN)
    b64, kvh64 = b.to(tl.int64), kvh.to(tl.int64)
    n0 = n_block * BLOCK_N
    offs_n = n0 + tl.arange(0, BLOCK_N)
    offs_m0 = tl.arange(0, BLOCK_M)
    offs_d = tl.arange(0, BLOCK_D)
    n_ok = offs_n < seqlen_k
    ok = n_ok[:, None] & (offs_d[None, :] < head_dim)
    if SAME_DV:
        offs_dv = offs_d
        ok_v = ok
    else:
        offs_dv = tl.arange(0, BLOCK_DV)
        ok_v = n_ok[:, None] & (offs_dv[None, :] < head_dim_v)
    row0 = k_row + n0
    k = tl.load(K + b_ptr * stride_kb + kvh64 * stride_kh + row0 * stride_kn
                + tl.arange(0, BLOCK_N)[:, None] * stride_kn + offs_d[None, :], mask=ok, other=0.0)
    v = tl.load(V + b_ptr * stride_vb + kvh64 * stride_vh + row0 * stride_vn
                + tl.arange(0, BLOCK_N)[:, None] * stride_vn + offs_dv[None, :], mask=ok_v, other=0.0)

    # Query range that sees any key of [n0, n_last]; its interior sees all of them.
    # Key j is visible to query i iff j - diag_offset - right <= i <= j - diag_offset + left.
    n_last = tl.minimum(n0 + BLOCK_N, seqlen_k) - 1
    lo = 0
    hi = seqlen_q
    full_lo = 0
    full_hi = seqlen_q
    if WINDOW_RIGHT:
        lo = tl.maximum(n0 - diag_offset - window_right, 0)
        full_lo = tl.maximum(n_last - diag_offset - window_right, 0)
    if WINDOW_LEFT:
        hi = tl.minimum(n_last - diag_offset + window_left + 1, seqlen_q)
        full_hi = tl.minimum(n0 - diag_offset + window_left + 1, seqlen_q)
    if CHUNK:
        # Queries at positions (i + diag_offset) in the chunks of keys n0 .. n_last; every
        # key of the block only for those in its one chunk (none if it spans two).
        first = chunk_start(n0, chunk)
        last = chunk_start(n_last, chunk)
        lo = tl.maximum(lo, first - diag_offset)
        hi = tl.minimum(hi, last + chunk - diag_offset)
        full_lo = tl.maximum(full_lo, first - diag_offset)
        full_hi = tl.minimum(full_hi, tl.where(first == last, first + chunk - diag_offset, 0))
    hi = tl.maximum(hi, 0)
    full_hi = tl.maximum(full_hi, 0)
    lo_tile = (lo // BLOCK_M) * BLOCK_M
    inner_lo = tl.maximum(tl.cdiv(full_lo, BLOCK_M) * BLOCK_M, lo_tile)
    inner_hi = tl.minimum((full_hi // BLOCK_M) * BLOCK_M, hi)
    # A key block running past seqlen_k needs the bounds mask on every tile.
    empty_inner = (inner_hi <= inner_lo) | (n0 + BLOCK_N > seqlen_k)
    inner_lo = tl.where(empty_inner, lo_tile, inner_lo)
    inner_hi = tl.where(empty_inner, lo_tile, inner_hi)

    seed = 0
    if DROPOUT:
        seed = tl.load(Seed)
    dk = tl.zeros([BLOCK_N, BLOCK_D], dtype=tl.float32)
    dv = tl.zeros([BLOCK_N, BLOCK_DV], dtype=tl.float32)
    for g in range(0, group_size):
        h = kvh * group_size + g
        h64 = h.to(tl.int64)
        bh64 = b64 * nheads + h64
        q_base = Q + b_ptr * stride_qb + h64 * stride_qh + q_row * stride_qm
        do_base = DO + b_ptr * stride_dob + h64 * stride_doh + q_row * stride_dom
        lse_base = Lse + b_ptr * stride_lb + h64 * stride_lh + q_row
        delta_base = Delta + b_ptr * stride_lb + h64 * stride_lh + q_row
        dq_base = DQacc + b_ptr * stride_qab + h64 * stride_qah + q_row * stride_qam
        mask_base = Mask
        if MASK_MODE != 0:
            mask_base = Mask + b64 * stride_mb + h64 * stride_mh + offs_n[:, None].to(tl.int64) * stride_mn
        alibi_slope = 0.0
        if HAS_ALIBI:
            alibi_slope = tl.load(Alibi + b64 * stride_ab + h64 * stride_ah) * C_LOG2E
        # Three phases (masked edge, unmasked interior, masked edge), or with SPLIT_PHASES
        # off one loop that masks every tile: less code, far fewer live values (BwdConfig).
        first_end = hi
        if SPLIT_PHASES:
            first_end = inner_lo
        dk, dv = _dkdv_tiles(
            dk, dv, k, v, q_base, do_base, lse_base, delta_base, mask_base, dq_base, lo_tile, first_end,
            offs_n, offs_m0, offs_d, offs_dv, stride_qm, stride_dom, stride_mm, stride_qam, seqlen_q, seqlen_k,
            head_dim, head_dim_v,
            qk_scale, sm_scale, softcap_in, softcap_out, alibi_slope, diag_offset, window_left, window_right,
            chunk, seed, bh64, dropout_p, BLOCK_M, EVEN_D, EVEN_DV, SAME_DV, True, WINDOW_LEFT, WINDOW_RIGHT, SOFTCAP, HAS_ALIBI, MASK_MODE,
            IEEE_DOT, DROPOUT, FUSED_DQ, CHUNK)
        if SPLIT_PHASES:
            dk, dv = _dkdv_tiles(
                dk, dv, k, v, q_base, do_base, lse_base, delta_base, mask_base, dq_base, inner_lo, inner_hi,
                offs_n, offs_m0, offs_d, offs_dv, stride_qm, stride_dom, stride_mm, stride_qam, seqlen_q, seqlen_k,
            head_dim, head_dim_v,
                qk_scale, sm_scale, softcap_in, softcap_out, alibi_slope, diag_offset, window_left, window_right,
                chunk, seed, bh64, dropout_p, BLOCK_M, EVEN_D, EVEN_DV, SAME_DV, False, WINDOW_LEFT, WINDOW_RIGHT, SOFTCAP, HAS_ALIBI, MASK_MODE,
                IEEE_DOT, DROPOUT, FUSED_DQ, CHUNK)
            dk, dv = _dkdv_tiles(
                dk, dv, k, v, q_base, do_base, lse_base, delta_base, mask_base, dq_base, inner_hi, hi,
                offs_n, offs_m0, offs_d, offs_dv, stride_qm, stride_dom, stride_mm, stride_qam, seqlen_q, seqlen_k,
            head_dim, head_dim_v,
                qk_scale, sm_scale, softcap_in, softcap_out, alibi_slope, diag_offset, window_left, window_right,
                chunk, seed, bh64, dropout_p, BLOCK_M, EVEN_D, EVEN_DV, SAME_DV, True, WINDOW_LEFT, WINDOW_RIGHT, SOFTCAP, HAS_ALIBI, MASK_MODE,
                IEEE_DOT, DROPOUT, FUSED_DQ, CHUNK)
    if not SOFTCAP:
        dk = dk * sm_scale
    local_n = tl.arange(0, BLOCK_N)
    tl.store(DK + b_ptr * stride_dkb + kvh64 * stride_dkh + row0 * stride_dkn + local_n[:, None] * stride_dkn
             + offs_d[None, :], dk.to(DK.dtype.element_ty), mask=ok)
    tl.store(DV + b_ptr * stride_dvb + kvh64 * stride_dvh + row0 * stride_dvn + local_n[:, None] * stride_dvn
             + offs_dv[None, :], dv.to(DV.dtype.element_ty), mask=ok_v)


@triton.jit
def sink_grad_kernel(Lse, Delta, Sink, DSink, batch, nheads, seqlen, BLOCK: tl.constexpr):
    """Program h: dsink_h = -sum_{b, i} exp(sink_h - lse_bhi) * Delta_bhi over rows with a
    finite LSE (lse and Delta (B, H, S) contiguous), summed in a fixed order."""
    h = tl.program_id(0).to(tl.int64)
    sink = tl.load(Sink + h)
    acc = tl.zeros([BLOCK], dtype=tl.float32)
    for b in range(0, batch):
        row = (b * nheads + h) * seqlen
        for s0 in range(0, seqlen, BLOCK):
            offs = s0 + tl.arange(0, BLOCK)
            ok = offs < seqlen
            lse = tl.load(Lse + row + offs, mask=ok, other=float("-inf"))
            delta = tl.load(Delta + row + offs, mask=ok, other=0.0)
            live = lse != float("-inf")
            weight = tl.exp(tl.where(live, sink - lse, 0.0))
            acc += tl.where(live, weight * delta, 0.0)
    tl.store(DSink + h, -tl.sum(acc, 0))


_launch_pre = Launcher(preprocess_kernel)
_launch_dkdv = Launcher(dkdv_kernel)
_launch_dq = Launcher(dq_kernel)


def preprocess(out, dout, dlse, varlen, tables, window_left: int, window_right: int, total_k: int,
               accumulator=None):
    """Delta = rowsum(dO * O) - dlse of every row (``preprocess_kernel``), as every backward
    family needs it, and a packed call's work lists.

    Args:
        out, dout: (B, H, Sq, D) views with unit stride along D (the forward's out and its
            gradient).
        dlse: None or (B, H, Sq), the upstream gradient of the LSE.
        varlen: None, or a ``problem.spec.Varlen`` (B = 1): then ``tables`` (the backward
            kernels' (block, over_keys) work lists) are built in the same launch as the
            preprocess's own 64-row list, and returned in their order.
        window_left, window_right: the normalised window; total_k: rows of k.
        accumulator: None, or a float32 (B, H, Sq rounded up to 64 or a larger multiple of 64,
            D) contiguous buffer (fixed lengths only: the one-pass backward's dQ) that the same
            launch zeroes.

    Returns:
        (delta (B, H, Sq) float32, [(table, capacity), ...] of ``tables``, empty when not
        packed).
    """
    import torch

    batch, nheads, seqlen_q, head_dim = out.shape
    block_d = max(16, triton.next_power_of_2(head_dim))
    delta = torch.empty((batch, nheads, seqlen_q), dtype=torch.float32, device=out.device)
    built = []
    if varlen is None:
        pre_blocks = triton.cdiv(seqlen_q, 64)
        pre_grid, pre_items, pre_cap, pre_sizes = pre_blocks * batch * nheads, out, 0, (seqlen_q, pre_blocks)
        acc_rows = pre_blocks * 64 if accumulator is None or accumulator.dim() != 4 else accumulator.shape[2]
        if accumulator is not None and (accumulator.shape != (batch, nheads, acc_rows, head_dim)
                                        or acc_rows % 64 or acc_rows < pre_blocks * 64
                                        or accumulator.dtype != torch.float32 or not accumulator.is_contiguous()):
            raise ValueError(f"accumulator must be float32 contiguous {(batch, nheads, pre_blocks * 64, head_dim)} "
                             f"(or more rows, a multiple of 64), got {accumulator.dtype} {tuple(accumulator.shape)}")
    elif accumulator is not None:
        raise ValueError("accumulator: fixed-length calls only (packed rows do not tile it)")
    else:
        built = build_work_items(varlen, seqlen_q, total_k, list(tables) + [(64, False)], window_left, window_right)
        pre_items, pre_cap = built.pop()
        pre_grid, pre_sizes, acc_rows = pre_cap * nheads, (seqlen_q, 0), 0
    _launch_pre((pre_grid,),
                (out, dout, delta, pre_items, delta if accumulator is None else accumulator, *out.stride()[:3],
                 *dout.stride()[:3], nheads, pre_sizes[0], head_dim, pre_sizes[1], pre_cap, acc_rows),
                dict(BLOCK_M=64, BLOCK_D=block_d, IEEE_DOT=out.dtype == torch.float32, VARLEN=varlen is not None,
                     ZERO_ACC=accumulator is not None),
                4, 3)
    if dlse is not None:
        delta -= dlse.to(torch.float32)
    return delta, built


_launch_sink_grad = Launcher(sink_grad_kernel)


def sink_grad(sink, lse, delta):
    """d loss / d sink, (H,) float32, from the saved LSE (sink included) and Delta
    (rowsum(dO * O) - dlse), both (B, H, S) float32 contiguous: the sink is a key with no
    value row, so dS_sink = P_sink (0 - Delta) with P_sink = exp(sink - lse), summed over
    batch and rows by one program per head in a fixed order (deterministic, no atomics).
    Rows with LSE -inf (outside every sequence of a packed call) hold no sink weight."""
    import torch

    batch, nheads, seqlen = lse.shape
    dsink = torch.empty((nheads,), dtype=torch.float32, device=lse.device)
    if nheads:
        _launch_sink_grad((nheads,), (lse, delta, sink, dsink, batch, nheads, seqlen), dict(BLOCK=1024), 4, 1)
    return dsink


def attention_backward(q, k, v, lse, delta, dout, dq, dk, dv, problem, *, config: BwdConfig, alibi=None,
                       mask=None, seed=None, varlen=None, tables=()) -> None:
    """Launch the Triton dK/dV and dQ kernels (``backends.run`` chose them; Delta from
    ``preprocess``).

    Args:
        q, dq: (B, H, Sq, D) and dout: (B, H, Sq, Dv) views with unit stride along the head dim.
        k, dk: (B, Hk, Sk, D) and v, dv: (B, Hk, Sk, Dv) views with unit stride along it.
        lse: (B, H, Sq) float32 contiguous, natural log, as the forward saved it.
        delta: ``preprocess``'s (B, H, Sq) float32.
        problem: the ``problem.spec.Problem``; dropout redraws the forward's mask from
            ``seed``. ``config``: tiles, and ``fused_dq`` (dQ by float32 atomics inside the
            dK/dV kernel: FA2's single pass, not bitwise reproducible).
        alibi: None or float32 (B, H). mask: None or (B, H, Sq, Sk) view.
        varlen, tables: a packed call (B = 1) and its work lists from ``preprocess``: the
            key-block list, then (unless fused) the query-block list. Rows and keys outside
            every sequence's used part are not written: the caller zeroes dq, dk, dv first
            when seqused is given.
    """
    import torch

    batch, nheads, seqlen_q, head_dim = q.shape
    nheads_k, seqlen_k = k.shape[1], k.shape[2]
    window_left, window_right = launch_window(problem.window_left, problem.window_right, seqlen_q, seqlen_k,
                                              problem.diag_offset, varlen)
    head_dim_v = v.shape[-1]
    block_d = max(16, triton.next_power_of_2(head_dim))
    block_dv = max(16, triton.next_power_of_2(head_dim_v))
    scale, softcap, dropout_p = problem.scale, problem.softcap, problem.dropout_p
    softcap_on = softcap > 0.0
    common = dict(
        BLOCK_D=block_d, EVEN_D=block_d == head_dim, BLOCK_DV=block_dv, EVEN_DV=block_dv == head_dim_v,
        SAME_DV=head_dim_v == head_dim,
        WINDOW_LEFT=window_left >= 0, WINDOW_RIGHT=window_right >= 0,
        SOFTCAP=softcap_on, HAS_ALIBI=alibi is not None, IEEE_DOT=q.dtype == torch.float32,
        DROPOUT=dropout_p > 0.0, CHUNK=problem.chunk > 0,
    )
    mask_mode, mask_arg, mstrides = mask_arguments(mask, q)
    alibi_arg, astrides = (q, (0, 0)) if alibi is None else (alibi, alibi.stride())
    scalars = (scale * LOG2E, scale,
               scale / softcap if softcap_on else 0.0, softcap * LOG2E if softcap_on else 0.0,
               problem.diag_offset, window_left, window_right, float(dropout_p), problem.chunk)
    seed_arg = seed if dropout_p > 0.0 else q

    fused = config.fused_dq
    dq_acc = torch.zeros((batch, nheads, seqlen_q, head_dim), dtype=torch.float32, device=q.device) if fused else q
    lstrides = (lse.stride(0), lse.stride(1))
    if varlen is None:
        num_n_blocks = triton.cdiv(seqlen_k, config.block_n_kv)
        num_m_blocks = triton.cdiv(seqlen_q, config.block_m_q)
        kv_grid, q_grid = num_n_blocks * batch * nheads_k, num_m_blocks * batch * nheads
        kv_items, kv_cap, q_items, q_cap = q, 0, q, 0
        sizes = (seqlen_q, seqlen_k)
    else:
        (kv_items, kv_cap), (q_items, q_cap) = tables[0], tables[-1]
        num_n_blocks = num_m_blocks = 0
        kv_grid, q_grid = kv_cap * nheads_k, q_cap * nheads
        sizes = (0, 0)  # per sequence, from the work list
        scalars = scalars[:4] + (0,) + scalars[5:]
    _launch_dkdv(
        (kv_grid,),
        (q, k, v, dout, lse, delta, dk, dv, mask_arg, alibi_arg, seed_arg, dq_acc, kv_items,
         *q.stride()[:3], *k.stride()[:3], *v.stride()[:3], *dout.stride()[:3],
         *dk.stride()[:3], *dv.stride()[:3], *mstrides, *astrides, *dq_acc.stride()[:3], *lstrides,
         nheads, nheads_k, nheads // nheads_k, *sizes, head_dim, head_dim_v, num_n_blocks, kv_cap, *scalars),
        dict(BLOCK_M=config.block_m_kv, BLOCK_N=config.block_n_kv, MASK_MODE=mask_mode, FUSED_DQ=fused,
             SPLIT_PHASES=config.split_phases, VARLEN=varlen is not None, **common),
        config.num_warps, config.num_stages)
    if fused:
        dq.copy_(dq_acc)
        return

    _launch_dq(
        (q_grid,),
        (q, k, v, dout, lse, delta, dq, mask_arg, alibi_arg, seed_arg, q_items,
         *q.stride()[:3], *k.stride()[:3], *v.stride()[:3], *dout.stride()[:3], *dq.stride()[:3],
         *mstrides, *astrides, *lstrides,
         nheads, nheads // nheads_k, *sizes, head_dim, head_dim_v, num_m_blocks, q_cap, *scalars),
        dict(BLOCK_M=config.block_m_q, BLOCK_N=config.block_n_q, MASK_MODE=mask_mode, VARLEN=varlen is not None,
             **common),
        config.num_warps, config.num_stages)

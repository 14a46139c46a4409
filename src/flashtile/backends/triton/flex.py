"""Triton FlexAttention: user score and mask functions inlined into the tile loop, block-sparse.

The mods arrive translated (``modgen.py``) as ``triton.jit`` functions, passed to the
kernels as constexpr arguments; their captured tensors travel as a tuple of pointers
(``SCORE_ARGS``, ``MASK_ARGS``). Each tile's scores go through the score pipeline's flex
stage (``scores.flex_scores``): scale, score_mod, mask_mod, bounds; base 2 after that.

Block sparsity follows torch's BlockMask (``problem/blockmask.py``): a query block visits
its partial key blocks (mask_mod evaluated) then its full ones (not evaluated); without a
block mask every key tile is visited. A kernel tile (BLOCK_M x BLOCK_N) divides the mask's
blocks (Q_BLOCK x KV_BLOCK).

    forward     one program per (query tile, batch x query head): out, lse
    dK/dV       one program per (key tile, batch x kv head): walks the query blocks that
                visit its key block (the BlockMask's transposed lists), for every query
                head of its group; no atomics
    dQ          one program per (query tile, batch x query head), the forward's walk

Both backward kernels write each gradient element once, so the backward is deterministic.
Lengths and the block lists' sizes are not specialised on (``do_not_specialize``): new B,
L or S reuse the compiled kernels.
"""

from __future__ import annotations

import triton
import triton.language as tl

from flashtile.backends.triton.scores import C_LN2, HIDDEN2, flex_scores, row_lse2

# Ints that change with B, L, S (the LSE's strides are L and H * L): never specialised on.
_LENGTHS = ["seqlen_q", "seqlen_k", "num_sb", "num_sh", "n_idx", "nheads", "group_size", "stride_lb", "stride_lh"]


@triton.jit
def _fwd_tile(acc, l_i, m_i, q, k_base, v_base, n0, b, h, offs_m, offs_n0, offs_d, offs_dv,
              stride_kn, stride_vn, seqlen_q, seqlen_k, head_dim, head_dim_v, sm_scale,
              SCORE_ARGS, MASK_ARGS, SCORE_MOD: tl.constexpr, MASK_MOD: tl.constexpr, APPLY_MASK: tl.constexpr,
              IEEE_DOT: tl.constexpr):
    offs_n = n0 + offs_n0
    k_ptrs = k_base + offs_n[None, :].to(tl.int64) * stride_kn + offs_d[:, None]
    kt = tl.load(k_ptrs, mask=(offs_n[None, :] < seqlen_k) & (offs_d[:, None] < head_dim), other=0.0)
    if IEEE_DOT:
        raw = tl.dot(q, kt, input_precision="ieee")
    else:
        raw = tl.dot(q, kt)
    s, _ = flex_scores(raw, b, h, offs_m[:, None], offs_n[None, :], seqlen_q, seqlen_k, sm_scale,
                       SCORE_ARGS, MASK_ARGS, SCORE_MOD, MASK_MOD, APPLY_MASK)
    m_new = tl.maximum(m_i, tl.max(s, 1))
    m_use = tl.where(m_new == float("-inf"), 0.0, m_new)
    p = tl.exp2(s - m_use[:, None])
    alpha = tl.exp2(m_i - m_use)
    l_i = l_i * alpha + tl.sum(p, 1)
    v_ptrs = v_base + offs_n[:, None].to(tl.int64) * stride_vn + offs_dv[None, :]
    v = tl.load(v_ptrs, mask=(offs_n[:, None] < seqlen_k) & (offs_dv[None, :] < head_dim_v), other=0.0)
    if IEEE_DOT:
        acc = tl.dot(p.to(v.dtype), v, acc * alpha[:, None], input_precision="ieee")
    else:
        acc = tl.dot(p.to(v.dtype), v, acc * alpha[:, None])
    return acc, l_i, m_new


@triton.jit(do_not_specialize=_LENGTHS)
def flex_fwd_kernel(
    Q, K, V, Out, Lse, KvNum, KvIdx, FullNum, FullIdx, SCORE_ARGS, MASK_ARGS,
    stride_qb, stride_qh, stride_qm, stride_kb, stride_kh, stride_kn, stride_vb, stride_vh, stride_vn,
    stride_ob, stride_oh, stride_om, stride_lb, stride_lh,
    num_sb, num_sh, n_idx, nheads, group_size, seqlen_q, seqlen_k, head_dim, head_dim_v, sm_scale,
    SCORE_MOD: tl.constexpr, MASK_MOD: tl.constexpr, SPARSE: tl.constexpr, HAS_FULL: tl.constexpr,
    Q_BLOCK: tl.constexpr, KV_BLOCK: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
    BLOCK_D: tl.constexpr, BLOCK_DV: tl.constexpr, EVEN_D: tl.constexpr, EVEN_DV: tl.constexpr,
    IEEE_DOT: tl.constexpr,
):
    m0 = tl.program_id(0) * BLOCK_M
    bh = tl.program_id(1)
    # Head dims that fill their blocks: the masks along d fold to true (16-byte loads).
    head_dim = BLOCK_D if EVEN_D else head_dim
    head_dim_v = BLOCK_DV if EVEN_DV else head_dim_v
    b = bh // nheads
    h = bh % nheads
    kvh = h // group_size
    offs_m = m0 + tl.arange(0, BLOCK_M)
    offs_n0 = tl.arange(0, BLOCK_N)
    offs_d = tl.arange(0, BLOCK_D)
    offs_dv = tl.arange(0, BLOCK_DV)
    b64, h64, kvh64 = b.to(tl.int64), h.to(tl.int64), kvh.to(tl.int64)
    q_ptrs = Q + b64 * stride_qb + h64 * stride_qh + offs_m[:, None].to(tl.int64) * stride_qm + offs_d[None, :]
    q = tl.load(q_ptrs, mask=(offs_m[:, None] < seqlen_q) & (offs_d[None, :] < head_dim), other=0.0)
    k_base = K + b64 * stride_kb + kvh64 * stride_kh
    v_base = V + b64 * stride_vb + kvh64 * stride_vh
    acc = tl.zeros([BLOCK_M, BLOCK_DV], dtype=tl.float32)
    l_i = tl.zeros([BLOCK_M], dtype=tl.float32)
    m_i = tl.full([BLOCK_M], float("-inf"), dtype=tl.float32)
    if SPARSE:
        row = b * num_sb + h * num_sh + m0 // Q_BLOCK
        idx_base = KvIdx + row.to(tl.int64) * n_idx
        for i in range(0, tl.load(KvNum + row)):
            kb = tl.load(idx_base + i)
            for sub in tl.static_range(KV_BLOCK // BLOCK_N):
                acc, l_i, m_i = _fwd_tile(acc, l_i, m_i, q, k_base, v_base, kb * KV_BLOCK + sub * BLOCK_N, b, h,
                                          offs_m, offs_n0, offs_d, offs_dv, stride_kn, stride_vn, seqlen_q,
                                          seqlen_k, head_dim, head_dim_v, sm_scale, SCORE_ARGS, MASK_ARGS,
                                          SCORE_MOD, MASK_MOD, MASK_MOD is not None, IEEE_DOT)
        if HAS_FULL:
            idx_base = FullIdx + row.to(tl.int64) * n_idx
            for i in range(0, tl.load(FullNum + row)):
                kb = tl.load(idx_base + i)
                for sub in tl.static_range(KV_BLOCK // BLOCK_N):
                    acc, l_i, m_i = _fwd_tile(acc, l_i, m_i, q, k_base, v_base, kb * KV_BLOCK + sub * BLOCK_N, b,
                                              h, offs_m, offs_n0, offs_d, offs_dv, stride_kn, stride_vn, seqlen_q,
                                              seqlen_k, head_dim, head_dim_v, sm_scale, SCORE_ARGS, MASK_ARGS,
                                              SCORE_MOD, MASK_MOD, False, IEEE_DOT)
    else:
        for n0 in range(0, seqlen_k, BLOCK_N):
            acc, l_i, m_i = _fwd_tile(acc, l_i, m_i, q, k_base, v_base, n0, b, h, offs_m, offs_n0, offs_d, offs_dv,
                                      stride_kn, stride_vn, seqlen_q, seqlen_k, head_dim, head_dim_v, sm_scale,
                                      SCORE_ARGS, MASK_ARGS, SCORE_MOD, MASK_MOD, False, IEEE_DOT)
    seen = l_i != 0.0
    out = acc / tl.where(seen, l_i, 1.0)[:, None]
    lse = tl.where(seen, (m_i + tl.log2(tl.where(seen, l_i, 1.0))) * C_LN2, float("-inf"))
    # A row only HIDDEN2 scores reach (flex_scores): the count its LSE cannot hold, encoded as
    # the float masks' (scores.row_lse2 decodes it).
    lse = tl.where(seen & (m_i == HIDDEN2), HIDDEN2 * (1.0 + tl.log2(tl.where(seen, l_i, 1.0)) / 32.0) * C_LN2, lse)
    o_ptrs = Out + b64 * stride_ob + h64 * stride_oh + offs_m[:, None].to(tl.int64) * stride_om + offs_dv[None, :]
    tl.store(o_ptrs, out.to(Out.dtype.element_ty), mask=(offs_m[:, None] < seqlen_q) & (offs_dv[None, :] < head_dim_v))
    tl.store(Lse + b64 * stride_lb + h64 * stride_lh + offs_m, lse, mask=offs_m < seqlen_q)


@triton.jit
def _dq_tile(dq, q, do, lse2, tail, delta, k_base, v_base, n0, b, h, offs_m, offs_n0, offs_d, offs_dv,
             stride_kn, stride_vn, seqlen_q, seqlen_k, head_dim, head_dim_v, sm_scale,
             SCORE_ARGS, MASK_ARGS, SCORE_MOD: tl.constexpr, MASK_MOD: tl.constexpr, APPLY_MASK: tl.constexpr,
             IEEE_DOT: tl.constexpr):
    offs_n = n0 + offs_n0
    kt = tl.load(k_base + offs_n[None, :].to(tl.int64) * stride_kn + offs_d[:, None],
                 mask=(offs_n[None, :] < seqlen_k) & (offs_d[:, None] < head_dim), other=0.0)
    vt = tl.load(v_base + offs_n[None, :].to(tl.int64) * stride_vn + offs_dv[:, None],
                 mask=(offs_n[None, :] < seqlen_k) & (offs_dv[:, None] < head_dim_v), other=0.0)
    if IEEE_DOT:
        raw = tl.dot(q, kt, input_precision="ieee")
        dp = tl.dot(do, vt, input_precision="ieee")
    else:
        raw = tl.dot(q, kt)
        dp = tl.dot(do, vt)
    s, dfac = flex_scores(raw, b, h, offs_m[:, None], offs_n[None, :], seqlen_q, seqlen_k, sm_scale,
                          SCORE_ARGS, MASK_ARGS, SCORE_MOD, MASK_MOD, APPLY_MASK)
    p = tl.exp2((s - lse2[:, None]) - tail[:, None])
    ds = p * (dp - delta[:, None]) * dfac
    ds = tl.where(p > 0.0, ds, 0.0)  # hidden keys: no gradient, even where dfac is not finite
    if IEEE_DOT:
        dq = tl.dot(ds.to(kt.dtype), tl.trans(kt), dq, input_precision="ieee")
    else:
        dq = tl.dot(ds.to(kt.dtype), tl.trans(kt), dq)
    return dq


@triton.jit(do_not_specialize=_LENGTHS)
def flex_dq_kernel(
    Q, K, V, O, DO, DQ, Lse, DLse, Delta, KvNum, KvIdx, FullNum, FullIdx, SCORE_ARGS, MASK_ARGS,
    stride_qb, stride_qh, stride_qm, stride_kb, stride_kh, stride_kn, stride_vb, stride_vh, stride_vn,
    stride_ob, stride_oh, stride_om,
    stride_dob, stride_doh, stride_dom, stride_dqb, stride_dqh, stride_dqm, stride_lb, stride_lh,
    num_sb, num_sh, n_idx, nheads, group_size, seqlen_q, seqlen_k, head_dim, head_dim_v, sm_scale,
    SCORE_MOD: tl.constexpr, MASK_MOD: tl.constexpr, SPARSE: tl.constexpr, HAS_FULL: tl.constexpr,
    Q_BLOCK: tl.constexpr, KV_BLOCK: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
    BLOCK_D: tl.constexpr, BLOCK_DV: tl.constexpr, EVEN_D: tl.constexpr, EVEN_DV: tl.constexpr,
    IEEE_DOT: tl.constexpr, HAS_DLSE: tl.constexpr,
):
    m0 = tl.program_id(0) * BLOCK_M
    bh = tl.program_id(1)
    # Head dims that fill their blocks: the masks along d fold to true (16-byte loads).
    head_dim = BLOCK_D if EVEN_D else head_dim
    head_dim_v = BLOCK_DV if EVEN_DV else head_dim_v
    b = bh // nheads
    h = bh % nheads
    kvh = h // group_size
    offs_m = m0 + tl.arange(0, BLOCK_M)
    offs_n0 = tl.arange(0, BLOCK_N)
    offs_d = tl.arange(0, BLOCK_D)
    offs_dv = tl.arange(0, BLOCK_DV)
    b64, h64, kvh64 = b.to(tl.int64), h.to(tl.int64), kvh.to(tl.int64)
    m_ok = offs_m < seqlen_q
    rows = offs_m[:, None].to(tl.int64)
    q = tl.load(Q + b64 * stride_qb + h64 * stride_qh + rows * stride_qm + offs_d[None, :],
                mask=m_ok[:, None] & (offs_d[None, :] < head_dim), other=0.0)
    do = tl.load(DO + b64 * stride_dob + h64 * stride_doh + rows * stride_dom + offs_dv[None, :],
                 mask=m_ok[:, None] & (offs_dv[None, :] < head_dim_v), other=0.0)
    lse = tl.load(Lse + b64 * stride_lb + h64 * stride_lh + offs_m, mask=m_ok, other=float("-inf"))
    lse2, tail = row_lse2(lse, 2)  # an empty row: P = 0; a row of HIDDEN2 scores: P = 1 / n
    # Delta = rowsum(dO * O) - dLSE, for this kernel and for the dK/dV kernel after it (no
    # separate launch: its lengths would be specialised on).
    o = tl.load(O + b64 * stride_ob + h64 * stride_oh + rows * stride_om + offs_dv[None, :],
                mask=m_ok[:, None] & (offs_dv[None, :] < head_dim_v), other=0.0)
    delta = tl.sum(o.to(tl.float32) * do.to(tl.float32), 1)
    if HAS_DLSE:
        delta -= tl.load(DLse + b64 * stride_lb + h64 * stride_lh + offs_m, mask=m_ok, other=0.0)
    tl.store(Delta + b64 * stride_lb + h64 * stride_lh + offs_m, delta, mask=m_ok)
    k_base = K + b64 * stride_kb + kvh64 * stride_kh
    v_base = V + b64 * stride_vb + kvh64 * stride_vh
    dq = tl.zeros([BLOCK_M, BLOCK_D], dtype=tl.float32)
    if SPARSE:
        row = b * num_sb + h * num_sh + m0 // Q_BLOCK
        idx_base = KvIdx + row.to(tl.int64) * n_idx
        for i in range(0, tl.load(KvNum + row)):
            kb = tl.load(idx_base + i)
            for sub in tl.static_range(KV_BLOCK // BLOCK_N):
                dq = _dq_tile(dq, q, do, lse2, tail, delta, k_base, v_base, kb * KV_BLOCK + sub * BLOCK_N, b, h, offs_m,
                              offs_n0, offs_d, offs_dv, stride_kn, stride_vn, seqlen_q, seqlen_k, head_dim,
                              head_dim_v, sm_scale, SCORE_ARGS, MASK_ARGS, SCORE_MOD, MASK_MOD,
                              MASK_MOD is not None, IEEE_DOT)
        if HAS_FULL:
            idx_base = FullIdx + row.to(tl.int64) * n_idx
            for i in range(0, tl.load(FullNum + row)):
                kb = tl.load(idx_base + i)
                for sub in tl.static_range(KV_BLOCK // BLOCK_N):
                    dq = _dq_tile(dq, q, do, lse2, tail, delta, k_base, v_base, kb * KV_BLOCK + sub * BLOCK_N, b, h,
                                  offs_m, offs_n0, offs_d, offs_dv, stride_kn, stride_vn, seqlen_q, seqlen_k,
                                  head_dim, head_dim_v, sm_scale, SCORE_ARGS, MASK_ARGS, SCORE_MOD, MASK_MOD,
                                  False, IEEE_DOT)
    else:
        for n0 in range(0, seqlen_k, BLOCK_N):
            dq = _dq_tile(dq, q, do, lse2, tail, delta, k_base, v_base, n0, b, h, offs_m, offs_n0, offs_d, offs_dv,
                          stride_kn, stride_vn, seqlen_q, seqlen_k, head_dim, head_dim_v, sm_scale,
                          SCORE_ARGS, MASK_ARGS, SCORE_MOD, MASK_MOD, False, IEEE_DOT)
    tl.store(DQ + b64 * stride_dqb + h64 * stride_dqh + rows * stride_dqm + offs_d[None, :],
             dq.to(DQ.dtype.element_ty), mask=m_ok[:, None] & (offs_d[None, :] < head_dim))


@triton.jit
def _dkdv_tile(dk, dv, k, v, q_base, do_base, lse_base, delta_base, m0, b, h, offs_n, offs_m0, offs_d, offs_dv,
               stride_qm, stride_dom, seqlen_q, seqlen_k, head_dim, head_dim_v, sm_scale,
               SCORE_ARGS, MASK_ARGS, SCORE_MOD: tl.constexpr, MASK_MOD: tl.constexpr, APPLY_MASK: tl.constexpr,
               IEEE_DOT: tl.constexpr):
    """One query tile [m0, m0 + BLOCK_M) into a key tile's dK, dV (keys x queries)."""
    offs_m = m0 + offs_m0
    m_ok = offs_m < seqlen_q
    cols = offs_m[None, :].to(tl.int64)
    qt = tl.load(q_base + cols * stride_qm + offs_d[:, None], mask=m_ok[None, :] & (offs_d[:, None] < head_dim),
                 other=0.0)
    dot_ = tl.load(do_base + cols * stride_dom + offs_dv[:, None],
                   mask=m_ok[None, :] & (offs_dv[:, None] < head_dim_v), other=0.0)
    lse = tl.load(lse_base + offs_m, mask=m_ok, other=float("-inf"))
    lse2, tail = row_lse2(lse, 2)
    delta = tl.load(delta_base + offs_m, mask=m_ok, other=0.0)
    if IEEE_DOT:
        raw = tl.dot(k, qt, input_precision="ieee")
        dpt = tl.dot(v, dot_, input_precision="ieee")
    else:
        raw = tl.dot(k, qt)
        dpt = tl.dot(v, dot_)
    s, dfac = flex_scores(raw, b, h, offs_m[None, :], offs_n[:, None], seqlen_q, seqlen_k, sm_scale,
                          SCORE_ARGS, MASK_ARGS, SCORE_MOD, MASK_MOD, APPLY_MASK)
    pt = tl.exp2((s - lse2[None, :]) - tail[None, :])
    if IEEE_DOT:
        dv = tl.dot(pt.to(dot_.dtype), tl.trans(dot_), dv, input_precision="ieee")
    else:
        dv = tl.dot(pt.to(dot_.dtype), tl.trans(dot_), dv)
    dst = pt * (dpt - delta[None, :]) * dfac
    dst = tl.where(pt > 0.0, dst, 0.0)
    if IEEE_DOT:
        dk = tl.dot(dst.to(qt.dtype), tl.trans(qt), dk, input_precision="ieee")
    else:
        dk = tl.dot(dst.to(qt.dtype), tl.trans(qt), dk)
    return dk, dv


@triton.jit(do_not_specialize=_LENGTHS)
def flex_dkdv_kernel(
    Q, K, V, DO, DK, DV, Lse, Delta, QNum, QIdx, FullNum, FullIdx, SCORE_ARGS, MASK_ARGS,
    stride_qb, stride_qh, stride_qm, stride_kb, stride_kh, stride_kn, stride_vb, stride_vh, stride_vn,
    stride_dob, stride_doh, stride_dom, stride_dkb, stride_dkh, stride_dkn, stride_dvb, stride_dvh, stride_dvn,
    stride_lb, stride_lh,
    num_sb, num_sh, n_idx, nheads, group_size, seqlen_q, seqlen_k, head_dim, head_dim_v, sm_scale,
    SCORE_MOD: tl.constexpr, MASK_MOD: tl.constexpr, SPARSE: tl.constexpr, HAS_FULL: tl.constexpr,
    Q_BLOCK: tl.constexpr, KV_BLOCK: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
    BLOCK_D: tl.constexpr, BLOCK_DV: tl.constexpr, EVEN_D: tl.constexpr, EVEN_DV: tl.constexpr,
    IEEE_DOT: tl.constexpr,
):
    n0 = tl.program_id(0) * BLOCK_N
    bkv = tl.program_id(1)
    # Head dims that fill their blocks: the masks along d fold to true (16-byte loads).
    head_dim = BLOCK_D if EVEN_D else head_dim
    head_dim_v = BLOCK_DV if EVEN_DV else head_dim_v
    nheads_k = nheads // group_size
    b = bkv // nheads_k
    kvh = bkv % nheads_k
    offs_n = n0 + tl.arange(0, BLOCK_N)
    offs_m0 = tl.arange(0, BLOCK_M)
    offs_d = tl.arange(0, BLOCK_D)
    offs_dv = tl.arange(0, BLOCK_DV)
    b64, kvh64 = b.to(tl.int64), kvh.to(tl.int64)
    n_ok = offs_n < seqlen_k
    rows = offs_n[:, None].to(tl.int64)
    k = tl.load(K + b64 * stride_kb + kvh64 * stride_kh + rows * stride_kn + offs_d[None, :],
                mask=n_ok[:, None] & (offs_d[None, :] < head_dim), other=0.0)
    v = tl.load(V + b64 * stride_vb + kvh64 * stride_vh + rows * stride_vn + offs_dv[None, :],
                mask=n_ok[:, None] & (offs_dv[None, :] < head_dim_v), other=0.0)
    dk = tl.zeros([BLOCK_N, BLOCK_D], dtype=tl.float32)
    dv = tl.zeros([BLOCK_N, BLOCK_DV], dtype=tl.float32)
    for g in range(0, group_size):
        h = kvh * group_size + g
        h64 = h.to(tl.int64)
        q_base = Q + b64 * stride_qb + h64 * stride_qh
        do_base = DO + b64 * stride_dob + h64 * stride_doh
        lse_base = Lse + b64 * stride_lb + h64 * stride_lh
        delta_base = Delta + b64 * stride_lb + h64 * stride_lh
        if SPARSE:
            row = b * num_sb + h * num_sh + n0 // KV_BLOCK
            idx_base = QIdx + row.to(tl.int64) * n_idx
            for i in range(0, tl.load(QNum + row)):
                qb = tl.load(idx_base + i)
                for sub in tl.static_range(Q_BLOCK // BLOCK_M):
                    dk, dv = _dkdv_tile(dk, dv, k, v, q_base, do_base, lse_base, delta_base,
                                        qb * Q_BLOCK + sub * BLOCK_M, b, h, offs_n, offs_m0, offs_d, offs_dv,
                                        stride_qm, stride_dom, seqlen_q, seqlen_k, head_dim, head_dim_v, sm_scale,
                                        SCORE_ARGS, MASK_ARGS, SCORE_MOD, MASK_MOD, MASK_MOD is not None, IEEE_DOT)
            if HAS_FULL:
                idx_base = FullIdx + row.to(tl.int64) * n_idx
                for i in range(0, tl.load(FullNum + row)):
                    qb = tl.load(idx_base + i)
                    for sub in tl.static_range(Q_BLOCK // BLOCK_M):
                        dk, dv = _dkdv_tile(dk, dv, k, v, q_base, do_base, lse_base, delta_base,
                                            qb * Q_BLOCK + sub * BLOCK_M, b, h, offs_n, offs_m0, offs_d, offs_dv,
                                            stride_qm, stride_dom, seqlen_q, seqlen_k, head_dim, head_dim_v,
                                            sm_scale, SCORE_ARGS, MASK_ARGS, SCORE_MOD, MASK_MOD, False, IEEE_DOT)
        else:
            for m0 in range(0, seqlen_q, BLOCK_M):
                dk, dv = _dkdv_tile(dk, dv, k, v, q_base, do_base, lse_base, delta_base, m0, b, h, offs_n, offs_m0,
                                    offs_d, offs_dv, stride_qm, stride_dom, seqlen_q, seqlen_k, head_dim, head_dim_v,
                                    sm_scale, SCORE_ARGS, MASK_ARGS, SCORE_MOD, MASK_MOD, False, IEEE_DOT)
    tl.store(DK + b64 * stride_dkb + kvh64 * stride_dkh + rows * stride_dkn + offs_d[None, :],
             dk.to(DK.dtype.element_ty), mask=n_ok[:, None] & (offs_d[None, :] < head_dim))
    tl.store(DV + b64 * stride_dvb + kvh64 * stride_dvh + rows * stride_dvn + offs_dv[None, :],
             dv.to(DV.dtype.element_ty), mask=n_ok[:, None] & (offs_dv[None, :] < head_dim_v))


# --------------------------------------------------------------------------- host side
_DUMMIES: dict = {}


def _dummy(device):
    """A one-element int32 tensor on ``device`` for the pointer arguments a call does not use
    (made once per device, not per call)."""
    import torch

    t = _DUMMIES.get(device)
    if t is None:
        t = _DUMMIES[device] = torch.zeros(1, dtype=torch.int32, device=device)
    return t


def alloc(shape, like, dtype=None):
    """An output buffer (one place, so that the GPU tests can poison them with NaN)."""
    return like.new_empty(shape, dtype=dtype or like.dtype)


def tiles(block_d: int, block_dv: int, heavy: bool, interpret: bool = False) -> tuple:
    """(forward, dQ, dK/dV) tiles, each (BLOCK_M, BLOCK_N, warps, stages), for padded head
    dims ``block_d``/``block_dv``. ``heavy``: a mod loads a whole (queries x keys) tile from
    a captured tensor (an (L, S) bias, a relative table): it holds that tile in registers and
    the pipeliner buffers it, so narrower key tiles and 2 stages. From sm_90a compiles
    (``tools/sm90_check --flex``: shared memory, spills, with the run-time specialization of
    lengths and head dims that are multiples of 16); unmeasured for speed on a device."""
    if interpret:
        return (16, 16, 4, 1), (16, 16, 4, 1), (16, 16, 4, 1)
    wide = max(block_d, block_dv)
    if heavy:
        fwd = {16: (128, 64, 8, 2), 32: (128, 64, 8, 2), 64: (128, 64, 8, 2), 128: (128, 64, 8, 2)}.get(
            wide, (64, 32, 8, 1))
    else:
        # 256 columns (d192, d256) at one stage: two needed 256 KB of shared memory (H100)
        fwd = {16: (128, 64, 4, 3), 32: (128, 64, 4, 3), 64: (128, 64, 4, 3), 128: (128, 128, 8, 3),
               256: (128, 64, 8, 1)}.get(wide, (64, 32, 8, 2))
    if heavy:  # the dQ kernel buffers the mod's tile too: 3 stages needed 240 KB at d64 (H100)
        dq = {16: (64, 64, 4, 2), 32: (64, 64, 4, 2), 64: (64, 64, 4, 2), 128: (64, 64, 4, 2)}.get(
            wide, (64, 64, 8, 1))
    else:
        dq = {16: (64, 64, 4, 3), 32: (64, 64, 4, 3), 64: (64, 64, 4, 3), 128: (64, 64, 4, 2),
              256: (64, 64, 8, 1)}.get(wide, (32, 16, 8, 1))
    # dK/dV: BLOCK_M queries per step of a BLOCK_N-key program; 32 queries keep the
    # accumulators' spills small (d128: 340 B against 1.3 KB at 64; d64: none against 1 KB).
    dkdv = {16: (32, 64, 4, 2), 32: (32, 64, 4, 2), 64: (32, 64, 4, 2), 128: (32, 64, 4, 2),
            256: (32, 64, 8, 1)}.get(wide, (16, 32, 8, 1))
    return fwd, dq, dkdv


class FlexLaunch:
    """What the three kernels share for one call: the translated mods, the block lists, tiles."""

    def __init__(self, q, k, v, score, mask, sparsity, scale: float, options: dict, interpret: bool):
        import torch

        self.score, self.mask, self.sparsity, self.scale = score, mask, sparsity, float(scale)
        self.deterministic = False  # the captured tensors' gradients under torch's deterministic algorithms
        self.block_d = max(16, triton.next_power_of_2(q.shape[-1]))
        self.block_dv = max(16, triton.next_power_of_2(v.shape[-1]))
        heavy = sum(m.tile_gathers for m in (score, mask) if m is not None) > 0
        fwd, dq, dkdv = tiles(self.block_d, self.block_dv, heavy, interpret)
        self.block_m = int(options.get("BLOCK_M", fwd[0]))
        self.block_n = int(options.get("BLOCK_N", fwd[1]))
        self.num_warps = int(options.get("num_warps", fwd[2]))
        self.num_stages = int(options.get("num_stages", fwd[3]))
        self.dq_tiles, self.dkdv_tiles = list(dq), list(dkdv)
        if sparsity is not None:
            # Kernel tiles divide the mask's blocks.
            self.block_m = min(self.block_m, sparsity.q_block)
            self.block_n = min(self.block_n, sparsity.kv_block)
            for pass_tiles in (self.dq_tiles, self.dkdv_tiles):
                pass_tiles[0] = min(pass_tiles[0], sparsity.q_block)
                pass_tiles[1] = min(pass_tiles[1], sparsity.kv_block)
            if sparsity.q_block % self.block_m or sparsity.kv_block % self.block_n:
                raise ValueError(f"kernel_options BLOCK_M/BLOCK_N ({self.block_m}, {self.block_n}) must divide the "
                                 f"block mask's BLOCK_SIZE ({sparsity.q_block}, {sparsity.kv_block})")
        self.even_d = self.block_d == q.shape[-1]
        self.even_dv = self.block_dv == v.shape[-1]
        extents = {"b": q.shape[0], "h": q.shape[1], "q_idx": q.shape[2], "kv_idx": k.shape[2]}
        for mod in (score, mask):
            if mod is not None:
                mod.check_bounds(extents)
        self.ieee = q.dtype == torch.float32
        self.dummy = _dummy(q.device)
        self.score_args = score.args(q.device) if score is not None else (self.dummy,)
        self.mask_args = mask.args(q.device) if mask is not None else (self.dummy,)

    def lists(self, transposed: bool):
        """(num, idx, full_num, full_idx, num_sb, num_sh, n_idx) of the block lists."""
        sp = self.sparsity
        if sp is None:
            return (self.dummy,) * 4 + (0, 0, 0)
        if transposed:
            num, idx, fnum, fidx = sp.q_num, sp.q_idx, sp.full_q_num, sp.full_q_idx
        else:
            num, idx, fnum, fidx = sp.kv_num, sp.kv_idx, sp.full_kv_num, sp.full_kv_idx
        bm, hm, n = num.shape
        num_sb = 0 if bm == 1 else hm * n
        num_sh = 0 if hm == 1 else n
        if fnum is None:
            fnum, fidx = self.dummy, self.dummy
        return num, idx, fnum, fidx, num_sb, num_sh, idx.shape[-1]

    def constexprs(self, block_m: int, block_n: int, tiles=None) -> dict:
        """The kernels' constexprs and launch options; ``tiles``: a backward kernel's
        (BLOCK_M, BLOCK_N, warps, stages) (None: the forward's)."""
        warps, stages = (self.num_warps, self.num_stages) if tiles is None else tiles[2:]
        sp = self.sparsity
        return dict(SCORE_MOD=None if self.score is None else self.score.fn,
                    MASK_MOD=None if self.mask is None else self.mask.fn,
                    SPARSE=sp is not None, HAS_FULL=sp is not None and sp.full_kv_num is not None,
                    Q_BLOCK=sp.q_block if sp is not None else block_m,
                    KV_BLOCK=sp.kv_block if sp is not None else block_n,
                    BLOCK_M=block_m, BLOCK_N=block_n, BLOCK_D=self.block_d, BLOCK_DV=self.block_dv,
                    EVEN_D=self.even_d, EVEN_DV=self.even_dv, IEEE_DOT=self.ieee,
                    num_warps=warps, num_stages=stages)


def forward(q, k, v, launch: FlexLaunch):
    """out (B, Hq, L, Ev) in q's dtype and lse (B, Hq, L) float32 (natural log)."""
    import torch

    batch, nheads, seqlen_q, head_dim = q.shape
    seqlen_k, head_dim_v = k.shape[2], v.shape[-1]
    out = alloc((batch, nheads, seqlen_q, head_dim_v), q)
    lse = alloc((batch, nheads, seqlen_q), q, torch.float32)
    if out.numel() == 0:
        lse.fill_(float("-inf"))
        return out.zero_(), lse
    num, idx, fnum, fidx, num_sb, num_sh, n_idx = launch.lists(False)
    grid = (triton.cdiv(seqlen_q, launch.block_m), batch * nheads)
    flex_fwd_kernel[grid](
        q, k, v, out, lse, num, idx, fnum, fidx, launch.score_args, launch.mask_args,
        q.stride(0), q.stride(1), q.stride(2), k.stride(0), k.stride(1), k.stride(2),
        v.stride(0), v.stride(1), v.stride(2), out.stride(0), out.stride(1), out.stride(2),
        lse.stride(0), lse.stride(1),
        num_sb, num_sh, n_idx, nheads, nheads // k.shape[1], seqlen_q, seqlen_k, head_dim, head_dim_v, launch.scale,
        **launch.constexprs(launch.block_m, launch.block_n))
    return out, lse


def backward(dout, q, k, v, out, lse, dlse, launch: FlexLaunch):
    """(dq, dk, dv, delta) of the forward's (out, lse) given dout and dlse (None: 0);
    delta (B, Hq, L) float32 = rowsum(dO * O) - dlse (None for an empty call)."""
    import torch

    batch, nheads, seqlen_q, head_dim = q.shape
    nheads_k, seqlen_k, head_dim_v = k.shape[1], k.shape[2], v.shape[-1]
    dq, dk, dv = alloc(q.shape, q), alloc(k.shape, k), alloc(v.shape, v)
    if q.numel() == 0 or k.numel() == 0:
        return dq.zero_(), dk.zero_(), dv.zero_(), None
    dout = dout if dout.stride(-1) == 1 else dout.contiguous()
    delta = alloc((batch, nheads, seqlen_q), q, torch.float32)  # written by the dQ kernel
    if dlse is not None:
        dlse = dlse.float().contiguous() if dlse.stride() != lse.stride() or dlse.dtype != torch.float32 else dlse
    num, idx, fnum, fidx, num_sb, num_sh, n_idx = launch.lists(False)
    bm, bn = launch.dq_tiles[:2]
    grid = (triton.cdiv(seqlen_q, bm), batch * nheads)
    flex_dq_kernel[grid](
        q, k, v, out, dout, dq, lse, lse if dlse is None else dlse, delta, num, idx, fnum, fidx, launch.score_args,
        launch.mask_args,
        q.stride(0), q.stride(1), q.stride(2), k.stride(0), k.stride(1), k.stride(2),
        v.stride(0), v.stride(1), v.stride(2), out.stride(0), out.stride(1), out.stride(2),
        dout.stride(0), dout.stride(1), dout.stride(2),
        dq.stride(0), dq.stride(1), dq.stride(2), lse.stride(0), lse.stride(1),
        num_sb, num_sh, n_idx, nheads, nheads // nheads_k, seqlen_q, seqlen_k, head_dim, head_dim_v, launch.scale,
        HAS_DLSE=dlse is not None, **launch.constexprs(bm, bn, launch.dq_tiles))
    num, idx, fnum, fidx, num_sb, num_sh, n_idx = launch.lists(True)
    # The dK/dV kernel's tiles: BLOCK_N keys by BLOCK_M queries, the same tile sizes.
    bm, bn = launch.dkdv_tiles[:2]
    grid = (triton.cdiv(seqlen_k, bn), batch * nheads_k)
    flex_dkdv_kernel[grid](
        q, k, v, dout, dk, dv, lse, delta, num, idx, fnum, fidx, launch.score_args, launch.mask_args,
        q.stride(0), q.stride(1), q.stride(2), k.stride(0), k.stride(1), k.stride(2),
        v.stride(0), v.stride(1), v.stride(2), dout.stride(0), dout.stride(1), dout.stride(2),
        dk.stride(0), dk.stride(1), dk.stride(2), dv.stride(0), dv.stride(1), dv.stride(2),
        lse.stride(0), lse.stride(1),
        num_sb, num_sh, n_idx, nheads, nheads // nheads_k, seqlen_q, seqlen_k, head_dim, head_dim_v, launch.scale,
        **launch.constexprs(bm, bn, launch.dkdv_tiles))
    return dq, dk, dv, delta

"""Triton FlashAttention forward: one program per (batch, head, block of BLOCK_M queries).

The canonical problem is ``problem.spec``'s; the scores of each tile go through the one
score pipeline (``scores.py``: scale or softcap, ALiBi, masks, window), in base 2 (the
scale and log2(e) folded into one multiply, exp2 for exp: one MUFU op instead of a
multiply and an op). The key range of a query block is split into three phases so that
only tiles that straddle a window/causal edge or the end of the sequence pay for element
masks (``scores.key_tiles``)::

    [lo, full_lo)  boundary tiles, masked   (left window edge)
    [full_lo, full_hi)  interior tiles, no mask
    [full_hi, hi)  boundary tiles, masked   (causal diagonal / right window edge / Sk)

Tiles outside [lo, hi) are never loaded. Rows that see no key get out 0 and lse -inf.
"""

from __future__ import annotations

import triton
import triton.language as tl

from flashtile.backends.configs import FwdConfig
from flashtile.backends.triton.scores import (C_LN2, C_LOG2E, HIDDEN2, LOG2E, add_sink, dropout_keep, key_tiles,
                                              mask_arguments, scores)
from flashtile.backends.worklist import program_item
from flashtile.problem.window import launch_window
from flashtile.runtime.launch import Launcher


@triton.jit
def _fwd_tiles(
    acc, l_i, m_i, q,
    k_base, v_base, mask_base, desc_k, desc_v, b, kvh,
    n_start, n_end,
    offs_m, offs_n0, offs_d, offs_dv,
    stride_kn, stride_vn, stride_mn,
    seqlen_q, seqlen_k, head_dim, head_dim_v,
    qk_scale, softcap_in, softcap_out, alibi_slope,
    diag_offset, window_left, window_right, chunk, seed, bh, dropout_p,
    BLOCK_N: tl.constexpr, BLOCK_D: tl.constexpr, EVEN_D: tl.constexpr, BLOCK_DV: tl.constexpr,
    EVEN_DV: tl.constexpr, SAME_DV: tl.constexpr, BOUNDARY: tl.constexpr,
    WINDOW_LEFT: tl.constexpr, WINDOW_RIGHT: tl.constexpr,
    SOFTCAP: tl.constexpr, HAS_ALIBI: tl.constexpr, MASK_MODE: tl.constexpr,
    IEEE_DOT: tl.constexpr, USE_TMA: tl.constexpr, DROPOUT: tl.constexpr, CHUNK: tl.constexpr,
):
    """Consume key tiles [n_start, n_end) into the running (acc, l_i, m_i)."""
    if EVEN_D:
        d_ok = offs_d < BLOCK_D  # all true, and known to be: keeps loads 16 bytes wide
    else:
        d_ok = offs_d < head_dim
    if SAME_DV:  # v's head dim is q's: the same masks (and the same machine code as before v had its own)
        dv_ok = d_ok
    elif EVEN_DV:
        dv_ok = offs_dv < BLOCK_DV
    else:
        dv_ok = offs_dv < head_dim_v
    for n0 in range(n_start, n_end, BLOCK_N):
        offs_n = n0 + offs_n0
        kv_row = tl.cast(n0, tl.int64)
        k_ptrs = k_base + kv_row * stride_kn + offs_n0[None, :] * stride_kn + offs_d[:, None]
        if USE_TMA:
            # The copy engine zero-fills rows past seqlen_k and columns past head_dim.
            kt = tl.trans(desc_k.load([b, kvh, n0, 0]).reshape(BLOCK_N, BLOCK_D))
        elif BOUNDARY:
            kt = tl.load(k_ptrs, mask=(offs_n[None, :] < seqlen_k) & d_ok[:, None], other=0.0)
        elif EVEN_D:
            kt = tl.load(k_ptrs)
        else:
            kt = tl.load(k_ptrs, mask=d_ok[:, None], other=0.0)
        if IEEE_DOT:
            s = tl.dot(q, kt, input_precision="ieee")
        else:
            s = tl.dot(q, kt)
        s, _ = scores(s, offs_m[:, None], offs_n[None, :], None, mask_base, offs_n0, stride_mn,
                      seqlen_q, seqlen_k, qk_scale, qk_scale, softcap_in, softcap_out, alibi_slope,
                      diag_offset, window_left, window_right, chunk,
                      BOUNDARY, WINDOW_LEFT, WINDOW_RIGHT, SOFTCAP, HAS_ALIBI, MASK_MODE, CHUNK)
        m_new = tl.maximum(m_i, tl.max(s, 1))
        if BOUNDARY or MASK_MODE != 0:
            # A row with nothing visible so far keeps m = -inf; exponentiate against 0
            # instead so that (-inf) - (-inf) never makes a NaN.
            m_use = tl.where(m_new == float("-inf"), 0.0, m_new)
        else:
            m_use = m_new
        p = tl.exp2(s - m_use[:, None])
        alpha = tl.exp2(m_i - m_use)
        l_i = l_i * alpha + tl.sum(p, 1)
        if DROPOUT:
            # l_i keeps the undropped sum (the LSE is of the full softmax); only P @ V drops.
            p = tl.where(dropout_keep(seed, bh, offs_m[:, None], offs_n[None, :], dropout_p), p, 0.0)
        acc = acc * alpha[:, None]
        v_ptrs = v_base + kv_row * stride_vn + offs_n0[:, None] * stride_vn + offs_dv[None, :]
        if USE_TMA:
            v = desc_v.load([b, kvh, n0, 0]).reshape(BLOCK_N, BLOCK_DV)
        elif BOUNDARY:
            v = tl.load(v_ptrs, mask=(offs_n[:, None] < seqlen_k) & dv_ok[None, :], other=0.0)
        elif EVEN_DV:
            v = tl.load(v_ptrs)
        else:
            v = tl.load(v_ptrs, mask=dv_ok[None, :], other=0.0)
        if IEEE_DOT:
            acc = tl.dot(p.to(v.dtype), v, acc, input_precision="ieee")
        else:
            acc = tl.dot(p.to(v.dtype), v, acc)
        m_i = m_new
        mask_base += BLOCK_N * stride_mn
    return acc, l_i, m_i


# Sizes stay specialised on divisibility by 16: marking them do_not_specialize cost up
# to 20% at d64 (H200, 2026-11-29: masks lose their constancy, loads their vector width).
@triton.jit
def fwd_kernel(
    Q, K, V, Out, Lse, Mask, Alibi, Seed, Sink, Items, desc_q, desc_k, desc_v, desc_o,
    stride_qb, stride_qh, stride_qm,
    stride_kb, stride_kh, stride_kn,
    stride_vb, stride_vh, stride_vn,
    stride_ob, stride_oh, stride_om,
    stride_mb, stride_mh, stride_mm, stride_mn,
    stride_ab, stride_ah, stride_lb, stride_lh,
    nheads, group_size, seqlen_q, seqlen_k, head_dim, head_dim_v, num_m_blocks, item_cap,
    qk_scale, softcap_in, softcap_out,
    diag_offset, window_left, window_right, dropout_p, chunk,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_D: tl.constexpr,
    EVEN_D: tl.constexpr, BLOCK_DV: tl.constexpr, EVEN_DV: tl.constexpr, SAME_DV: tl.constexpr,
    WINDOW_LEFT: tl.constexpr, WINDOW_RIGHT: tl.constexpr,
    SOFTCAP: tl.constexpr, HAS_ALIBI: tl.constexpr, MASK_MODE: tl.constexpr,
    IEEE_DOT: tl.constexpr, REVERSE_M: tl.constexpr, USE_TMA: tl.constexpr, DROPOUT: tl.constexpr,
    VARLEN: tl.constexpr, HAS_SINK: tl.constexpr, CHUNK: tl.constexpr,
):
    # A flat 1-D grid: no 65,535 limit on batch x heads (``program_item``).
    pid = tl.program_id(0)
    count = 0
    if VARLEN:
        count = tl.load(Items)
        if pid >= count * nheads:
            return
    b, h, m_block, bh, b_ptr, q_row, k_row, seqlen_q, seqlen_k, diag_offset = program_item(
        pid, Items, item_cap, count, nheads, num_m_blocks, seqlen_q, seqlen_k, diag_offset, REVERSE_M, VARLEN)
    kvh = h // group_size
    b64 = b.to(tl.int64)
    h64 = h.to(tl.int64)
    kvh64 = kvh.to(tl.int64)
    m0 = m_block * BLOCK_M

    offs_m0 = tl.arange(0, BLOCK_M)
    offs_m = m0 + offs_m0
    offs_n0 = tl.arange(0, BLOCK_N)
    offs_d = tl.arange(0, BLOCK_D)
    m_ok = offs_m < seqlen_q
    if EVEN_D:
        d_ok = offs_d < BLOCK_D
    else:
        d_ok = offs_d < head_dim
    if SAME_DV:
        offs_dv = offs_d
        dv_ok = d_ok
    else:
        offs_dv = tl.arange(0, BLOCK_DV)
        if EVEN_DV:
            dv_ok = offs_dv < BLOCK_DV
        else:
            dv_ok = offs_dv < head_dim_v

    q_ptrs = (Q + b_ptr * stride_qb + h64 * stride_qh + (q_row + m0) * stride_qm
              + offs_m0[:, None] * stride_qm + offs_d[None, :])
    if USE_TMA:
        q = desc_q.load([b, h, m0, 0]).reshape(BLOCK_M, BLOCK_D)
    else:
        q = tl.load(q_ptrs, mask=m_ok[:, None] & d_ok[None, :], other=0.0)
    k_base = K + b_ptr * stride_kb + kvh64 * stride_kh + k_row * stride_kn
    v_base = V + b_ptr * stride_vb + kvh64 * stride_vh + k_row * stride_vn
    mask_base = Mask
    if MASK_MODE != 0:
        mask_base = (Mask + b64 * stride_mb + h64 * stride_mh + m0.to(tl.int64) * stride_mm
                     + offs_m0[:, None] * stride_mm)

    alibi_slope = 0.0
    if HAS_ALIBI:
        alibi_slope = tl.load(Alibi + b64 * stride_ab + h64 * stride_ah) * C_LOG2E
    seed = 0
    if DROPOUT:
        seed = tl.load(Seed)

    lo_tile, inner_lo, inner_hi, hi = key_tiles(
        m0, seqlen_q, seqlen_k, diag_offset, window_left, window_right, chunk,
        BLOCK_M, BLOCK_N, WINDOW_LEFT, WINDOW_RIGHT, CHUNK)

    acc = tl.zeros([BLOCK_M, BLOCK_DV], dtype=tl.float32)
    l_i = tl.zeros([BLOCK_M], dtype=tl.float32)
    m_i = tl.full([BLOCK_M], float("-inf"), dtype=tl.float32)

    if WINDOW_LEFT or CHUNK:
        acc, l_i, m_i = _fwd_tiles(
            acc, l_i, m_i, q, k_base, v_base, mask_base + tl.cast(lo_tile, tl.int64) * stride_mn, desc_k, desc_v,
            b, kvh, lo_tile, inner_lo,
            offs_m, offs_n0, offs_d, offs_dv, stride_kn, stride_vn, stride_mn, seqlen_q, seqlen_k, head_dim,
            head_dim_v,
            qk_scale, softcap_in, softcap_out, alibi_slope, diag_offset, window_left, window_right, chunk, seed, bh,
            dropout_p, BLOCK_N, BLOCK_D, EVEN_D, BLOCK_DV, EVEN_DV, SAME_DV, True, WINDOW_LEFT, WINDOW_RIGHT, SOFTCAP, HAS_ALIBI, MASK_MODE,
            IEEE_DOT, USE_TMA, DROPOUT, CHUNK)
    acc, l_i, m_i = _fwd_tiles(
        acc, l_i, m_i, q, k_base, v_base, mask_base + tl.cast(inner_lo, tl.int64) * stride_mn, desc_k, desc_v,
        b, kvh, inner_lo, inner_hi,
        offs_m, offs_n0, offs_d, offs_dv, stride_kn, stride_vn, stride_mn, seqlen_q, seqlen_k, head_dim,
        head_dim_v,
        qk_scale, softcap_in, softcap_out, alibi_slope, diag_offset, window_left, window_right, chunk, seed, bh,
        dropout_p, BLOCK_N, BLOCK_D, EVEN_D, BLOCK_DV, EVEN_DV, SAME_DV, False, WINDOW_LEFT, WINDOW_RIGHT, SOFTCAP, HAS_ALIBI, MASK_MODE,
        IEEE_DOT, USE_TMA, DROPOUT, CHUNK)
    acc, l_i, m_i = _fwd_tiles(
        acc, l_i, m_i, q, k_base, v_base, mask_base + tl.cast(inner_hi, tl.int64) * stride_mn, desc_k, desc_v,
        b, kvh, inner_hi, hi,
        offs_m, offs_n0, offs_d, offs_dv, stride_kn, stride_vn, stride_mn, seqlen_q, seqlen_k, head_dim,
        head_dim_v,
        qk_scale, softcap_in, softcap_out, alibi_slope, diag_offset, window_left, window_right, chunk, seed, bh,
        dropout_p, BLOCK_N, BLOCK_D, EVEN_D, BLOCK_DV, EVEN_DV, SAME_DV, True, WINDOW_LEFT, WINDOW_RIGHT, SOFTCAP, HAS_ALIBI, MASK_MODE,
        IEEE_DOT, USE_TMA, DROPOUT, CHUNK)

    if HAS_SINK:
        acc, l_i, m_i = add_sink(acc, l_i, m_i, tl.load(Sink + h) * C_LOG2E)
    # l_i == 0 exactly when the row saw no key (and no sink); NaN (from NaN/inf in the data)
    # must propagate to out and lse rather than pass for an empty row.
    seen = l_i != 0.0
    if DROPOUT:
        out = acc / (tl.where(seen, l_i, 1.0) * (1.0 - dropout_p))[:, None]
    else:
        out = acc / tl.where(seen, l_i, 1.0)[:, None]
    lse = tl.where(seen, (m_i + tl.log2(tl.where(seen, l_i, 1.0))) * C_LN2, float("-inf"))
    if MASK_MODE == 2:
        # A row that only hidden keys reach (see HIDDEN2): the count its LSE cannot hold.
        hidden_row = seen & (m_i == HIDDEN2)
        lse = tl.where(hidden_row, HIDDEN2 * (1.0 + tl.log2(tl.where(seen, l_i, 1.0)) / 32.0) * C_LN2,
                       lse)
    o_ptrs = (Out + b_ptr * stride_ob + h64 * stride_oh + (q_row + m0) * stride_om
              + offs_m0[:, None] * stride_om + offs_dv[None, :])
    if USE_TMA:
        desc_o.store([b, h, m0, 0], out.to(Out.dtype.element_ty).reshape(1, 1, BLOCK_M, BLOCK_DV))
    else:
        tl.store(o_ptrs, out.to(Out.dtype.element_ty), mask=m_ok[:, None] & dv_ok[None, :])
    lse_ptrs = Lse + b_ptr * stride_lb + h64 * stride_lh + q_row + offs_m
    tl.store(lse_ptrs, lse, mask=m_ok)


_launch_fwd = Launcher(fwd_kernel)


def attention_forward(q, k, v, out, lse, problem, *, config: FwdConfig, alibi=None, mask=None, seed=None,
                      varlen=None, sink=None) -> None:
    """Launch the forward kernel on a validated call (``backends.run`` chose it).

    Args:
        q: (B, H, Sq, D); k: (B, Hk, Sk, D); v: (B, Hk, Sk, Dv); unit stride along D.
        out: (B, H, Sq, Dv) view to write, unit stride along Dv.
        lse: (B, H, Sq) float32, contiguous.
        problem: the ``problem.spec.Problem`` (scale, diagonal, window, softcap, dropout,
            chunk).
        config: tiles, warps, stages; ``use_tma`` loads and stores through the bulk tensor
            copy engine (the registry sets it only for TMA-ready tensors on sm90+).
        alibi: None or float32 (B, H) slopes (any strides).
        mask: None or (B, H, Sq, Sk) bool/float view (broadcast strides allowed).
        seed: a 1-element int64 tensor on q's device holding the dropout's Philox key (read
            only when problem.dropout_p > 0).
        varlen: None, or a ``problem.spec.Varlen`` for packed sequences: q, out (1, H,
            total_q, D), k, v (1, Hk, total_k, D), lse (1, H, total_q); each sequence has its
            own bottom-right diagonal (``problem.diag_offset`` is ignored). No mask.
        sink: None or (H,) float32, contiguous: one logit per query head in the softmax's
            denominator (``scores.add_sink``).
    """
    import torch

    batch, nheads, seqlen_q, head_dim = q.shape
    nheads_k, seqlen_k = k.shape[1], k.shape[2]
    head_dim_v = v.shape[-1]
    block_d = max(16, triton.next_power_of_2(head_dim))
    block_dv = max(16, triton.next_power_of_2(head_dim_v))
    diag_offset = problem.diag_offset
    window_left, window_right = launch_window(problem.window_left, problem.window_right, seqlen_q, seqlen_k,
                                              diag_offset, varlen)
    if varlen is None:
        num_m_blocks = triton.cdiv(seqlen_q, config.block_m)
        grid = (num_m_blocks * batch * nheads,)
        items, item_cap = q, 0
    else:
        from flashtile.backends.worklist import build_work_items

        [(items, item_cap)] = build_work_items(varlen, seqlen_q, seqlen_k, [(config.block_m, False)],
                                                window_left, window_right)
        num_m_blocks = 0
        grid = (item_cap * nheads,)
        seqlen_q = seqlen_k = diag_offset = 0  # per sequence, from the work list
    mask_mode, mask_arg, mstrides = mask_arguments(mask, q)
    alibi_arg, astrides = (q, (0, 0)) if alibi is None else (alibi, alibi.stride())
    scale, softcap, dropout_p = problem.scale, problem.softcap, problem.dropout_p
    softcap_on = softcap > 0.0
    if config.use_tma:
        from triton.tools.tensor_descriptor import TensorDescriptor

        def desc(t, rows, cols):
            return TensorDescriptor(t, list(t.shape), list(t.stride()), [1, 1, rows, cols])

        descs = (desc(q, config.block_m, block_d), desc(k, config.block_n, block_d), desc(v, config.block_n, block_dv),
                 desc(out, config.block_m, block_dv))
    else:
        descs = (q, k, v, out)
    _launch_fwd(
        grid,
        (q, k, v, out, lse, mask_arg, alibi_arg, seed if dropout_p > 0.0 else q, q if sink is None else sink, items,
         *descs,
         q.stride(0), q.stride(1), q.stride(2),
         k.stride(0), k.stride(1), k.stride(2),
         v.stride(0), v.stride(1), v.stride(2),
         out.stride(0), out.stride(1), out.stride(2),
         *mstrides, *astrides, lse.stride(0), lse.stride(1),
         nheads, nheads // nheads_k, seqlen_q, seqlen_k, head_dim, head_dim_v, num_m_blocks, item_cap,
         scale * LOG2E,
         scale / softcap if softcap_on else 0.0,
         softcap * LOG2E if softcap_on else 0.0,
         diag_offset, window_left, window_right, float(dropout_p), problem.chunk),
        dict(BLOCK_M=config.block_m, BLOCK_N=config.block_n, BLOCK_D=block_d,
             EVEN_D=block_d == head_dim, BLOCK_DV=block_dv, EVEN_DV=block_dv == head_dim_v,
             SAME_DV=head_dim_v == head_dim,
             WINDOW_LEFT=window_left >= 0, WINDOW_RIGHT=window_right >= 0,
             SOFTCAP=softcap_on, HAS_ALIBI=alibi is not None, MASK_MODE=mask_mode,
             IEEE_DOT=q.dtype == torch.float32,
             REVERSE_M=window_right >= 0, USE_TMA=config.use_tma, DROPOUT=dropout_p > 0.0,
             VARLEN=varlen is not None, HAS_SINK=sink is not None, CHUNK=problem.chunk > 0),
        config.num_warps, config.num_stages,
    )

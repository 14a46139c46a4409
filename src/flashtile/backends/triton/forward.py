"""Triton FlashAttention forward: one program per (batch, head, block of BLOCK_M queries).

The canonical problem (the APIs in ``flashtile.api`` reduce to it):
    q (B, H, Sq, D), k and v (B, Hk, Sk, D), any strides with unit stride along D;
    query head h reads key/value head h // (H // Hk).
    Key j is visible to query i iff
        (window_left  < 0 or j >= i + diag_offset - window_left) and
        (window_right < 0 or j <= i + diag_offset + window_right) and
        (no bool attn_mask, or attn_mask[b, h, i, j]).
    s_ij = scale * q_i.k_j -> softcap * tanh(s / softcap) -> - slope[b, h] * |i + diag_offset - j|
           -> + float attn_mask[b, h, i, j];  out_i = softmax_j(s_ij) v;  lse_i = logsumexp_j s_ij.
    Rows that see no key get out 0 and lse -inf.

Inside the kernel scores live in base 2: the scale and log2(e) are folded into one
multiply, and exp2 replaces exp (one MUFU op instead of a multiply and an op). The key
range of a query block is split into three phases so that only tiles that straddle a
window/causal edge or the end of the sequence pay for element masks:

    [lo, full_lo)  boundary tiles, masked   (left window edge)
    [full_lo, full_hi)  interior tiles, no mask
    [full_hi, hi)  boundary tiles, masked   (causal diagonal / right window edge / Sk)

Tiles outside [lo, hi) are never loaded.
"""

from __future__ import annotations

import contextlib
import os

import triton
import triton.language as tl

from flashtile.backends.configs import FwdConfig, cuda_capability, device_index
from flashtile.runtime.launch import Launcher
from flashtile.backends.worklist import varlen_item
from flashtile.problem.window import launch_window

LOG2E = 1.4426950408889634
LN2 = 0.6931471805599453

# MASK_MODE values for an explicit attn_mask.
MASK_NONE, MASK_BOOL, MASK_FLOAT = 0, 1, 2

# Float masks hide keys with huge negative biases (transformers uses torch.finfo(dtype).min).
# A bias below -2^126 in base 2 (about -5.9e37: the float32 and bfloat16 minimum and anything
# near them) overflows once scaled by log2(e), and in torch's own arithmetic it swallows the
# q.k term: every key of a row that only such keys reach gets the same score, so torch's SDPA
# spreads the row evenly over them (out = their mean of v). The kernels give such keys the
# score HIDDEN2 = -2^127 exactly (an explicit -inf stays -inf): a row with any other key
# gives them weight 0, a row with none spreads evenly. Its LSE (HIDDEN2 + log2(n), with
# log2(n) lost to rounding at that size) is stored as HIDDEN2 * (1 + log2(n) / 32) (nat
# units: that times ln 2): a value below -2^126 that no other row reaches, from which the
# backward takes log2(n) back (`backends.triton.backward._row_lse2`) to form P = 1/n.
HUGE_BIAS2 = tl.constexpr(-8.507059173023462e37)  # -2^126
HIDDEN2 = tl.constexpr(-1.7014118346046923e38)  # -2^127


@triton.jit
def _add_float_mask(s, bias):
    """Scores in base 2 plus a float mask's ``bias`` (natural units), huge biases to HIDDEN2."""
    bias = bias.to(tl.float32)
    bias2 = bias * 1.4426950408889634
    hidden = tl.where(bias == float("-inf"), float("-inf"), HIDDEN2)
    return tl.where(bias2 < HUGE_BIAS2, hidden, s + bias2)


@triton.jit
def _tanh(x):
    # 1 - 2 / (exp(2x) + 1) saturates cleanly to +-1 and needs no libdevice (so it runs in
    # the interpreter), but near 0 its absolute error (~6e-8) is large relative to tanh(x)
    # itself, and softcap multiplies it back up: below |x| = 0.25 use the odd Taylor series
    # to x^9 instead (truncation error < 1e-8 relative).
    big = 1.0 - 2.0 / (tl.exp2(x * (2.0 * 1.4426950408889634)) + 1.0)
    x2 = x * x
    small = x * (1.0 + x2 * (-0.3333333333333333 + x2 * (0.13333333333333333
                 + x2 * (-0.05396825396825397 + x2 * 0.021869488536155203))))
    return tl.where(tl.abs(x) < 0.25, small, big)


@triton.jit
def _dropout_keep(seed, bh, i2, j2, dropout_p):
    """Philox keep-mask of a tile: element (bh, i, j) is kept iff its uniform >= dropout_p.

    The counter is (j, i, bh, 0) and the key the seed, so forward and backward kernels
    draw the same bit for the same element whatever their tiling or orientation.
    """
    zero = (i2 * 0 + j2 * 0).to(tl.uint32)
    c0 = (j2 + i2 * 0).to(tl.uint32)
    c1 = (i2 + j2 * 0).to(tl.uint32)
    c2 = zero + bh.to(tl.uint32)
    r, _, _, _ = tl.philox(seed, c0, c1, c2, zero)
    return tl.uint_to_uniform_float(r) >= dropout_p


@triton.jit
def _key_tiles(m0, seqlen_q, seqlen_k, diag_offset, window_left, window_right,
               BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
               WINDOW_LEFT: tl.constexpr, WINDOW_RIGHT: tl.constexpr):
    """Key tiles of the query block starting at m0: (lo_tile, inner_lo, inner_hi, hi).

    [lo_tile, inner_lo) and [inner_hi, hi) need element masks; the interior
    [inner_lo, inner_hi) holds whole BLOCK_N tiles that every row of the block sees
    entirely (and that end before seqlen_k). All bounds but hi are multiples of BLOCK_N;
    values that could go negative are clamped before any division.
    """
    m_last = tl.minimum(m0 + BLOCK_M, seqlen_q) - 1
    lo = 0
    hi = seqlen_k
    full_lo = 0
    full_hi = seqlen_k
    if WINDOW_LEFT:
        lo = tl.maximum(m0 + diag_offset - window_left, 0)
        full_lo = tl.maximum(m_last + diag_offset - window_left, 0)
    if WINDOW_RIGHT:
        hi = tl.minimum(m_last + diag_offset + window_right + 1, seqlen_k)
        full_hi = tl.minimum(m0 + diag_offset + window_right + 1, seqlen_k)
    hi = tl.maximum(hi, 0)
    full_hi = tl.maximum(full_hi, 0)
    lo_tile = (lo // BLOCK_N) * BLOCK_N
    inner_lo = tl.maximum(tl.cdiv(full_lo, BLOCK_N) * BLOCK_N, lo_tile)
    inner_hi = tl.minimum((full_hi // BLOCK_N) * BLOCK_N, hi)
    empty_inner = inner_hi <= inner_lo
    inner_lo = tl.where(empty_inner, lo_tile, inner_lo)
    inner_hi = tl.where(empty_inner, lo_tile, inner_hi)
    return lo_tile, inner_lo, inner_hi, hi


@triton.jit
def _fwd_tiles(
    acc, l_i, m_i, q,
    k_base, v_base, mask_base, desc_k, desc_v, b, kvh,
    n_start, n_end,
    offs_m, offs_n0, offs_d,
    stride_kn, stride_vn, stride_mn,
    seqlen_q, seqlen_k, head_dim,
    qk_scale, softcap_in, softcap_out, alibi_slope,
    diag_offset, window_left, window_right, seed, bh, dropout_p,
    BLOCK_N: tl.constexpr, BLOCK_D: tl.constexpr, EVEN_D: tl.constexpr, BOUNDARY: tl.constexpr,
    WINDOW_LEFT: tl.constexpr, WINDOW_RIGHT: tl.constexpr,
    SOFTCAP: tl.constexpr, HAS_ALIBI: tl.constexpr, MASK_MODE: tl.constexpr,
    IEEE_DOT: tl.constexpr, USE_TMA: tl.constexpr, DROPOUT: tl.constexpr,
):
    """Consume key tiles [n_start, n_end) into the running (acc, l_i, m_i)."""
    if EVEN_D:
        d_ok = offs_d < BLOCK_D  # all true, and known to be: keeps loads 16 bytes wide
    else:
        d_ok = offs_d < head_dim
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
        if SOFTCAP:
            s = softcap_out * _tanh(s * softcap_in)
        else:
            s = s * qk_scale
        if HAS_ALIBI:
            rel = offs_m[:, None] + diag_offset - offs_n[None, :]
            s = s - alibi_slope * tl.abs(rel).to(tl.float32)
        if MASK_MODE == 1:
            # Rows past seqlen_q are not stored, but their mask bytes must not be read either.
            keep = tl.load(mask_base + offs_n0[None, :] * stride_mn,
                           mask=(offs_n[None, :] < seqlen_k) & (offs_m[:, None] < seqlen_q), other=0)
            s = tl.where(keep != 0, s, float("-inf"))
        elif MASK_MODE == 2:
            bias = tl.load(mask_base + offs_n0[None, :] * stride_mn,
                           mask=(offs_n[None, :] < seqlen_k) & (offs_m[:, None] < seqlen_q), other=0.0)
            s = _add_float_mask(s, bias)
        if BOUNDARY:
            visible = offs_n[None, :] < seqlen_k
            if WINDOW_RIGHT:
                visible = visible & (offs_n[None, :] <= offs_m[:, None] + diag_offset + window_right)
            if WINDOW_LEFT:
                visible = visible & (offs_n[None, :] >= offs_m[:, None] + diag_offset - window_left)
            s = tl.where(visible, s, float("-inf"))
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
            p = tl.where(_dropout_keep(seed, bh, offs_m[:, None], offs_n[None, :], dropout_p), p, 0.0)
        acc = acc * alpha[:, None]
        v_ptrs = v_base + kv_row * stride_vn + offs_n0[:, None] * stride_vn + offs_d[None, :]
        if USE_TMA:
            v = desc_v.load([b, kvh, n0, 0]).reshape(BLOCK_N, BLOCK_D)
        elif BOUNDARY:
            v = tl.load(v_ptrs, mask=(offs_n[:, None] < seqlen_k) & d_ok[None, :], other=0.0)
        elif EVEN_D:
            v = tl.load(v_ptrs)
        else:
            v = tl.load(v_ptrs, mask=d_ok[None, :], other=0.0)
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
def _fwd_kernel(
    Q, K, V, Out, Lse, Mask, Alibi, Seed, Items, desc_q, desc_k, desc_v, desc_o,
    stride_qb, stride_qh, stride_qm,
    stride_kb, stride_kh, stride_kn,
    stride_vb, stride_vh, stride_vn,
    stride_ob, stride_oh, stride_om,
    stride_mb, stride_mh, stride_mm, stride_mn,
    stride_ab, stride_ah, stride_lb, stride_lh,
    nheads, group_size, seqlen_q, seqlen_k, head_dim, num_m_blocks, item_cap,
    qk_scale, softcap_in, softcap_out,
    diag_offset, window_left, window_right, dropout_p,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_D: tl.constexpr,
    EVEN_D: tl.constexpr, WINDOW_LEFT: tl.constexpr, WINDOW_RIGHT: tl.constexpr,
    SOFTCAP: tl.constexpr, HAS_ALIBI: tl.constexpr, MASK_MODE: tl.constexpr,
    IEEE_DOT: tl.constexpr, REVERSE_M: tl.constexpr, USE_TMA: tl.constexpr, DROPOUT: tl.constexpr,
    VARLEN: tl.constexpr,
):
    # A flat 1-D grid: no 65,535 limit on batch x heads. Programs of one (b, h) are
    # adjacent so that their K/V tiles are shared through L2.
    pid = tl.program_id(0)
    if VARLEN:
        # One program per (head, work item), heads outer: the items (sequence, query
        # block) of one head come longest first from backends/worklist.py, so the programs
        # running at once share a few heads' K/V through L2 (heads inner, every head's
        # longest blocks at once, measured 0.71x at causal d128 on the H200, run 56).
        # Pointers address batch row 0 of the packed tensors from the sequence's first
        # row; b is the sequence (ALiBi, dropout).
        count = tl.load(Items)
        if pid >= count * nheads:
            return
        h = pid // count
        item = pid % count
        b, m_block, start_q, seqlen_q, start_k, seqlen_k = varlen_item(Items, item, item_cap)
        diag_offset = seqlen_k - seqlen_q
        bh = b * nheads + h
        b_ptr = (b * 0).to(tl.int64)
        q_row = start_q.to(tl.int64)
        k_row = start_k.to(tl.int64)
    else:
        bh = pid // num_m_blocks
        m_block = pid % num_m_blocks
        if REVERSE_M:
            # Causal: the last query blocks see the most keys; start them first.
            m_block = num_m_blocks - 1 - m_block
        b = bh // nheads
        h = bh % nheads
        b_ptr = b.to(tl.int64)
        q_row = (b * 0).to(tl.int64)
        k_row = q_row
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
        alibi_slope = tl.load(Alibi + b64 * stride_ab + h64 * stride_ah) * 1.4426950408889634
    seed = 0
    if DROPOUT:
        seed = tl.load(Seed)

    lo_tile, inner_lo, inner_hi, hi = _key_tiles(
        m0, seqlen_q, seqlen_k, diag_offset, window_left, window_right,
        BLOCK_M, BLOCK_N, WINDOW_LEFT, WINDOW_RIGHT)

    acc = tl.zeros([BLOCK_M, BLOCK_D], dtype=tl.float32)
    l_i = tl.zeros([BLOCK_M], dtype=tl.float32)
    m_i = tl.full([BLOCK_M], float("-inf"), dtype=tl.float32)

    if WINDOW_LEFT:
        acc, l_i, m_i = _fwd_tiles(
            acc, l_i, m_i, q, k_base, v_base, mask_base + tl.cast(lo_tile, tl.int64) * stride_mn, desc_k, desc_v, b, kvh, lo_tile, inner_lo,
            offs_m, offs_n0, offs_d, stride_kn, stride_vn, stride_mn, seqlen_q, seqlen_k, head_dim,
            qk_scale, softcap_in, softcap_out, alibi_slope, diag_offset, window_left, window_right, seed, bh, dropout_p,
            BLOCK_N, BLOCK_D, EVEN_D, True, WINDOW_LEFT, WINDOW_RIGHT, SOFTCAP, HAS_ALIBI, MASK_MODE, IEEE_DOT, USE_TMA, DROPOUT)
    acc, l_i, m_i = _fwd_tiles(
        acc, l_i, m_i, q, k_base, v_base, mask_base + tl.cast(inner_lo, tl.int64) * stride_mn, desc_k, desc_v, b, kvh, inner_lo, inner_hi,
        offs_m, offs_n0, offs_d, stride_kn, stride_vn, stride_mn, seqlen_q, seqlen_k, head_dim,
        qk_scale, softcap_in, softcap_out, alibi_slope, diag_offset, window_left, window_right, seed, bh, dropout_p,
        BLOCK_N, BLOCK_D, EVEN_D, False, WINDOW_LEFT, WINDOW_RIGHT, SOFTCAP, HAS_ALIBI, MASK_MODE, IEEE_DOT, USE_TMA, DROPOUT)
    acc, l_i, m_i = _fwd_tiles(
        acc, l_i, m_i, q, k_base, v_base, mask_base + tl.cast(inner_hi, tl.int64) * stride_mn, desc_k, desc_v, b, kvh, inner_hi, hi,
        offs_m, offs_n0, offs_d, stride_kn, stride_vn, stride_mn, seqlen_q, seqlen_k, head_dim,
        qk_scale, softcap_in, softcap_out, alibi_slope, diag_offset, window_left, window_right, seed, bh, dropout_p,
        BLOCK_N, BLOCK_D, EVEN_D, True, WINDOW_LEFT, WINDOW_RIGHT, SOFTCAP, HAS_ALIBI, MASK_MODE, IEEE_DOT, USE_TMA, DROPOUT)

    # l_i == 0 exactly when the row saw no key; NaN (from NaN/inf in the data) must
    # propagate to out and lse rather than pass for an empty row.
    seen = l_i != 0.0
    if DROPOUT:
        out = acc / (tl.where(seen, l_i, 1.0) * (1.0 - dropout_p))[:, None]
    else:
        out = acc / tl.where(seen, l_i, 1.0)[:, None]
    lse = tl.where(seen, (m_i + tl.log2(tl.where(seen, l_i, 1.0))) * 0.6931471805599453, float("-inf"))
    if MASK_MODE == 2:
        # A row that only hidden keys reach (see HIDDEN2): the count its LSE cannot hold.
        hidden_row = seen & (m_i == HIDDEN2)
        lse = tl.where(hidden_row, HIDDEN2 * (1.0 + tl.log2(tl.where(seen, l_i, 1.0)) / 32.0) * 0.6931471805599453,
                       lse)
    o_ptrs = (Out + b_ptr * stride_ob + h64 * stride_oh + (q_row + m0) * stride_om
              + offs_m0[:, None] * stride_om + offs_d[None, :])
    if USE_TMA:
        desc_o.store([b, h, m0, 0], out.to(Out.dtype.element_ty).reshape(1, 1, BLOCK_M, BLOCK_D))
    else:
        tl.store(o_ptrs, out.to(Out.dtype.element_ty), mask=m_ok[:, None] & d_ok[None, :])
    lse_ptrs = Lse + b_ptr * stride_lb + h64 * stride_lh + q_row + offs_m
    tl.store(lse_ptrs, lse, mask=m_ok)


_launch_fwd = Launcher(_fwd_kernel)


def _tma_layout_ok(t) -> bool:
    """A tensor the bulk tensor copy engine can address: 16-byte aligned base and strides,
    unit last stride, no zero stride (broadcast views) on a dimension longer than 1."""
    if t.data_ptr() % 16 or t.stride(-1) != 1:
        return False
    size = t.element_size()
    return not any((s * size) % 16 or (s == 0 and n > 1) for s, n in zip(t.stride()[:-1], t.shape[:-1]))


def _tma_ok(*tensors) -> bool:
    """The bulk tensor copy engine needs sm90+, 16-byte aligned bases and strides."""
    t0 = tensors[0]
    if t0.device.type != "cuda" or t0.dtype.itemsize != 2:
        return False
    if any(t.numel() == 0 for t in tensors):  # a descriptor needs positive sizes
        return False
    if cuda_capability(device_index(t0.device))[0] < 9:
        return False
    return all(_tma_layout_ok(t) for t in tensors)


def attention_forward(q, k, v, out, lse, *, scale: float, diag_offset: int, window_left: int,
                      window_right: int, softcap: float, alibi_slopes, attn_mask,
                      config: FwdConfig, dropout_p: float = 0.0, seed=None, varlen=None) -> None:
    """Launch the forward kernel. Inputs are already validated by ``flashtile.api``.

    Args:
        q: (B, H, Sq, D); k, v: (B, Hk, Sk, D); unit stride along D.
        out: (B, H, Sq, D) view to write, unit stride along D.
        lse: (B, H, Sq) float32, contiguous.
        alibi_slopes: None or float32 (B, H) (any strides).
        attn_mask: None or (B, H, Sq, Sk) bool/float view (broadcast strides allowed).
        config: block sizes, warps and stages; ``use_ws`` sends problems in its scope
            (sm90, fp16/bf16, head dim 64/128/256, plain or causal, no extras) to the
            warp-specialized Gluon kernel of ``forward_sm90``.
        dropout_p, seed: dropout probability and a 1-element int64 tensor on q's device
            holding the Philox key (only read when dropout_p > 0).
        varlen: None, or a ``varlen.Varlen`` for packed sequences: q, out (1, H, total_q, D),
            k, v (1, Hk, total_k, D), lse (1, H, total_q); each sequence has its own
            bottom-right diagonal (``diag_offset`` is ignored) and the window is already
            normalised against the longest sequences. No attn_mask.
    """
    import torch

    batch, nheads, seqlen_q, head_dim = q.shape
    nheads_k, seqlen_k = k.shape[1], k.shape[2]
    block_d = max(16, triton.next_power_of_2(head_dim))
    window_left, window_right = launch_window(window_left, window_right, seqlen_q, seqlen_k, diag_offset, varlen)
    if varlen is None:
        num_m_blocks = triton.cdiv(seqlen_q, config.block_m)
        grid = (num_m_blocks * batch * nheads,)
        items, item_cap = q, 0

    if attn_mask is None:
        mask_mode, mask_arg, mstrides = MASK_NONE, q, (0, 0, 0, 0)
    else:
        if attn_mask.dtype == torch.bool:
            # tl cannot load torch.bool pointers portably; a uint8 view has the same bytes.
            mask_mode, mask_arg = MASK_BOOL, attn_mask.view(torch.uint8)
        else:
            mask_mode, mask_arg = MASK_FLOAT, attn_mask
        mstrides = attn_mask.stride()
    alibi_arg, astrides = (q, (0, 0)) if alibi_slopes is None else (alibi_slopes, alibi_slopes.stride())

    tma_ok = (config.use_ws or config.use_tma) and _tma_ok(q, k, v, out)
    if tma_ok and config.use_ws and os.environ.get("FLASHTILE_WS", "1") != "0":
        from flashtile.backends.sm90 import forward as forward_sm90

        # wgmma and setmaxnreg: Hopper only (_tma_ok lets later architectures through).
        # Varlen with seqused (the kv-cache path, paged keys) stays on the Triton kernel: the
        # Gluon kernel's tiles read whole rows past a sequence's used end (masked scores,
        # but 0 * NaN in P V if those rows hold garbage, as an unused cache tail may).
        if (cuda_capability(device_index(q.device))[0] == 9
                and (varlen is None or (varlen.seqused_q is None and varlen.seqused_k is None))
                and forward_sm90.ws_applies(q, head_dim, scale, window_left, window_right, softcap, alibi_slopes,
                                            attn_mask, dropout_p)):
            forward_sm90.attention_forward_ws(q, k, v, out, lse, scale=scale, diag_offset=diag_offset,
                                              causal=window_right == 0, varlen=varlen)
            return
    if varlen is not None:
        from flashtile.backends.worklist import build_work_items

        [(items, item_cap)] = build_work_items(varlen, seqlen_q, seqlen_k, [(config.block_m, False)],
                                                window_left, window_right)
        num_m_blocks = 0
        grid = (item_cap * nheads,)
        seqlen_q = seqlen_k = diag_offset = 0  # per sequence, from the work list
    softcap_on = softcap > 0.0
    use_tma = config.use_tma and tma_ok and varlen is None
    if use_tma:
        from triton.tools.tensor_descriptor import TensorDescriptor

        def desc(t, rows):
            return TensorDescriptor(t, list(t.shape), list(t.stride()), [1, 1, rows, block_d])

        descs = (desc(q, config.block_m), desc(k, config.block_n), desc(v, config.block_n), desc(out, config.block_m))
    else:
        descs = (q, k, v, out)
    _launch_fwd(
        grid,
        (q, k, v, out, lse, mask_arg, alibi_arg, seed if dropout_p > 0.0 else q, items, *descs,
         q.stride(0), q.stride(1), q.stride(2),
         k.stride(0), k.stride(1), k.stride(2),
         v.stride(0), v.stride(1), v.stride(2),
         out.stride(0), out.stride(1), out.stride(2),
         *mstrides, *astrides, lse.stride(0), lse.stride(1),
         nheads, nheads // nheads_k, seqlen_q, seqlen_k, head_dim, num_m_blocks, item_cap,
         scale * LOG2E,
         scale / softcap if softcap_on else 0.0,
         softcap * LOG2E if softcap_on else 0.0,
         diag_offset, window_left, window_right, float(dropout_p)),
        dict(BLOCK_M=config.block_m, BLOCK_N=config.block_n, BLOCK_D=block_d,
             EVEN_D=block_d == head_dim,
             WINDOW_LEFT=window_left >= 0, WINDOW_RIGHT=window_right >= 0,
             SOFTCAP=softcap_on, HAS_ALIBI=alibi_slopes is not None, MASK_MODE=mask_mode,
             IEEE_DOT=q.dtype == torch.float32,
             REVERSE_M=window_right >= 0, USE_TMA=use_tma, DROPOUT=dropout_p > 0.0,
             VARLEN=varlen is not None),
        config.num_warps, config.num_stages,
    )


@triton.jit
def _dropout_keep_kernel(Seed, Keep, rows, cols, dropout_p, BLOCK: tl.constexpr):
    """Keep[bh, i, j] (uint8) = the forward kernel's dropout bit of element (bh, i, j)."""
    bh = tl.program_id(0)
    i = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    j = tl.program_id(2) * BLOCK + tl.arange(0, BLOCK)
    keep = _dropout_keep(tl.load(Seed), bh, i[:, None], j[None, :], dropout_p)
    ptrs = Keep + bh.to(tl.int64) * rows * cols + i[:, None].to(tl.int64) * cols + j[None, :]
    tl.store(ptrs, keep.to(tl.uint8), mask=(i[:, None] < rows) & (j[None, :] < cols))


_launch_keep = Launcher(_dropout_keep_kernel)


def dropout_keep_mask(seed, batch_heads: int, rows: int, cols: int, dropout_p: float):
    """(batch_heads, rows, cols) bool: the keep mask every flashtile kernel draws for
    element (b * nheads + h, i, j) from the Philox key ``seed`` (i, j within the sequence)."""
    import torch

    keep = torch.empty((batch_heads, rows, cols), dtype=torch.uint8, device=seed.device)
    if keep.numel():
        block = 32
        with torch.cuda.device(seed.device) if seed.is_cuda else contextlib.nullcontext():
            _launch_keep((batch_heads, triton.cdiv(rows, block), triton.cdiv(cols, block)),
                         (seed, keep, rows, cols, float(dropout_p)), dict(BLOCK=block), 4, 1)
    return keep.bool()

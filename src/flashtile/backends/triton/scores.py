"""The score pipeline: what every Triton kernel does to a tile of q.k products.

The forward, the two backward kernels and the kv-cache decode kernel all call ``scores``
on a (rows x keys) tile of raw products q_i.k_j, in this order (``problem.spec``)::

    s = scale * q.k                  (or softcap * tanh(scale * q.k / softcap))
    s = s - slope * |i + diag - j|   ALiBi, from the same diagonal as the window
    s = s + mask[i, j]               a float mask; a bool mask hides keys
    s = -inf where j is outside the window (left, right) around the diagonal, outside the
        query's chunk (chunked attention), or outside the tile's bounds

Scores live in base 2 inside the kernels: the scale and log2(e) are folded into one
multiply (``qk_scale = scale * LOG2E``), so exp2 replaces exp. A tile the caller knows to
be inside the window and the bounds (``VISIBILITY=False``) skips the element masks.
``scores`` also returns d s / d(q.k) (the backward's chain-rule factor through softcap);
the forward and decode kernels drop it and the compiler removes its arithmetic.

A sink (one logit per head that joins only the softmax's denominator) enters the running
state once, after the key tiles (``add_sink``). User-defined score and mask functions
(FlexAttention's, translated by ``modgen.py``) go through ``flex_scores``, the flex
kernels' stage of the same pipeline. FP8 scales plug in here.
"""

from __future__ import annotations

import triton
import triton.language as tl

from flashtile.runtime.launch import Launcher

LOG2E = 1.4426950408889634  # log2(e): natural-log scores to base 2
LN2 = 0.6931471805599453  # ln(2): base-2 LSEs back to natural log
# The same constants for kernel code, which reads only tl.constexpr globals.
C_LOG2E = tl.constexpr(LOG2E)
C_LN2 = tl.constexpr(LN2)

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
# backward takes log2(n) back (``row_lse2``) to form P = 1/n.
HUGE_BIAS2 = tl.constexpr(-8.507059173023462e37)  # -2^126
HIDDEN2 = tl.constexpr(-1.7014118346046923e38)  # -2^127


@triton.jit
def tanh(x):
    """tanh for softcap, accurate near 0 and exactly +-1 far from it."""
    # 1 - 2 / (exp(2x) + 1) saturates cleanly to +-1 and needs no libdevice (so it runs in
    # the interpreter), but near 0 its absolute error (~6e-8) is large relative to tanh(x)
    # itself, and softcap multiplies it back up: below |x| = 0.25 use the odd Taylor series
    # to x^9 instead (truncation error < 1e-8 relative).
    big = 1.0 - 2.0 / (tl.exp2(x * (2.0 * C_LOG2E)) + 1.0)
    x2 = x * x
    small = x * (1.0 + x2 * (-0.3333333333333333 + x2 * (0.13333333333333333
                 + x2 * (-0.05396825396825397 + x2 * 0.021869488536155203))))
    return tl.where(tl.abs(x) < 0.25, small, big)


@triton.jit
def add_float_mask(s, bias):
    """Scores in base 2 plus a float mask's ``bias`` (natural units), huge biases to HIDDEN2."""
    bias = bias.to(tl.float32)
    bias2 = bias * C_LOG2E
    hidden = tl.where(bias == float("-inf"), float("-inf"), HIDDEN2)
    return tl.where(bias2 < HUGE_BIAS2, hidden, s + bias2)


@triton.jit
def chunk_start(p, chunk):
    """floor(p / chunk) * chunk for any int p, negative too (``%`` may keep p's sign)."""
    r = p % chunk
    return p - tl.where(r < 0, r + chunk, r)


@triton.jit
def scores(raw, i2, j2, in_bounds, mask_ptrs, mask_cols, mask_stride, seqlen_q, seqlen_k,
           qk_scale, sm_scale, softcap_in, softcap_out, alibi_slope,
           diag_offset, window_left, window_right, chunk,
           VISIBILITY: tl.constexpr, WINDOW_LEFT: tl.constexpr, WINDOW_RIGHT: tl.constexpr,
           SOFTCAP: tl.constexpr, HAS_ALIBI: tl.constexpr, MASK_MODE: tl.constexpr, CHUNK: tl.constexpr):
    """(s, dfac) of a tile: scores in base 2, -inf where the key is hidden, and d s / d(q.k).

    ``raw``: the tile of q_i.k_j; ``i2``/``j2``: query and key indices broadcast to the
    tile's orientation (queries x keys in the forward, dq and decode kernels, keys x
    queries in the dk/dv kernel); ``in_bounds``: the tile's elements that exist, or None
    for keys before ``seqlen_k`` (computed here, where the masks need it: computed by the
    caller, the compare moves and ptxas schedules the spilling d128 dk/dv kernel
    differently); ``mask_ptrs``: the mask's elements of the tile, or with ``mask_cols``
    (not None: the tile's key offsets) its row pointers, the keys added here as
    ``mask_cols[None, :] * mask_stride``
    (read only where i2 < seqlen_q and j2 < seqlen_k; where the address is formed decides
    the order ptxas schedules a spilling d256 forward in); ``alibi_slope``: in base 2, a
    scalar or one per row. ``VISIBILITY``: apply ``in_bounds``, the window and the chunk
    (``CHUNK``: query i sees keys in [c, c + chunk), c = chunk_start(i + diag_offset))
    (else the caller knows every element of the tile is visible).
    """
    if SOFTCAP:
        t = tanh(raw * softcap_in)
        s = softcap_out * t
        dfac = sm_scale * (1.0 - t * t)
    else:
        s = raw * qk_scale
        dfac = sm_scale
    if HAS_ALIBI:
        s = s - alibi_slope * tl.abs(i2 + diag_offset - j2).to(tl.float32)
    if MASK_MODE != 0:
        if mask_cols is not None:
            mask_ptrs = mask_ptrs + mask_cols[None, :] * mask_stride
    if MASK_MODE == 1:
        keep = tl.load(mask_ptrs, mask=(j2 < seqlen_k) & (i2 < seqlen_q), other=0)
        s = tl.where(keep != 0, s, float("-inf"))
    elif MASK_MODE == 2:
        bias = tl.load(mask_ptrs, mask=(j2 < seqlen_k) & (i2 < seqlen_q), other=0.0)
        s = add_float_mask(s, bias)
    if VISIBILITY:
        if in_bounds is None:
            visible = j2 < seqlen_k
        else:
            visible = in_bounds
        if WINDOW_RIGHT:
            visible = visible & (j2 <= i2 + diag_offset + window_right)
        if WINDOW_LEFT:
            visible = visible & (j2 >= i2 + diag_offset - window_left)
        if CHUNK:
            start = chunk_start(i2 + diag_offset, chunk)
            visible = visible & (j2 >= start) & (j2 < start + chunk)
        s = tl.where(visible, s, float("-inf"))
    return s, dfac


@triton.jit
def flex_scores(raw, b, h, i2, j2, seqlen_q, seqlen_k, sm_scale, SCORE_ARGS, MASK_ARGS,
                SCORE_MOD: tl.constexpr, MASK_MOD: tl.constexpr, APPLY_MASK: tl.constexpr):
    """(s, dfac) of a flex tile (``backends/triton/flex.py``): FlexAttention's order, in
    natural units until the end:

        s = score_mod(scale * q.k, b, h, i, j)      (a translated mod: ``modgen.py``)
        s = -inf where mask_mod(b, h, i, j) is False (partial blocks: ``APPLY_MASK``)
              or where i or j is past its sequence
        s = s * log2(e)                               (base 2, as every kernel's; below
                                                      -2^126: HIDDEN2, as a float mask's)

    ``dfac`` = d s / d(q.k) in natural units: scale times score_mod's derivative (the
    backward's chain rule). ``i2``/``j2``: query and key indices broadcast to the tile's
    orientation; b, h: the program's batch and query head.
    """
    s = raw * sm_scale
    dfac = sm_scale
    if SCORE_MOD is not None:
        s, ds = SCORE_MOD(s, b, h, i2, j2, SCORE_ARGS)
        s = tl.broadcast_to(s, raw.shape)  # a mod of the indices alone gives a row or a column
        dfac = ds * sm_scale
    visible = (j2 < seqlen_k) & (i2 < seqlen_q)
    if APPLY_MASK:
        visible = visible & MASK_MOD(b, h, i2, j2, MASK_ARGS)
    s2 = s * C_LOG2E
    # Scores a mod pushes below -2^126 in base 2 (torch.finfo(float32).min: "hidden" as
    # transformers writes it) all become HIDDEN2, as a float mask's do (add_float_mask): a
    # row only such keys reach spreads evenly over them, as in torch.
    s2 = tl.where(s2 < HUGE_BIAS2, tl.where(s == float("-inf"), float("-inf"), HIDDEN2), s2)
    s = tl.where(visible, s2, float("-inf"))
    return s, dfac


@triton.jit
def add_sink(acc, l_i, m_i, sink2):
    """The running softmax state (acc, l_i, m_i) of rows (base 2) with one more logit
    ``sink2`` per row (a sink, in base 2) that joins only the denominator: it has no value
    row, so acc is only rescaled. Called once, after every key tile: a row that saw no key
    ends with acc 0, l 1 and m sink2, hence out 0 and lse sink."""
    m_new = tl.maximum(m_i, sink2)
    m_use = tl.where(m_new == float("-inf"), 0.0, m_new)  # a -inf sink on an empty row: stays empty
    alpha = tl.exp2(m_i - m_use)
    return acc * alpha[:, None], l_i * alpha + tl.exp2(sink2 - m_use), m_new


@triton.jit
def key_tiles(m0, seqlen_q, seqlen_k, diag_offset, window_left, window_right, chunk,
              BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
              WINDOW_LEFT: tl.constexpr, WINDOW_RIGHT: tl.constexpr, CHUNK: tl.constexpr):
    """Key tiles of the query block starting at m0: (lo_tile, inner_lo, inner_hi, hi).

    Tiles outside [lo_tile, hi) see no key of the block and are never loaded;
    [lo_tile, inner_lo) and [inner_hi, hi) straddle a window or chunk edge or the end of
    the keys and need element masks; the interior [inner_lo, inner_hi) holds whole BLOCK_N
    tiles that every row of the block sees entirely (none when the block's rows lie in
    two chunks). All bounds but hi are multiples of BLOCK_N; values that could go negative
    are clamped before any division.
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
    if CHUNK:
        first = chunk_start(m0 + diag_offset, chunk)  # the first row's chunk
        last = chunk_start(m_last + diag_offset, chunk)  # the last row's
        lo = tl.maximum(lo, first)
        hi = tl.minimum(hi, last + chunk)
        full_lo = tl.maximum(full_lo, last)
        full_hi = tl.minimum(full_hi, first + chunk)
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
def row_lse2(lse, MASK_MODE: tl.constexpr):
    """(lse2, tail) of rows whose saved LSE is ``lse`` (natural log): P = exp2(s - lse2 - tail).

    lse2 is the LSE in base 2, +inf for rows that saw no key (and rows past the end, loaded
    as +inf), so their P is 0. tail is 0, except under a float mask for a row that only
    hidden keys reach (HIDDEN2): there lse2 = HIDDEN2 and tail = log2 of the number of
    keys, taken back from the LSE the forward encoded, so each gets P = 1/n."""
    lse2 = tl.where(lse == float("-inf"), float("inf"), lse * C_LOG2E)
    tail = tl.zeros_like(lse2)
    if MASK_MODE == 2:
        hidden_row = lse2 < HUGE_BIAS2
        tail = tl.where(hidden_row, tl.maximum((lse2 / HIDDEN2 - 1.0) * 32.0, 0.0), 0.0)
        lse2 = tl.where(hidden_row, HIDDEN2, lse2)
    return lse2, tail


@triton.jit
def dropout_keep(seed, bh, i2, j2, dropout_p):
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


def mask_arguments(mask, q):
    """(MASK_MODE, the pointer argument, its 4 strides) of an explicit mask (None: none)."""
    import torch

    if mask is None:
        return MASK_NONE, q, (0, 0, 0, 0)
    if mask.dtype == torch.bool:
        # tl cannot load torch.bool pointers portably; a uint8 view has the same bytes.
        return MASK_BOOL, mask.view(torch.uint8), mask.stride()
    return MASK_FLOAT, mask, mask.stride()


@triton.jit
def _dropout_keep_kernel(Seed, Keep, rows, cols, dropout_p, BLOCK: tl.constexpr):
    """Keep[bh, i, j] (uint8) = the kernels' dropout bit of element (bh, i, j)."""
    bh = tl.program_id(0)
    i = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    j = tl.program_id(2) * BLOCK + tl.arange(0, BLOCK)
    keep = dropout_keep(tl.load(Seed), bh, i[:, None], j[None, :], dropout_p)
    ptrs = Keep + bh.to(tl.int64) * rows * cols + i[:, None].to(tl.int64) * cols + j[None, :]
    tl.store(ptrs, keep.to(tl.uint8), mask=(i[:, None] < rows) & (j[None, :] < cols))


_launch_keep = Launcher(_dropout_keep_kernel)


def dropout_keep_mask(seed, batch_heads: int, rows: int, cols: int, dropout_p: float):
    """(batch_heads, rows, cols) bool: the keep mask every flashtile kernel draws for
    element (b * nheads + h, i, j) from the Philox key ``seed`` (i, j within the sequence)."""
    import torch

    from flashtile.runtime.device import device_context

    keep = torch.empty((batch_heads, rows, cols), dtype=torch.uint8, device=seed.device)
    if keep.numel():
        block = 32
        with device_context(seed):
            _launch_keep((batch_heads, triton.cdiv(rows, block), triton.cdiv(cols, block)),
                         (seed, keep, rows, cols, float(dropout_p)), dict(BLOCK=block), 4, 1)
    return keep.bool()

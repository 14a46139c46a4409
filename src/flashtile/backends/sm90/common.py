"""What the Hopper (Gluon) kernels share: work items, the K/V loader, gradient tile stores,
TMA descriptors.

The forward (``forward.py``) and both backwards (``backward_split.py``,
``backward_onepass.py``) of this package take their work items, the K/V ring loader and
their tensor descriptors from here, not from each other.
"""

from __future__ import annotations

import functools

from triton.experimental import gluon
from triton.experimental.gluon import language as gl
from triton.experimental.gluon.language.nvidia.hopper import (fence_async_shared, mbarrier, tma, warpgroup_mma,
                                                         warpgroup_mma_wait)
from triton.experimental.gluon.nvidia.hopper import TensorDescriptor

from flashtile.runtime.launch import TESTED_VERSION


def pair_group(knob: int | None, causal: bool, num_n_blocks: int, num_pairs: int, sms: int, *, gqa: bool,
               group_mha: bool = False) -> int:
    """A key-block grid's order (the one-pass backward's, and the d256 dV and dK kernels'):
    (batch, kv head) pairs a group, block-major within a group (every pair's key block 0,
    then every pair's block 1, ...: ``grouped_coords``), the groups one after another; 1 is
    pair-major (a pair's blocks side by side, sharing its Q and dO in L2), ``num_pairs``
    block-major over the whole grid. ``knob`` None: the rule, causal GQA calls (and causal
    MHA ones with ``group_mha``) take ``sms // num_n_blocks`` pairs a group (about one wave of
    programs: a pair's blocks in one wave share its Q and dO, and each group starts its
    heaviest blocks first), other causal MHA calls and calls without causal mask, whose blocks
    weigh the same, pair-major; else that many pairs a group for every causal call (0: every
    pair). H100 runs 248-252 (docs/perf-notes.md, sessions 47-48): the rule gained causal GQA 4
    1-14% over the orders before it; causal MHA moved within the spread."""
    if not causal or (knob is None and not (gqa or group_mha)):
        return 1
    if knob is not None:
        return min(knob or num_pairs, num_pairs)
    return max(1, min(num_pairs, sms // num_n_blocks))


@gluon.jit
def grouped_coords(pid, num_pairs, num_n_blocks, pair_group):
    """Program pid's (key block, pair) in a grouped order (``pair_group``): the grid's
    num_pairs x num_n_blocks programs in groups of pair_group pairs, one group after another
    (the last may be short), block-major within a group: its pairs' block 0 first (causal: the
    blocks with the most queries), then their block 1, ... Plain operators on non-negative
    ints: tests call it as Python (``grouped_coords.fn``)."""
    group = pid // (pair_group * num_n_blocks)
    r = pid % (pair_group * num_n_blocks)
    left = num_pairs - group * pair_group
    in_group = left - (left > pair_group) * (left - pair_group)  # min(left, pair_group)
    return r // in_group, group * pair_group + r % in_group


@gluon.jit
def fixed_item(t, num_m_blocks, num_bh, nheads, group_size, seqlen_q, seqlen_k, diag_offset,
               ROWS: gl.constexpr, BLOCK_N: gl.constexpr, CAUSAL: gl.constexpr):
    """Work item t -> (b, h, kvh, bh, m0, n_tiles): a block of 2 * ROWS query rows of one
    (batch, head) and the number of key tiles it sees. Items run head by head, so the
    programs working at the same time share one head's K/V through L2; causal heads start
    with their last query blocks (they see the most keys). Ordering all heads' last
    blocks first instead (longest job first across heads) cost 5-7% at causal S16384:
    16 heads' K/V at once do not fit in L2 (H200 run 22)."""
    bh = t // num_m_blocks
    m_block = t % num_m_blocks
    if CAUSAL:
        m_block = num_m_blocks - 1 - m_block
    h = bh % nheads
    m0 = m_block * (2 * ROWS)
    hi = seqlen_k
    if CAUSAL:
        hi = gl.maximum(gl.minimum(gl.minimum(m0 + 2 * ROWS, seqlen_q) + diag_offset, seqlen_k), 0)
    return bh // nheads, h, h // group_size, bh, m0, gl.cdiv(hi, BLOCK_N)


@gluon.jit
def varlen_item(Items, item, item_cap):
    """Item ``item`` of a work list (backends/worklist.py): (sequence, block, q start, q length,
    k start, k length); the Gluon twin of ``varlen.varlen_item``."""
    seq = gl.load(Items + 16 + item)
    blk = gl.load(Items + 16 + item_cap + item)
    meta = Items + 16 + 2 * item_cap + 4 * seq
    return seq, blk, gl.load(meta), gl.load(meta + 1), gl.load(meta + 2), gl.load(meta + 3)


@gluon.jit
def work_item(t, num_m_blocks, num_bh, nheads, group_size, seqlen_q, seqlen_k, diag_offset, Items, item_cap,
          ROWS: gl.constexpr, BLOCK_N: gl.constexpr, CAUSAL: gl.constexpr):
    """Work item t -> (b, h, kvh, bh, m0, n_tiles, q_row, k_row, seqlen_q, seqlen_k,
    diag_offset): ``fixed_item`` for a fixed-length call; for a varlen one (Items an int32
    work list of backends/worklist.py with count items, blocks of 2 * ROWS rows) item t % count of
    the list and head t // count, at batch 0 from the sequence's first rows (q_row, k_row), with its own
    lengths and bottom-right diagonal; bh is then h (the LSE row is h * total_q + q_row).
    Tiles read past a sequence's end hold the next document's rows: their scores are
    masked to -inf, so they add exactly 0 to finite sums, and no row past the end is stored."""
    if Items.dtype.element_ty == gl.int32:
        # Heads outer, each head's items longest first: the running items share a few
        # heads' K/V in L2, as in the fixed-length order.
        count = gl.load(Items)
        h = t // count
        item = t % count
        seq, blk, q_row, len_q, k_row, len_k = varlen_item(Items, item, item_cap)
        diag = len_k - len_q
        m0 = blk * (2 * ROWS)
        hi = len_k
        if CAUSAL:
            hi = gl.maximum(gl.minimum(gl.minimum(m0 + 2 * ROWS, len_q) + diag, len_k), 0)
        return seq * 0, h, h // group_size, h, m0, gl.cdiv(hi, BLOCK_N), q_row, k_row, len_q, len_k, diag
    else:
        b, h, kvh, bh, m0, n_tiles = fixed_item(t, num_m_blocks, num_bh, nheads, group_size, seqlen_q, seqlen_k,
                                                diag_offset, ROWS, BLOCK_N, CAUSAL)
        return b, h, kvh, bh, m0, n_tiles, b * 0, b * 0, seqlen_q, seqlen_k, diag_offset


@gluon.jit
def load_kv_tiles(k_desc, v_desc, k_smem, v_smem, k_ready, k_empty, v_ready, v_empty, b, kvh, it, n_tiles, k_row):
    """Key tiles 0 .. n_tiles - 1 of kv head (b, kvh), from key row k_row on, into the K/V
    ring, it tiles in: each slot once its consumers have released it (a fresh barrier
    passes phase 1)."""
    BLOCK_N: gl.constexpr = k_desc.block_type.shape[2]
    NUM_BUF: gl.constexpr = k_smem.type.shape[0]
    for j in range(n_tiles):
        slot = (it + j) % NUM_BUF
        free_phase = (((it + j) // NUM_BUF) & 1) ^ 1
        mbarrier.wait(k_empty.index(slot), free_phase)
        mbarrier.expect(k_ready.index(slot), k_desc.block_type.nbytes)
        tma.async_copy_global_to_shared(k_desc, [b, kvh, k_row + j * BLOCK_N, 0], k_ready.index(slot),
                                        k_smem.index(slot))
        mbarrier.wait(v_empty.index(slot), free_phase)
        mbarrier.expect(v_ready.index(slot), v_desc.block_type.nbytes)
        tma.async_copy_global_to_shared(v_desc, [b, kvh, k_row + j * BLOCK_N, 0], v_ready.index(slot),
                                        v_smem.index(slot))


@gluon.jit
def store_grad_tile(x, smem, desc, Ptr, stride_h, stride_m, b, h, row0, r, seqlen, VARLEN: gl.constexpr):
    """Rows r .. r + R of x (R x D; a warpgroup's gradient tile) into head h of a gradient at
    batch b, rows row0 + r ..: by TMA through its staging tile ``smem``, which clips rows
    past the tensor's end; but a varlen tile that reaches past its sequence's end (seqlen
    rows from row0) goes from registers, its rows masked: a TMA store would overwrite the
    next document's first rows. The caller waits for the TMA stores. (The register store
    keeps the wgmma layout: 4-byte stores, one tile per sequence end; the forward's 16-byte
    ones go through a layout conversion, whose scratch the dK/dV kernel's 229 KB of shared
    memory has no room for.) The split backward's dK, dV and dQ and the one-pass backward's
    packed dK and dV."""
    ROWS: gl.constexpr = x.shape[0]
    HEAD_D: gl.constexpr = x.shape[1]
    if VARLEN:
        if r + ROWS > seqlen:
            layout: gl.constexpr = x.type.layout
            rows = r + gl.arange(0, ROWS, layout=gl.SliceLayout(1, layout))
            cols = gl.arange(0, HEAD_D, layout=gl.SliceLayout(0, layout))
            ptrs = (Ptr + h.to(gl.int64) * stride_h + (row0 + rows).to(gl.int64)[:, None] * stride_m
                    + cols[None, :])
            gl.store(ptrs, x, mask=(rows < seqlen)[:, None])
        else:
            tma_store_tile(x, smem, desc, b, h, row0 + r)
    else:
        tma_store_tile(x, smem, desc, b, h, row0 + r)


@gluon.jit
def tma_store_tile(x, smem, desc, b, h, row):
    """x (R x D) into head h of batch b from row ``row`` on, by TMA through ``smem``."""
    smem.reshape([x.shape[0], x.shape[1]]).store(x)
    fence_async_shared()
    tma.async_copy_shared_to_global(desc, [b, h, row, 0], smem)


@gluon.jit
def dkdv_step_products(q_t, do_t, k_tile, v_tile, p_tile, ds_tile, q_smem, do_smem, prev, dk, dv,
                       s_layout: gl.constexpr):
    """One step of a backward loop over query tiles against a warpgroup's keys (the one-pass
    kernel and the split dK/dV kernel): S_s = Q_s K^T and dP_s = dO_s V^T issued, then the
    previous step's dV += P^T dO_{s-1} and dK += dS^T Q_{s-1} (P, dS from shared memory; Q and
    dO of step s-1 in ring slot ``prev``); returns (S_s, dP_s, dk, dv) once S_s and dP_s are
    done, dk and dv still in flight."""
    QROWS: gl.constexpr = q_t.type.shape[0]
    HEAD_D: gl.constexpr = q_t.type.shape[1]
    KEYS: gl.constexpr = k_tile.type.shape[0]
    st = warpgroup_mma(q_t, k_tile.permute((1, 0)), gl.zeros([QROWS, KEYS], gl.float32, s_layout),
                       use_acc=False, is_async=True)
    dpt = warpgroup_mma(do_t, v_tile.permute((1, 0)), gl.zeros([QROWS, KEYS], gl.float32, s_layout),
                        use_acc=False, is_async=True)
    dv = warpgroup_mma(p_tile.permute((1, 0)), do_smem.index(prev).reshape([QROWS, HEAD_D]), dv, is_async=True)
    dk = warpgroup_mma(ds_tile.permute((1, 0)), q_smem.index(prev).reshape([QROWS, HEAD_D]), dk, is_async=True)
    st, dpt = warpgroup_mma_wait(num_outstanding=2, deps=(st, dpt))  # step s-1's products stay in flight
    return st, dpt, dk, dv


@gluon.jit
def step_range(n0, seqlen_q, diag_offset, ROWS: gl.constexpr, CAUSAL: gl.constexpr):
    """First query block that sees key n0, and the number of query blocks."""
    q_lo = 0
    if CAUSAL:
        q_lo = gl.maximum(n0 - diag_offset, 0) // ROWS
    return q_lo, gl.maximum(gl.cdiv(seqlen_q, ROWS) - q_lo, 0)


@functools.lru_cache(maxsize=None)
def smem_layout(rows: int, head_dim: int, dtype_name: str):
    return gl.NVMMASharedLayout.get_default_for([1, 1, rows, head_dim], getattr(gl, dtype_name))


def tma_descriptor(t, rows: int):
    """Gluon TensorDescriptor of a (B, H, S, D) view ``t`` in (1, 1, rows, D) blocks, as
    ``TensorDescriptor(t, shape, strides, block, layout)`` makes it, without that
    dataclass's per-call checks (rank, block shape, 16-byte base and strides, positive
    sizes, unit last stride, layout type, padding): the library checked what depends on
    the tensors (``backends.layout.tma_ready``) before choosing these kernels, and builds the rest
    from constants. The checked way costs ~3x as long (~2.3 vs 0.8 us on a laptop core;
    the H200 host is slower), and a training step builds 11-13. A direct caller
    with a bad tensor gets the error at launch instead (Triton's assert on the last
    stride, or ``cuTensorMapEncodeTiled``'s), possibly after an earlier kernel of the same
    backward was queued."""
    head_dim = t.shape[-1]
    layout = smem_layout(rows, head_dim, str(t.dtype).replace("torch.", ""))
    if not TESTED_VERSION:  # another triton: its constructor, whatever its fields are
        return TensorDescriptor(t, list(t.shape), list(t.stride()), [1, 1, rows, head_dim], layout)
    d = object.__new__(TensorDescriptor)
    d.base, d.shape, d.strides, d.block_shape, d.layout, d.padding = (
        t, list(t.shape), list(t.stride()), [1, 1, rows, head_dim], layout, "zero")
    return d

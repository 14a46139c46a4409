"""Experiment: d256's dV and dK kernels with separate Q and dO rings (written in session 7;
never run on a GPU: the device time ran out before its A/B).

The library's d256 backward (``backward_sm90._dv_kernel`` / ``_dk_kernel``, H200 run 45:
0.82-0.86x cuDNN) loads each step's Q and dO tiles into one 2-slot ring, so step s + 1's
tiles can only load when step s - 1 is done with both, and every step waits for its
loads: measured alone, the dV kernel runs at ~475 TF/s on its 2 products and the dK
kernel at ~430 on its 3 (the dQ kernel, whose K/V ring has 3 slots, at ~610). Here Q and
dO get rings of their own, each slot released as soon as its tile is read (see the
comment at DV_RING), so every load starts about a step ahead. Same arithmetic in the same
order, so the gradients must be bitwise those of the library's kernels; predicted: dV and
dK kernels 20-30% faster, the d256 backward ~0.95x cuDNN.

    PYTHONPATH=src python3 benchmarks/experiments/gluon_bwd_d256_rings.py            # H200
    PYTHONPATH=src python3 benchmarks/experiments/gluon_bwd_d256_rings.py --compile  # CPU: sm_90a only

The run checks the new kernels against the library's (bitwise) and fp32 autograd on odd
shapes (GQA, causal rows without keys, seqlen 1), then times the library's d256
backward, the new one, each new kernel alone next to the library's, and cuDNN. If it
wins: move these kernels into ``backward_sm90`` in place of the split kernels there.
"""

from __future__ import annotations

import argparse
import os
import sys

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

from flashtile.ops.backward_sm90 import (
    BLOCK,
    CONSUMER_REGS,
    LOADER_REGS,
    ROWS,
    _p_and_ds,
    _p_only,
    _step_range,
    attention_backward_ws,
)
from flashtile.ops.forward import LOG2E
from flashtile.ops.forward_sm90 import _smem_layout
from flashtile.ops.launch import Launcher

# At head dim 256 one warpgroup cannot hold both 64 x 256 float32 accumulators (dK and dV:
# 256 registers per thread), so dV and dK come from separate kernels, one accumulator each.
# 8 tile products per tile pair instead of 7: the dV kernel recomputes S.
#
# Q and dO have rings of their own, each slot released as soon as its tile is read, so a
# step's loads start a step ahead (run 45's single (Q, dO) ring of 2 slots could only load
# step s + 1 when step s - 1 had finished with both: its latency was exposed every step):
#   dV kernel (2 warpgroups): Q_s is read by S_s only, dO_s by step s + 1's dV product;
#       DV_RING = (2 Q slots, 2 dO slots). Shared memory (bf16): Q 64 KB + dO 64 KB + K of
#       2 x 64 keys 64 KB + P 16 KB = 208 KB.
#   dK kernel (1 warpgroup): Q_s is read by S_s and by step s + 1's dK product, dO_s by
#       dP_s only; DK_RING = (3 Q slots, 1 dO slot). Q 96 KB + dO 32 KB + K and V of 64
#       keys 64 KB + dS 8 KB = 200 KB (two warpgroups would need 256 KB).
DV_RING = (2, 2)
DK_RING = (3, 1)


@gluon.jit
def _wait_tile(smem, ready, s):
    """Step s's tile of a ring (slot s % slots) once it has landed, as a (ROWS, D) view."""
    NUM: gl.constexpr = smem.type.shape[0]
    HEAD_D: gl.constexpr = smem.type.shape[4]
    mbarrier.wait(ready.index(s % NUM), (s // NUM) & 1)
    return smem.index(s % NUM).reshape([ROWS, HEAD_D])


@gluon.jit
def _release_tile(smem, empty, s):
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
    q_lo, nq = _step_range(n0, seqlen_q, diag_offset, ROWS, CAUSAL)
    n_steps = nq * group_size
    zeros_s = gl.zeros([ROWS, ROWS], gl.float32, s_layout)
    acc = gl.zeros([ROWS, HEAD_D], gl.float32, o_layout)
    mbarrier.wait(kv_bar.index(WG), 0)
    if n_steps > 0:  # step 0: nothing to overlap with yet
        hq = kvh * group_size
        m0 = q_lo * ROWS
        st = warpgroup_mma(_wait_tile(q_smem, q_ready, 0), k_tile.permute((1, 0)), zeros_s, use_acc=False,
                           is_async=True)
        if DK:
            dpt = warpgroup_mma(_wait_tile(do_smem, do_ready, 0), v_tile.permute((1, 0)), zeros_s, use_acc=False,
                                is_async=True)
            st, dpt = warpgroup_mma_wait(num_outstanding=0, deps=(st, dpt))
            _release_tile(do_smem, do_empty, 0)
            pt, tt = _p_and_ds(st, dpt, Lse, Delta, b, hq, nheads, seqlen_q, seqlen_k, nk, m0, diag_offset,
                               qk_scale, CAUSAL, dtype, s_layout)
        else:
            st = warpgroup_mma_wait(num_outstanding=0, deps=(st,))
            _release_tile(q_smem, q_empty, 0)
            tt = _p_only(st, Lse, Delta, b, hq, nheads, seqlen_q, seqlen_k, nk, m0, diag_offset, qk_scale, CAUSAL,
                         dtype, s_layout)
        t_tile.store(tt)
        fence_async_shared()
    for s in range(1, n_steps):
        hq = kvh * group_size + s // nq
        m0 = (q_lo + s % nq) * ROWS
        st = warpgroup_mma(_wait_tile(q_smem, q_ready, s), k_tile.permute((1, 0)), zeros_s, use_acc=False,
                           is_async=True)
        if DK:
            dpt = warpgroup_mma(_wait_tile(do_smem, do_ready, s), v_tile.permute((1, 0)), zeros_s, use_acc=False,
                                is_async=True)
            acc = warpgroup_mma(t_tile.permute((1, 0)), q_smem.index((s - 1) % q_smem.type.shape[0]).reshape(
                [ROWS, HEAD_D]), acc, is_async=True)
            st, dpt = warpgroup_mma_wait(num_outstanding=1, deps=(st, dpt))  # dK product in flight
            _release_tile(do_smem, do_empty, s)  # dO_s is read
            pt, tt = _p_and_ds(st, dpt, Lse, Delta, b, hq, nheads, seqlen_q, seqlen_k, nk, m0, diag_offset,
                               qk_scale, CAUSAL, dtype, s_layout)
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
            acc = warpgroup_mma(t_tile.permute((1, 0)), q_smem.index(last % q_smem.type.shape[0]).reshape(
                [ROWS, HEAD_D]), acc, is_async=True)
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
    """K (and V) of the program's keys once, then every step's Q and dO tiles, each into
    its own ring as soon as its slot is released (a fresh barrier passes phase 1)."""
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
    q_lo, nq = _step_range(n0, seqlen_q, diag_offset, ROWS, CAUSAL)
    for s in range(nq * group_size):
        hq = kvh * group_size + s // nq
        m0 = (q_lo + s % nq) * ROWS
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
def _dv_kernel(q_desc, k_desc, do_desc, dv_desc, Lse, Delta, nheads, nheads_k, group_size, seqlen_q, seqlen_k,
               num_n_blocks, diag_offset, qk_scale, scale,
               CAUSAL: gl.constexpr, NUM_Q: gl.constexpr, NUM_DO: gl.constexpr, CONSUMER_REGS: gl.constexpr,
               LOADER_REGS: gl.constexpr):
    """dV of 2 x 64 keys of one (batch, kv head) per program (flat grid, key blocks fastest)."""
    HEAD_D: gl.constexpr = q_desc.block_type.shape[3]
    dtype: gl.constexpr = q_desc.dtype
    pid = gl.program_id(0)
    bk = pid // num_n_blocks
    n0 = (pid % num_n_blocks) * (2 * ROWS)
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
def _dk_kernel(q_desc, k_desc, v_desc, do_desc, dk_desc, Lse, Delta, nheads, nheads_k, group_size, seqlen_q,
               seqlen_k, num_n_blocks, diag_offset, qk_scale, scale,
               CAUSAL: gl.constexpr, NUM_Q: gl.constexpr, NUM_DO: gl.constexpr, LOADER_REGS: gl.constexpr):
    """dK of 64 keys of one (batch, kv head) per program: one consumer warpgroup."""
    HEAD_D: gl.constexpr = q_desc.block_type.shape[3]
    dtype: gl.constexpr = q_desc.dtype
    pid = gl.program_id(0)
    bk = pid // num_n_blocks
    n0 = (pid % num_n_blocks) * ROWS
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


_launch_dv = Launcher(_dv_kernel)
_launch_dk = Launcher(_dk_kernel)


def rings_backward(q, k, v, dout, lse, delta, dq, dk, dv, *, scale: float, diag_offset: int, causal: bool,
                   kernels=("dv", "dk", "dq")) -> None:
    """The d256 backward with these dV and dK kernels and the library's dQ kernel.
    Tensors as ``backward_sm90.attention_backward_ws`` takes them."""
    from triton.experimental.gluon.nvidia.hopper import TensorDescriptor

    batch, nheads, seqlen_q, head_dim = q.shape
    nheads_k, seqlen_k = k.shape[1], k.shape[2]
    dtype_name = str(q.dtype).replace("torch.", "")

    def desc(t):
        return TensorDescriptor(t, list(t.shape), list(t.stride()), [1, 1, BLOCK, head_dim],
                                _smem_layout(BLOCK, head_dim, dtype_name))

    sizes = (lse, delta, nheads, nheads_k, nheads // nheads_k, seqlen_q, seqlen_k)
    if "dv" in kernels:
        nb = triton.cdiv(seqlen_k, 2 * BLOCK)
        _launch_dv((nb * batch * nheads_k,), (desc(q), desc(k), desc(dout), desc(dv), *sizes, nb, diag_offset,
                                              scale * LOG2E, scale),
                   dict(CAUSAL=causal, NUM_Q=DV_RING[0], NUM_DO=DV_RING[1], CONSUMER_REGS=CONSUMER_REGS,
                        LOADER_REGS=LOADER_REGS), 4, 1)
    if "dk" in kernels:
        nb = triton.cdiv(seqlen_k, BLOCK)
        _launch_dk((nb * batch * nheads_k,), (desc(q), desc(k), desc(v), desc(dout), desc(dk), *sizes, nb,
                                              diag_offset, scale * LOG2E, scale),
                   dict(CAUSAL=causal, NUM_Q=DK_RING[0], NUM_DO=DK_RING[1], LOADER_REGS=LOADER_REGS), 4, 1)
    if "dq" in kernels:
        attention_backward_ws(q, k, v, dout, lse, delta, dq, None, None, scale=scale, diag_offset=diag_offset,
                              causal=causal, kernels=("dq",))


def compile_report() -> None:
    """Shared memory, spills, register redistribution and exp2-under-the-product of both
    kernels (sm_90a), in ``tests/test_sm90_compile.py``'s report format."""
    from flashtile.ops import sm90_check

    for causal in (False, True):
        for name, fn, descs, extra in (
                ("dv-rings", _dv_kernel, ("q_desc", "k_desc", "do_desc", "dv_desc"),
                 dict(NUM_Q=DV_RING[0], NUM_DO=DV_RING[1], CONSUMER_REGS=CONSUMER_REGS)),
                ("dk-rings", _dk_kernel, ("q_desc", "k_desc", "v_desc", "do_desc", "dk_desc"),
                 dict(NUM_Q=DK_RING[0], NUM_DO=DK_RING[1]))):
            c = sm90_check._compile_ws(f"{name} causal={int(causal)}", fn, "bf16", 256, dict.fromkeys(descs, BLOCK),
                                       dict(CAUSAL=causal, LOADER_REGS=LOADER_REGS, **extra))
            regs, spill = c.registers()
            ex2 = ",".join(map(str, sm90_check.ex2_under_wait(c.sass(), 1)))
            print(f"{c.name} smem={c.shared} spill={spill} ex2={ex2} setmaxnreg={c.ptx.count('setmaxnreg')}",
                  flush=True)


def run(shapes) -> None:
    import torch
    from torch.nn.attention import SDPBackend, sdpa_kernel
    from triton.testing import do_bench

    from gluon_bwd import ref_grads

    D = 256
    for B, H, Hk, Sq, Sk, causal in ((2, 4, 2, 333, 517, True), (1, 4, 4, 1000, 1000, False),
                                     (2, 6, 1, 300, 129, False), (1, 2, 2, 700, 200, True), (1, 2, 2, 1, 300, False),
                                     (1, 8, 2, 2100, 2100, True)):
        g = torch.Generator(device="cuda").manual_seed(0)
        q = torch.randn(B, H, Sq, D, device="cuda", dtype=torch.bfloat16, generator=g)
        k, v = (torch.randn(B, Hk, Sk, D, device="cuda", dtype=torch.bfloat16, generator=g) for _ in range(2))
        dout = torch.randn(B, H, Sq, D, device="cuda", dtype=torch.bfloat16, generator=g)
        diag = Sk - Sq
        out, lse, *refs = ref_grads(q, k, v, dout, causal, diag)
        lse = lse.detach().contiguous()
        delta = (out.detach() * dout.float()).sum(-1).contiguous()
        lib, new = ([torch.full_like(t, float("nan")) for t in (q, k, v)] for _ in range(2))
        attention_backward_ws(q, k, v, dout, lse, delta, *lib, scale=D ** -0.5, diag_offset=diag, causal=causal)
        rings_backward(q, k, v, dout, lse, delta, *new, scale=D ** -0.5, diag_offset=diag, causal=causal)
        torch.cuda.synchronize()
        same = all(torch.equal(a, b) for a, b in zip(lib, new))
        errs = "  ".join(f"{n} {(g_.float() - r).abs().max().item():.2e}/{r.abs().max().item():.1e}"
                         for n, g_, r in zip(("dq", "dk", "dv"), new, refs))
        print(f"B{B} H{H}/{Hk} Sq{Sq} Sk{Sk} causal={int(causal)}: bitwise as the library: {same}; "
              f"max err/|ref| {errs}", flush=True)

    for S, causal in shapes:
        B, H = 16384 // S, 2048 // D
        q, k, v, out, dout = (torch.randn(B, H, S, D, device="cuda", dtype=torch.bfloat16) for _ in range(5))
        lse = torch.randn(B, H, S, device="cuda").abs() + 5
        delta = torch.randn(B, H, S, device="cuda")
        grads = [torch.empty_like(t) for t in (q, k, v)]
        bwd_flops = 2.5 * 4 * B * H * S * S * D / (2 if causal else 1)
        kw = dict(scale=D ** -0.5, diag_offset=0, causal=causal)
        calls = {
            "library": lambda: attention_backward_ws(q, k, v, dout, lse, delta, *grads, **kw),
            "rings": lambda: rings_backward(q, k, v, dout, lse, delta, *grads, **kw),
            "library dv": lambda: attention_backward_ws(q, k, v, dout, lse, delta, *grads, kernels=("dv",), **kw),
            "rings dv": lambda: rings_backward(q, k, v, dout, lse, delta, *grads, kernels=("dv",), **kw),
            "library dk": lambda: attention_backward_ws(q, k, v, dout, lse, delta, *grads, kernels=("dk",), **kw),
            "rings dk": lambda: rings_backward(q, k, v, dout, lse, delta, *grads, kernels=("dk",), **kw),
        }
        row = {name: bwd_flops / do_bench(fn, warmup=25, rep=100) * 1e-9 for name, fn in calls.items()}
        qs, ks, vs = (t.detach().requires_grad_(True) for t in (q, k, v))
        with sdpa_kernel(SDPBackend.CUDNN_ATTENTION):
            o = torch.nn.functional.scaled_dot_product_attention(qs, ks, vs, is_causal=causal)
            row["cudnn"] = bwd_flops / do_bench(
                lambda: torch.autograd.grad(o, (qs, ks, vs), dout, retain_graph=True), warmup=25, rep=100) * 1e-9
        print(f"d256 S{S} causal={int(causal)} (whole-backward TF/s): "
              + "  ".join(f"{k_} {v_:6.1f}" for k_, v_ in row.items()), flush=True)


def main(argv=None) -> int:
    p = argparse.ArgumentParser()
    p.add_argument("--compile", action="store_true", help="sm_90a compile report only (no GPU)")
    p.add_argument("--shapes", default="2048,0;2048,1;4096,0;4096,1;16384,0;16384,1", help="seqlen,causal;...")
    args = p.parse_args(argv)
    if args.compile:
        compile_report()
        return 0
    sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))  # gluon_bwd.ref_grads
    run([(int(s), bool(int(c))) for s, c in (x.split(",") for x in args.shapes.split(";"))])
    return 0


if __name__ == "__main__":
    raise SystemExit(main())

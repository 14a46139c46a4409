"""Experiment: would the Gluon dQ kernel speed up the d256 backward?

At head dim 256 the backward runs the Triton kernels (0.45-0.53x cuDNN on the H200, runs
41-42): the Gluon dK/dV kernel cannot hold two 64 x 256 float32 accumulators per
warpgroup. The Gluon dQ kernel can (one accumulator; ``backward_sm90._dq_kernel`` with
32-key tiles fits shared memory with 2 or 3 ring slots, compiles without spills and keeps
its exp2 under the dQ product: ``--compile``). A hybrid would run the Triton dK/dV kernel
and the Gluon dQ kernel. Beyond that, the dK/dV side can go to Gluon too when dK and dV
come from separate programs (``_dv_kernel``: two warpgroups of 64 keys, S then
dV += P^T dO; ``_dk_kernel``: one warpgroup of 64 keys, S and dP then dK += dS^T Q):
8 tile products instead of 7, each program within registers and shared memory. This
measures the parts before anything is wired in:

    PYTHONPATH=src python3 benchmarks/experiments/gluon_bwd_d256.py            # H200
    PYTHONPATH=src python3 benchmarks/experiments/gluon_bwd_d256.py --compile  # CPU: sm_90a only

For each shape: the library's backward (Triton at d256), its dK/dV kernel alone and its dQ
kernel alone (the other launcher stubbed out), the Gluon dQ kernel for each (key tile,
ring slots), the Gluon dV and dK kernels alone, cuDNN, the projected hybrid (Triton dK/dV
+ the best Gluon dQ) and the all-Gluon backward (dV + dK + dQ, run as one call). TF/s use
the whole backward's FLOPs (2.5x the forward's) so the columns add as times. All of it
is checked against fp32 autograd first, on odd shapes.
"""

from __future__ import annotations

import argparse
import contextlib
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
    _load_qdo_steps,
    _p_and_ds,
    _step_range,
    _step_tiles,
    attention_backward_ws,
)
from flashtile.ops.forward import LOG2E
from flashtile.ops.forward_sm90 import _smem_layout
from flashtile.ops.launch import Launcher

DQ_VARIANTS = ((32, 2), (32, 3))  # (keys per tile, ring slots); 64-key tiles need 262 KB
SPLIT_NUM_BUF = 2  # (Q, dO) ring slots of the dV and dK kernels: 64 KB each at d256


# ---------------------------------------------------------------------------- dV and dK apart
# Shared memory at d256 (bf16): dV kernel: 2 ring slots of (Q, dO) 128 KB + K of 2 x 64 keys
# 64 KB + P 16 KB = 208 KB; dK kernel: ring 128 KB + K and V of 64 keys 64 KB + dS 8 KB =
# 200 KB (two warpgroups would need 256 KB). Registers: one 64 x 256 float32 accumulator
# (128 per thread) per warpgroup, against two in the library's dK/dV kernel.


@gluon.jit
def _p_only(s, Lse, Delta, b, hq, nheads, seqlen_q, seqlen_k, nk, m0, diag_offset, qk_scale,
            CAUSAL: gl.constexpr, dtype: gl.constexpr, s_layout: gl.constexpr):
    """P of a (queries x keys) tile: ``_p_and_ds`` with S standing in for dP; the unused
    dS and its Delta loads are dead code the compiler drops."""
    pt, _ = _p_and_ds(s, s, Lse, Delta, b, hq, nheads, seqlen_q, seqlen_k, nk, m0, diag_offset, qk_scale, CAUSAL,
                      dtype, s_layout)
    return pt


@gluon.jit
def _split_consumer(WG: gl.constexpr, DK: gl.constexpr, q_desc, k_desc, v_desc, do_desc, out_desc, Lse, Delta,
                    q_smem, do_smem, k_smem, v_smem, t_smem, kv_bar, q_ready, q_empty, b, kvh, n0, group_size,
                    nheads, seqlen_q, seqlen_k, diag_offset, qk_scale, scale):
    """Warpgroup WG's 64 keys: dV (DK False: S, P, dV += P^T dO) or dK (DK True: S, dP, dS,
    dK += dS^T Q), the previous step's product in flight while this step's P or dS is made."""
    HEAD_D: gl.constexpr = q_desc.block_type.shape[3]
    NUM_BUF: gl.constexpr = q_smem.type.shape[0]
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
        hq, m0, q_t, do_t = _step_tiles(0, q_lo, nq, kvh, group_size, q_smem, do_smem, q_ready)
        st = warpgroup_mma(q_t, k_tile.permute((1, 0)), zeros_s, use_acc=False, is_async=True)
        if DK:
            dpt = warpgroup_mma(do_t, v_tile.permute((1, 0)), zeros_s, use_acc=False, is_async=True)
            st, dpt = warpgroup_mma_wait(num_outstanding=0, deps=(st, dpt))
            pt, tt = _p_and_ds(st, dpt, Lse, Delta, b, hq, nheads, seqlen_q, seqlen_k, nk, m0, diag_offset,
                               qk_scale, CAUSAL, dtype, s_layout)
        else:
            st = warpgroup_mma_wait(num_outstanding=0, deps=(st,))
            tt = _p_only(st, Lse, Delta, b, hq, nheads, seqlen_q, seqlen_k, nk, m0, diag_offset, qk_scale, CAUSAL,
                         dtype, s_layout)
        t_tile.store(tt)
        fence_async_shared()
    for s in range(1, n_steps):
        prev = (s - 1) % NUM_BUF
        hq, m0, q_t, do_t = _step_tiles(s, q_lo, nq, kvh, group_size, q_smem, do_smem, q_ready)
        st = warpgroup_mma(q_t, k_tile.permute((1, 0)), zeros_s, use_acc=False, is_async=True)
        if DK:
            dpt = warpgroup_mma(do_t, v_tile.permute((1, 0)), zeros_s, use_acc=False, is_async=True)
            acc = warpgroup_mma(t_tile.permute((1, 0)), q_smem.index(prev).reshape([ROWS, HEAD_D]), acc,
                                is_async=True)
            st, dpt = warpgroup_mma_wait(num_outstanding=1, deps=(st, dpt))  # dK product in flight
            pt, tt = _p_and_ds(st, dpt, Lse, Delta, b, hq, nheads, seqlen_q, seqlen_k, nk, m0, diag_offset,
                               qk_scale, CAUSAL, dtype, s_layout)
        else:
            acc = warpgroup_mma(t_tile.permute((1, 0)), do_smem.index(prev).reshape([ROWS, HEAD_D]), acc,
                                is_async=True)
            st = warpgroup_mma_wait(num_outstanding=1, deps=(st,))  # dV product in flight
            tt = _p_only(st, Lse, Delta, b, hq, nheads, seqlen_q, seqlen_k, nk, m0, diag_offset, qk_scale, CAUSAL,
                         dtype, s_layout)
        acc = warpgroup_mma_wait(num_outstanding=0, deps=(acc,))
        mbarrier.arrive(q_empty.index(prev), count=1)  # Q_{s-1} and dO_{s-1} are read
        t_tile.store(tt)
        fence_async_shared()
    if n_steps > 0:
        last = (n_steps - 1) % NUM_BUF
        if DK:
            acc = warpgroup_mma(t_tile.permute((1, 0)), q_smem.index(last).reshape([ROWS, HEAD_D]), acc,
                                is_async=True)
        else:
            acc = warpgroup_mma(t_tile.permute((1, 0)), do_smem.index(last).reshape([ROWS, HEAD_D]), acc,
                                is_async=True)
        acc = warpgroup_mma_wait(num_outstanding=0, deps=(acc,))
        mbarrier.arrive(q_empty.index(last), count=1)
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
                  k_smem, v_smem, t_smem, kv_bar, q_ready, q_empty, b, kvh, n0, group_size, nheads, seqlen_q,
                  seqlen_k, diag_offset, qk_scale, scale):
    NUM_WG: gl.constexpr = k_smem.type.shape[0]
    CAUSAL: gl.constexpr = kv_bar.type.shape[0] == NUM_WG + 1
    for wg in gl.static_range(NUM_WG):
        if LOAD_V:
            mbarrier.expect(kv_bar.index(wg), k_desc.block_type.nbytes + v_desc.block_type.nbytes)
            tma.async_copy_global_to_shared(k_desc, [b, kvh, n0 + wg * ROWS, 0], kv_bar.index(wg), k_smem.index(wg))
            tma.async_copy_global_to_shared(v_desc, [b, kvh, n0 + wg * ROWS, 0], kv_bar.index(wg), v_smem.index(wg))
        else:
            mbarrier.expect(kv_bar.index(wg), k_desc.block_type.nbytes)
            tma.async_copy_global_to_shared(k_desc, [b, kvh, n0 + wg * ROWS, 0], kv_bar.index(wg), k_smem.index(wg))
    _load_qdo_steps(q_desc, do_desc, q_smem, do_smem, q_ready, q_empty, b, kvh, n0, group_size, seqlen_q,
                    diag_offset, CAUSAL)


@gluon.jit
def _dv_consumer0(q_desc, k_desc, v_desc, do_desc, out_desc, Lse, Delta, q_smem, do_smem, k_smem, v_smem, t_smem,
                  kv_bar, q_ready, q_empty, b, kvh, n0, group_size, nheads, seqlen_q, seqlen_k, diag_offset,
                  qk_scale, scale):
    _split_consumer(0, False, q_desc, k_desc, v_desc, do_desc, out_desc, Lse, Delta, q_smem, do_smem, k_smem,
                    v_smem, t_smem, kv_bar, q_ready, q_empty, b, kvh, n0, group_size, nheads, seqlen_q, seqlen_k,
                    diag_offset, qk_scale, scale)


@gluon.jit
def _dv_consumer1(q_desc, k_desc, v_desc, do_desc, out_desc, Lse, Delta, q_smem, do_smem, k_smem, v_smem, t_smem,
                  kv_bar, q_ready, q_empty, b, kvh, n0, group_size, nheads, seqlen_q, seqlen_k, diag_offset,
                  qk_scale, scale):
    _split_consumer(1, False, q_desc, k_desc, v_desc, do_desc, out_desc, Lse, Delta, q_smem, do_smem, k_smem,
                    v_smem, t_smem, kv_bar, q_ready, q_empty, b, kvh, n0, group_size, nheads, seqlen_q, seqlen_k,
                    diag_offset, qk_scale, scale)


@gluon.jit
def _dk_consumer0(q_desc, k_desc, v_desc, do_desc, out_desc, Lse, Delta, q_smem, do_smem, k_smem, v_smem, t_smem,
                  kv_bar, q_ready, q_empty, b, kvh, n0, group_size, nheads, seqlen_q, seqlen_k, diag_offset,
                  qk_scale, scale):
    _split_consumer(0, True, q_desc, k_desc, v_desc, do_desc, out_desc, Lse, Delta, q_smem, do_smem, k_smem,
                    v_smem, t_smem, kv_bar, q_ready, q_empty, b, kvh, n0, group_size, nheads, seqlen_q, seqlen_k,
                    diag_offset, qk_scale, scale)


@gluon.jit
def _dv_loader(q_desc, k_desc, v_desc, do_desc, out_desc, Lse, Delta, q_smem, do_smem, k_smem, v_smem, t_smem,
               kv_bar, q_ready, q_empty, b, kvh, n0, group_size, nheads, seqlen_q, seqlen_k, diag_offset,
               qk_scale, scale):
    _split_loader(False, q_desc, k_desc, v_desc, do_desc, out_desc, Lse, Delta, q_smem, do_smem, k_smem, v_smem,
                  t_smem, kv_bar, q_ready, q_empty, b, kvh, n0, group_size, nheads, seqlen_q, seqlen_k, diag_offset,
                  qk_scale, scale)


@gluon.jit
def _dk_loader(q_desc, k_desc, v_desc, do_desc, out_desc, Lse, Delta, q_smem, do_smem, k_smem, v_smem, t_smem,
               kv_bar, q_ready, q_empty, b, kvh, n0, group_size, nheads, seqlen_q, seqlen_k, diag_offset,
               qk_scale, scale):
    _split_loader(True, q_desc, k_desc, v_desc, do_desc, out_desc, Lse, Delta, q_smem, do_smem, k_smem, v_smem,
                  t_smem, kv_bar, q_ready, q_empty, b, kvh, n0, group_size, nheads, seqlen_q, seqlen_k, diag_offset,
                  qk_scale, scale)


@gluon.jit
def _dv_kernel(q_desc, k_desc, do_desc, dv_desc, Lse, Delta, nheads, nheads_k, group_size, seqlen_q, seqlen_k,
               num_n_blocks, diag_offset, qk_scale, scale,
               CAUSAL: gl.constexpr, NUM_BUF: gl.constexpr, CONSUMER_REGS: gl.constexpr,
               LOADER_REGS: gl.constexpr):
    """dV of 2 x 64 keys of one (batch, kv head) per program (flat grid, key blocks fastest)."""
    HEAD_D: gl.constexpr = q_desc.block_type.shape[3]
    dtype: gl.constexpr = q_desc.dtype
    pid = gl.program_id(0)
    bk = pid // num_n_blocks
    n0 = (pid % num_n_blocks) * (2 * ROWS)
    b = bk // nheads_k
    kvh = bk % nheads_k
    q_smem = gl.allocate_shared_memory(dtype, [NUM_BUF, 1, 1, ROWS, HEAD_D], q_desc.layout)
    do_smem = gl.allocate_shared_memory(dtype, [NUM_BUF, 1, 1, ROWS, HEAD_D], do_desc.layout)
    k_smem = gl.allocate_shared_memory(dtype, [2, 1, 1, ROWS, HEAD_D], k_desc.layout)
    t_layout: gl.constexpr = gl.NVMMASharedLayout.get_default_for([ROWS, ROWS], dtype)
    t_smem = gl.allocate_shared_memory(dtype, [2, ROWS, ROWS], t_layout)
    kv_bar = gl.allocate_shared_memory(gl.int64, [3 if CAUSAL else 2, 1], mbarrier.MBarrierLayout())
    q_ready = gl.allocate_shared_memory(gl.int64, [NUM_BUF, 1], mbarrier.MBarrierLayout())
    q_empty = gl.allocate_shared_memory(gl.int64, [NUM_BUF, 1], mbarrier.MBarrierLayout())
    for i in gl.static_range(2):
        mbarrier.init(kv_bar.index(i), count=1)
    for i in gl.static_range(NUM_BUF):
        mbarrier.init(q_ready.index(i), count=1)
        mbarrier.init(q_empty.index(i), count=2)  # both consumers release a slot
    # V is not needed: K's descriptor and tiles stand in for it (never read).
    args = (q_desc, k_desc, k_desc, do_desc, dv_desc, Lse, Delta, q_smem, do_smem, k_smem, k_smem, t_smem, kv_bar,
            q_ready, q_empty, b, kvh, n0, group_size, nheads, seqlen_q, seqlen_k, diag_offset, qk_scale, scale)
    gl.warp_specialize([(_dv_consumer0, args), (_dv_consumer1, args), (_dv_loader, args)], [4, 1],
                       [CONSUMER_REGS, LOADER_REGS])


@gluon.jit
def _dk_kernel(q_desc, k_desc, v_desc, do_desc, dk_desc, Lse, Delta, nheads, nheads_k, group_size, seqlen_q,
               seqlen_k, num_n_blocks, diag_offset, qk_scale, scale,
               CAUSAL: gl.constexpr, NUM_BUF: gl.constexpr, LOADER_REGS: gl.constexpr):
    """dK of 64 keys of one (batch, kv head) per program: one consumer warpgroup."""
    HEAD_D: gl.constexpr = q_desc.block_type.shape[3]
    dtype: gl.constexpr = q_desc.dtype
    pid = gl.program_id(0)
    bk = pid // num_n_blocks
    n0 = (pid % num_n_blocks) * ROWS
    b = bk // nheads_k
    kvh = bk % nheads_k
    q_smem = gl.allocate_shared_memory(dtype, [NUM_BUF, 1, 1, ROWS, HEAD_D], q_desc.layout)
    do_smem = gl.allocate_shared_memory(dtype, [NUM_BUF, 1, 1, ROWS, HEAD_D], do_desc.layout)
    k_smem = gl.allocate_shared_memory(dtype, [1, 1, 1, ROWS, HEAD_D], k_desc.layout)
    v_smem = gl.allocate_shared_memory(dtype, [1, 1, 1, ROWS, HEAD_D], v_desc.layout)
    t_layout: gl.constexpr = gl.NVMMASharedLayout.get_default_for([ROWS, ROWS], dtype)
    t_smem = gl.allocate_shared_memory(dtype, [1, ROWS, ROWS], t_layout)
    kv_bar = gl.allocate_shared_memory(gl.int64, [2 if CAUSAL else 1, 1], mbarrier.MBarrierLayout())
    q_ready = gl.allocate_shared_memory(gl.int64, [NUM_BUF, 1], mbarrier.MBarrierLayout())
    q_empty = gl.allocate_shared_memory(gl.int64, [NUM_BUF, 1], mbarrier.MBarrierLayout())
    mbarrier.init(kv_bar.index(0), count=1)
    for i in gl.static_range(NUM_BUF):
        mbarrier.init(q_ready.index(i), count=1)
        mbarrier.init(q_empty.index(i), count=1)
    args = (q_desc, k_desc, v_desc, do_desc, dk_desc, Lse, Delta, q_smem, do_smem, k_smem, v_smem, t_smem, kv_bar,
            q_ready, q_empty, b, kvh, n0, group_size, nheads, seqlen_q, seqlen_k, diag_offset, qk_scale, scale)
    gl.warp_specialize([(_dk_consumer0, args), (_dk_loader, args)], [1], [LOADER_REGS])


_launch_dv = Launcher(_dv_kernel)
_launch_dk = Launcher(_dk_kernel)


def split_backward(q, k, v, dout, lse, delta, dq, dk, dv, *, scale: float, diag_offset: int, causal: bool,
                   kernels=("dv", "dk", "dq"), dq_block_n: int = 32, dq_num_buf: int = 3) -> None:
    """The all-Gluon d256 backward: dV and dK kernels, then the library's dQ kernel.
    Tensors as ``backward_sm90.attention_backward_ws`` takes them."""
    from triton.experimental.gluon.nvidia.hopper import TensorDescriptor


    batch, nheads, seqlen_q, head_dim = q.shape
    nheads_k, seqlen_k = k.shape[1], k.shape[2]
    dtype_name = str(q.dtype).replace("torch.", "")

    def desc(t):
        return TensorDescriptor(t, list(t.shape), list(t.stride()), [1, 1, BLOCK, head_dim],
                                _smem_layout(BLOCK, head_dim, dtype_name))

    common = (lse, delta, nheads, nheads_k, nheads // nheads_k, seqlen_q, seqlen_k)
    if "dv" in kernels:
        nb = triton.cdiv(seqlen_k, 2 * BLOCK)
        _launch_dv((nb * batch * nheads_k,), (desc(q), desc(k), desc(dout), desc(dv), *common, nb, diag_offset,
                                              scale * LOG2E, scale),
                   dict(CAUSAL=causal, NUM_BUF=SPLIT_NUM_BUF, CONSUMER_REGS=CONSUMER_REGS, LOADER_REGS=LOADER_REGS),
                   4, 1)
    if "dk" in kernels:
        nb = triton.cdiv(seqlen_k, BLOCK)
        _launch_dk((nb * batch * nheads_k,), (desc(q), desc(k), desc(v), desc(dout), desc(dk), *common, nb,
                                              diag_offset, scale * LOG2E, scale),
                   dict(CAUSAL=causal, NUM_BUF=SPLIT_NUM_BUF, LOADER_REGS=LOADER_REGS), 4, 1)
    if "dq" in kernels:
        attention_backward_ws(q, k, v, dout, lse, delta, dq, None, None, scale=scale, diag_offset=diag_offset,
                              causal=causal, dq_block_n=dq_block_n, dq_num_buf=dq_num_buf, kernels=("dq",))


def compile_report() -> None:
    """Shared memory, spills and exp2-under-the-product of the d256 dQ variants (sm_90a)."""
    from flashtile.ops import backward_sm90 as bw
    from flashtile.ops import sm90_check

    for causal in (False, True):
        for block_n, num_buf in DQ_VARIANTS:
            c = sm90_check._compile_ws(
                f"dq-d256 causal={int(causal)} block_n={block_n} num_buf={num_buf}", bw._dq_kernel, "bf16", 256,
                dict(q_desc=bw.BLOCK, k_desc=block_n, v_desc=block_n, do_desc=bw.BLOCK, dq_desc=bw.BLOCK),
                dict(CAUSAL=causal, NUM_BUF=num_buf, CONSUMER_REGS=bw.CONSUMER_REGS, LOADER_REGS=bw.LOADER_REGS))
            regs, spill = c.registers()
            ex2 = ",".join(map(str, sm90_check.ex2_under_wait(c.sass(), 1)))
            print(f"{c.name} smem={c.shared} spill={spill} ex2={ex2}", flush=True)
        for name, fn, descs, extra in (
                ("dv-d256", _dv_kernel, ("q_desc", "k_desc", "do_desc", "dv_desc"), dict(CONSUMER_REGS=CONSUMER_REGS)),
                ("dk-d256", _dk_kernel, ("q_desc", "k_desc", "v_desc", "do_desc", "dk_desc"), {})):
            c = sm90_check._compile_ws(f"{name} causal={int(causal)} num_buf={SPLIT_NUM_BUF}", fn, "bf16", 256,
                                       dict.fromkeys(descs, bw.BLOCK),
                                       dict(CAUSAL=causal, NUM_BUF=SPLIT_NUM_BUF, LOADER_REGS=LOADER_REGS, **extra))
            regs, spill = c.registers()
            ex2 = ",".join(map(str, sm90_check.ex2_under_wait(c.sass(), 1)))
            print(f"{c.name} smem={c.shared} spill={spill} ex2={ex2} setmaxnreg={c.ptx.count('setmaxnreg')}",
                  flush=True)


@contextlib.contextmanager
def _stubbed(module, name):
    """``module.name`` replaced by a no-op launcher for the duration."""
    saved = getattr(module, name)
    setattr(module, name, lambda *a, **k: None)
    try:
        yield
    finally:
        setattr(module, name, saved)


def run(shapes) -> None:
    import torch
    from torch.nn.attention import SDPBackend, sdpa_kernel
    from triton.testing import do_bench

    from flashtile.ops import backward as tb
    from gluon_bwd import ref_grads

    os.environ["FLASHTILE_WS"] = "1"

    def gluon_dq(q, k, v, dout, lse, delta, dq, causal, diag, block_n, num_buf):
        split_backward(q, k, v, dout, lse, delta, dq, None, None, scale=q.shape[-1] ** -0.5, diag_offset=diag,
                       causal=causal, kernels=("dq",), dq_block_n=block_n, dq_num_buf=num_buf)

    # Correctness of the Gluon dQ at d256 against fp32 autograd (odd lengths, GQA, causal
    # rows that see no key).
    for B, H, Hk, Sq, Sk, causal in ((2, 4, 2, 333, 517, True), (1, 4, 4, 1000, 1000, False),
                                     (2, 6, 1, 300, 129, False), (1, 2, 2, 700, 200, True), (1, 2, 2, 1, 300, False)):
        g = torch.Generator(device="cuda").manual_seed(0)
        D = 256
        q = torch.randn(B, H, Sq, D, device="cuda", dtype=torch.bfloat16, generator=g)
        k, v = (torch.randn(B, Hk, Sk, D, device="cuda", dtype=torch.bfloat16, generator=g) for _ in range(2))
        dout = torch.randn(B, H, Sq, D, device="cuda", dtype=torch.bfloat16, generator=g)
        diag = Sk - Sq
        out, lse, dq_ref, dk_ref, dv_ref = ref_grads(q, k, v, dout, causal, diag)
        lse = lse.detach().contiguous()
        delta = (out.detach() * dout.float()).sum(-1).contiguous()
        name = f"B{B} H{H}/{Hk} Sq{Sq} Sk{Sk} causal={int(causal)}"
        for block_n, num_buf in DQ_VARIANTS:
            dq = torch.full_like(q, float("nan"))
            gluon_dq(q, k, v, dout, lse, delta, dq, causal, diag, block_n, num_buf)
            err = (dq.float() - dq_ref).abs().max().item()
            print(f"{name} dq({block_n},{num_buf}): max err {err:.2e} / |ref| {dq_ref.abs().max().item():.1e}",
                  flush=True)
        try:
            grads = [torch.full_like(t, float("nan")) for t in (q, k, v)]
            split_backward(q, k, v, dout, lse, delta, *grads, scale=D ** -0.5, diag_offset=diag, causal=causal)
            torch.cuda.synchronize()
            errs = "  ".join(f"{n} {(g_.float() - r).abs().max().item():.2e}/{r.abs().max().item():.1e}"
                             for n, g_, r in zip(("dq", "dk", "dv"), grads, (dq_ref, dk_ref, dv_ref)))
            print(f"{name} split (dV, dK, dQ kernels): max err/|ref| {errs}", flush=True)
        except Exception as exc:  # noqa: BLE001  (an experiment: report and go on)
            print(f"{name} split failed: {type(exc).__name__}: {str(exc)[:300]}", flush=True)

    for S, causal in shapes:
        B, H, D = 16384 // S, 2048 // 256, 256
        q, k, v, out, dout = (torch.randn(B, H, S, D, device="cuda", dtype=torch.bfloat16) for _ in range(5))
        lse = torch.randn(B, H, S, device="cuda").abs() + 5
        delta = torch.randn(B, H, S, device="cuda")
        dq, dk, dv = torch.empty_like(q), torch.empty_like(k), torch.empty_like(v)
        bwd_flops = 2.5 * 4 * B * H * S * S * D / (2 if causal else 1)
        config = tb_config(q, causal)

        def triton_bwd():
            tb.attention_backward(q, k, v, out, lse, dout, dq, dk, dv, scale=D ** -0.5, diag_offset=0,
                                  window_left=-1, window_right=0 if causal else -1, softcap=0.0, alibi_slopes=None,
                                  attn_mask=None, config=config)

        row = {"triton": bwd_flops / do_bench(triton_bwd, warmup=25, rep=100) * 1e-9}
        ms = {}
        for part, other in (("dkdv", "_launch_dq"), ("dq", "_launch_dkdv")):
            with _stubbed(tb, other):
                ms[part] = do_bench(triton_bwd, warmup=25, rep=100)
            row[f"  triton {part}"] = bwd_flops / ms[part] * 1e-9
        for block_n, num_buf in DQ_VARIANTS:
            ms_g = do_bench(lambda: gluon_dq(q, k, v, dout, lse, delta, dq, causal, 0, block_n, num_buf),
                            warmup=25, rep=100)
            ms[(block_n, num_buf)] = ms_g
            row[f"gluon dq{block_n},{num_buf}"] = bwd_flops / ms_g * 1e-9
        best = min(ms[v_] for v_ in DQ_VARIANTS)
        row["hybrid (projected)"] = bwd_flops / (ms["dkdv"] + best) * 1e-9

        def split(kernels=("dv", "dk", "dq")):
            split_backward(q, k, v, dout, lse, delta, dq, dk, dv, scale=D ** -0.5, diag_offset=0, causal=causal,
                           kernels=kernels)

        try:
            for part in ("dv", "dk"):
                row[f"gluon {part}"] = bwd_flops / do_bench(lambda: split((part,)), warmup=25, rep=100) * 1e-9
            row["gluon all"] = bwd_flops / do_bench(split, warmup=25, rep=100) * 1e-9
        except Exception as exc:  # noqa: BLE001
            print(f"d256 S{S} split failed: {type(exc).__name__}: {str(exc)[:200]}", flush=True)
        qs, ks, vs = (t.detach().requires_grad_(True) for t in (q, k, v))
        try:
            with sdpa_kernel(SDPBackend.CUDNN_ATTENTION):
                o = torch.nn.functional.scaled_dot_product_attention(qs, ks, vs, is_causal=causal)
                row["cudnn"] = bwd_flops / do_bench(
                    lambda: torch.autograd.grad(o, (qs, ks, vs), dout, retain_graph=True), warmup=25, rep=100) * 1e-9
        except Exception as exc:  # noqa: BLE001
            print(f"d256 S{S} cudnn failed: {type(exc).__name__}: {str(exc)[:200]}", flush=True)
        print(f"d256 S{S} causal={int(causal)}: " + "  ".join(f"{k_} {v_:6.1f}" for k_, v_ in row.items())
              + " TF/s", flush=True)


def tb_config(q, causal: bool):
    """The backward config the library's table picks for this call."""
    from flashtile.ops.configs import cuda_capability, default_bwd_config, device_index

    return default_bwd_config(cuda_capability(device_index(q.device)), q.shape[-1],
                              str(q.dtype).replace("torch.", ""), True, tile_masks=causal)


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

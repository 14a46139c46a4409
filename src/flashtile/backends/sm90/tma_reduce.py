"""A bulk tensor reduction from shared memory into global memory, for Gluon kernels on sm90.

FA3's backward adds each dQ tile into an fp32 buffer with one TMA reduction per tile
(``cp.reduce.async.bulk.tensor...add.f32``) instead of per-thread atomics, whose L2
throughput capped flashtile's one-pass backward at 290-375 TF/s (docs/perf-notes.md, runs
30-34). triton 3.6's Gluon ``tma`` module exports the bulk copies but not this reduction;
the compiled ``libtriton`` has the builder for it, ``GluonOpBuilder.create_async_tma_reduce
(kind, descriptor, coordinates, shared memory)`` with ``ir.DESCRIPTOR_REDUCE_KIND``.
`async_reduce_add_shared_to_global` wraps it as a Gluon builtin with the same arguments
as ``tma.async_copy_shared_to_global``: write the tile to shared memory, call
``fence_async_shared()``, issue the reduction, and ``tma.store_wait`` before the shared
memory is reused (the reduction is a bulk async group like a store).

`tests/test_sm90_compile.py` compiles `reduce_probe_kernel` for sm_90a on the CPU and checks
the instruction in its PTX (issue 17's first fact). Whether the hardware's result is the
sum (and at what speed) is for the GPU: ``tests/test_tma_reduce_gpu.py`` runs the probe.
"""

from __future__ import annotations

from triton._C.libtriton import ir
from triton.experimental import gluon
from triton.experimental.gluon import language as gl
from triton.experimental.gluon.language._core import builtin
from triton.experimental.gluon.language.nvidia.hopper import fence_async_shared, tma

__all__ = ["async_reduce_add_shared_to_global"]


@builtin
def async_reduce_add_shared_to_global(tensor_desc, coord, src, _semantic=None):
    """Add the shared-memory tile ``src`` into ``tensor_desc``'s block at ``coord``
    (element-wise, by the copy engine; fp32 adds at the L2). Asynchronous: wait with
    ``tma.store_wait`` before ``src`` is written again."""
    coord = _semantic._convert_to_ir_values(coord, require_i64=False)
    _semantic.builder.create_async_tma_reduce(ir.DESCRIPTOR_REDUCE_KIND.ADD, tensor_desc.handle, coord, src.handle)


@gluon.jit
def reduce_probe_kernel(desc, X, stride_x, ROWS: gl.constexpr, COLS: gl.constexpr):
    """Each program adds the fp32 (ROWS, COLS) tile X into ``desc``'s block at (0, 0):
    after n programs the block holds n * X (a probe of the instruction, not library code)."""
    layout: gl.constexpr = gl.BlockedLayout([1, 4], [4, 8], [4, 1], [1, 0])
    rows = gl.arange(0, ROWS, layout=gl.SliceLayout(1, layout))
    cols = gl.arange(0, COLS, layout=gl.SliceLayout(0, layout))
    tile = gl.load(X + rows[:, None] * stride_x + cols[None, :])
    smem = gl.allocate_shared_memory(gl.float32, [ROWS, COLS], desc.layout)
    smem.store(tile)
    fence_async_shared()
    async_reduce_add_shared_to_global(desc, [0, 0], smem)
    tma.store_wait(pendings=0)


@gluon.jit
def reduce_rate_kernel(desc, DQ, stride_dq, n_q_blocks, n_k_blocks, ROWS: gl.constexpr, COLS: gl.constexpr,
                        USE_TMA: gl.constexpr, NUM_BUF: gl.constexpr):
    """The dQ traffic of a one-pass backward without its products: program (head h, key
    block j) adds an fp32 (ROWS, COLS) tile into each of the ``n_q_blocks`` query blocks of
    head h's rows of DQ, starting at block j (so the programs of a wave hit different
    blocks), by bulk TMA reductions from NUM_BUF shared-memory slots (USE_TMA) or by
    per-thread atomic adds from registers. benchmarks/tma_reduce_rate.py times both."""
    layout: gl.constexpr = gl.BlockedLayout([1, 4], [4, 8], [4, 1], [1, 0])
    rows = gl.arange(0, ROWS, layout=gl.SliceLayout(1, layout))
    cols = gl.arange(0, COLS, layout=gl.SliceLayout(0, layout))
    pid = gl.program_id(0)
    head = pid // n_k_blocks
    j = pid % n_k_blocks
    tile = gl.full([ROWS, COLS], 1.0, gl.float32, layout) * (pid % 7 + 1).to(gl.float32)
    if USE_TMA:
        smem = gl.allocate_shared_memory(gl.float32, [NUM_BUF, ROWS, COLS], desc.layout)
        for i in range(n_q_blocks):
            slot = i % NUM_BUF
            tma.store_wait(pendings=NUM_BUF - 1)  # the reduction that last read this slot is done
            smem.index(slot).store(tile)
            fence_async_shared()
            q0 = (head * n_q_blocks + (j + i) % n_q_blocks) * ROWS
            async_reduce_add_shared_to_global(desc, [q0, 0], smem.index(slot))
        tma.store_wait(pendings=0)
    else:
        for i in range(n_q_blocks):
            q0 = (head * n_q_blocks + (j + i) % n_q_blocks) * ROWS
            gl.atomic_add(DQ + (q0 + rows).to(gl.int64)[:, None] * stride_dq + cols[None, :], tile, sem="relaxed")

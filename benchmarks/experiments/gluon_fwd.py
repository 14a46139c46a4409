"""Experiment: an FA3-style forward for Hopper written in Gluon (triton 3.6), against the
library's Triton kernel on the same inputs. Not part of flashtile's API.

Why: the Triton forward tops out at 0.78-0.92x cuDNN because its softmax runs while the
tensor cores idle. In plain Triton a wgmma stays in flight only as a loop-carried
accumulator (docs/perf-notes.md, "Tried without device time"). Gluon exposes the async
wgmma and its waits, so one program can overlap P_{j-1} V_{j-1} with the softmax of
tile j (FA3's intra-warpgroup overlap):

    issue S_j = Q K_j^T          (async)
    issue O  += P_{j-1} V_{j-1}  (async, P from registers)
    wait until 1 group is left   (S_j done; the P V product keeps the tensor cores busy)
    softmax of S_j               (exp2, row max/sum)
    wait for O, rescale it by alpha_j
K and V stream through a two-slot shared-memory ring filled by TMA, one mbarrier per
slot and operand. Scope of the experiment: bf16/fp16, head dim 64 or 128, seqlen a
multiple of the tiles, (B, H, S, D)-contiguous inputs, non-causal or causal with
seqlen_q == seqlen_k.

    PYTHONPATH=src python3 benchmarks/experiments/gluon_fwd.py            # GPU: check + time
    PYTHONPATH=src python3 benchmarks/experiments/gluon_fwd.py --compile  # CPU: sm_90a PTX only
"""

from __future__ import annotations

import argparse
import dataclasses
import re
import sys

from triton.experimental import gluon
from triton.experimental.gluon import language as gl
from triton.experimental.gluon.language.nvidia.hopper import (
    fence_async_shared,
    mbarrier,
    tma,
    warpgroup_mma,
    warpgroup_mma_wait,
)

LOG2E = 1.4426950408889634


@gluon.jit
def _load_kv(desc, smem, bars, slot, row):
    mbarrier.expect(bars.index(slot), desc.block_type.nbytes)
    tma.async_copy_global_to_shared(desc, [row, 0], bars.index(slot), smem.index(slot))


@gluon.jit
def _scores(s, qk_scale, m0, n0, BLOCK_M: gl.constexpr, BLOCK_N: gl.constexpr, CAUSAL: gl.constexpr,
            s_layout: gl.constexpr):
    s = s * qk_scale
    if CAUSAL:
        if n0 + BLOCK_N > m0:  # a tile on the diagonal
            rows = m0 + gl.arange(0, BLOCK_M, layout=gl.SliceLayout(1, s_layout))
            cols = n0 + gl.arange(0, BLOCK_N, layout=gl.SliceLayout(0, s_layout))
            s = gl.where(cols[None, :] <= rows[:, None], s, float("-inf"))
    return s


@gluon.jit
def _softmax_step(s, m_i, l_i):
    """One online-softmax step on a score tile in log2 units: (P, alpha, m, l), where alpha
    rescales what was accumulated against the old row maximum."""
    m_new = gl.maximum(m_i, gl.max(s, axis=1))
    p = gl.exp2(s - m_new[:, None])
    alpha = gl.exp2(m_i - m_new)
    return p, alpha, m_new, l_i * alpha + gl.sum(p, axis=1)


@gluon.jit
def _store_out(acc, m_i, l_i, o_smem, o_desc, Lse, row0, m_first, bh, seqlen,
               row_s: gl.constexpr, row_o: gl.constexpr):
    """O = acc / l through shared memory and a TMA store (o_smem: the finished Q tile);
    the natural-log LSE by plain stores."""
    out = acc / gl.convert_layout(l_i, row_o)[:, None]
    o_smem.store(out.to(o_desc.dtype))
    fence_async_shared()
    tma.async_copy_shared_to_global(o_desc, [row0 + m_first, 0], o_smem)
    rows = m_first + gl.arange(0, o_desc.block_type.shape[0], layout=row_s)
    gl.store(Lse + bh.to(gl.int64) * seqlen + rows, (m_i + gl.log2(l_i)) * 0.6931471805599453)
    tma.store_wait(pendings=0)


@gluon.jit
def _gluon_fwd_kernel(q_desc, k_desc, v_desc, o_desc, Lse, seqlen, qk_scale,
                      BLOCK_M: gl.constexpr, BLOCK_N: gl.constexpr, HEAD_D: gl.constexpr,
                      CAUSAL: gl.constexpr, num_warps: gl.constexpr):
    pid_m = gl.program_id(0)
    bh = gl.program_id(1)
    if CAUSAL:
        pid_m = gl.num_programs(0) - 1 - pid_m  # the longest rows first
    m0 = pid_m * BLOCK_M
    row0 = bh * seqlen  # this (batch, head) in the (B*H*S, D) matrix
    dtype: gl.constexpr = q_desc.dtype

    s_layout: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[num_warps, 1],
                                                       instr_shape=[16, BLOCK_N, 16])
    o_layout: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[num_warps, 1],
                                                       instr_shape=[16, HEAD_D, 16])
    p_layout: gl.constexpr = gl.DotOperandLayout(operand_index=0, parent=o_layout, k_width=2)
    row_s: gl.constexpr = gl.SliceLayout(1, s_layout)
    row_o: gl.constexpr = gl.SliceLayout(1, o_layout)

    q_smem = gl.allocate_shared_memory(dtype, [BLOCK_M, HEAD_D], q_desc.layout)
    k_smem = gl.allocate_shared_memory(dtype, [2, BLOCK_N, HEAD_D], k_desc.layout)
    v_smem = gl.allocate_shared_memory(dtype, [2, BLOCK_N, HEAD_D], v_desc.layout)
    q_bar = gl.allocate_shared_memory(gl.int64, [1], mbarrier.MBarrierLayout())
    k_bar = gl.allocate_shared_memory(gl.int64, [2, 1], mbarrier.MBarrierLayout())
    v_bar = gl.allocate_shared_memory(gl.int64, [2, 1], mbarrier.MBarrierLayout())
    mbarrier.init(q_bar, count=1)
    for i in gl.static_range(2):
        mbarrier.init(k_bar.index(i), count=1)
        mbarrier.init(v_bar.index(i), count=1)

    if CAUSAL:
        n_tiles = gl.cdiv(m0 + BLOCK_M, BLOCK_N)
    else:
        n_tiles = seqlen // BLOCK_N

    mbarrier.expect(q_bar, q_desc.block_type.nbytes)
    tma.async_copy_global_to_shared(q_desc, [row0 + m0, 0], q_bar, q_smem)
    _load_kv(k_desc, k_smem, k_bar, 0, row0)
    _load_kv(v_desc, v_smem, v_bar, 0, row0)
    if n_tiles > 1:
        _load_kv(k_desc, k_smem, k_bar, 1, row0 + BLOCK_N)
        _load_kv(v_desc, v_smem, v_bar, 1, row0 + BLOCK_N)

    # Tile 0: scores and the first softmax, nothing to overlap with yet.
    zeros_s = gl.zeros([BLOCK_M, BLOCK_N], gl.float32, s_layout)
    mbarrier.wait(q_bar, 0)
    mbarrier.wait(k_bar.index(0), 0)
    s = warpgroup_mma(q_smem, k_smem.index(0).permute((1, 0)), zeros_s, use_acc=False, is_async=True)
    s = warpgroup_mma_wait(num_outstanding=0, deps=(s,))
    s = _scores(s, qk_scale, m0, 0, BLOCK_M, BLOCK_N, CAUSAL, s_layout)
    m_i = gl.max(s, axis=1)
    p = gl.exp2(s - m_i[:, None])
    l_i = gl.sum(p, axis=1)
    acc = gl.zeros([BLOCK_M, HEAD_D], gl.float32, o_layout)

    for j in range(1, n_tiles):
        slot = j % 2
        prev = 1 - slot
        mbarrier.wait(k_bar.index(slot), (j // 2) & 1)
        s = warpgroup_mma(q_smem, k_smem.index(slot).permute((1, 0)), zeros_s, use_acc=False, is_async=True)
        mbarrier.wait(v_bar.index(prev), ((j - 1) // 2) & 1)
        acc = warpgroup_mma(gl.convert_layout(p.to(dtype), p_layout), v_smem.index(prev), acc, is_async=True)
        s = warpgroup_mma_wait(num_outstanding=1, deps=(s,))
        # K_{j-1}'s slot was read by S_{j-1}, long finished: refill it with K_{j+1} now.
        if j + 1 < n_tiles:
            _load_kv(k_desc, k_smem, k_bar, prev, row0 + (j + 1) * BLOCK_N)
        s = _scores(s, qk_scale, m0, j * BLOCK_N, BLOCK_M, BLOCK_N, CAUSAL, s_layout)
        p, alpha, m_i, l_i = _softmax_step(s, m_i, l_i)
        acc = warpgroup_mma_wait(num_outstanding=0, deps=(acc,))
        acc = acc * gl.convert_layout(alpha, row_o)[:, None]
        if j + 1 < n_tiles:  # P_{j-1} V_{j-1} is done: V_{j-1}'s slot is free
            _load_kv(v_desc, v_smem, v_bar, prev, row0 + (j + 1) * BLOCK_N)

    last = (n_tiles - 1) % 2
    mbarrier.wait(v_bar.index(last), ((n_tiles - 1) // 2) & 1)
    acc = warpgroup_mma(gl.convert_layout(p.to(dtype), p_layout), v_smem.index(last), acc, is_async=True)
    acc = warpgroup_mma_wait(num_outstanding=0, deps=(acc,))

    mbarrier.invalidate(q_bar)
    for i in gl.static_range(2):
        mbarrier.invalidate(k_bar.index(i))
        mbarrier.invalidate(v_bar.index(i))

    # Q is no longer read: its tile holds O for the TMA store.
    _store_out(acc, m_i, l_i, q_smem, o_desc, Lse, row0, m0, bh, seqlen, row_s, row_o)


# The warp-specialized variant (run 18) became the library's sm90 forward:
# flashtile/backends/sm90/forward.py. ``ws`` configs below time that kernel.


def library_ws(q4, k4, v4, causal: bool, block_n: int = 128, num_buf: int = 2, persistent: int = 1):
    """flashtile.backends.sm90.forward on (B, H, S, D) inputs with explicit tiles."""
    import torch

    from flashtile.backends.sm90.forward import attention_forward_ws

    out4 = torch.empty_like(q4)
    lse = torch.empty(q4.shape[:3], device=q4.device, dtype=torch.float32)
    attention_forward_ws(q4, k4, v4, out4, lse, scale=q4.shape[-1] ** -0.5, diag_offset=0, causal=causal,
                         block_n=block_n, num_buf=num_buf, persistent=bool(persistent))
    return out4, lse


def _layout(block, torch_dtype):
    import torch

    return gl.NVMMASharedLayout.get_default_for(block, {torch.bfloat16: gl.bfloat16, torch.float16: gl.float16}[torch_dtype])


def gluon_forward(q4, k4, v4, causal: bool, block_m: int = 128, block_n: int = 128, num_warps: int = 8):
    """q4, k4, v4: (B, H, S, D) contiguous, S % block_m == S % block_n == 0. Returns (out4, lse)."""
    import torch
    from triton.experimental.gluon.nvidia.hopper import TensorDescriptor

    B, H, S, D = q4.shape
    assert k4.shape == q4.shape and S % block_m == 0 and S % block_n == 0 and D in (64, 128)
    out4 = torch.empty_like(q4)
    lse = torch.empty((B, H, S), device=q4.device, dtype=torch.float32)

    def desc(t, rows):
        flat = t.reshape(B * H * S, D)
        return TensorDescriptor(flat, list(flat.shape), list(flat.stride()), [rows, D], _layout([rows, D], t.dtype))

    grid = (S // block_m, B * H)
    _gluon_fwd_kernel[grid](desc(q4, block_m), desc(k4, block_n), desc(v4, block_n), desc(out4, block_m), lse, S,
                            D ** -0.5 * LOG2E, BLOCK_M=block_m, BLOCK_N=block_n, HEAD_D=D, CAUSAL=causal,
                            num_warps=num_warps)
    return out4, lse


def compile_only(block_m=128, block_n=128, head_d=128, num_warps=8, causal=False, ws=False):
    """sm_90a compile on any machine (no GPU): a ``flashtile.tools.sm90_check.Compiled``.

    ws=True compiles the library's warp-specialized kernel (block_m is then 2 x 64 rows)."""
    from flashtile.tools.sm90_check import compile_forward_ws, compile_gluon

    if ws:
        return compile_forward_ws("bf16", head_d, causal=causal, block_n=block_n)

    def td(rows):
        return f"tensordesc<bf16[{rows}, {head_d}],{_layout_str(rows, head_d)}>"

    sig = {"q_desc": td(block_m), "k_desc": td(block_n), "v_desc": td(block_n), "o_desc": td(block_m),
           "Lse": "*fp32", "seqlen": "i32", "qk_scale": "fp32"}
    consts = {"BLOCK_M": block_m, "BLOCK_N": block_n, "HEAD_D": head_d, "CAUSAL": causal, "num_warps": num_warps}
    attrs = {(4,): [["tt.divisibility", 16]], (5,): [["tt.divisibility", 16]]}
    return compile_gluon("gluon", _gluon_fwd_kernel, sig, consts, attrs, num_warps=num_warps)


def _layout_str(rows, d):
    return str(gl.NVMMASharedLayout.get_default_for([rows, d], gl.bfloat16))


def _schedule(ptx: str) -> str:
    seq = []
    for line in ptx.splitlines():
        ins = line.strip()
        tag = ("MMA" if ins.startswith("wgmma.mma_async") else
               "WAIT" + ins.split()[-1].rstrip(";") if ins.startswith("wgmma.wait_group") else
               "EX2" if ins.startswith("ex2.approx") else
               "LOOP" if re.match(r"^\$L__BB\d+_\d+:", ins) else None)
        if tag:
            if seq and seq[-1][0] == tag:
                seq[-1][1] += 1
            else:
                seq.append([tag, 1])
    return " ".join(f"{t}x{n}" if n > 1 else t for t, n in seq)


def check_and_time(shapes, configs=((128, 128, 8),)) -> None:
    import torch
    from triton.testing import do_bench

    from flashtile.backends.configs import default_fwd_config
    from flashtile.backends.triton.forward import attention_forward
    from flashtile.problem.spec import Problem
    from torch.nn.attention import SDPBackend, sdpa_kernel

    for d, S, causal in shapes:
        B, H = 16384 // S, 2048 // d
        q4, k4, v4 = (torch.randn(B, H, S, d, device="cuda", dtype=torch.bfloat16) for _ in range(3))
        ref = torch.nn.functional.scaled_dot_product_attention(q4.float(), k4.float(), v4.float(), is_causal=causal)
        ref_lse = torch.logsumexp((q4.float() @ k4.float().transpose(-1, -2)) * d ** -0.5
                                  + (torch.full((S, S), float("-inf"), device="cuda").triu(1) if causal else 0), -1)
        flops = 4 * B * H * S * S * d / (2 if causal else 1)
        out_t, lse_t = torch.empty_like(q4), torch.empty((B, H, S), device="cuda", dtype=torch.float32)
        # The Triton kernel: the table's config with the Gluon path off.
        cfg = dataclasses.replace(default_fwd_config(torch.cuda.get_device_capability(), d, "bfloat16", causal, S),
                                  use_ws=False)
        problem = Problem(d ** -0.5, 0, -1, 0 if causal else -1)
        times, errs = {}, []
        for c in configs:
            if c[0] == "ws":  # ("ws", block_n, num_buf, persistent)
                name = f"ws n{c[1]} buf{c[2]} pers{c[3]}"
                fn = lambda c=c: library_ws(q4, k4, v4, causal, *map(int, c[1:]))
            else:  # (block_m, block_n, warps)
                name = f"gluon m{c[0]}n{c[1]}w{c[2]}"
                fn = lambda c=c: gluon_forward(q4, k4, v4, causal, *map(int, c))
            try:
                out, lse = fn()
                torch.cuda.synchronize()
            except Exception as exc:  # noqa: BLE001  (an experiment: report and go on)
                errs.append(f"{name} failed: {type(exc).__name__}: {str(exc)[:160]}")
                continue
            errs.append(f"{name} out {(out.float() - ref).abs().max().item():.1e} "
                        f"lse {(lse - ref_lse).abs().max().item():.1e}")
            times[name] = do_bench(fn, warmup=25, rep=100)
        times |= {"triton": do_bench(lambda: attention_forward(q4, k4, v4, out_t, lse_t, problem, config=cfg),
                                    warmup=25, rep=100)}
        with sdpa_kernel(SDPBackend.CUDNN_ATTENTION):
            times["cudnn"] = do_bench(lambda: torch.nn.functional.scaled_dot_product_attention(
                q4, k4, v4, is_causal=causal), warmup=25, rep=100)
        tf = {k: flops / ms * 1e-9 for k, ms in times.items()}
        print(f"d{d} S{S} causal={int(causal)} max err: {'; '.join(errs)}\n   "
              + "  ".join(f"{k} {v:6.1f}" for k, v in tf.items()) + " TF/s", flush=True)


def main(argv=None) -> int:
    p = argparse.ArgumentParser()
    p.add_argument("--compile", action="store_true", help="compile for sm_90a only (no GPU needed)")
    p.add_argument("--configs", default="128,128,8", help="block_m,block_n,warps or ws,block_n,num_buf,persistent;... (GPU run)")
    p.add_argument("--shapes", default="128,4096,0;128,4096,1;128,16384,0;128,16384,1;64,4096,0;64,16384,1",
                   help="headdim,seqlen,causal;... (GPU run)")
    args = p.parse_args(argv)
    if args.compile:
        for d, bm, bn, w, causal, ws in ((128, 128, 128, 8, False, False), (128, 128, 128, 8, True, False),
                                         (64, 64, 64, 4, False, False), (128, 128, 128, 4, False, True),
                                         (128, 128, 128, 4, True, True), (64, 128, 128, 4, False, True)):
            c = compile_only(bm, bn, d, w, causal, ws)
            regs, spills = c.registers()
            print(f"{'ws ' if ws else ''}d{d} m{bm} n{bn} w{w} causal={int(causal)}: regs={regs} spill={spills}B "
                  f"smem={c.shared} setmaxnreg={c.ptx.count('setmaxnreg')}\n"
                  f"  {_schedule(c.ptx)}", flush=True)
        return 0
    p_cfg = [tuple(x if x == "ws" else int(x) for x in c.split(",")) for c in args.configs.split(";")]
    shapes = [tuple(int(x) for x in sh.split(",")) for sh in args.shapes.split(";")]
    check_and_time([(d, S, bool(c)) for d, S, c in shapes], p_cfg)
    return 0


if __name__ == "__main__":
    sys.exit(main())

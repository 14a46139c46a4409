"""Experiment (issue 38): the decode kernel's key and value tiles read through TMA.

    PYTHONPATH=src python3 benchmarks/experiments/decode_tma.py            # GPU: check, then time
    TRITON_INTERPRET=1 PYTHONPATH=src python3 benchmarks/experiments/decode_tma.py --cpu   # check only

The library's decode kernel (``backends/triton/decode.py``) reads each key tile with
per-thread pointer loads (cp.async, pipelined by Triton). Here the same split-KV program
(b, kv head, block of packed GQA rows, split) reads them with host tensor descriptors of
the (batch, seqlen, nheads_k, headdim) cache in [1, BLOCK_N, 1, BLOCK_D] boxes: one
thread issues a tile, and the registers that held 64 addresses are free. Whole tiles run
unmasked; a split's last, partial tile is read with masked pointer loads, as the library
reads every tile (the cache holds anything past a sequence, NaN included, and a value row
zeroed in registers would hold the whole tile there: sm_90a, d128, 127 registers against
97), so only that tile pays for masks. A second variant reads the whole tiles through
unmasked pointer loads (cp.async as the library, without its per-key masks): whether a
gain is TMA's or only the masks'.

Scope: a row cache, one query per sequence (decoding), no options (rotary, ALiBi,
softcap, windows, sinks, appends). It uses the library's split plan and combine, so the
two kernels differ only in how they read the cache. The GPU run prints each shape's
speed against the library kernel (CUDA graphs: kernel time, not host time) and the bytes
read per second; the library takes it only if it wins at small batch without losing
elsewhere.
"""

from __future__ import annotations

import argparse
import itertools

import triton
import triton.language as tl

from flashtile.backends.triton.scores import C_LN2, LOG2E


@triton.jit
def tma_decode_kernel(
    Q, K, V, desc_k, desc_v, OutPart, LsePart, SeqLens,
    stride_qb, stride_qh, stride_kb, stride_ks, stride_kh, stride_vb, stride_vs, stride_vh,
    stride_pp, stride_pb, stride_ph, stride_lp, stride_lpb, stride_lph,
    nheads_k, group, split_size, num_m_blocks, qk_scale,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_D: tl.constexpr, NUM_SPLITS: tl.constexpr,
    TMA: tl.constexpr = True,
):
    """Program (b, kv head hk, row block, split): rows r = query heads hk * group + r of
    sequence b (one query each) against keys [split * split_size, (split + 1) * split_size)
    of its cache row; partial out and LSE (base e) into OutPart, LsePart. Whole tiles through
    the descriptors when TMA, else through unmasked pointer loads (the library's cp.async
    ring without its per-key masks)."""
    pid = tl.program_id(0)
    split = pid % NUM_SPLITS
    rest = pid // NUM_SPLITS
    m_block = rest % num_m_blocks
    bhk = rest // num_m_blocks
    b = bhk // nheads_k
    hk = bhk % nheads_k

    r = m_block * BLOCK_M + tl.arange(0, BLOCK_M)
    row_ok = r < group
    h = (hk * group + r).to(tl.int64)
    offs_d = tl.arange(0, BLOCK_D)
    q = tl.load(Q + b.to(tl.int64) * stride_qb + h[:, None] * stride_qh + offs_d[None, :], mask=row_ok[:, None],
                other=0.0)

    len_k = tl.load(SeqLens + b)
    lo = split * split_size
    hi = tl.minimum(lo + split_size, len_k)
    full_hi = lo + (tl.maximum(hi - lo, 0) // BLOCK_N) * BLOCK_N

    acc = tl.zeros([BLOCK_M, BLOCK_D], dtype=tl.float32)
    l_i = tl.zeros([BLOCK_M], dtype=tl.float32)
    m_i = tl.full([BLOCK_M], float("-inf"), dtype=tl.float32)
    k_row = K + b.to(tl.int64) * stride_kb + hk * stride_kh
    v_row = V + b.to(tl.int64) * stride_vb + hk * stride_vh
    for n0 in range(lo, full_hi, BLOCK_N):  # whole tiles: no masks
        if TMA:
            kt = tl.trans(desc_k.load([b, n0, hk, 0]).reshape(BLOCK_N, BLOCK_D))
        else:
            j64 = (n0 + tl.arange(0, BLOCK_N)).to(tl.int64)
            kt = tl.load(k_row + j64[None, :] * stride_ks + offs_d[:, None])
        s = tl.dot(q, kt) * qk_scale
        m_new = tl.maximum(m_i, tl.max(s, 1))
        p = tl.exp2(s - m_new[:, None])
        alpha = tl.exp2(m_i - m_new)
        l_i = l_i * alpha + tl.sum(p, 1)
        if TMA:
            v = desc_v.load([b, n0, hk, 0]).reshape(BLOCK_N, BLOCK_D)
        else:
            v = tl.load(v_row + j64[:, None] * stride_vs + offs_d[None, :])
        acc = tl.dot(p.to(v.dtype), v, acc * alpha[:, None])
        m_i = m_new
    for n0 in range(full_hi, hi, BLOCK_N):  # the last, partial tile (a loop: Triton stages its loads in
        j = n0 + tl.arange(0, BLOCK_N)       # shared memory, not the whole tile in registers)
        j_ok = j < hi
        j64 = j.to(tl.int64)
        b64 = b.to(tl.int64)
        kt = tl.load(K + b64 * stride_kb + hk * stride_kh + j64[None, :] * stride_ks + offs_d[:, None],
                     mask=j_ok[None, :], other=0.0)
        s = tl.where(j_ok[None, :], tl.dot(q, kt) * qk_scale, float("-inf"))
        m_new = tl.maximum(m_i, tl.max(s, 1))
        p = tl.exp2(s - m_new[:, None])
        alpha = tl.exp2(m_i - m_new)
        l_i = l_i * alpha + tl.sum(p, 1)
        v = tl.load(V + b64 * stride_vb + hk * stride_vh + j64[:, None] * stride_vs + offs_d[None, :],
                    mask=j_ok[:, None], other=0.0)
        acc = tl.dot(p.to(v.dtype), v, acc * alpha[:, None])
        m_i = m_new

    seen = l_i != 0.0
    out = acc / tl.where(seen, l_i, 1.0)[:, None]
    lse = tl.where(seen, (m_i + tl.log2(tl.where(seen, l_i, 1.0))) * C_LN2, float("-inf"))
    s64 = split.to(tl.int64)
    b64 = b.to(tl.int64)
    tl.store(OutPart + s64 * stride_pp + b64 * stride_pb + h[:, None] * stride_ph + offs_d[None, :], out,
             mask=row_ok[:, None])
    tl.store(LsePart + s64 * stride_lp + b64 * stride_lpb + h * stride_lph, lse, mask=row_ok)


def tma_decode(q, k_cache, v_cache, seqlens, num_warps: int = 4, num_stages: int = 3, tma: bool = True):
    """q (B, 1, H, D), caches (B, S, Hk, D) contiguous, seqlens int32 (B,) -> out (B, 1, H, D),
    lse (B, H, 1), with the library's split plan and combine; ``tma`` False: whole tiles
    through unmasked pointer loads instead of the descriptors."""
    import torch
    from triton.tools.tensor_descriptor import TensorDescriptor

    from flashtile.backends.triton import decode

    batch, seqlen_q, nheads, head_dim = q.shape
    if seqlen_q != 1 or head_dim not in (64, 128, 256):
        raise ValueError("the experiment decodes one query per sequence at head dims 64, 128 or 256")
    nheads_k = k_cache.shape[2]
    group = nheads // nheads_k
    block_m, block_n, block_d, _ = decode.block_sizes(head_dim, group)
    num_m_blocks = triton.cdiv(group, block_m)
    splits, split_size = decode.split_plan(q, k_cache, None, 0)
    out = torch.empty_like(q)
    lse = torch.empty(batch, nheads, 1, device=q.device, dtype=torch.float32)
    out_part = torch.empty(splits, batch, 1, nheads, head_dim, device=q.device, dtype=torch.float32)
    lse_part = torch.empty(splits, batch, nheads, 1, device=q.device, dtype=torch.float32)
    box = [1, block_n, 1, block_d]
    desc_k = TensorDescriptor(k_cache, list(k_cache.shape), list(k_cache.stride()), box)
    desc_v = TensorDescriptor(v_cache, list(v_cache.shape), list(v_cache.stride()), box)
    grid = (batch * nheads_k * num_m_blocks * splits,)
    tma_decode_kernel[grid](
        q, k_cache, v_cache, desc_k, desc_v, out_part, lse_part, seqlens,
        q.stride(0), q.stride(2), k_cache.stride(0), k_cache.stride(1), k_cache.stride(2),
        v_cache.stride(0), v_cache.stride(1), v_cache.stride(2),
        out_part.stride(0), out_part.stride(1), out_part.stride(3), lse_part.stride(0), lse_part.stride(1),
        lse_part.stride(2),
        nheads_k, group, split_size, num_m_blocks, head_dim ** -0.5 * LOG2E,
        BLOCK_M=block_m, BLOCK_N=block_n, BLOCK_D=block_d, NUM_SPLITS=splits, TMA=tma,
        num_warps=num_warps, num_stages=num_stages)
    decode.combine(out_part, lse_part, out, lse)
    return out, lse, splits


def library_decode(q, k_cache, v_cache, seqlens):
    """The library's decode kernel (and combine) on the same call: out, lse."""
    import torch

    from flashtile.backends.triton import decode

    batch, _, nheads, head_dim = q.shape
    out = torch.empty_like(q)
    lse = torch.empty(batch, nheads, 1, device=q.device, dtype=torch.float32)
    decode.decode(q, k_cache, v_cache, out, lse, seqlens, None, None, None, None, None, None, new=0,
                  scale=head_dim ** -0.5, softcap=0.0, window_left=-1, window_right=-1, interleaved=False,
                  rotary_local=False, num_splits=0)
    return out, lse


def make(batch, cached, nheads, nheads_k, head_dim, dtype, device, ragged: bool = True):
    """A decode call: caches of ``cached`` rows with NaN past each sequence (what the
    kernels must never read into a result), lengths ragged up to ``cached``."""
    import torch

    g = torch.Generator(device="cpu").manual_seed(batch * 7 + cached)
    q = torch.randn(batch, 1, nheads, head_dim, generator=g).to(device=device, dtype=dtype)
    k_cache, v_cache = (torch.randn(batch, cached, nheads_k, head_dim, generator=g).to(device=device, dtype=dtype)
                        for _ in range(2))
    lens = [cached - (37 * b if ragged else 0) % max(cached // 2, 1) for b in range(batch)]
    for b, n in enumerate(lens):
        k_cache[b, n:] = float("nan")
        v_cache[b, n:] = float("nan")
    return q, k_cache, v_cache, torch.tensor(lens, dtype=torch.int32, device=device)


def check(device: str, dtype, shapes) -> None:
    """The experiment's kernel, TMA and unmasked-pointer tiles, against the library's, shape
    by shape (max |difference| of out, LSE)."""
    import torch

    for (batch, cached, nheads, nheads_k, head_dim), tma in itertools.product(shapes, (True, False)):
        q, kc, vc, lens = make(batch, cached, nheads, nheads_k, head_dim, dtype, device)
        out, lse, splits = tma_decode(q, kc, vc, lens, tma=tma)
        ref_out, ref_lse = library_decode(q, kc, vc, lens)
        d_out = (out.float() - ref_out.float()).abs().max().item()
        d_lse = (lse - ref_lse).abs().max().item()
        ok = torch.isfinite(out.float()).all().item() and d_out <= 2e-2 and d_lse <= 1e-3
        print(f"check {'tma' if tma else 'unmasked'} B{batch} L{cached} H{nheads}/{nheads_k} d{head_dim} "
              f"splits {splits}: max |d out| {d_out:.2e}"
              f" |d lse| {d_lse:.2e} {'ok' if ok else 'FAILED'}", flush=True)
        if not ok:
            raise SystemExit(1)


def time_shapes(shapes) -> None:
    """Kernel time under CUDA graphs (host cost out), library vs TMA vs unmasked pointer loads
    of whole tiles, and the bytes read per second."""
    import torch
    from triton.testing import do_bench_cudagraph

    for batch, cached, nheads, nheads_k, head_dim in shapes:
        q, kc, vc, lens = make(batch, cached, nheads, nheads_k, head_dim, torch.bfloat16, "cuda", ragged=False)
        nbytes = 2 * kc.numel() * kc.element_size()
        ms_lib = do_bench_cudagraph(lambda: library_decode(q, kc, vc, lens), rep=100)
        ms_tma = do_bench_cudagraph(lambda: tma_decode(q, kc, vc, lens), rep=100)
        ms_plain = do_bench_cudagraph(lambda: tma_decode(q, kc, vc, lens, tma=False), rep=100)
        print(f"B{batch} L{cached} H{nheads}/{nheads_k} d{head_dim}: library {ms_lib * 1e3:7.1f} us "
              f"{nbytes / ms_lib * 1e-9:5.2f} TB/s | tma {ms_tma * 1e3:7.1f} us {nbytes / ms_tma * 1e-9:5.2f} TB/s "
              f"| unmasked {ms_plain * 1e3:7.1f} us | speed against the library: tma {ms_lib / ms_tma:.3f}, "
              f"unmasked {ms_lib / ms_plain:.3f}", flush=True)


SHAPES = [(1, 4096, 32, 8, 128), (1, 8192, 32, 8, 128), (1, 32768, 32, 8, 128), (2, 4096, 32, 8, 128),
          (2, 8192, 32, 8, 128), (4, 4096, 32, 8, 128), (4, 8192, 32, 8, 128), (4, 32768, 32, 8, 128),
          (8, 4096, 32, 8, 128), (8, 32768, 32, 8, 128), (64, 8192, 32, 8, 128), (4, 8192, 32, 8, 64),
          (4, 8192, 16, 2, 256)]


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--cpu", action="store_true", help="TRITON_INTERPRET=1: check small shapes on the CPU only")
    args = p.parse_args(argv)
    if args.cpu:
        import torch

        check("cpu", torch.float16, [(2, 1000, 8, 2, 64), (1, 70, 4, 4, 128), (3, 530, 6, 2, 64)])
        return 0
    import torch

    check("cuda", torch.bfloat16, [(2, 1000, 32, 8, 128), (3, 333, 8, 8, 64), (1, 4097, 16, 2, 256)])
    time_shapes(SHAPES)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())

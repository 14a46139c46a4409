"""Host cost per call next to GPU time: forward, forward with grad, backward (also with a
learnable sink), varlen forward (with and without grad) and backward, kv-cache decode and
a generation step (decode + append), for flashtile and its peers in the same process;
flashtile's calls through ``flash_attn_func`` and through its own
``scaled_dot_product_attention`` (``flashtile-sdpa``, the fixed-length rows).

    PYTHONPATH=src python3 benchmarks/host_overhead.py [--plans-off]

For each workload and implementation: ``host`` is microseconds per call measured with
perf_counter over 200 calls enqueued back to back, the fastest of 5 such blocks (no sync
inside a block: while the GPU queue is not full this is the CPU cost of one call), ``gpu`` is do_bench's median. When host > gpu,
a loop of eager calls waits on Python, and do_bench of it times the host, not the kernel.
Peers: sdpa-cudnn and sdpa-flash (torch SDPA with that backend forced), and sdpa-flashtile
(SDPA's flash backend with flashtile's SDPA provider active: the provider's host cost next
to the direct call's). For varlen the
peers run the same tokens as one dense sequence; for decode they attend over the whole
cache (SDPA has no per-sequence lengths). ``--plans-off`` sets FLASHTILE_PLANS=0 (every
call takes the full path: validation, config, Triton's launcher).

    TRITON_INTERPRET=1 PYTHONPATH=src python3 benchmarks/host_overhead.py --cpu-stub

needs no GPU: every kernel launch is stubbed (``flashtile.runtime.stubs.stub_launches``: plans
are recorded and replayed as on a GPU, the launch itself does nothing) and the flashtile
rows time the Python host path alone on small CPU tensors: a benchmark CI can run to
catch a host-cost regression, not a timed test.
"""

from __future__ import annotations

import argparse
import contextlib
import os
import sys
import time
from typing import Callable

import torch

import flashtile

IMPLS = ("flashtile", "flashtile-sdpa", "sdpa-cudnn", "sdpa-flash", "sdpa-flashtile")


@contextlib.contextmanager
def provider(on: bool):
    """flashtile's SDPA provider active inside when ``on`` (the sdpa-flashtile rows)."""
    if not on:
        yield
        return
    from flashtile.integrations import torch_sdpa
    with torch_sdpa.activated():
        yield


def host_us(fn, n=200, warmup=1, sync=None, blocks=1):
    """Host microseconds per call: ``n`` calls enqueued back to back after ``warmup``; with
    ``blocks`` > 1 the fastest of that many such blocks (a shared machine's noise only
    ever adds time)."""
    sync = sync or torch.cuda.synchronize
    for _ in range(warmup):
        fn()
    best = float("inf")
    for _ in range(blocks):
        sync()
        t = time.perf_counter()
        for _ in range(n):
            fn()
        best = min(best, (time.perf_counter() - t) / n * 1e6)
    sync()
    return best


def workloads(device: str, dtype: torch.dtype, d: int, S: int, peers: bool, B: int = 4) -> dict[str, dict[str, Callable]]:
    """{workload: {impl: zero-argument call}}; ``peers`` adds the SDPA rows (CUDA only)."""
    from torch.nn.attention import SDPBackend, sdpa_kernel
    from torch.nn.functional import scaled_dot_product_attention as sdpa

    H = 16
    mk = lambda *shape, grad=False: torch.randn(*shape, device=device, dtype=dtype, requires_grad=grad)
    q, k, v = (mk(B, S, H, d) for _ in range(3))
    leaves = [mk(B, S, H, d, grad=True) for _ in range(3)]
    out = flashtile.flash_attn_func(*leaves, causal=True)
    dout = torch.randn_like(out)
    sink = torch.randn(H, device=device, requires_grad=True)  # gpt-oss's learnable sink, one logit per head
    out_s = flashtile.flash_attn_func(*leaves, causal=True, learnable_sink=sink)
    # varlen: four documents packed into one row of 4*S tokens
    lens = [S // 2, S + S // 2, S // 4, S + S // 4 + S]
    cu = torch.tensor([0] + list(torch.tensor(lens).cumsum(0)), device=device, dtype=torch.int32)
    qv, kv, vv = (mk(sum(lens), H, d) for _ in range(3))
    leaves_v = [mk(sum(lens), H, d, grad=True) for _ in range(3)]
    out_v = flashtile.flash_attn_varlen_func(*leaves_v, cu, cu, max(lens), max(lens), causal=True)
    dout_v = torch.randn_like(out_v)
    # decode: batch 8, one new token, 4096 cached tokens (32 query heads over 8 kv heads)
    Bd, Sc, Hq, Hk = 8, 4096, 32, 8
    qd = mk(Bd, 1, Hq, d)
    kc, vc = mk(Bd, Sc, Hk, d), mk(Bd, Sc, Hk, d)
    seqlens = torch.full((Bd,), Sc - 96, device=device, dtype=torch.int32)
    kd, vd = mk(Bd, 1, Hk, d), mk(Bd, 1, Hk, d)
    # batch 1: a step bound by its launches (an eager step this small is one launch: ``decode.fuse_step``)
    q1, k1, v1 = qd[:1], kd[:1], vd[:1]
    kc1, vc1, seqlens1 = kc[:1], vc[:1], seqlens[:1]
    rows = {
        "fwd, no grad": {"flashtile": lambda: flashtile.flash_attn_func(q, k, v, causal=True)},
        "fwd, inputs require grad": {"flashtile": lambda: flashtile.flash_attn_func(*leaves, causal=True)},
        "bwd (autograd.grad, retained graph)": {
            "flashtile": lambda: torch.autograd.grad(out, leaves, dout, retain_graph=True)},
        "fwd with grad, learnable sink": {
            "flashtile": lambda: flashtile.flash_attn_func(*leaves, causal=True, learnable_sink=sink)},
        "bwd, learnable sink": {
            "flashtile": lambda: torch.autograd.grad(out_s, leaves + [sink], dout, retain_graph=True)},
        "varlen fwd, 4 documents": {"flashtile": lambda: flashtile.flash_attn_varlen_func(
            qv, kv, vv, cu, cu, max(lens), max(lens), causal=True)},
        # a packed training call: its forward with grad and its backward
        "varlen fwd, inputs require grad": {"flashtile": lambda: flashtile.flash_attn_varlen_func(
            *leaves_v, cu, cu, max(lens), max(lens), causal=True)},
        "varlen bwd (autograd.grad)": {
            "flashtile": lambda: torch.autograd.grad(out_v, leaves_v, dout_v, retain_graph=True)},
        "kvcache decode, B8 4096 cached": {"flashtile": lambda: flashtile.flash_attn_with_kvcache(
            qd, kc, vc, cache_seqlens=seqlens)},
        # a generation step: the new token's key and value appended first (same positions every
        # call: the cache does not grow); the SDPA peers have no cache, they run the row above
        "kvcache decode + append, B8 4096": {"flashtile": lambda: flashtile.flash_attn_with_kvcache(
            qd, kc, vc, kd, vd, cache_seqlens=seqlens)},
        "kvcache decode, B1 4096 cached": {"flashtile": lambda: flashtile.flash_attn_with_kvcache(
            q1, kc1, vc1, cache_seqlens=seqlens1)},
        "kvcache decode + append, B1 4096": {"flashtile": lambda: flashtile.flash_attn_with_kvcache(
            q1, kc1, vc1, k1, v1, cache_seqlens=seqlens1)},
    }
    # flashtile's own SDPA API on (B, H, S, D) tensors (torch's semantics: top-left causal)
    t = lambda x: x.transpose(1, 2)
    qh, kh, vh = (t(x).contiguous() for x in (q, k, v))
    lh = [t(x).detach().contiguous().requires_grad_(True) for x in leaves]
    oh = flashtile.scaled_dot_product_attention(*lh, is_causal=True)
    doh = torch.randn_like(oh)
    rows["fwd, no grad"]["flashtile-sdpa"] = lambda: flashtile.scaled_dot_product_attention(qh, kh, vh, is_causal=True)
    rows["fwd, inputs require grad"]["flashtile-sdpa"] = lambda: flashtile.scaled_dot_product_attention(
        *lh, is_causal=True)
    rows["bwd (autograd.grad, retained graph)"]["flashtile-sdpa"] = lambda: torch.autograd.grad(
        oh, lh, doh, retain_graph=True)
    if not peers:
        return rows
    qvt, kvt, vvt = (x.transpose(0, 1).unsqueeze(0).contiguous() for x in (qv, kv, vv))
    lvt = [x.detach().transpose(0, 1).unsqueeze(0).contiguous().requires_grad_(True) for x in leaves_v]
    qdt = t(qd).contiguous()
    kdt, vdt = (t(x).repeat_interleave(Hq // Hk, dim=1).contiguous() for x in (kc, vc))
    for impl, backend in (("sdpa-cudnn", SDPBackend.CUDNN_ATTENTION), ("sdpa-flash", SDPBackend.FLASH_ATTENTION),
                          ("sdpa-flashtile", SDPBackend.FLASH_ATTENTION)):
        def forced(fn, backend=backend):
            def call():
                with sdpa_kernel(backend):
                    return fn()
            return call
        with sdpa_kernel(backend), provider(impl == "sdpa-flashtile"):
            o = sdpa(*lh, is_causal=True)
        do = torch.randn_like(o)
        rows["fwd, no grad"][impl] = forced(lambda: sdpa(qh, kh, vh, is_causal=True))
        rows["fwd, inputs require grad"][impl] = forced(lambda: sdpa(*lh, is_causal=True))
        rows["bwd (autograd.grad, retained graph)"][impl] = forced(
            lambda o=o, do=do: torch.autograd.grad(o, lh, do, retain_graph=True))
        rows["varlen fwd, 4 documents"][impl] = forced(lambda: sdpa(qvt, kvt, vvt, is_causal=True))
        with sdpa_kernel(backend), provider(impl == "sdpa-flashtile"):
            ov = sdpa(*lvt, is_causal=True)
        dov = torch.randn_like(ov)
        rows["varlen fwd, inputs require grad"][impl] = forced(lambda: sdpa(*lvt, is_causal=True))
        rows["varlen bwd (autograd.grad)"][impl] = forced(
            lambda ov=ov, dov=dov: torch.autograd.grad(ov, lvt, dov, retain_graph=True))
        rows["kvcache decode, B8 4096 cached"][impl] = forced(lambda: sdpa(qdt, kdt, vdt))
        rows["kvcache decode + append, B8 4096"][impl] = rows["kvcache decode, B8 4096 cached"][impl]
        rows["kvcache decode, B1 4096 cached"][impl] = forced(lambda: sdpa(qdt[:1], kdt[:1], vdt[:1]))
        rows["kvcache decode + append, B1 4096"][impl] = rows["kvcache decode, B1 4096 cached"][impl]
    return rows


def cpu_stub(n: int = 2000) -> None:
    """Host microseconds per call of flashtile's API with every kernel launch stubbed."""
    from flashtile.runtime.stubs import stub_launches

    if os.environ.get("TRITON_INTERPRET") != "1":  # read when the kernels are defined: too late to set here
        raise SystemExit("--cpu-stub runs the Triton path on CPU tensors: run it with TRITON_INTERPRET=1")
    os.environ.setdefault("FLASHTILE_BACKEND", "triton")
    # a GPU call's metadata is on the device and checked there (the path the kv-cache rows
    # time on a GPU); CPU metadata would take the host check instead
    os.environ.setdefault("FLASHTILE_KVCACHE_CHECK", "device")
    from flashtile.integrations import torch_sdpa

    handle = torch_sdpa.install("CPU")  # the provider's rows: PyTorch's flash ops called directly
    with stub_launches():
        rows = workloads("cpu", torch.float16, 64, 128, peers=False)
        op = torch.ops.aten._scaled_dot_product_flash_attention
        qh, kh, vh = (torch.randn(4, 16, 128, 64, dtype=torch.float16) for _ in range(3))
        lh = [torch.randn(4, 16, 128, 64, dtype=torch.float16, requires_grad=True) for _ in range(3)]
        oh = op(*lh, 0.0, True)[0]
        doh = torch.randn_like(oh)
        rows["fwd, no grad"]["sdpa-flashtile"] = lambda: op(qh, kh, vh, 0.0, True)
        rows["fwd, inputs require grad"]["sdpa-flashtile"] = lambda: op(*lh, 0.0, True)
        rows["bwd (autograd.grad, retained graph)"]["sdpa-flashtile"] = lambda: torch.autograd.grad(
            oh, lh, doh, retain_graph=True)
        for name, impls in rows.items():
            for impl, fn in impls.items():
                try:
                    us = host_us(fn, n=n // 10, warmup=100, sync=lambda: None, blocks=10)
                    print(f"{name:38s} {impl:14s} host {us:7.1f} us", flush=True)
                except Exception as err:  # a workload the stub cannot run: say so, go on
                    print(f"{name:38s} {impl:14s} failed: {type(err).__name__}: {err}", flush=True)
    handle.remove()


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--cpu-stub", action="store_true", help="no GPU: time the host path with stubbed launches")
    p.add_argument("--plans-off", action="store_true", help="FLASHTILE_PLANS=0: the full path on every call")
    p.add_argument("--headdim", type=int, default=128)
    p.add_argument("--seqlen", type=int, default=512, help="fwd/bwd rows: --batch, 16 heads, causal")
    p.add_argument("--batch", type=int, default=4, help="fwd/bwd rows' batch")
    p.add_argument("--only", nargs="+", help="the workloads whose name holds one of these words")
    p.add_argument("--impl", nargs="+", choices=IMPLS, default=IMPLS[:4],
                   help="default: flashtile's two APIs and the two SDPA backends (sdpa-flashtile on request)")
    p.add_argument("--dtype", choices=("bf16", "fp16"), default="bf16")
    args = p.parse_args(argv)
    if args.plans_off:
        os.environ["FLASHTILE_PLANS"] = "0"
    if args.cpu_stub:
        cpu_stub()
        return 0
    from triton.testing import do_bench

    dtype = {"bf16": torch.bfloat16, "fp16": torch.float16}[args.dtype]
    print(f"# {torch.cuda.get_device_name()} torch {torch.__version__} d{args.headdim} S{args.seqlen} "
          f"B{args.batch} {args.dtype} plans {'off' if args.plans_off else 'on'}", flush=True)
    for name, impls in workloads("cuda", dtype, args.headdim, args.seqlen, peers=True, B=args.batch).items():
        if args.only and not any(w in name for w in args.only):
            continue
        cells = []
        for impl in args.impl:
            if impl not in impls:  # flashtile's SDPA has no packed or kv-cache rows
                continue
            try:
                fn = impls[impl]
                with provider(impl == "sdpa-flashtile"):
                    fn()
                    torch.cuda.synchronize()
                    gpu = do_bench(fn, warmup=25, rep=100, return_mode="median") * 1e3
                    cells.append(f"{impl}: host {host_us(fn, blocks=5):6.1f} gpu {gpu:7.1f}")
            except Exception as err:  # e.g. a backend that refuses the shape
                cells.append(f"{impl}: failed ({type(err).__name__}: {str(err)[:60]})")
        print(f"{name:38s} " + " | ".join(cells), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())

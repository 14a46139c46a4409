"""Compile the kernels for Hopper (sm90) on a machine without a GPU.

Triton compiles ahead of time for a named target with the ptxas it ships, so CI can
check what otherwise only shows on the device: that every launch configuration in the
tables compiles, fits in the 227 KB of shared memory a block may use on an H100/H200, and
reaches the Hopper tensor-core instructions (wgmma). Run it in a process without
TRITON_INTERPRET (under the interpreter ``@triton.jit`` builds no compilable function)::

    python -m flashtile.tools.sm90_check            # smem and wgmma of every table config
    python -m flashtile.tools.sm90_check --regs     # plus registers and spills (ptxas -v)
    python -m flashtile.tools.sm90_check --headdim 128   # one head dim of the table
    python -m flashtile.tools.sm90_check --decode   # the KV-cache kernels (backends/triton/decode.py)
    python -m flashtile.tools.sm90_check --wide     # head dims to 512, v's own head dim, MLA decode
    python -m flashtile.tools.sm90_check --flex     # the flex kernels with translated mods
    python -m flashtile.tools.sm90_check --flex --ptx-only   # shared memory and PTX only, no ptxas
    python -m flashtile.tools.sm90_check --flex --flex-part fit   # those that once ran past shared memory
    python -m flashtile.tools.sm90_check --ptx-only --regs-match '^fwd '   # ptxas for the matching kernels only

Registers per thread and spill bytes come from running Triton's bundled ptxas with
``-v`` on the generated PTX: a kernel at the 255-register cap that spills to local
memory runs slower than its tile sizes suggest (the backward kernels do, see
docs/perf-notes.md).
"""

from __future__ import annotations

import contextlib
import os
import re
import subprocess
import sys
import tempfile
import threading
from dataclasses import dataclass

SM90_SHARED_LIMIT = 232448  # bytes a block may opt into on sm90 (cudaDevAttrMaxSharedMemoryPerBlockOptin)


@dataclass(frozen=True)
class Compiled:
    name: str
    shared: int
    wgmma: bool
    tma: bool
    ptx: str = ""
    ptxas_log: str = ""  # what the compile's own ``ptxas -v`` printed ("" on a cache hit)
    cubin: bytes = b""  # the compile's sm_90a binary

    def registers(self) -> tuple[int, int]:
        """(registers per thread, spill store + load bytes) from ptxas -v for sm_90a: the
        compile's own log, or ptxas run again on the PTX when the compile was cached."""
        log = self.ptxas_log
        if "Used " not in log:
            import triton

            ptxas = os.path.join(os.path.dirname(triton.__file__), "backends", "nvidia", "bin", "ptxas")
            with tempfile.TemporaryDirectory() as tmp:
                path = os.path.join(tmp, "kernel.ptx")
                with open(path, "w") as fh:
                    fh.write(self.ptx)
                log = subprocess.run([ptxas, "-v", "--gpu-name", "sm_90a", path, "-o", os.devnull],
                                     capture_output=True, text=True, check=True).stderr
        regs = re.search(r"Used (\d+) registers", log)
        spills = [int(x) for x in re.findall(r"(\d+) bytes spill (?:stores|loads)", log)]
        return (int(regs.group(1)) if regs else -1), sum(spills)

    def sass(self) -> str:
        """The sm_90a machine code (ptxas, then nvdisasm): ptxas schedules within a basic
        block and may move a ``wgmma.wait_group`` above independent work, so an overlap
        written in the PTX is only real if it survives here."""
        import triton

        bindir = os.path.join(os.path.dirname(triton.__file__), "backends", "nvidia", "bin")
        with tempfile.TemporaryDirectory() as tmp:
            ptx, cubin = os.path.join(tmp, "kernel.ptx"), os.path.join(tmp, "kernel.cubin")
            if self.cubin:
                with open(cubin, "wb") as fh:
                    fh.write(self.cubin)
            else:
                with open(ptx, "w") as fh:
                    fh.write(self.ptx)
                subprocess.run([os.path.join(bindir, "ptxas"), "--gpu-name", "sm_90a", ptx, "-o", cubin],
                               capture_output=True, text=True, check=True)
            return subprocess.run([os.path.join(bindir, "nvdisasm"), "-c", cubin],
                                  capture_output=True, text=True, check=True).stdout


def ex2_under_wait(sass: str, in_flight: int) -> list[int]:
    """For each ``WARPGROUP.DEPBAR.LE gsb0, in_flight`` (products still in flight) in
    ``sass``: how many MUFU.EX2 run before the next full wait (``DEPBAR.LE gsb0, 0x0``),
    i.e. the exp2 work that overlaps those products."""
    counts, open_ = [], False
    for line in sass.splitlines():
        if f"WARPGROUP.DEPBAR.LE gsb0, {in_flight:#x} " in line:
            counts.append(0)
            open_ = True
        elif "WARPGROUP.DEPBAR.LE gsb0, 0x0 " in line:
            open_ = False
        elif open_ and "MUFU.EX2" in line:
            counts[-1] += 1
    return counts


def _signature(fn, pointers: dict, constexprs: dict) -> dict:
    sig = {}
    for name in fn.arg_names:
        if name in constexprs:
            sig[name] = "constexpr"
        elif name in pointers:
            sig[name] = pointers[name]
        elif name.startswith(("qk_scale", "softcap", "sm_scale", "dropout_p")) or name == "scale":
            sig[name] = "fp32"
        else:
            sig[name] = "i32"
    return sig


def _divisibility(fn, sig: dict) -> dict:
    """The specialization a launch at the benchmark shapes gets: Triton marks every pointer
    that is 16-byte aligned and every int that is a multiple of 16 (strides of contiguous
    (B, S, H, D) tensors, seqlens 512..16k, head dims 64/128/256) as divisible by 16, and
    the kernels' address arithmetic vectorises only with that fact. Without it the
    register and spill counts describe a kernel that never runs."""
    attrs = {}
    # Not modelled: ints equal to 1 become constants at run time (the key stride of a
    # contiguous mask, a (H,)-broadcast ALiBi stride, group size 1); they stay plain here.
    unit = ("stride_mn", "stride_ah")
    for i, name in enumerate(fn.arg_names):
        kind = sig[name]
        if (kind.startswith("*") or (name.startswith("stride_") and name not in unit)
                or name in ("seqlen_q", "seqlen_k", "head_dim")):
            attrs[(i,)] = [["tt.divisibility", 16]]
    return attrs


def _build(name: str, src, **options) -> Compiled:
    """Compile a kernel source (Triton's ASTSource or Gluon's) for sm_90a."""
    import io

    import triton
    from triton import knobs
    from triton.backends.compiler import GPUTarget

    # Triton runs ptxas -v itself; with this knob it prints that log (to stdout), which
    # spares ``registers()`` a second ptxas run (~15% of a compile check).
    log = io.StringIO()
    with knobs.nvidia.scope(), contextlib.redirect_stdout(log):  # the scope restores the knob and its variable
        knobs.nvidia.dump_ptxas_log = True
        kernel = triton.compile(src, target=GPUTarget("cuda", 90, 32), options=options)
    ptx = kernel.asm["ptx"]
    return Compiled(name, kernel.metadata.shared, "wgmma.mma_async" in ptx, "cp.async.bulk.tensor" in ptx, ptx,
                    log.getvalue(), kernel.asm.get("cubin", b""))


_PTX_ONLY = threading.Lock()


@contextlib.contextmanager
def ptx_only():
    """Inside, compiles stop at the PTX: no ptxas (~30-45% of a compile), for checks that
    read only the shared memory and the PTX (whether ptxas takes the kernel then shows on a
    GPU). Their ``cubin`` is empty and their ``ptxas_log`` too (``registers()`` runs ptxas).

    The empty binary must never reach a GPU: Triton's stage hook
    (``knobs.runtime.add_stages_inspection_hook``) swaps the cubin stage, and the compiles
    go to a plain file cache in a directory of their own, deleted after (whatever cache
    manager is configured: a remote one would share them), with IR dumps off; Triton's
    knob scopes restore every knob and environment variable they touch. For
    ``triton.compile`` only (a ``kernel[grid]`` launch inside would keep the empty kernel
    in the JIT's memory). One thread at a time, not nested."""
    from triton import knobs
    from triton.runtime.cache import FileCacheManager

    if not _PTX_ONLY.acquire(blocking=False):
        raise RuntimeError("sm90_check.ptx_only() is already active (it is neither reentrant nor thread-safe)")
    try:
        with tempfile.TemporaryDirectory() as tmp, knobs.cache.scope(), knobs.runtime.scope(), \
                knobs.compilation.scope():
            previous = knobs.runtime.add_stages_inspection_hook

            def without_ptxas(backend, stages, options, language, capability):
                if previous is not None:
                    previous(backend, stages, options, language, capability)
                stages["cubin"] = lambda src, metadata: b""

            knobs.runtime.add_stages_inspection_hook = without_ptxas
            knobs.cache.manager_class = FileCacheManager
            knobs.cache.dir = tmp
            knobs.compilation.dump_ir = False
            knobs.compilation.override = False
            yield
    finally:
        _PTX_ONLY.release()


def _compile(name, fn, pointers, constexprs, num_warps, num_stages) -> Compiled:
    from triton.compiler import ASTSource

    sig = _signature(fn, pointers, constexprs)
    src = ASTSource(fn, sig, constexprs=constexprs, attrs=_divisibility(fn, sig))
    return _build(name, src, num_warps=num_warps, num_stages=num_stages)


def compile_gluon(name: str, fn, sig: dict, constexprs: dict, attrs: dict, num_warps: int) -> Compiled:
    """A Gluon kernel for sm_90a. ``sig``: the type string of every runtime argument
    (constexprs are added); ``attrs``: {(arg index,): [["tt.divisibility", 16]]} facts."""
    from triton.experimental.gluon._runtime import GluonASTSource

    sig = dict(sig, **{n: "constexpr" for n in constexprs})
    return _build(name, GluonASTSource(fn, sig, constexprs=constexprs, attrs=attrs), num_warps=num_warps)


def compile_tma_reduce_probe(rows: int = 64, cols: int = 128) -> Compiled:
    """``backends.sm90.tma_reduce.reduce_probe_kernel`` for sm_90a: an fp32 (rows, cols) tile added
    from shared memory into a tensor descriptor's block by one bulk TMA reduction
    (``cp.reduce.async.bulk.tensor...add``, the instruction FA3's dQ accumulation uses)."""
    from triton.experimental.gluon import language as gl

    from flashtile.backends.sm90.tma_reduce import reduce_probe_kernel

    layout = gl.NVMMASharedLayout.get_default_for([rows, cols], gl.float32)
    sig = {"desc": f"tensordesc<fp32[{rows}, {cols}],{layout}>", "X": "*fp32", "stride_x": "i32"}
    return compile_gluon(f"tma-reduce-probe fp32 {rows}x{cols}", reduce_probe_kernel, sig,
                         dict(ROWS=rows, COLS=cols), {(1,): [["tt.divisibility", 16]]}, num_warps=4)


def compile_tma_reduce_rate(use_tma: bool, num_buf: int = 2, rows: int = 64, cols: int = 128) -> Compiled:
    """``backends.sm90.tma_reduce.reduce_rate_kernel`` (benchmarks/tma_reduce_rate.py) for sm_90a."""
    from triton.experimental.gluon import language as gl

    from flashtile.backends.sm90.tma_reduce import reduce_rate_kernel

    layout = gl.NVMMASharedLayout.get_default_for([rows, cols], gl.float32)
    sig = {"desc": f"tensordesc<fp32[{rows}, {cols}],{layout}>", "DQ": "*fp32", "stride_dq": "i32",
           "n_q_blocks": "i32", "n_k_blocks": "i32"}
    return compile_gluon(f"tma-reduce-rate use_tma={use_tma} num_buf={num_buf}", reduce_rate_kernel, sig,
                         dict(ROWS=rows, COLS=cols, USE_TMA=use_tma, NUM_BUF=num_buf),
                         {(1,): [["tt.divisibility", 16]]}, num_warps=4)


def _block(head_dim: int) -> int:
    return max(16, 1 << (head_dim - 1).bit_length())


def compile_forward(cfg, dtype: str, head_dim: int, *, causal: bool, mask_mode: int = 0, extras: bool = False,
                    varlen: bool = False, head_dim_v: int = 0) -> Compiled:
    """The forward kernel with ``cfg`` (a FwdConfig); ``extras`` turns on every option;
    ``varlen``: the packed-sequence variant (work list from backends/worklist.py);
    ``head_dim_v``: v's head dim (0: head_dim)."""
    from flashtile.backends.triton.forward import fwd_kernel

    dv = head_dim_v or head_dim
    block_d, block_dv = _block(head_dim), _block(dv)
    c = dict(BLOCK_M=cfg.block_m, BLOCK_N=cfg.block_n, BLOCK_D=block_d, EVEN_D=block_d == head_dim,
             BLOCK_DV=block_dv, EVEN_DV=block_dv == dv, SAME_DV=dv == head_dim,
             WINDOW_LEFT=extras, WINDOW_RIGHT=causal or extras, SOFTCAP=extras, HAS_ALIBI=extras,
             MASK_MODE=mask_mode, IEEE_DOT=dtype == "fp32", REVERSE_M=causal, USE_TMA=cfg.use_tma, DROPOUT=extras,
             VARLEN=varlen, HAS_SINK=extras, CHUNK=extras)
    ptrs = {n: f"*{dtype}" for n in ("Q", "K", "V", "Out", "desc_q", "desc_k", "desc_v", "desc_o")}
    ptrs.update(Lse="*fp32", Mask="*u8" if mask_mode == 1 else f"*{dtype}", Alibi="*fp32", Seed="*i64",
                Items="*i32", Sink="*fp32")
    if cfg.use_tma:
        for n, rows, cols in (("desc_q", cfg.block_m, block_d), ("desc_k", cfg.block_n, block_d),
                              ("desc_v", cfg.block_n, block_dv), ("desc_o", cfg.block_m, block_dv)):
            ptrs[n] = f"tensordesc<{dtype}[1,1,{rows},{cols}]>"
    dims = f"d{head_dim}" + (f"-{dv}" if dv != head_dim else "")
    name = f"fwd {dtype} {dims} causal={causal} mask={mask_mode} extras={extras} varlen={varlen} {cfg}"
    return _compile(name, fwd_kernel, ptrs, c, cfg.num_warps, cfg.num_stages)


def _compile_ws(name: str, fn, dtype: str, head_dim: int, rows: dict, constexprs: dict,
                extra_pointers: dict | None = None) -> Compiled:
    """A warp-specialized Gluon kernel of ``backends.sm90``: ``rows`` gives
    the box rows of each tensor-descriptor argument; Lse and Delta are float32 pointers
    (16-byte aligned at run time), Counter an int32 pointer, the other runtime arguments typed
    as ``_signature`` does."""
    from flashtile.backends.sm90.common import smem_layout

    torch_name = {"bf16": "bfloat16", "fp16": "float16"}[dtype]
    pointers = {n: f"tensordesc<{dtype}[1, 1, {r}, {head_dim}],{smem_layout(r, head_dim, torch_name)}>"
                for n, r in rows.items()}
    pointers.update(Lse="*fp32", Delta="*fp32", Counter="*i32", Items="*fp32", Out="*fp32",
                    **{n: f"*{dtype}" for n in ("Dq", "Dk", "Dv")})
    pointers.update(extra_pointers or {})
    sig = _signature(fn, pointers, constexprs)
    attrs = {(i,): [["tt.divisibility", 16]] for i, n in enumerate(fn.arg_names) if sig[n].startswith("*")}
    return compile_gluon(name, fn, sig, constexprs, attrs, num_warps=4)


def compile_forward_ws(dtype: str, head_dim: int, *, causal: bool, block_n: int | None = None,
                       num_buf: int | None = None, dynamic: bool = False, varlen: bool = False,
                       sink: bool = False) -> Compiled:
    """The warp-specialized Gluon forward (``backends.sm90.forward``; its default tiles unless given;
    ``dynamic``: the kernel of the dynamic schedule; ``varlen``: that kernel on a work list
    (Items an int32 pointer), as packed sequences run it; ``sink``: with an attention sink
    (Sink a float32 pointer, else q's dtype: none))."""
    from flashtile.backends.sm90 import forward as forward_sm90
    from flashtile.backends.sm90.forward import HALF_M, LOADER_REGS, fwd_ws_dyn_kernel, fwd_ws_kernel

    block_n = block_n or forward_sm90.default_block_n(head_dim)
    num_buf = num_buf or forward_sm90.NUM_BUF
    dynamic = dynamic or varlen
    name = "fwd-ws-varlen" if varlen else "fwd-ws-dyn" if dynamic else "fwd-ws"
    pointers = dict(Sink="*fp32" if sink else f"*{dtype}")
    if varlen:
        pointers.update(Items="*i32", Out=f"*{dtype}")
    return _compile_ws(f"{name} {dtype} d{head_dim} causal={causal} block_n={block_n} num_buf={num_buf}"
                       + (" sink" if sink else ""),
                       fwd_ws_dyn_kernel if dynamic else fwd_ws_kernel, dtype, head_dim,
                       dict(q_desc=HALF_M, k_desc=block_n, v_desc=block_n, o_desc=HALF_M),
                       dict(CAUSAL=causal, NUM_BUF=num_buf, CONSUMER_REGS=240, LOADER_REGS=LOADER_REGS),
                       pointers)


def compile_backward_ws(dtype: str, head_dim: int, *, causal: bool, dkdv_num_buf: int | None = None,
                        dq_block_n: int | None = None, dq_num_buf: int | None = None,
                        dkdv_block_q: int | None = None, varlen: bool = False,
                        keys_outer: bool = False) -> list[Compiled]:
    """The warp-specialized Gluon backward (``backends.sm90.backward_split``): the dK/dV kernel (at d256 the
    dV and the dK kernel, whose rings are fixed: dkdv_num_buf and dkdv_block_q are refused
    there, as ``attention_backward_ws`` refuses them) and the dQ kernel; ``varlen``: their
    work-list variants (d64/d128); ``keys_outer``: the d256 kernels' grid in groups of pairs
    (``backward_split.PAIR_GROUP``)."""
    from flashtile.backends.sm90 import backward_split as bw

    split = head_dim in bw.SPLIT_HEAD_DIMS
    if split and varlen:
        raise ValueError("the split kernels of head dim 256 have no varlen variant")
    items = dict(Items="*i32") if varlen else None
    if split and (dkdv_num_buf or dkdv_block_q):
        raise ValueError(f"dkdv_num_buf and dkdv_block_q do not apply at head dim {head_dim} (split kernels)")
    block_q, dkdv_num_buf = bw.dkdv_steps(head_dim, varlen, dkdv_block_q, dkdv_num_buf)  # the library's
    dq_block_n = dq_block_n or bw.default_dq_block_n(head_dim)
    dq_num_buf = dq_num_buf or bw.DQ_NUM_BUF
    regs = dict(CONSUMER_REGS=bw.CONSUMER_REGS, LOADER_REGS=bw.LOADER_REGS)
    if keys_outer and not split:
        raise ValueError("keys_outer orders the d256 kernels' grids")
    if split:  # fixed rings (DV_RING, DK_RING)
        tag = f"{dtype} d{head_dim} causal={causal}" + (" keys_outer" if keys_outer else "")
        out = [_compile_ws(f"bwd-ws-dv {tag} rings={bw.DV_RING}", bw.dv_kernel, dtype, head_dim,
                           dict.fromkeys(("q_desc", "k_desc", "do_desc", "dv_desc"), bw.BLOCK),
                           dict(CAUSAL=causal, NUM_Q=bw.DV_RING[0], NUM_DO=bw.DV_RING[1], KEYS_OUTER=keys_outer,
                                **regs)),
               _compile_ws(f"bwd-ws-dk {tag} rings={bw.DK_RING}", bw.dk_kernel, dtype, head_dim,
                           dict.fromkeys(("q_desc", "k_desc", "v_desc", "do_desc", "dk_desc"), bw.BLOCK),
                           dict(CAUSAL=causal, NUM_Q=bw.DK_RING[0], NUM_DO=bw.DK_RING[1],
                                LOADER_REGS=bw.LOADER_REGS, KEYS_OUTER=keys_outer))]
    else:
        tag = f"{dtype} d{head_dim} causal={causal} num_buf={dkdv_num_buf}"
        tag += f" block_q={block_q}" if block_q != bw.BLOCK else ""
        tag += " varlen" if varlen else ""
        out = [_compile_ws(f"bwd-ws-dkdv {tag}", bw.dkdv_kernel, dtype, head_dim,
                           dict(q_desc=block_q, k_desc=bw.BLOCK, v_desc=bw.BLOCK, do_desc=block_q, dk_desc=bw.BLOCK,
                                dv_desc=bw.BLOCK),
                           dict(CAUSAL=causal, NUM_BUF=dkdv_num_buf, **regs), items)]
    out.append(_compile_ws(f"bwd-ws-dq {dtype} d{head_dim} causal={causal} block_n={dq_block_n} num_buf={dq_num_buf}"
                           + (" varlen" if varlen else ""),
                           bw.dq_kernel, dtype, head_dim,
                           dict(q_desc=bw.BLOCK, k_desc=dq_block_n, v_desc=dq_block_n, do_desc=bw.BLOCK,
                                dq_desc=bw.BLOCK),
                           dict(CAUSAL=causal, NUM_BUF=dq_num_buf, **regs), items))
    return out


def compile_backward_onepass(dtype: str, head_dim: int, *, causal: bool, num_buf: int | None = None,
                             dq_buf: int | None = None, keys_outer: bool = False,
                             dq_swizzle: int | str | None = None, varlen: bool = False,
                             q_rows: int | None = None, deterministic: bool = False,
                             rotate: bool = False, q_split: bool | None = None) -> Compiled:
    """The one-pass Gluon backward (``backends.sm90.backward_onepass``; its default rings,
    dQ swizzle and queries per step unless given; ``varlen``: its work-list variant for
    packed sequences; ``deterministic``: dQ's sums in a fixed order, an int32 Sem;
    ``rotate``: in that mode, each key block from a query tile of its own; ``keys_outer``:
    the grid block-major within groups of pairs, ``backward_onepass.pair_group``; ``q_split``:
    the warpgroups split the queries, ``backward_onepass.split_plan``): its PTX should hold the
    bulk tensor reductions of dQ."""
    from flashtile.backends.sm90 import backward_onepass as op

    q_rows, num_buf = op.step_plan(head_dim, varlen, q_rows, num_buf)
    dq_buf = op.dq_slots(head_dim, dq_buf, varlen, deterministic)
    dq_swizzle = op.dq_slot_swizzle(head_dim, dq_swizzle, varlen)  # bytes, or op.DQ_NATIVE
    q_split = op.split_plan(head_dim, q_rows, dq_swizzle == op.DQ_NATIVE, varlen, q_split)
    box = op.dq_box(head_dim, q_rows, q_split)
    dq_desc = f"tensordesc<fp32[{box[0]}, {box[1]}],{op.dq_accumulator_layout(head_dim, dq_swizzle)}>"
    return _compile_ws(f"bwd-onepass {dtype} d{head_dim} causal={causal} num_buf={num_buf} dq_buf={dq_buf} "
                       f"dq_swizzle={dq_swizzle}" + (f" q_rows={q_rows}" if q_rows != op.BLOCK else "")
                       + (" varlen" if varlen else "") + (" deterministic" if deterministic else "")
                       + (" rotate" if rotate else "") + (" keys_outer" if keys_outer else "")
                       + (" q_split" if q_split else ""),
                       op.onepass_kernel, dtype, head_dim,
                       dict(dict.fromkeys(("k_desc", "v_desc", "dk_desc", "dv_desc"), op.BLOCK),
                            q_desc=q_rows, do_desc=q_rows),
                       dict(CAUSAL=causal, NUM_BUF=num_buf, DQ_BUF=dq_buf, CONSUMER_REGS=op.CONSUMER_REGS,
                            LOADER_REGS=op.LOADER_REGS, REDUCER_REGS=op.REDUCER_REGS,
                            KEYS_OUTER=keys_outer and not varlen, DQ_NATIVE=dq_swizzle == op.DQ_NATIVE,
                            DET_ROTATE=rotate),
                       dict(dq_desc=dq_desc, Sem="*i32" if deterministic else "*fp32",
                            **(dict(Items="*i32") if varlen else {})))


def compile_backward(cfg, dtype: str, head_dim: int, *, mask_mode: int = 0, extras: bool = False,
                     varlen: bool = False, head_dim_v: int = 0) -> list[Compiled]:
    """The dq and dk/dv kernels with ``cfg`` (a BwdConfig); ``varlen``: packed sequences;
    ``head_dim_v``: v's head dim (0: head_dim)."""
    from flashtile.backends.triton.backward import dkdv_kernel, dq_kernel

    dv = head_dim_v or head_dim
    block_d, block_dv = _block(head_dim), _block(dv)
    common = dict(BLOCK_D=block_d, EVEN_D=block_d == head_dim, BLOCK_DV=block_dv, EVEN_DV=block_dv == dv,
                  SAME_DV=dv == head_dim,
                  WINDOW_LEFT=extras, WINDOW_RIGHT=True,
                  SOFTCAP=extras, HAS_ALIBI=extras, MASK_MODE=mask_mode, IEEE_DOT=dtype == "fp32", DROPOUT=extras,
                  VARLEN=varlen, CHUNK=extras)
    ptrs = {n: f"*{dtype}" for n in ("Q", "K", "V", "DO", "DQ", "DK", "DV")}
    ptrs.update(Lse="*fp32", Delta="*fp32", Mask="*u8" if mask_mode == 1 else f"*{dtype}", Alibi="*fp32",
                Seed="*i64", DQacc="*fp32", Items="*i32")
    out = []
    kernels = [("dkdv", dkdv_kernel, cfg.block_m_kv, cfg.block_n_kv,
                dict(FUSED_DQ=cfg.fused_dq, SPLIT_PHASES=cfg.split_phases))]
    if not cfg.fused_dq:
        kernels.append(("dq", dq_kernel, cfg.block_m_q, cfg.block_n_q, {}))
    for kname, fn, bm, bn, extra in kernels:
        c = dict(common, BLOCK_M=bm, BLOCK_N=bn, **extra)
        dims = f"d{head_dim}" + (f"-{dv}" if dv != head_dim else "")
        name = f"bwd-{kname} {dtype} {dims} mask={mask_mode} extras={extras} varlen={varlen} {cfg}"
        out.append(_compile(name, fn, ptrs, c, cfg.num_warps, cfg.num_stages))
    return out


def compile_decode(dtype: str, head_dim: int, *, rows: int = 4, paged: int = 0, extras: bool = False,
                   split: bool = True, page_slice: int = 0, head_dim_v: int = 0,
                   append: bool = True, fused_combine: bool = False, append_t: int = 1,
                   fused_check: bool = False, pdl: bool = False, spread: bool = False) -> list[Compiled]:
    """The KV-cache kernels of ``backends/triton/decode.py`` as a decode step launches them: the check,
    the append kernel (``FLASHTILE_DECODE_APPEND=separate``'s) and the decode kernel, which
    appends the new keys itself when ``append`` (the default: ``fused``)
    (``rows`` packed query rows, seqlen_q x group; ``fused_check``: the decode kernel checks the
    metadata itself, no check kernel; ``paged``:
    the page size, 0 for a row cache, a multiple of the key tile reads one table entry per
    tile), then the combine kernel when ``split``. ``extras`` turns on every option
    (leftpad, batch index, windows, softcap, ALiBi, rotary); ``page_slice``: the page
    gather's table slice in registers (``decode.PAGE_SLICE_MAX``); ``pdl``: the decode and
    combine kernels as ``FLASHTILE_PDL=on`` launches them; ``spread`` (with ``split``): the
    spread check's decode kernel and its last kernel (``finish_kernel``) instead of the
    check, append and combine kernels."""
    from flashtile.backends.triton import decode

    block_m, block_n, block_d, block_dv = decode.block_sizes(head_dim, rows, head_dim_v)
    dims = f"d{head_dim}" + (f"-{head_dim_v}" if head_dim_v and head_dim_v != head_dim else "")
    tag = (f"{dtype} {dims} rows={rows} paged={paged} extras={extras}" + (f" slice={page_slice}" if page_slice else "")
           + (f" append_t={append_t}" if append_t != 1 else "") + (" check=fused" if fused_check else "")
           + (" check=spread" if spread else "")
           + (" pdl" if pdl else ""))
    ints = ("SeqLens", "LeftPad", "BatchIdx", "Table", "Status", "Slots")
    ptrs = {n: "*i32" for n in ints}
    ptrs.update({n: f"*{dtype}" for n in ("Q", "K", "V", "KCache", "VCache", "Out", "KNew", "VNew")})
    ptrs.update(Lse="*fp32", OutPart="*fp32", LsePart="*fp32", Alibi="*fp32", Cos="*fp32", Sin="*fp32",
                Sink="*fp32", Counters="*i32")
    kind = decode.layout(paged > 0, paged, block_n)
    out = [] if fused_check or spread else [  # the fused and spread checks: no check kernel
        _compile(f"decode-check {tag}", decode.check_kernel, ptrs,
                 dict(HAS_LEFTPAD=extras, HAS_BATCH_IDX=extras and not paged, PAGED=paged > 0, ROTARY=extras,
                      ROTARY_LOCAL=False, BLOCK=16, BLOCK_E=decode.CHECK_BLOCK_E, PADDING=extras), 8, 1)]
    out += [] if spread else [_compile(f"decode-append {tag}", decode.append_kernel, ptrs,
                     dict(BLOCK_T=16, BLOCK_D=block_d, BLOCK_DV=block_dv, SAME_DV=not head_dim_v or head_dim_v == head_dim,
                          PAGED=paged > 0,
                          HAS_BATCH_IDX=extras and not paged,
                          ROTARY=extras, INTERLEAVED=False, CHECKED=True, PADDING=extras), 4, 1)]
    out += [_compile(f"decode {tag} split={split}" + ("" if append else " append=separate")
                     + (" combine=fused" if fused_combine else ""), decode.decode_kernel, ptrs,
                     dict(BLOCK_M=block_m, BLOCK_N=block_n, BLOCK_D=block_d, BLOCK_DV=block_dv,
                          SAME_DV=not head_dim_v or head_dim_v == head_dim, PAGED=paged > 0,
                          PAGE_TILE=kind == "tile", PAGE_SLICE=page_slice,
                          HAS_BATCH_IDX=extras and not paged,
                          HAS_LEFTPAD=extras, WINDOW_LEFT=extras, WINDOW_RIGHT=extras, SOFTCAP=extras,
                          HAS_ALIBI=extras, ROTARY=extras, INTERLEAVED=False, ROTARY_LOCAL=extras, SPLIT=split,
                          CHECKED=not spread, IEEE_DOT=dtype == "fp32", HAS_SINK=extras, CHUNK=extras,
                          APPEND=append and not spread, APPEND_T=append_t, FUSED_COMBINE=fused_combine and split,
                          PADDING=extras, FUSED_CHECK=fused_check, CHECK_ROTARY=(fused_check or spread) and extras,
                          CHECK_BLOCK=16, CHECK_BLOCK_E=decode.SPREAD_BLOCK_E if spread else decode.FUSED_CHECK_BLOCK_E,
                          MERGE_M=decode.merge_rows(block_m, rows),
                          COMBINE_CHUNK=decode.combine_chunk(decode.merge_rows(block_m, rows), block_dv)
                          if fused_combine and split else 1, PDL=pdl, SPREAD=spread, BLOCK_NEW=16), 4,
                     decode.stages(kind, block_d, block_dv))]
    if spread:
        out.append(_compile(f"decode-finish {tag}", decode.finish_kernel, ptrs,
                            dict(BLOCK_S=16, BLOCK_D=block_d, BLOCK_DV=block_dv, BLOCK_SLOTS=64, APPEND_T=1,
                                 HAS_SINK=extras, SAME_DV=not head_dim_v or head_dim_v == head_dim, PAGED=paged > 0,
                                 HAS_BATCH_IDX=extras and not paged, ROTARY=extras, INTERLEAVED=False,
                                 PADDING=extras, APPEND=True, PDL=pdl), 4, 1))
    elif split and not fused_combine:
        out.append(_compile(f"decode-combine {tag}", decode.combine_kernel, ptrs,
                            dict(BLOCK_S=16, BLOCK_D=block_dv, HAS_SINK=extras, PDL=pdl), 4, 1))
    return out


def decode_checks(head_dims=(64, 128, 256), dtype: str = "bf16"):
    """The decode kernels at each head dim: row cache (GQA group 4, one query) split and
    unsplit, appending the new keys and not (``append``), merging the splits itself
    (``fused_combine``), pages of 16 and 256 keys, pages of 16 with the table slice in registers
    (``decode.PAGE_SLICE_MAX``), and every option at 4 x 4 rows."""
    for head_dim in head_dims:
        yield lambda d=head_dim: compile_decode(dtype, d, rows=4)
        yield lambda d=head_dim: compile_decode(dtype, d, rows=4, append=False)  # the decode loop alone
        yield lambda d=head_dim: compile_decode(dtype, d, rows=4, fused_combine=True)
        yield lambda d=head_dim: compile_decode(dtype, d, rows=4, fused_combine=True, fused_check=True)  # one launch
        yield lambda d=head_dim: compile_decode(dtype, d, rows=4, paged=16, page_slice=128, fused_check=True)
        yield lambda d=head_dim: compile_decode(dtype, d, rows=4, spread=True)  # a captured step's default
        if head_dim == 128:  # the spread check's page loop (the row cache's kernel: every head dim)
            yield lambda d=head_dim: compile_decode(dtype, d, rows=4, paged=16, page_slice=128, spread=True)
        yield lambda d=head_dim: compile_decode(dtype, d, rows=16, append_t=16)  # speculative: 16 new a step
        yield lambda d=head_dim: compile_decode(dtype, d, rows=4, split=False)
        yield lambda d=head_dim: compile_decode(dtype, d, rows=4, paged=16)
        yield lambda d=head_dim: compile_decode(dtype, d, rows=4, paged=256)
        yield lambda d=head_dim: compile_decode(dtype, d, rows=4, paged=16, page_slice=128)
        yield lambda d=head_dim: compile_decode(dtype, d, rows=16, extras=True)


def table_checks(head_dims=(64, 128, 256), dtype: str = "bf16"):
    """Every distinct sm90 table entry a call can reach, plain and with an explicit mask and
    every option. An explicit mask comes only from SDPA, which refuses it with is_causal,
    so masked kernels are compiled without causal."""
    from flashtile.backends import configs

    for head_dim in head_dims:
        seen = set()
        for causal in (False, True):
            for seqlen in (1024, 8192):
                for mask_mode, extras in (((0, False),) if causal else ((0, False), (1, False), (2, True))):
                    cfg = configs.default_fwd_config((9, 0), head_dim, "bfloat16", causal, seqlen, mask_mode != 0)
                    key = (cfg, causal, mask_mode, extras)
                    if key in seen:
                        continue
                    seen.add(key)
                    yield lambda cfg=cfg, causal=causal, m=mask_mode, e=extras: [
                        compile_forward(cfg, dtype, head_dim, causal=causal, mask_mode=m, extras=e)]
                    if cfg.use_ws and mask_mode == 0 and not extras and (head_dim, causal) not in seen:
                        seen.add((head_dim, causal))
                        yield lambda causal=causal: [compile_forward_ws(dtype, head_dim, causal=causal)]
        bwd = configs.default_bwd_config((9, 0), head_dim, "bfloat16")
        yield lambda bwd=bwd, head_dim=head_dim: compile_backward(bwd, dtype, head_dim)
        yield lambda bwd=bwd, head_dim=head_dim: compile_backward(bwd, dtype, head_dim, mask_mode=2, extras=True)
        fused = configs.default_bwd_config((9, 0), head_dim, "bfloat16", dq_mode="atomic")
        yield lambda fused=fused, head_dim=head_dim: compile_backward(fused, dtype, head_dim)
        plain = configs.default_bwd_config((9, 0), head_dim, "bfloat16", tile_masks=False)
        if plain != bwd:  # the one-loop variant, for calls without causal/window/mask
            yield lambda plain=plain, head_dim=head_dim: compile_backward(plain, dtype, head_dim)


def wide_checks(head_dims=(), dtype: str = "bf16"):
    """Head dims past the Gluon kernels' (issue 36): the Triton forward and backward at
    (512, 512) and (192, 128) (DeepSeek's q/k and v), the fused-dQ backward at 512, and MLA's
    absorbed decode (q/k 576, v 512) over row and paged caches. ``head_dims`` is ignored."""
    from flashtile.backends import configs

    for d, dv in ((512, 512), (192, 128)):
        for causal in (False, True):
            cfg = configs.default_fwd_config((9, 0), max(d, dv), "bfloat16", causal, 8192)
            yield lambda cfg=cfg, causal=causal, d=d, dv=dv: [compile_forward(cfg, dtype, d, causal=causal,
                                                                               head_dim_v=dv)]
        bwd = configs.default_bwd_config((9, 0), max(d, dv), "bfloat16")
        yield lambda bwd=bwd, d=d, dv=dv: compile_backward(bwd, dtype, d, head_dim_v=dv)
    fused = configs.default_bwd_config((9, 0), 512, "bfloat16", dq_mode="atomic")
    yield lambda: compile_backward(fused, dtype, 512)
    for paged in (0, 16, 64):
        yield lambda paged=paged: compile_decode(dtype, 576, rows=128, head_dim_v=512, paged=paged)


def compile_flex(kernel: str, dtype: str, head_dim: int, score_mod=None, mask_mod=None, head_dim_v=None,
                 ) -> list[Compiled]:
    """A flex kernel ("fwd", "dq" or "dkdv", ``backends/triton/flex.py``) with translated
    mods at its default tiles (``flex.FlexLaunch``): a block mask of 128 x 128 blocks when
    ``mask_mod`` is given."""
    import torch

    from flashtile.backends.triton import flex, modgen

    head_dim_v = head_dim_v or head_dim
    score = modgen.translate(score_mod, "score", torch.device("cpu")) if score_mod is not None else None
    mask = modgen.translate(mask_mod, "mask", torch.device("cpu")) if mask_mod is not None else None
    t = {"bf16": "*bf16", "fp16": "*fp16"}[dtype]
    block_d, block_dv = max(16, 1 << (head_dim - 1).bit_length()), max(16, 1 << (head_dim_v - 1).bit_length())
    heavy = sum(m.tile_gathers for m in (score, mask) if m is not None) > 0
    fwd, dq, dkdv = flex.tiles(block_d, block_dv, heavy)
    bm, bn, warps, stages = {"fwd": fwd, "dq": dq, "dkdv": dkdv}[kernel]
    fn = {"fwd": flex.flex_fwd_kernel, "dq": flex.flex_dq_kernel, "dkdv": flex.flex_dkdv_kernel}[kernel]
    constexprs = dict(SCORE_MOD=None if score is None else score.fn, MASK_MOD=None if mask is None else mask.fn,
                      SPARSE=mask is not None, HAS_FULL=mask is not None, Q_BLOCK=128, KV_BLOCK=128,
                      BLOCK_M=bm, BLOCK_N=bn, BLOCK_D=block_d, BLOCK_DV=block_dv, EVEN_D=block_d == head_dim,
                      EVEN_DV=block_dv == head_dim_v, IEEE_DOT=False)

    def args_of(mod):
        return ("*i32",) + tuple("*" + {torch.float32: "fp32", torch.int64: "i64", torch.int32: "i32",
                                        torch.bool: "i8", torch.bfloat16: "bf16", torch.float16: "fp16"}[c.dtype]
                                 for c in mod.captured) if mod is not None else ("*i32",)

    pointers = {n: t for n in ("Q", "K", "V", "O", "Out", "DO", "DQ", "DK", "DV")}
    pointers.update({n: "*fp32" for n in ("Lse", "DLse", "Delta")})
    if kernel == "dq":
        constexprs["HAS_DLSE"] = True
    pointers.update({n: "*i32" for n in ("KvNum", "KvIdx", "QNum", "QIdx", "FullNum", "FullIdx")})
    pointers.update(SCORE_ARGS=args_of(score), MASK_ARGS=args_of(mask))
    sig = _signature(fn, pointers, constexprs)
    # the specialization of a launch whose lengths and head dims are multiples of 16, as
    # at run time: with it the pipeliner buffers K and V in shared memory (without it the
    # d192/128 forward compiled at 164 KB here and needed 256 KB on the H100, session 24)
    attrs = {(i,): [["tt.divisibility", 16]] for i, name in enumerate(fn.arg_names)
             if (isinstance(sig[name], str) and sig[name].startswith("*")) or name.startswith("stride_")
             or (name in ("seqlen_q", "seqlen_k", "head_dim", "head_dim_v")
                 and (name != "head_dim" or head_dim % 16 == 0) and (name != "head_dim_v" or head_dim_v % 16 == 0))}
    from triton.compiler import ASTSource

    src = ASTSource(fn, sig, constexprs=constexprs, attrs=attrs)
    names = "-".join(m.name for m in (score, mask) if m is not None) or "plain"
    return [_build(f"flex-{kernel} {dtype} d{head_dim}" + (f"-{head_dim_v}" if head_dim_v != head_dim else "")
                   + f" {names}", src, num_warps=warps, num_stages=stages)]


FLEX_PARTS = ("fit", "rest")


def flex_checks(head_dims=(64, 128), dtype: str = "bf16", part: str | None = None):
    """The flex kernels (issue 35) with the ready-made mods that take them (ALiBi and a
    relative-position table as score_mods, a document mask) at each head dim, then a learned
    bias and the widest head dims. ``part``: None for all; "fit" for the five compiles whose
    shared memory once ran out (the table + document mask at d128, which needed ``flex.tiles``'
    heavy tiles: 362 KB with the plain ones; the learned bias's dQ at 240 KB and the (192, 128)
    forward at 256 KB, H100 session 24); "rest" for the others."""
    import torch

    from flashtile.api import mods

    if part not in (None, *FLEX_PARTS):
        raise ValueError(f"part is None or one of {FLEX_PARTS}, got {part!r}")
    cases = (("alibi", lambda: mods.alibi(torch.rand(16)), lambda: mods.causal),
             ("relative", lambda: mods.relative_bias(torch.zeros(16, 8191), 4096),
              lambda: mods.and_masks(mods.document(torch.zeros(4096, dtype=torch.long)), mods.causal)))
    # a learned (L, S) bias and a per-head table (each score reads a tile of a captured tensor)
    bias, table = torch.zeros(700, 700), torch.zeros(4, 1399)

    def learned(score, b, h, q_idx, kv_idx):
        return score + table[h, q_idx - kv_idx + 699] + bias[q_idx, kv_idx]

    checks = []  # (once past shared memory, compile)
    for head_dim in head_dims:
        for kernel in ("fwd", "dq", "dkdv"):
            for name, score, mask in cases:
                checks.append((name == "relative" and head_dim == 128,
                               lambda k=kernel, d=head_dim, s=score, m=mask: compile_flex(k, dtype, d, s(), m())))
    for kernel in ("fwd", "dq", "dkdv"):
        checks.append((kernel == "dq", lambda k=kernel: compile_flex(k, dtype, 64, learned, mods.causal)))
        # the widest tiles; (32, 96) runs in test_flex_gpu.py
        for d, dv in ((192, 128), (256, 256)):
            checks.append(((d, kernel) == (192, "fwd"), lambda k=kernel, d=d, dv=dv: compile_flex(
                k, dtype, d, mods.alibi(torch.rand(16)), mods.causal, head_dim_v=dv)))
    for fit, check in checks:
        if part is None or (part == "fit") == fit:
            yield check


def main(argv=None) -> int:
    """``python -m flashtile.tools.sm90_check [--regs] [--headdim N ...]``: compile the table
    (every head dim, or those given) and print one line per kernel."""
    import argparse

    p = argparse.ArgumentParser(prog="python -m flashtile.tools.sm90_check")
    p.add_argument("--regs", action="store_true", help="also report registers and spills")
    p.add_argument("--headdim", type=int, nargs="+", default=[64, 128, 256])
    p.add_argument("--decode", action="store_true", help="the KV-cache decode kernels instead of the table")
    p.add_argument("--wide", action="store_true", help="head dims past 256 and a v head dim of its own instead")
    p.add_argument("--flex", action="store_true", help="the flex kernels with translated mods instead")
    p.add_argument("--flex-part", choices=FLEX_PARTS, help="with --flex: those that once ran past shared memory "
                   "(fit) or the others (rest); default all")
    p.add_argument("--ptx-only", action="store_true", help="stop at the PTX: no ptxas (``ptx_only``)")
    def regex(text):
        try:
            return re.compile(text)
        except re.error as e:
            raise argparse.ArgumentTypeError(f"not a regular expression: {text!r} ({e})") from None

    p.add_argument("--regs-match", metavar="REGEX", type=regex,
                   help="registers and spills only of the kernels whose name matches (ptxas runs for those)")
    args = p.parse_args(sys.argv[1:] if argv is None else argv)
    failures = 0
    if args.flex_part and not args.flex:
        p.error("--flex-part needs --flex")
    if args.flex:
        checks = flex_checks(part=args.flex_part)
    else:
        checks = (decode_checks if args.decode else wide_checks if args.wide else table_checks)(
            head_dims=tuple(args.headdim))
    with ptx_only() if args.ptx_only else contextlib.nullcontext():
        for check in checks:
            for result in check():
                # the decode kernels' products are small (16-64 rows), and so are the d512
                # backward's 16-key tiles: Triton may pick mma.sync there
                ok = result.shared <= SM90_SHARED_LIMIT and (result.wgmma or args.decode or args.wide)
                failures += not ok
                extra = ""
                if args.regs if args.regs_match is None else args.regs_match.search(result.name):
                    n_regs, spill = result.registers()
                    extra = f" regs={n_regs:3d} spill={spill:5d}B"
                print(f"{'ok  ' if ok else 'FAIL'} smem={result.shared:6d} wgmma={result.wgmma} tma={result.tma}"
                      f"{extra}  {result.name}", flush=True)
    return 1 if failures else 0


if __name__ == "__main__":
    sys.exit(main())

"""Kernel launch configurations: a fixed table per (GPU arch, head dim, dtype, causal).

The first call of a new shape must not autotune for tens of seconds, so the default is
a table lookup (measured choices live in docs/perf-notes.md). Optional autotuning
(``FLASHTILE_AUTOTUNE=1``) times a few candidates once per key and caches the winner in
``$FLASHTILE_CACHE_DIR`` (default ``~/.cache/flashtile``) as JSON.
"""

from __future__ import annotations

import json
import os
import threading
from dataclasses import asdict, dataclass, replace
from pathlib import Path
from typing import Callable, Sequence

from flashtile.runtime import settings


@dataclass(frozen=True)
class FwdConfig:
    """Tile sizes and launch shape of the forward kernel."""

    block_m: int
    block_n: int
    num_warps: int
    num_stages: int
    use_tma: bool = False  # loads/stores through the bulk tensor copy engine (sm90+, aligned strides)
    # The warp-specialized Gluon kernel (backends/sm90/forward.py: its own 128 x 128 tiles) for
    # the problems in its scope; the Triton kernel with the fields above for the rest.
    use_ws: bool = False


def head_dim_bucket(head_dim: int) -> int:
    """The padded head dim the kernel runs at (power of two, at least 16)."""
    bucket = 16
    while bucket < head_dim:
        bucket *= 2
    return bucket


# Hopper (sm90: H100, H200), keyed by (padded head dim, causal-like, long). "long" means
# seqlen_q >= 2048: short problems at d128 and short causal ones at d<=64 want 64-row
# tiles (more programs for 132 SMs, less of each tile wasted on the diagonal). Chosen by
# the H200 sweeps of 2026-11-29 (fp16 long, bf16 S512/S1024; docs/perf-notes.md);
# TMA = loads/stores through the bulk tensor copy engine.
_SM90_FWD = {}
for _bucket in (16, 32, 64):
    _SM90_FWD[(_bucket, False, False)] = FwdConfig(128, 64, 8, 3, False)
    _SM90_FWD[(_bucket, False, True)] = FwdConfig(128, 64, 8, 3, False)
    _SM90_FWD[(_bucket, True, False)] = FwdConfig(64, 64, 4, 3, True)
    _SM90_FWD[(_bucket, True, True)] = FwdConfig(128, 64, 8, 3, False)
_SM90_FWD[(128, False, False)] = FwdConfig(64, 64, 4, 3, True)
_SM90_FWD[(128, False, True)] = FwdConfig(128, 128, 8, 3, True)
_SM90_FWD[(128, True, False)] = FwdConfig(64, 64, 4, 3, True)
_SM90_FWD[(128, True, True)] = FwdConfig(128, 128, 8, 3, True)
# d256: one config. The S512/S1024 re-sweep (bf16, run 7) put TMA ahead for short causal
# too (316 vs 268 TFLOP/s at S1024, 236 vs 203 at S512); run 4's 93 TFLOP/s did not recur.
for _causal in (False, True):
    for _long in (False, True):
        _SM90_FWD[(256, _causal, _long)] = FwdConfig(128, 64, 8, 2, True)
        # d512 (Gemma 4's full layers, DeepSeek-V4): unmeasured. The 64 x 512 fp32
        # accumulator is 128 registers a thread at 8 warps; TMA boxes stop at 256 columns.
        _SM90_FWD[(512, _causal, _long)] = FwdConfig(64, 32, 8, 2, False)
# d64/d128/d256 in fp16/bf16 without extras: the warp-specialized Gluon kernel, except
# short causal calls at d64, where the Triton kernel's 64-row tiles waste less on the
# diagonal (H200 runs 22-23 and 26, bf16, TF/s Gluon vs Triton: d128 S4096 612 vs 481,
# causal 543 vs 427; d64 S4096 459 vs 409, causal 395 vs 367; d64 causal S1024 247 vs
# 294; d256 S4096 641 vs 511, causal 571 vs 435).
for _key, _cfg in list(_SM90_FWD.items()):
    if _key[0] in (64, 128, 256) and _key != (64, True, False):
        _SM90_FWD[_key] = replace(_cfg, use_ws=True)
LONG_SEQLEN = 2048

# Anything else (Ampere, Ada, unknown): conservative tiles that fit 100 KB of smem.
_GENERIC_FWD = {
    16: FwdConfig(128, 64, 4, 3),
    32: FwdConfig(128, 64, 4, 3),
    64: FwdConfig(128, 64, 4, 3),
    128: FwdConfig(128, 32, 4, 2),
    256: FwdConfig(64, 32, 4, 1),
    512: FwdConfig(32, 16, 4, 1),
}

# Under TRITON_INTERPRET=1 every element is numpy work: small tiles are faster and still
# exercise every masking path.
INTERPRETER_FWD = FwdConfig(16, 16, 4, 1)


def default_fwd_config(capability: tuple[int, int], head_dim: int, dtype_name: str, causal: bool,
                       seqlen_q: int = LONG_SEQLEN, has_mask: bool = False) -> FwdConfig:
    """Table lookup; never times anything. ``causal`` means any right window (diagonal).

    An explicit attn_mask streams a (block_m, block_n) mask tile per step through shared
    memory too: its tiles are narrower and less deeply pipelined so that they fit.
    """
    bucket = head_dim_bucket(head_dim)
    if capability[0] == 9:
        cfg = _SM90_FWD[(bucket, causal, seqlen_q >= LONG_SEQLEN)]
    else:
        cfg = _GENERIC_FWD[bucket]
    if has_mask:
        block_m, warps = (64, 4) if bucket >= 256 else (cfg.block_m, cfg.num_warps)
        cfg = FwdConfig(block_m, min(cfg.block_n, 64), warps, min(cfg.num_stages, 2), cfg.use_tma)
    if dtype_name == "float32":
        # fp32 tiles take twice the shared memory and run on CUDA cores (IEEE dot).
        cfg = FwdConfig(min(cfg.block_m, 64), min(cfg.block_n, 32), 4, min(cfg.num_stages, 2), False)
    return cfg


def fwd_candidates(head_dim: int) -> list[FwdConfig]:
    """What autotuning tries."""
    bucket = head_dim_bucket(head_dim)
    if bucket <= 64:
        blocks = [(128, 128), (128, 64), (64, 64)]
    elif bucket <= 128:
        blocks = [(128, 128), (128, 64), (64, 64)]
    else:
        blocks = [(128, 64), (64, 64), (128, 32)]
    cands = [FwdConfig(m, n, w, s, tma) for (m, n) in blocks for w in (4, 8) for s in (2, 3) for tma in (False, True)]
    if bucket in (64, 128, 256):  # the Gluon kernel (its own tiles) where it applies (sm90 only)
        cands.append(FwdConfig(128, 128, 8, 3, True, use_ws=True))
    return cands


def _cache_path() -> Path:
    return Path(settings.cache_dir()) / "autotune-fwd.json"


_lock = threading.Lock()
_memory_cache: dict[str, FwdConfig] = {}


def autotuned_fwd_config(key: str, candidates: Sequence[FwdConfig], time_ms: Callable[[FwdConfig], float]) -> FwdConfig:
    """Best of ``candidates`` by ``time_ms`` (failures skipped), cached in memory and on disk.

    The disk cache is rewritten atomically (temp file + rename) so that a crash never
    leaves a half-written file.
    """
    with _lock:
        if key in _memory_cache:
            return _memory_cache[key]
        path = _cache_path()
        stored: dict = {}
        if path.exists():
            try:
                stored = json.loads(path.read_text())
            except (OSError, ValueError):
                stored = {}
        if key in stored:
            cfg = FwdConfig(**stored[key])
            _memory_cache[key] = cfg
            return cfg
        best, best_ms = None, float("inf")
        for cfg in candidates:
            try:
                ms = time_ms(cfg)
            except Exception:  # out of shared memory, unsupported shape: not a candidate
                continue
            if ms < best_ms:
                best, best_ms = cfg, ms
        if best is None:
            raise RuntimeError(f"autotuning found no runnable forward config for {key}")
        stored[key] = asdict(best)
        path.parent.mkdir(parents=True, exist_ok=True)
        tmp = path.with_suffix(f".tmp{os.getpid()}")
        tmp.write_text(json.dumps(stored, indent=1, sort_keys=True))
        os.replace(tmp, path)
        _memory_cache[key] = best
        return best


@dataclass(frozen=True)
class BwdConfig:
    """Tiles of the backward kernels: (queries, keys) per tile of the dk/dv and dq kernels."""

    block_m_kv: int
    block_n_kv: int
    block_m_q: int
    block_n_q: int
    num_warps: int
    num_stages: int
    fused_dq: bool = False  # dQ by atomics inside the dk/dv kernel (nondeterministic)
    # dk/dv query loop in three phases (masked edge, unmasked interior, masked edge), as in
    # the forward; False = one loop masking every tile. Three phases do less ALU work per
    # interior tile, one loop spills far less (sm90_check --regs; unmeasured on a GPU).
    split_phases: bool = True


# Hopper, from the H200 backward sweep (bf16, S 1024/4096/16384, causal and not; runs 6-7
# in docs/perf-notes.md). 64x64 tiles with 4 warps beat FA2's 64x128/8 warps by 2-10%
# at d64/d128 and win or tie every seqlen; d256 needs 8 warps (the dk/dv accumulators
# alone are 128 KB of registers) and gains 30% from a second pipeline stage.
_SM90_BWD = {
    16: BwdConfig(64, 64, 64, 64, 4, 3),
    32: BwdConfig(64, 64, 64, 64, 4, 3),
    64: BwdConfig(64, 64, 64, 64, 4, 3),
    128: BwdConfig(64, 64, 64, 64, 4, 2),
    256: BwdConfig(64, 64, 64, 64, 8, 2),
    512: BwdConfig(32, 16, 32, 16, 8, 1),  # unmeasured: dK and dV accumulators 16 x 512 each
}
_GENERIC_BWD = {
    16: BwdConfig(32, 64, 64, 32, 4, 2),
    32: BwdConfig(32, 64, 64, 32, 4, 2),
    64: BwdConfig(32, 64, 64, 32, 4, 2),
    128: BwdConfig(32, 64, 64, 32, 4, 1),
    256: BwdConfig(16, 32, 32, 16, 4, 1),
    512: BwdConfig(16, 16, 16, 16, 4, 1),
}
# Without tile masks the one-loop dk/dv kernel (spills ~4x less) beats the three phases by
# 4-10% here; with a causal diagonal the three phases win (H200 runs 11-12, bf16):
# d64 S1024/4096/16384 non-causal 299/330/341 vs 272/308/323 TF/s, causal S16384 288 vs
# 304; d256 S4096 192 vs 185, causal 149 vs 163. d128 loses either way (334 vs 338).
_SM90_BWD_ONE_LOOP = (16, 32, 64, 256)
INTERPRETER_BWD = BwdConfig(16, 16, 16, 16, 4, 1)


def bwd_dq_mode(deterministic: bool) -> str:
    """The Triton backward's dQ: "split" (dq kernel, deterministic) or "atomic" (fused,
    FA2's single pass).

    ``FLASHTILE_BWD_DQ``: ``auto`` (default), ``onepass`` and ``split`` give split here
    (``auto`` lets the Hopper one-pass Gluon kernel take the head dims where it is faster,
    ``onepass`` causal packed d128 calls too: ``sm90.scope.onepass_scope``; ``split`` keeps the split
    kernels everywhere);
    ``atomic`` opts in to the fused variant. Determinism (the call's flag or
    ``torch.use_deterministic_algorithms``) always wins over it.
    """
    mode = settings.bwd_dq()
    if deterministic:
        return "split"
    return "atomic" if mode == "atomic" else "split"


def default_bwd_config(capability: tuple[int, int], head_dim: int, dtype_name: str,
                       deterministic: bool = True, dq_mode: str | None = None,
                       tile_masks: bool = True) -> BwdConfig:
    """Table lookup for the backward kernels; never times anything.

    ``dq_mode`` ("split" or "atomic") overrides ``bwd_dq_mode(deterministic)``; the
    compile check uses it to vet both variants. ``tile_masks=False`` says the call has no
    causal diagonal, window or explicit mask (only the sequence ends are masked): then
    the single-loop dk/dv variant wins at d <= 64 and d256 (H200 run 12).
    """
    bucket = head_dim_bucket(head_dim)
    cfg = (_SM90_BWD if capability[0] == 9 else _GENERIC_BWD)[bucket]
    if dtype_name == "float32":
        cfg = BwdConfig(min(cfg.block_m_kv, 32), min(cfg.block_n_kv, 64), min(cfg.block_m_q, 64),
                        min(cfg.block_n_q, 32), 4, 1)
    if dq_mode not in (None, "split", "atomic"):
        raise ValueError(f"dq_mode must be None, 'split' or 'atomic', got {dq_mode!r}")
    if (dq_mode or bwd_dq_mode(deterministic)) == "atomic":
        # The fused kernel also stages K for dQ: at d256 a second stage needs 263 KB of
        # shared memory (H200 run 8), over the 227 KB limit.
        cfg = replace(cfg, fused_dq=True, num_stages=1 if bucket >= 256 else cfg.num_stages)
    elif not tile_masks and capability[0] == 9 and bucket in _SM90_BWD_ONE_LOOP and dtype_name != "float32":
        cfg = replace(cfg, split_phases=False)
    return cfg

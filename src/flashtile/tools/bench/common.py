"""What the benchmarks share: provenance stamped on every row, the row files, the peers'
kernels set up once, and the shape constants (FlashAttention's papers: hidden size 2048,
16384 tokens per batch)."""

from __future__ import annotations

import json
import math
import re
import subprocess
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable, Iterable

HIDDEN = 2048
TOKENS = 16384
SDPA_BACKENDS = {"sdpa-flash": "FLASH_ATTENTION", "sdpa-cudnn": "CUDNN_ATTENTION",
                 "sdpa-efficient": "EFFICIENT_ATTENTION"}


@dataclass(frozen=True)
class RunInfo:
    """Provenance stamped on every row."""

    gpu: str
    torch: str
    triton: str
    commit: str

    def row_fields(self) -> dict[str, Any]:
        return {"gpu": self.gpu, "torch": self.torch, "triton": self.triton, "commit": self.commit}


def git_commit() -> str:
    """Short HEAD of the repo holding this file, "-dirty" if tracked files changed; else "unknown"."""
    here = str(Path(__file__).resolve().parent)
    try:
        rev = subprocess.run(["git", "-C", here, "rev-parse", "--short", "HEAD"],
                             capture_output=True, text=True, timeout=10)
        if rev.returncode != 0:
            return "unknown"
        dirty = subprocess.run(["git", "-C", here, "status", "--porcelain", "--untracked-files=no"],
                               capture_output=True, text=True, timeout=10).stdout.strip()
        return rev.stdout.strip() + ("-dirty" if dirty else "")
    except (OSError, subprocess.SubprocessError):
        return "unknown"


def gpu_slug(name: str) -> str:
    """'NVIDIA H200' -> 'h200', 'NVIDIA H100 80GB HBM3' -> 'h100-80gb-hbm3'."""
    name = re.sub(r"^nvidia\s+", "", name.strip().lower())
    return re.sub(r"[^a-z0-9]+", "-", name).strip("-") or "gpu"


def run_info(dry_run: bool) -> RunInfo:
    import torch
    try:
        import triton
        triton_version = triton.__version__
    except ImportError:
        triton_version = "none"
    gpu = "dry-run" if dry_run else torch.cuda.get_device_name()
    return RunInfo(gpu, torch.__version__, triton_version, git_commit())


class RowWriter:
    """Appends one JSON object per line and flushes, so a killed run keeps its rows."""

    def __init__(self, path: Path) -> None:
        self.path = path
        self.rows: list[dict[str, Any]] = []
        path.parent.mkdir(parents=True, exist_ok=True)

    def write(self, row: dict[str, Any]) -> None:
        clean = {k: (repr(v) if isinstance(v, float) and not math.isfinite(v) else v)
                 for k, v in row.items()}  # strict JSON has no NaN/inf
        with self.path.open("a") as f:
            f.write(json.dumps(clean) + "\n")
            f.flush()
        self.rows.append(clean)


def read_rows(paths: Iterable[str | Path]) -> list[dict[str, Any]]:
    return [json.loads(line) for p in paths for line in Path(p).read_text().splitlines() if line.strip()]


_FLEX_COMPILED: Callable[..., Any] | None = None


def compiled_flex() -> Callable[..., Any]:
    """One torch.compile'd flex_attention; dynamo specialises (recompiles) it per shape."""
    global _FLEX_COMPILED
    if _FLEX_COMPILED is None:
        import torch
        from torch.nn.attention.flex_attention import flex_attention
        for name in ("cache_size_limit", "recompile_limit",
                     "accumulated_cache_size_limit", "accumulated_recompile_limit"):
            if hasattr(torch._dynamo.config, name):
                setattr(torch._dynamo.config, name, 4096)
        _FLEX_COMPILED = torch.compile(flex_attention, dynamic=False)
    return _FLEX_COMPILED



def reason(err: BaseException) -> str:
    text = str(err).strip().splitlines()
    return f"{type(err).__name__}: {text[0] if text else ''}"[:300]

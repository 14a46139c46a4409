"""What the benchmarks share: provenance stamped on every row, the row files, the peers'
kernels set up once, and the shape constants (FlashAttention's papers: hidden size 2048,
16384 tokens per batch)."""

from __future__ import annotations

import json
import math
import os
import re
import subprocess
import tempfile
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
    """Short HEAD of the repo holding this file; when tracked files changed, "-dirty" and the
    id of src/ as it is on disk (``src_tree``: a copy whose git metadata is older than its files,
    as the device machine's is, still names the files it ran); "unknown" without git."""
    here = Path(__file__).resolve().parent
    try:
        rev = subprocess.run(["git", "-C", str(here), "rev-parse", "--short", "HEAD"],
                             capture_output=True, text=True, timeout=10)
        if rev.returncode != 0:
            return "unknown"
        dirty = subprocess.run(["git", "-C", str(here), "status", "--porcelain", "--untracked-files=no"],
                               capture_output=True, text=True, timeout=10).stdout.strip()
        if not dirty:
            return rev.stdout.strip()
        tree = src_tree(here)
        return rev.stdout.strip() + "-dirty" + (f" (src tree {tree})" if tree else "")
    except (OSError, subprocess.SubprocessError):
        return "unknown"


def src_tree(path: Path) -> str | None:
    """The short git tree id of the src/ folder of the work tree holding ``path``, as its files
    are on disk (tracked and untracked, not ignored): what ``git rev-parse --short C:src``
    prints for a commit C holding the same files. Nothing is written to the repository: the
    index and the objects go to a temporary folder. None if git fails."""
    try:
        top = subprocess.run(["git", "-C", str(path), "rev-parse", "--show-toplevel", "--git-path", "objects"],
                             capture_output=True, text=True, timeout=10)
        if top.returncode != 0:
            return None
        root, objects = top.stdout.splitlines()
        objects = str(Path(path, objects).resolve())  # --git-path answers relative to the -C folder
        with tempfile.TemporaryDirectory() as tmp:
            Path(tmp, "objects").mkdir()
            env = dict(os.environ, GIT_INDEX_FILE=str(Path(tmp, "index")),
                       GIT_OBJECT_DIRECTORY=str(Path(tmp, "objects")), GIT_ALTERNATE_OBJECT_DIRECTORIES=objects)
            git = lambda *args: subprocess.run(["git", "-C", root, *args], capture_output=True, text=True,
                                               timeout=60, env=env)
            if git("add", "-A", "--", "src").returncode != 0:
                return None
            tree = git("write-tree", "--prefix=src/")
            if tree.returncode != 0:
                return None
            short = git("rev-parse", "--short", tree.stdout.strip())
            return short.stdout.strip() or None
    except (OSError, subprocess.SubprocessError, ValueError):
        return None


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

"""flashtile: FlashAttention you can read.

Where each layer lives:

- ``flashtile.reference`` (``reference/``): the math. NumPy versions of the textbook
  formulas (``naive.py``) and of FlashAttention-2's tile algebra, forward and backward
  (``tiled.py``). Exact in float64; the oracle of every other test.
- ``flashtile.traffic`` (``traffic.py``): the model. HBM bytes and FLOPs of naive vs
  tiled attention, which explains why the tiles exist.
- ``flashtile.ops`` (``ops/``): the kernels. Triton forward/backward kernels and their
  launchers.
- ``flashtile.autograd`` (``autograd.py``): the torch glue: the kernels as torch.library
  ops with their autograd formula (torch.compile traces them).
- ``flashtile.api`` (``api/``): the public GPU API, flash-attn- and SDPA-compatible:
  ``flash_attn_func`` and its packed variants, ``flash_attn_varlen_func`` (packed
  sequences) and its packed variants, ``scaled_dot_product_attention``,
  ``unpad_input`` / ``pad_input``; one validation layer in ``problem/validate.py``.
- ``flashtile.cli`` (``cli.py``): the ``flashtile demo | traffic | bench`` command.

Importing this package needs numpy only: torch and triton are imported the first time a
GPU API name is touched (``flashtile.flash_attn_func``), never at ``import flashtile``,
so the reference and the traffic model work on machines without them.
"""

from __future__ import annotations

import importlib
from typing import Any

from flashtile import reference

__version__ = "0.1.0"

# Names served by flashtile.api, which imports torch (and triton where available):
# resolved on first access so that `import flashtile` stays numpy-only.
_API_NAMES = (
    "flash_attn_func",
    "flash_attn_qkvpacked_func",
    "flash_attn_kvpacked_func",
    "flash_attn_varlen_func",
    "flash_attn_varlen_qkvpacked_func",
    "flash_attn_varlen_kvpacked_func",
    "flash_attn_with_kvcache",
    "flash_attn_combine",
    "scaled_dot_product_attention",
    "unpad_input",
    "pad_input",
)
# Numpy-only submodules loaded on first access; traffic is developed alongside this file
# and a lazy import keeps `import flashtile` working even if it fails to import.
_LAZY_SUBMODULES = ("traffic",)

__all__ = ["__version__", "reference", *_LAZY_SUBMODULES, *_API_NAMES]


def __getattr__(name: str) -> Any:
    """Resolve the lazy names (PEP 562): the GPU API and numpy-only submodules."""
    if name in _API_NAMES:
        try:
            api = importlib.import_module("flashtile.api")
        except ModuleNotFoundError as err:
            if err.name not in ("torch", "triton"):
                raise
            raise ImportError(_missing(err.name, f"flashtile.{name}")) from err
        value = getattr(api, name)
    elif name in _LAZY_SUBMODULES:
        value = importlib.import_module(f"flashtile.{name}")
    else:
        raise AttributeError(f"module 'flashtile' has no attribute {name!r}")
    globals()[name] = value  # cache: later lookups skip __getattr__
    return value


def _missing(module: str, what: str) -> str:
    """The message for a GPU-API name used without torch (or triton) installed."""
    return (f"{what} needs {module}, which is not installed: `pip install torch triton` (or "
            f"`pip install 'flashtile[bench]'`); on a machine without a GPU `make test` sets up a CPU stack. "
            f"The NumPy reference (flashtile.reference) and the traffic model work without it.")


def __dir__() -> list[str]:
    return sorted(set(globals()) | set(__all__))

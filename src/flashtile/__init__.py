"""flashtile: FlashAttention you can read.

The tree is the call path, top down (every import points down; docs/architecture.md):

- ``flashtile.api``: the public functions, flash-attn's and SDPA's signatures
  (``flash_attn_func``, the varlen and kv-cache functions, ``scaled_dot_product_attention``).
- ``flashtile.problem``: the problem every call reduces to (``spec.py``) and every
  argument check (``validate.py``).
- ``flashtile.dispatch``: runs a problem on the torch twin or on the kernels.
- ``flashtile.autograd``: the kernels as torch.library ops with their autograd formula.
- ``flashtile.backends``: which kernel runs a call (``registry.py``) and the kernels:
  ``twin/`` (plain torch), ``triton/`` (portable Triton), ``sm90/`` (Gluon for Hopper).
- ``flashtile.runtime``: device facts, the environment switches, launches and their replay.
- ``flashtile.parallel`` (context parallelism), ``flashtile.integrations`` (transformers).
- ``flashtile.reference``: the math in NumPy, exact in float64; the oracle of the tests.
- ``flashtile.traffic``: HBM bytes and FLOPs, naive vs tiled: why the tiles exist.
- ``flashtile.tools`` and ``flashtile.cli``: ``flashtile demo | traffic | bench | explain | check``.

Importing this package needs numpy only: torch and triton are imported the first time a
GPU API name is touched (``flashtile.flash_attn_func``), never at ``import flashtile``,
so the reference and the traffic model work on machines without them.
"""

from __future__ import annotations

import importlib
from typing import Any

from flashtile import reference
from flashtile.public import API_NAMES, LAZY_SUBMODULES, missing_dependency

__version__ = "0.1.0"

__all__ = ["__version__", "reference", *LAZY_SUBMODULES, *API_NAMES]


def __getattr__(name: str) -> Any:
    """Resolve the lazy names (PEP 562): the GPU API and numpy-only submodules."""
    if name in API_NAMES:
        try:
            api = importlib.import_module("flashtile.api")
        except ModuleNotFoundError as err:
            if err.name not in ("torch", "triton"):
                raise
            raise ImportError(missing_dependency(err.name, f"flashtile.{name}")) from err
        value = getattr(api, name)
    elif name in LAZY_SUBMODULES:
        value = importlib.import_module(f"flashtile.{name}")
    else:
        raise AttributeError(f"module 'flashtile' has no attribute {name!r}")
    globals()[name] = value  # cache: later lookups skip __getattr__
    return value


def __dir__() -> list[str]:
    return sorted(set(globals()) | set(__all__))

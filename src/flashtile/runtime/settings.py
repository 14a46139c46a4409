"""Every environment switch flashtile reads, read and checked here and nowhere else.

The switches are read at call time, not at import (tests and benchmarks flip them inside
one process; a call traced by torch.compile reads them once: ``trace_as_constants``),
through the mapping behind ``os.environ``: ``os.environ.get`` costs about 1.5 us a name
(it encodes the key first), the mapping about 0.1 us, and a launch reads two of them. A
switch with a value outside its choices raises ValueError naming it.

=========================  ==============================================================
``FLASHTILE_BACKEND``      ``auto`` (CUDA tensors: the kernels; CPU tensors: the torch
                           twin), ``triton`` (the kernels; on CPU tensors only under
                           ``TRITON_INTERPRET=1``) or ``torch`` (the twin everywhere)
``FLASHTILE_WS``           ``0`` keeps every call off the Gluon (Hopper) kernels
``FLASHTILE_BWD_DQ``       ``auto``, ``split`` (no one-pass Gluon backward), ``onepass``
                           (``auto``, and causal packed d128 calls and short causal
                           deterministic fixed-length ones on the one-pass kernel too: ``auto`` takes
                           non-causal and d64 packed ones, deterministic ones without
                           causal and causal ones from 2048 queries on) or ``atomic`` (the Triton
                           backward's dQ by atomics; never when deterministic)
``FLASHTILE_KVCACHE_CHECK``  ``auto``, ``host`` or ``device``: where kv-cache metadata
                           values are checked (``flashtile.api.kvcache``)
``FLASHTILE_DECODE_APPEND``  ``fused`` (the decode kernel writes the new keys and values
                           of a short append: ``decode.FUSED_APPEND_MAX``) or ``separate``
                           (an append kernel first, one launch more)
``FLASHTILE_DECODE_COMBINE``  ``auto`` (``fused`` for an eager step with a small cache
                           read, else ``separate``: ``decode.fuse_step``), ``separate`` (a
                           split decode's combine kernel) or ``fused`` (the decode kernel's
                           last split of each group merges the partials: less host time,
                           1-5 us more GPU time)
``FLASHTILE_DECODE_CHECK``  ``auto`` (``fused`` as above, else ``spread`` where
                           ``decode.spread_step`` allows it, else ``separate``), ``separate``
                           (a device check of kv-cache metadata is a launch of its own),
                           ``fused`` (the decode kernel checks them itself, where it is the
                           call's only writer: less host time, 1-2 us more GPU time) or
                           ``spread`` (each decode program checks what its split reads, and
                           the kernel after it merges, appends and reports: no check launch
                           and no wait; ``separate`` where the step does not allow it)
``FLASHTILE_PDL``          ``on`` (a decode step's decode and combine kernels are launched
                           with Programmatic Dependent Launch on Hopper: each launch
                           overlaps the kernel before it) or ``off``
``FLASHTILE_AUTOTUNE``     ``1``/``true``/``yes``: time forward configs once per key
``FLASHTILE_CACHE_DIR``    where autotuning keeps its winners (``~/.cache/flashtile``)
``FLASHTILE_PLANS``        ``0`` turns launch plans (replays) off
``FLASHTILE_FAST_LAUNCH``  ``0`` turns the direct launch path off
``FLASHTILE_LAUNCH_CHECK``  ``1``: every direct launch also runs Triton's own lookup
``TRITON_INTERPRET``       Triton's: ``1`` runs the Triton kernels on CPU tensors
=========================  ==============================================================
"""

from __future__ import annotations

import os

# Every switch above, in the order the launch plans key on them (runtime.replay.env_key).
SWITCHES = ("FLASHTILE_PLANS", "FLASHTILE_BACKEND", "FLASHTILE_WS", "FLASHTILE_BWD_DQ", "FLASHTILE_AUTOTUNE",
            "FLASHTILE_FAST_LAUNCH", "FLASHTILE_LAUNCH_CHECK", "FLASHTILE_CACHE_DIR", "TRITON_INTERPRET",
            "FLASHTILE_KVCACHE_CHECK", "FLASHTILE_DECODE_APPEND", "FLASHTILE_DECODE_COMBINE",
            "FLASHTILE_DECODE_CHECK", "FLASHTILE_PDL")

# CPython keeps os.environ's encoded mapping in step with every os.environ write; where it
# is missing (another interpreter), the public way.
_DATA = getattr(os.environ, "_data", None)
if isinstance(_DATA, dict):
    _encode, _get = os.environ.encodekey, _DATA.get
    _decode = os.environ.decodevalue
else:  # pragma: no cover
    _encode, _get, _decode = (lambda name: name), os.environ.get, (lambda value: value)
_KEYS = {name: _encode(name) for name in SWITCHES}
SWITCH_KEYS = tuple(_KEYS[name] for name in SWITCHES)
raw_get = _get  # the mapping's own get, for ``runtime.replay.env_key``


def _read(name: str) -> str | None:
    value = _get(_KEYS[name])
    return None if value is None else _decode(value)


_PARSED: dict = {}  # (name, raw value) -> checked choice: a call reads several switches


def _choice(name: str, choices: tuple[str, ...]) -> str:
    """A switch whose value is one of ``choices`` (unset or empty: the first)."""
    raw = _get(_KEYS[name])
    hit = _PARSED.get((name, raw))
    if hit is not None:
        return hit
    value = ("" if raw is None else _decode(raw)).strip().lower() or choices[0]
    if value not in choices:
        raise ValueError(f"{name} must be one of {', '.join(choices)}, got {value!r}")
    if len(_PARSED) < 256:
        _PARSED[(name, raw)] = value
    return value


def trace_as_constants(mark) -> None:
    """Have torch.compile read every switch once, when it traces a call, and keep the value
    in the graph (``mark``: ``torch.compiler.assume_constant_result``, which only tags the
    function: eager calls are unchanged). Without it Dynamo traces the reads themselves,
    which torch 2.11's cannot (the environment mapping's ``get``: a graph break, an error
    under ``fullgraph=True``; H100, session 24). A switch changed after a compile therefore
    does not reach that compiled graph, as with a kernel choice."""
    mark(_read)
    mark(_choice)


def backend() -> str:
    """``FLASHTILE_BACKEND``: auto, triton or torch."""
    return _choice("FLASHTILE_BACKEND", ("auto", "triton", "torch"))


def interpret() -> bool:
    """``TRITON_INTERPRET=1``: Triton runs its kernels on CPU tensors."""
    return _read("TRITON_INTERPRET") == "1"


def gluon_enabled() -> bool:
    """``FLASHTILE_WS`` is not ``0``: the Gluon kernels may take the calls in their scope."""
    return _read("FLASHTILE_WS") != "0"


def bwd_dq() -> str:
    """``FLASHTILE_BWD_DQ``: auto, split, onepass or atomic."""
    return _choice("FLASHTILE_BWD_DQ", ("auto", "split", "onepass", "atomic"))


def kvcache_check() -> str:
    """``FLASHTILE_KVCACHE_CHECK``: auto, host or device."""
    return _choice("FLASHTILE_KVCACHE_CHECK", ("auto", "host", "device"))


def decode_append() -> str:
    """``FLASHTILE_DECODE_APPEND``: fused or separate."""
    return _choice("FLASHTILE_DECODE_APPEND", ("fused", "separate"))


def decode_combine() -> str:
    """``FLASHTILE_DECODE_COMBINE``: auto, separate or fused."""
    return _choice("FLASHTILE_DECODE_COMBINE", ("auto", "separate", "fused"))


def decode_check() -> str:
    """``FLASHTILE_DECODE_CHECK``: auto, separate, fused or spread."""
    return _choice("FLASHTILE_DECODE_CHECK", ("auto", "separate", "fused", "spread"))


def pdl() -> bool:
    """``FLASHTILE_PDL``: on or off."""
    return _choice("FLASHTILE_PDL", ("on", "off")) == "on"


def autotune() -> bool:
    """``FLASHTILE_AUTOTUNE`` in {1, true, yes}."""
    return (_read("FLASHTILE_AUTOTUNE") or "").strip().lower() in ("1", "true", "yes")


def cache_dir() -> str:
    """``FLASHTILE_CACHE_DIR``, default ``~/.cache/flashtile``."""
    return _read("FLASHTILE_CACHE_DIR") or os.path.join(os.path.expanduser("~"), ".cache", "flashtile")


def plans_enabled() -> bool:
    """``FLASHTILE_PLANS`` is not ``0``."""
    return _read("FLASHTILE_PLANS") != "0"


def fast_launch() -> bool:
    """``FLASHTILE_FAST_LAUNCH`` is not ``0`` and the kernels are compiled, not interpreted."""
    return _read("FLASHTILE_FAST_LAUNCH") != "0" and (_read("TRITON_INTERPRET") or "0") == "0"


def launch_check() -> bool:
    """``FLASHTILE_LAUNCH_CHECK=1``."""
    return _read("FLASHTILE_LAUNCH_CHECK") == "1"

"""Launch plans: what a repeated call derives from its arguments, derived once.

Everything the host does for an attention call before its kernels run (validation, the
canonical problem, the config, the grid, the buffers, each launch's argument list)
depends only on a *key*: the tensors' shapes, strides, dtypes, devices, 16-byte
alignment and requires_grad, the scalar arguments, the grad mode, the determinism
switch, the current device and the environment switches the code reads
(``runtime.settings.SWITCHES``).
The data pointers are the only thing that changes between two calls with one key.

So the first call with a key runs the ordinary code under a ``Recorder``: a torch
dispatch mode notes every buffer it allocates (``empty``, ``new_empty``, ``zeros``, ...)
and every fill of one (``zero_``, ``fill_``), and ``runtime.launch.Launcher`` reports every
kernel launch (the compiled kernel, the grid, the full argument list). Each pointer a
launch received is written as (source, byte offset), the source being an input of the
call, a recorded buffer or the stream's work counter (``stream_counter``). Anything else
the code does (a copy, a random draw, a host read of device data, a tensor argument
that points nowhere known, an op the recorder has no rule for) makes the key
*unplannable*: it keeps taking the ordinary path, so a plan is never a guess.

A later call with the key *replays*: it allocates the buffers, repeats the fills and
calls Triton's C launcher (``CudaLauncher.launch``, what ``CompiledKernel.run`` ends in)
with the recorded argument list, patching in only the pointers; TMA descriptors are
encoded from the recorded shapes, strides and block by the driver call Triton itself
uses (``fill_tma_descriptor``), cached per base address. Under ``TRITON_INTERPRET=1``
(and for launches Triton made without a compiled kernel) a replay calls the kernel
through ``kernel[grid](...)`` on views of the same sources instead, so CPU tests compare
replays with the ordinary path bit for bit.

Inputs that overlap in memory (q, k, v views of one packed tensor) are part of the key
through their pointer differences, so a pointer derived from one input is also right for
any other that contains it. Not part of the key, and not seen by a replay: Triton's debug
and instrumentation knobs and a change of a global a kernel read at compile time; call
``clear()`` after changing those. ``FLASHTILE_PLANS=0`` turns plans off.

Layers: ``flash_attn_func`` plans the whole call (and validates once per key); the ops
under every API (``backends.run.forward`` / ``backward``) plan their kernels.
A training call cannot replay as a whole (autograd must see it), so the API entry keeps
the forward op's entry in ``below``, and the forward's entry keeps its backward's there,
keyed by what only the backward brings (dout, dlse, the switches): neither key is made
again on a repeated training step. A training call with no per-call tensor but q, k, v, a
packed call's metadata and a sink (``dispatch.attention_keyed``) records its forward,
layouts included, on those tensors, and its backward on the saved tensors (the sink among
them), dout, dlse and the metadata.
"""

from __future__ import annotations

import threading
from typing import Any, Callable, Optional, Sequence

import torch
import torch.autograd.forward_ad as _fwad
from torch.utils._python_dispatch import TorchDispatchMode, _get_current_dispatch_mode

from flashtile.runtime import settings

_MAX_PLANS = 4096  # per cache; a new key past this clears the cache (shapes built per call stay bounded)
_MAX_TMA = 4096
_MAX_TRIES = 3  # recordings of a key that refuse before it is marked unplannable
_local = threading.local()
_aten = torch.ops.aten
_ALLOC = {_aten.empty.memory_format, _aten.empty_strided.default, _aten.new_empty.default,
          _aten.new_empty_strided.default, _aten.empty_like.default}
_ALLOC_ZERO = {_aten.zeros.default, _aten.new_zeros.default, _aten.zeros_like.default}
_FILL = {_aten.zero_.default, _aten.fill_.Scalar}
_UNPLANNABLE = object()


class _Refuse(Exception):
    """The recorded call did something a replay could not repeat."""


def env_key() -> tuple:
    """The switches the call path reads, with the grad mode, determinism and the
    current CUDA device: part of every key."""
    device = torch.cuda.current_device() if torch.cuda.is_initialized() else -1
    return (tuple(map(settings.raw_get, settings.SWITCH_KEYS)), torch.is_grad_enabled(),
            torch.are_deterministic_algorithms_enabled(), device)


def capturing(t: torch.Tensor) -> bool:
    """Whether a CUDA graph is being captured on the current stream of t's device, where a
    call's launches for t go (False for a CPU tensor, and while torch.compile traces:
    Dynamo cannot trace the query, and a traced call is never planned): part of the key of
    a call whose launches differ under capture."""
    if not t.is_cuda or torch.compiler.is_compiling():
        return False
    index = t.device.index
    if index is not None and index != torch.cuda.current_device():
        with torch.cuda.device(index):  # the query reads the current device's stream
            return torch.cuda.is_current_stream_capturing()
    return torch.cuda.is_current_stream_capturing()


def tensor_key(t: Optional[torch.Tensor]) -> Any:
    """What about one tensor argument the host path may depend on (not its address)."""
    if t is None:
        return None
    return (type(t), t.shape, t.stride(), t.dtype, t.device, t.requires_grad, t.data_ptr() % 16 == 0)


def _extent(t: torch.Tensor) -> int:
    """Bytes from t's first element to one past its last."""
    if t.numel() == 0:
        return 0
    return (1 + sum((n - 1) * s for n, s in zip(t.shape, t.stride()))) * t.element_size()


def _overlaps(bases: Sequence[int], extents: Sequence[int], live: Optional[Sequence[int]] = None) -> tuple:
    """(i, j, base_j - base_i) for every pair of inputs whose bytes overlap, in (i, j)
    order; ``live``: the indices of the inputs with bytes (an empty tensor overlaps
    nothing), when the caller knows them. One sweep over those inputs sorted by address: an
    input overlaps a later one iff that one starts before it ends, so a call whose inputs
    share bytes (a packed call with cu_seqlens_q is cu_seqlens_k) pays per overlap, not per
    pair of inputs (10 inputs: 6.4 -> 2.4 us on this box; none overlapping: 2.2 -> 1.7)."""
    if live is None:
        live = [i for i, e in enumerate(extents) if e]
    spans = sorted([(bases[i], bases[i] + extents[i], i) for i in live])
    n = len(spans)
    pairs = None
    for k in range(n - 1):
        _, end, i = spans[k]
        m = k + 1
        while m < n and spans[m][0] < end:
            j = spans[m][2]
            if pairs is None:
                pairs = []
            pairs.append((i, j) if i < j else (j, i))
            m += 1
    if pairs is None:
        return ()  # the common case
    pairs.sort()
    return tuple((i, j, bases[j] - bases[i]) for i, j in pairs)


# ---------------------------------------------------------------------------------------
# The dynamic schedule's work counter
# ---------------------------------------------------------------------------------------

_COUNTERS: dict[tuple[int, int], torch.Tensor] = {}


def stream_counter(device: torch.device, size: int = 1) -> torch.Tensor:
    """At least ``size`` int32 counters that are 0 when a kernel starts and that the kernel
    leaves at 0 (``backends.sm90.forward._reset_counter``, the decode kernel's fused
    combine): one buffer per device and stream, so kernels on one stream reuse it in order
    and kernels on two streams never share one; it grows (a fresh zeroed buffer, twice the
    size) when a kernel needs more. Under CUDA-graph capture a fresh zeroed buffer instead,
    owned by the graph: a graph replayed on another stream must not share counters with
    eager calls."""
    if device.type != "cuda":
        return torch.zeros(size, dtype=torch.int32, device=device)
    index = device.index if device.index is not None else torch.cuda.current_device()
    if torch.cuda.is_current_stream_capturing():
        return torch.zeros(size, dtype=torch.int32, device=device)
    key = (index, torch._C._cuda_getCurrentRawStream(index))
    counter = _COUNTERS.get(key)
    rec = getattr(_local, "recorder", None)
    if counter is None or counter.numel() < size:
        grown = size if counter is None else max(size, 2 * counter.numel())
        counter = _COUNTERS[key] = _new_counter(device, rec, grown)
    if rec is not None:
        rec.counters[counter.data_ptr()] = (device, max(size, rec.counters.get(counter.data_ptr(), (0, 0))[1]))
    return counter


def _new_counter(device: torch.device, rec: Optional["Recorder"], size: int = 1) -> torch.Tensor:
    """The stream's counter, made once. A recording that is active meanwhile must not see
    the allocation and its fill: they would become steps of its plan, a fresh zeroed buffer
    per replay that no launch reads (H200 run 90: an allocation and a fill kernel in every
    training forward, because the first call of a process made the counter)."""
    if rec is not None:
        rec.paused += 1
    try:
        return torch.zeros(size, dtype=torch.int32, device=device)
    finally:
        if rec is not None:
            rec.paused -= 1


# ---------------------------------------------------------------------------------------
# Recording
# ---------------------------------------------------------------------------------------

class Recorder(TorchDispatchMode):
    """Notes the buffers, fills and launches of one ordinary call (module docstring)."""

    def __init__(self, inputs: Sequence[Optional[torch.Tensor]]):
        super().__init__()
        self.inputs = list(inputs)
        self.slots: list[torch.Tensor] = []
        self.steps: list[tuple] = []
        self.counters: dict[int, tuple[torch.device, int]] = {}  # base -> (device, counters used)
        self.paused = 0
        self.refused: Optional[str] = None

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        out = func(*args, **kwargs)
        if self.paused or self.refused is not None:
            return out
        if func in _ALLOC or func in _ALLOC_ZERO:
            if not isinstance(out, torch.Tensor) or out.storage_offset() != 0:
                self.refused = f"allocation {func}"
            else:
                self.slots.append(out)
                if func in _ALLOC_ZERO:
                    self.steps.append(("fill", len(self.inputs) + len(self.slots) - 1, 0.0))
        elif func in _FILL:
            try:
                value = 0.0 if func is _aten.zero_.default else args[1]
                if isinstance(value, torch.Tensor) or not isinstance(value, (int, float, bool)):
                    raise _Refuse("fill with a tensor value")
                self.steps.append(("fill_view", self._view(args[0]), value))
            except _Refuse as e:
                self.refused = str(e)
        elif not func.is_view:
            self.refused = f"op {func}"
        return out

    # Where a pointer points -----------------------------------------------------------
    def _sources(self):
        srcs = []
        for i, t in enumerate(self.inputs):
            if t is not None:
                srcs.append((i, t.data_ptr(), _extent(t)))
        n = len(self.inputs)
        for j, t in enumerate(self.slots):
            st = t.untyped_storage()
            srcs.append((n + j, st.data_ptr(), st.nbytes()))
        return srcs

    def _where(self, ptr: int) -> tuple[Any, int]:
        """(source, byte offset) of a device address the call handed a kernel."""
        if ptr in self.counters:
            return ("counter", *self.counters[ptr]), 0  # ("counter", device, size)
        exact = inside = None
        for index, base, extent in self._sources():
            if ptr == base and exact is None:
                exact = index
            elif base <= ptr < base + extent and inside is None:
                inside = (index, base)
        if exact is not None:
            return exact, 0
        if inside is not None:
            return inside[0], ptr - inside[1]
        raise _Refuse(f"a pointer ({ptr:#x}) into no input or recorded buffer")

    def _source_tensor(self, index) -> torch.Tensor:
        n = len(self.inputs)
        return self.inputs[index] if index < n else self.slots[index - n]

    def _view(self, t: torch.Tensor) -> tuple:
        """(source, element offset, size, stride, dtype) of a tensor: a view of a source,
        reinterpreted (``dtype`` not None) when its dtype differs from the source's but has
        the same element size (a float32 scratch's int32 status words)."""
        if type(t) is not torch.Tensor:
            raise _Refuse("a tensor subclass")
        src, off = self._where(t.data_ptr())
        if isinstance(src, tuple):
            raise _Refuse("a view of the work counter")
        base = self._source_tensor(src)
        if base.element_size() != t.element_size() or off % t.element_size():
            raise _Refuse("a view with another element size")
        dtype = None if base.dtype == t.dtype else t.dtype
        return (src, off // t.element_size(), tuple(t.shape), tuple(t.stride()), dtype)

    # What Launcher reports ------------------------------------------------------------
    def launch(self, launcher, compiled, grid, args, constexprs, num_warps, num_stages) -> None:
        if self.refused is not None:
            return
        try:
            grid = tuple(grid) + (1,) * (3 - len(grid))
            if compiled is not None:
                self.steps.append(("raw", _RawLaunch.record(self, launcher, compiled, grid, args, constexprs)))
            else:
                self.steps.append(("generic", _GenericLaunch.record(self, launcher, grid, args, constexprs,
                                                                    num_warps, num_stages)))
        except _Refuse as e:
            self.refused = str(e)


class _RawLaunch:
    """One launch through Triton's C launcher with a recorded argument list."""

    __slots__ = ("raw", "grid", "device", "function", "coop", "pdl", "packed", "template", "patches", "descs")

    @classmethod
    def record(cls, rec: Recorder, launcher, compiled, grid, args, constexprs) -> "_RawLaunch":
        run = compiled.run
        if getattr(run, "global_scratch_size", 1) or getattr(run, "profile_scratch_size", 1):
            raise _Refuse("a kernel with scratch memory")
        raw = run.launch
        if getattr(raw, "__closure__", None):  # wrap_handle_tensordesc's closure: the C function inside
            cells = dict(zip(raw.__code__.co_freevars, (c.cell_contents for c in raw.__closure__)))
            raw = cells.get("launcher")
            if raw is None:
                raise _Refuse("an unknown launcher wrapper")
        metas = list(getattr(compiled.metadata, "tensordesc_meta", None) or [])
        self = cls()
        self.raw, self.grid, self.function = raw, grid, compiled.function
        self.device = torch.cuda.current_device() if torch.cuda.is_available() else None
        self.coop, self.pdl, self.packed = run.launch_cooperative_grid, run.launch_pdl, compiled.packed_metadata
        self.template, self.patches, self.descs = [], [], []
        desc_index = 0
        for a in launcher.full_args(args, constexprs):
            if isinstance(a, torch.Tensor):
                src, off = rec._where(a.data_ptr())
                self.patches.append((len(self.template), src, off))
                self.template.append(0)
            elif hasattr(a, "block_shape"):  # a TensorDescriptor
                meta = metas[desc_index] if desc_index < len(metas) else None
                desc_index += 1
                src, off = rec._where(a.base.data_ptr())
                shape, strides = [int(x) for x in a.shape], [int(x) for x in a.strides]
                if meta is None:  # lowered to a pointer with shape and strides (see make_tensordesc_arg)
                    self.patches.append((len(self.template), src, off))
                    self.template += [0, *shape, *strides, a.padding == "nan"]
                else:
                    from triton.backends.nvidia.driver import TMA_DTYPE_DEVICE_TO_HOST

                    if meta["fp4_padded"]:
                        raise _Refuse("an fp4 descriptor")
                    spec = (meta["swizzle"], meta["elem_size"], TMA_DTYPE_DEVICE_TO_HOST[meta["elem_type"]],
                            list(meta["block_size"]), shape, strides, 1 if a.padding == "nan" else 0)
                    self.descs.append((len(self.template), src, off, spec))
                    self.template.append(None)
                self.template += [*shape, *strides]
            elif a is None or type(a) in (int, float, bool) or not hasattr(a, "data_ptr"):
                self.template.append(a)
            else:
                raise _Refuse(f"an argument of type {type(a).__name__}")
        return self

    def __call__(self, bases: list[int], tma: dict) -> None:
        args = self.template.copy()
        for i, src, off in self.patches:
            args[i] = (bases[src] if type(src) is int else stream_counter(src[1], src[2]).data_ptr()) + off
        for i, src, off, spec in self.descs:
            ptr = bases[src] + off
            key = (id(spec), ptr)
            desc = tma.get(key)
            if desc is None:
                if len(tma) >= _MAX_TMA:
                    tma.clear()
                from triton.runtime import driver

                desc = tma[key] = driver.active.utils.fill_tma_descriptor(ptr, *spec)
            args[i] = desc
        g = self.grid
        stream = 0 if self.device is None else torch._C._cuda_getCurrentRawStream(self.device)
        self.raw(g[0], g[1], g[2], stream, self.function, self.coop, self.pdl, None, None, self.packed, None, None,
                 None, *args)


class _GenericLaunch:
    """One launch through ``kernel[grid](...)`` on views of the recorded sources."""

    __slots__ = ("fn", "grid", "args", "constexprs", "num_warps", "num_stages")

    @classmethod
    def record(cls, rec: Recorder, launcher, grid, args, constexprs, num_warps, num_stages) -> "_GenericLaunch":
        self = cls()
        self.fn, self.grid, self.constexprs = launcher.fn, grid, dict(constexprs)
        self.num_warps, self.num_stages = num_warps, num_stages
        self.args = []
        for a in args:
            if isinstance(a, torch.Tensor):
                self.args.append(("view", rec._view(a)))
            elif hasattr(a, "block_shape"):
                raise _Refuse("a tensor descriptor without a compiled kernel")
            elif a is None or type(a) in (int, float, bool):
                self.args.append(("const", a))
            else:
                raise _Refuse(f"an argument of type {type(a).__name__}")
        return self

    def __call__(self, sources: list[torch.Tensor]) -> None:
        args = [_as_view(sources, v) if kind == "view" else v for kind, v in self.args]
        self.fn[self.grid](*args, **self.constexprs, num_warps=self.num_warps, num_stages=self.num_stages)


def _as_view(sources, view) -> torch.Tensor:
    src, off, size, stride, dtype = view
    base = sources[src]
    if dtype is not None:
        base = base.view(dtype)
    if off == 0 and tuple(base.shape) == size and tuple(base.stride()) == stride:
        return base
    return base.as_strided(size, stride, base.storage_offset() + off)


# ---------------------------------------------------------------------------------------
# Replay
# ---------------------------------------------------------------------------------------

class Plan:
    """The recorded buffers, steps and outputs of one key (module docstring)."""

    __slots__ = ("slots", "steps", "outputs", "treedef", "raw_only", "tma")

    def __init__(self, rec: Recorder, outputs):
        import torch.utils._pytree as pytree

        leaves, self.treedef = pytree.tree_flatten(outputs)
        if isinstance(outputs, torch.Tensor):
            self.treedef = "leaf"
        elif type(outputs) is tuple and len(leaves) == len(outputs):
            self.treedef = "tuple"
        self.slots = [(tuple(t.shape), tuple(t.stride()), t.dtype, t.device) for t in rec.slots]
        self.steps = rec.steps
        self.outputs = []
        for leaf in leaves:
            if isinstance(leaf, torch.Tensor):
                self.outputs.append(("view", rec._view(leaf)))
            elif leaf is None or type(leaf) in (int, float, bool):
                self.outputs.append(("const", leaf))
            else:
                raise _Refuse(f"an output of type {type(leaf).__name__}")
        self.raw_only = all(kind in ("raw", "fill", "fill_view") for kind, *_ in self.steps)
        self.tma: dict = {}

    def replay(self, inputs: Sequence[Optional[torch.Tensor]], bases: list[int]):
        sources = list(inputs)
        for size, stride, dtype, device in self.slots:
            t = torch.empty_strided(size, stride, dtype=dtype, device=device)
            sources.append(t)
            bases.append(t.data_ptr())
        for kind, *step in self.steps:
            if kind == "raw":
                step[0](bases, self.tma)
            elif kind == "fill":
                sources[step[0]].fill_(step[1])
            elif kind == "fill_view":
                _as_view(sources, step[0]).fill_(step[1])
            else:
                step[0](sources)
        outs = [_as_view(sources, v) if kind == "view" else v for kind, v in self.outputs]
        if self.treedef == "leaf":
            return outs[0]
        if self.treedef == "tuple":
            return tuple(outs)
        import torch.utils._pytree as pytree

        return pytree.tree_unflatten(outs, self.treedef)


class _Entry:
    """One key's state: its inputs' extents, plans per overlap signature (a Plan, a count
    of refused recordings, or unplannable), what an API layer derived once for it
    (``prepared``), and ``below``: entries of the call one layer down that this key
    determines (so a training call finds its kernels' entry without making their key:
    ``flashtile.autograd``)."""

    __slots__ = ("extents", "live", "overlapping", "plans", "prepared", "below")

    def __init__(self, inputs):
        self.extents = [0 if t is None else _extent(t) for t in inputs]
        self.live = [i for i, e in enumerate(self.extents) if e]  # inputs with bytes
        self.overlapping = len(self.live) > 1  # only these can share bytes
        self.plans: dict = {}
        self.prepared = None
        self.below: dict = {}


def below(entry: _Entry, name: Any, inputs: Sequence[Optional[torch.Tensor]]) -> _Entry:
    """The entry ``name`` (any hashable: a string, or a key of what only that call brings)
    of a call one layer down that ``entry``'s key determines but its inputs' addresses
    (``entry.below[name]``), made on first use with these inputs."""
    e = entry.below.get(name)
    if e is None:
        e = entry.below[name] = _Entry(inputs)
    return e


class Cache:
    """Plans of one call site: key -> ``_Entry``."""

    def __init__(self, name: str):
        self.name = name
        self.entries: dict = {}
        self.lock = threading.Lock()

    def entry(self, key, inputs) -> _Entry:
        """The entry of ``key`` (not None), made on first use."""
        e = self.entries.get(key)
        if e is None:
            with self.lock:
                if len(self.entries) >= _MAX_PLANS:
                    self.entries.clear()
                e = self.entries.setdefault(key, _Entry(inputs))
        return e

    def clear(self) -> None:
        self.entries.clear()


_CACHES: list[Cache] = []


def cache(name: str) -> Cache:
    c = Cache(name)
    _CACHES.append(c)
    return c


def clear() -> None:
    """Forget every plan (after changing Triton knobs or kernel globals at run time)."""
    for c in _CACHES:
        c.clear()
    _COUNTERS.clear()


def active_recorder() -> Optional[Recorder]:
    """The recorder of the call this thread is recording, if any."""
    return getattr(_local, "recorder", None)


_PLAIN = frozenset((type(None), bool, int, float, str))


def plain_scalars(values) -> Optional[tuple]:
    """A hashable key part for an API call's non-tensor arguments: each as (type, value)
    (so causal=1 and causal=True, or softcap=0 and 0.0, stay apart: validation may treat
    them differently), tuples and lists of plain values element by element; None when an
    argument is of another type (a tensor window_size, say): such a call is not planned."""
    out = tuple((type(x), x) for x in values)
    for t, x in out:
        if t not in _PLAIN:
            if t is not tuple and t is not list:
                return None
            for y in x:
                if type(y) not in _PLAIN:
                    return None
    return out if list not in map(type, values) else tuple((t, tuple(x) if t is list else x) for t, x in out)


def make_key(inputs: Sequence[Optional[torch.Tensor]], scalars: tuple) -> Any:
    """The key of a call with these tensors and (hashable) scalar arguments, or None when
    it must not be planned: plans off, inside another call's recording, under anything
    that traces or transforms tensors (torch.compile, a dispatch mode, functorch,
    jit.trace, a forward-AD dual level), a tensor subclass among the inputs, or one without
    storage (a functorch wrapper that outlived its transform: the ordinary path takes it)."""
    if (getattr(_local, "recorder", None) is not None or torch.compiler.is_compiling()
            or _get_current_dispatch_mode() is not None or torch._C._are_functorch_transforms_active()
            or torch._C._get_tracing_state() is not None or _fwad._current_level >= 0):
        return None  # something traces or transforms the call: the ordinary path, every time
    for t in inputs:
        if t is not None and type(t) is not torch.Tensor:
            return None
    env = env_key()
    if env[0][0] in ("0", b"0"):
        return None
    try:
        keys = tuple(map(tensor_key, inputs))
    except RuntimeError:  # no data pointer: a tensor without storage
        return None
    return (env, scalars, *keys)


def call(c: Cache, key, inputs: Sequence[Optional[torch.Tensor]], fn: Callable[[], Any]):
    """``fn()``, through the plan of ``key`` when there is one (module docstring).

    ``key`` must hold everything ``fn``'s host path depends on except the inputs'
    addresses (``tensor_key`` of each input, scalars, ``env_key()``); None means "do not
    plan this call". ``inputs``: the tensors ``fn`` reads or writes (None allowed)."""
    if key is None:
        return fn()
    return run(c.entry(key, inputs), inputs, fn)


def run(entry: _Entry, inputs: Sequence[Optional[torch.Tensor]], fn: Callable[[], Any]):
    """``call`` with the key's entry already found (``Cache.entry``)."""
    bases = [0 if t is None else t.data_ptr() for t in inputs]
    sig = _overlaps(bases, entry.extents, entry.live) if entry.overlapping else ()
    plan = entry.plans.get(sig)
    if type(plan) is Plan:
        if plan.raw_only and hooks_installed():
            return fn()
        return plan.replay(inputs, bases)
    if plan is _UNPLANNABLE:
        return fn()
    rec = Recorder(inputs)
    _local.recorder = rec
    try:
        with rec:
            out = fn()
    finally:
        _local.recorder = None
    new = None
    if rec.refused is None:
        try:
            new = Plan(rec, out)
        except _Refuse as e:
            rec.refused = str(e)
    if new is None:
        # A first call may do one-time work (autotuning, a config file): record twice more.
        tries = plan or 0
        new = _UNPLANNABLE if tries >= _MAX_TRIES - 1 else tries + 1
    entry.plans[sig] = new
    return out


_knobs = None  # triton.knobs.runtime, imported on first use (this module needs no triton)


def hooks_installed() -> bool:
    """A profiler's launch hooks are set (triton 3.6 keeps them in always-present
    HookChains): a replay would skip them, so a plan of raw launches is not replayed, and
    the direct launch path is off."""
    global _knobs
    if _knobs is None:
        import triton

        _knobs = triton.knobs.runtime
    rt = _knobs
    return any(getattr(h, "calls", h) for h in (rt.launch_enter_hook, rt.launch_exit_hook))

"""Translate a score_mod or mask_mod written with torch ops into a Triton function.

A mod is traced once with ``make_fx`` on one-element inputs (score float32, b, h, q_idx,
kv_idx int32), which reduces any torch spelling to a short list of aten ops; each op
becomes one line of a ``@triton.jit`` function that the flex kernels' score pipeline
inlines (``scores.flex_scores``), applied to whole tiles: b and h are the program's
scalars, q_idx a column and kv_idx a row of indices.

Tensors the mod reads (captured in its closure or globals: per-head slopes, an (L, S)
bias, a relative-position table, document ids) become pointer arguments, with their sizes
and strides in a small int64 tensor (``meta``), so that new values, or new shapes, never
recompile the kernel (its offsets are int32, int64 for a tensor past 2^31 elements: a
second compile); a load is masked to the tensor's bounds (padded rows and columns
past the sequence read index 0 instead of faulting) and negative indices wrap as in
torch. A tensor indexed by b, h, q_idx or kv_idx itself is checked against the call's
extents before the launch (an IndexError, as torch raises); an index computed out of a
tensor's bounds otherwise reads 0 where torch would raise. A score function's translation
also returns d score_mod / d score, by forward-mode differentiation of the same lines: the
backward's chain rule.

Translated (aten ops)::

    arithmetic   add sub rsub mul div (true, floor, trunc) floor_divide remainder fmod neg
                 abs pow (scalar exponent) reciprocal minimum maximum clamp clamp_min
                 clamp_max
    math         exp exp2 log log2 sqrt rsqrt tanh sigmoid sin cos sign floor ceil trunc
    compare      eq ne lt le gt ge, logical_and/or/xor/not, bitwise_and/or/xor/not (bool)
    select       where, zeros_like/ones_like/full_like/scalar_tensor (constants)
    tensors      captured tensors indexed by index expressions (index.Tensor, select),
                 a one-element captured tensor read as a value, small constant tensors
                 made inside the mod (torch.tensor(5))
    dtypes       _to_copy (casts), views and copies of one element (no-ops)

Any other op is refused (``UntranslatableMod``, naming the op and the mod), and so are a
mod whose result per element is not one value, a view or reshape of a captured tensor and
an integer constant beyond int32; never computed differently. Ops on constants alone are
computed here with torch (Triton would fold Python literals with Python's semantics). A
``triton.jit`` function may be passed instead of a Python mod (``triton_mod``).

Known differences from torch (tests/backends/triton/test_modgen.py): the indices are int32
in the kernels (int64 in torch's calls), so integer arithmetic on them that passes 2^31
wraps; a row that only scores below -2^126 / log2(e) reach (torch.finfo(float32).min)
spreads evenly over them as in torch, but its LSE is the float masks' encoding of that
case (``scores.row_lse2``), not torch's value.
"""

from __future__ import annotations

import functools
import hashlib
import linecache
import math
import re
import types
import weakref
from dataclasses import dataclass, field
from typing import Callable, Optional

import torch

aten = torch.ops.aten


class UntranslatableMod(NotImplementedError):
    """A score_mod/mask_mod the flex kernels cannot run (the twin, on CPU tensors, can)."""


_TL_DTYPES = {torch.float32: "tl.float32", torch.float16: "tl.float16", torch.bfloat16: "tl.bfloat16",
              torch.float64: "tl.float64", torch.int32: "tl.int32", torch.int64: "tl.int64", torch.int16: "tl.int16",
              torch.int8: "tl.int8", torch.uint8: "tl.uint8", torch.bool: "tl.int1"}


@dataclass
class Translated:
    """A translated mod: ``fn`` (a JITFunction: score kind ``fn(score, b, h, q_idx, kv_idx,
    ARGS) -> (score, d score / d input)``, mask kind ``fn(b, h, q_idx, kv_idx, ARGS) ->
    keep``), its ``source``, the ``captured`` tensors in ARGS order (ARGS = (meta,
    *captured)), and whether the mod reads its input score at all."""

    kind: str
    name: str
    fn: object
    source: str
    captured: tuple
    guard: tuple = ()
    direct: tuple = ()  # (captured tensor, its dim, "b" | "h" | "q_idx" | "kv_idx"): indexed by an index itself
    tile_gathers: int = 0  # loads of a whole (queries x keys) tile from captured tensors (an (L, S) bias)
    _meta: dict = field(default_factory=dict)

    def check_bounds(self, extents: dict) -> None:
        """A captured tensor indexed directly by b, h, q_idx or kv_idx must cover the call's
        extent of it (``extents``: {"b": B, "h": Hq, "q_idx": L, "kv_idx": S}): torch raises
        an IndexError there, and the kernels would read 0 (their loads are masked)."""
        for c, dim, name in self.direct:
            size = self.captured[c].shape[dim]
            if size < extents[name]:
                raise IndexError(f"{self.kind}_mod {self.name!r} indexes dim {dim} of a captured tensor of shape "
                                 f"{tuple(self.captured[c].shape)} by {name}, which reaches {extents[name] - 1}: "
                                 f"out of bounds (torch raises here too)")

    def args(self, device) -> tuple:
        """(meta, *captured): meta the int64 sizes and strides of each captured tensor."""
        key = (str(device),) + tuple((tuple(t.shape), tuple(t.stride())) for t in self.captured)
        meta = self._meta.get(key)
        if meta is None:
            values = []
            for t in self.captured:
                values += list(t.shape) + list(t.stride())
            # int32 offsets (fewer registers in the kernels' tiles) unless a tensor needs 64 bits.
            wide = any(t.numel() > 0 and t.storage_offset() + sum((n - 1) * st for n, st in zip(t.shape, t.stride()))
                       >= 2**31 for t in self.captured)
            meta = torch.tensor(values or [0], dtype=torch.int64 if wide else torch.int32, device=device)
            self._meta[key] = meta
        return (meta,) + tuple(self.captured)

    @property
    def requires_grad(self) -> tuple:
        """The captured tensors that require grad (learned biases)."""
        return tuple(t for t in self.captured if t.requires_grad)


@dataclass
class _Ref:
    """A captured tensor, partly indexed: tensor ``c``, its remaining dims, the element
    offset so far and the in-bounds predicate so far (source expressions)."""

    c: int
    dims: list
    offset: str
    ok: str


@dataclass
class _Val:
    expr: str
    dtype: torch.dtype
    d: Optional[str] = None  # d value / d score (score mods), None: does not depend on the score


# --------------------------------------------------------------------------- the cache
_CACHE: dict = {}


def _reachable(fn, depth: int = 4, seen=None) -> tuple:
    """(tensors, Python numbers) a mod can reach (its closure, the globals it names, a
    partial's arguments, a bound method's object), recursing through functions and
    containers: the guard of a cached translation (a mod rebound to another tensor, or
    reading a number that changed, is traced again)."""
    seen = set() if seen is None else seen
    found, scalars = [], []

    def visit(obj, level):
        if id(obj) in seen or level < 0:
            return
        seen.add(id(obj))
        if isinstance(obj, torch.Tensor):
            found.append(obj)
        elif isinstance(obj, (bool, int, float, complex)):
            scalars.append(obj)  # read by value into the trace: a new value must trace again
        elif isinstance(obj, (list, tuple)):
            for x in obj:
                visit(x, level - 1)
        elif isinstance(obj, dict):
            for x in obj.values():
                visit(x, level - 1)
        elif isinstance(obj, functools.partial):
            visit(obj.func, level - 1)
            visit(obj.args, level - 1)
            visit(obj.keywords, level - 1)
        elif isinstance(obj, types.MethodType):
            visit(obj.__func__, level - 1)
            visit(obj.__self__, level - 1)
        elif isinstance(obj, types.FunctionType):
            for cell in obj.__closure__ or ():
                try:
                    visit(cell.cell_contents, level - 1)
                except ValueError:
                    pass
            names = obj.__code__.co_names
            for name in names:
                if name in obj.__globals__:
                    value = obj.__globals__[name]
                    if not isinstance(value, types.ModuleType):
                        visit(value, level - 1)
        elif isinstance(obj, torch.nn.Module):
            for t in list(obj.parameters(recurse=False)) + list(obj.buffers(recurse=False)):
                visit(t, level - 1)
            visit(obj.__dict__, level - 1)
        elif hasattr(obj, "__dict__") and not isinstance(obj, type):
            visit(vars(obj), level - 1)

    visit(fn, depth)
    return found, scalars


def is_triton_function(fn) -> bool:
    """A ``triton.jit`` function (compiled, or the interpreter's)."""
    from triton.runtime.jit import KernelInterface

    return isinstance(fn, KernelInterface)


def translate(fn, kind: str, device) -> Translated:
    """The translation of ``fn`` ("score" or "mask"), traced once per mod and reused while
    the tensors it can reach are the same objects."""
    if is_triton_function(fn):
        return triton_mod(fn, kind)
    tensors, scalars = _reachable(fn)
    reach = (tuple(id(t) for t in tensors), tuple((type(x), x) for x in scalars))
    key = (id(fn), kind)
    hit = _CACHE.get(key)
    if hit is not None:
        ref, translated = hit
        if ref() is fn and translated.guard == reach and translated.guard is not None:
            return translated
    translated = _trace(fn, kind, device)
    traced_ids = {id(t) for t in translated.captured}
    # Tensors the trace read that the guard cannot see: trace again on every call.
    translated.guard = reach if traced_ids <= set(reach[0]) else None
    try:
        _CACHE[key] = (weakref.ref(fn), translated)
    except TypeError:
        pass
    return translated


def triton_mod(fn, kind: str) -> Translated:
    """A user's own ``triton.jit`` mod (score: ``fn(score, b, h, q_idx, kv_idx, ARGS) ->
    (score, d score / d input)``; mask: ``fn(b, h, q_idx, kv_idx, ARGS) -> keep``), called
    with ARGS = (meta,) (no captured tensors)."""
    return Translated(kind, getattr(fn, "__name__", "triton_mod"), fn, getattr(fn, "src", ""), ())


# --------------------------------------------------------------------------- tracing
def _trace(fn, kind: str, device) -> Translated:
    from torch.fx.experimental.proxy_tensor import make_fx

    name = getattr(fn, "__name__", type(fn).__name__)
    idx = [torch.zeros(1, dtype=torch.int32, device=device) for _ in range(4)]
    inputs = ([torch.zeros(1, dtype=torch.float32, device=device)] if kind == "score" else []) + idx
    try:
        with torch.no_grad():
            gm = make_fx(fn)(*inputs)
    except UntranslatableMod:
        raise
    except Exception as err:  # data-dependent control flow, Python on tensor values, ...
        raise UntranslatableMod(f"{kind}_mod {name!r} cannot be traced into a kernel ({type(err).__name__}: "
                                f"{str(err).splitlines()[0][:200]}); write it with torch ops only (no Python "
                                f"branches on tensor values), or run on CPU tensors (the twin)") from err
    return _Emitter(gm, kind, name).emit()


class _Emitter:
    """Emits the Triton source of a traced mod, line by line."""

    def __init__(self, gm, kind: str, name: str):
        self.gm, self.kind, self.name = gm, kind, name
        self.lines: list[str] = []
        self.env: dict = {}
        self.captured: list = []
        self.direct: list = []
        self.deps: dict = {"q_idx": {"q"}, "kv_idx": {"kv"}}
        self.tile_gathers = 0
        self.n = 0

    # helpers
    def fresh(self, expr: str) -> str:
        self.n += 1
        var = f"v{self.n}"
        self.lines.append(f"    {var} = {expr}")
        # Which of the tile's axes the value varies along (a gather along both loads a tile).
        deps = set()
        for name in re.findall(r"\b(v\d+|q_idx|kv_idx)\b", expr):
            deps |= self.deps.get(name, set())
        self.deps[var] = deps
        if expr.startswith("gather(") and deps == {"q", "kv"}:
            self.tile_gathers += 1
        return var

    def refuse(self, what: str):
        raise UntranslatableMod(f"{self.kind}_mod {self.name!r} uses {what}, which flashtile's kernels do not "
                                f"translate (backends/triton/modgen.py lists what does); run it on CPU tensors "
                                f"(the twin) or rewrite it")

    def capture(self, t: torch.Tensor) -> int:
        for i, c in enumerate(self.captured):
            if c is t:
                return i
        self.captured.append(t)
        return len(self.captured) - 1

    def meta_base(self, c: int) -> int:
        return sum(2 * t.dim() for t in self.captured[:c])

    def size(self, ref: _Ref, dim: int) -> str:
        return f"tl.load(ARGS[0] + {self.meta_base(ref.c) + dim})"

    def stride(self, ref: _Ref, dim: int) -> str:
        return f"tl.load(ARGS[0] + {self.meta_base(ref.c) + self.captured[ref.c].dim() + dim})"

    def value(self, arg) -> _Val:
        """An fx argument as a value (constants as literals, one-element tensors loaded)."""
        if isinstance(arg, torch.fx.Node):
            v = self.env[arg]
            if isinstance(v, _Ref):
                if v.dims:
                    if self.captured[v.c].numel() != 1:
                        self.refuse(f"a captured tensor of shape {tuple(self.captured[v.c].shape)} as a whole "
                                    f"(index it by b, h, q_idx, kv_idx)")
                    v = _Ref(v.c, [], v.offset, v.ok)  # its one element
                dtype = self.captured[v.c].dtype
                var = self.fresh(f"gather(ARGS[{v.c + 1}], {v.offset}, {v.ok})")
                return _Val(var, dtype)
            return v
        if isinstance(arg, bool):
            return _Val("True" if arg else "False", torch.bool)
        if isinstance(arg, int):
            if not -2**31 <= arg < 2**31:
                self.refuse(f"the integer constant {arg} (the kernels' indices are int32: it would wrap)")
            return _Val(str(arg), torch.int64)
        if isinstance(arg, float):
            if math.isinf(arg):
                return _Val('float("inf")' if arg > 0 else 'float("-inf")', torch.float32)
            if math.isnan(arg):
                return _Val('float("nan")', torch.float32)
            return _Val(repr(arg), torch.float32)
        self.refuse(f"the argument {arg!r}")

    def cast(self, expr: str, dtype: torch.dtype) -> str:
        tl_dtype = _TL_DTYPES.get(dtype)
        if tl_dtype is None:
            self.refuse(f"the dtype {dtype}")
        literal = _literal(expr)
        if literal is not None:  # a Python constant has no .to: keep it a literal of the dtype
            if dtype == torch.bool:
                return repr(bool(literal))
            if dtype.is_floating_point:
                value = float(literal)
                return repr(value) if math.isfinite(value) else f'float("{value}")'
            return repr(int(literal))
        return f"({expr}).to({tl_dtype})"

    # the walk
    def emit(self) -> Translated:
        placeholders = [n for n in self.gm.graph.nodes if n.op == "placeholder"]
        names = (["score"] if self.kind == "score" else []) + ["b", "h", "q_idx", "kv_idx"]
        for node, nm in zip(placeholders, names):
            self.env[node] = _Val(nm, torch.float32 if nm == "score" else torch.int32, "1.0" if nm == "score" else None)
        result = None
        for node in self.gm.graph.nodes:
            if node.op == "placeholder":
                continue
            if node.op == "get_attr":
                t = getattr(self.gm, node.target)
                self.env[node] = self.constant_or_capture(node, t)
                continue
            if node.op == "output":
                result = node.args[0]
                break
            if node.op != "call_function":
                self.refuse(f"the fx node {node.op}")
            self.env[node] = self.op(node)
        if isinstance(result, (list, tuple)):
            if len(result) != 1:
                self.refuse("several results")
            result = result[0]
        out = self.value(result)
        if self.kind == "score":
            value = self.cast(out.expr, torch.float32)
            deriv = "0.0" if out.d is None else out.d
            result_var = self.fresh(value)
            self.lines.append(f"    return {result_var}, {deriv} + tl.zeros_like({result_var})")
            head = f"def {self.fn_name()}(score, b, h, q_idx, kv_idx, ARGS):"
        else:
            if out.dtype != torch.bool:
                self.refuse(f"a mask that returns {out.dtype} (it must return bool)")
            self.lines.append(f"    return {out.expr}")
            head = f"def {self.fn_name()}(b, h, q_idx, kv_idx, ARGS):"
        source = "\n".join(["@triton.jit", head, f'    """{self.kind}_mod {self.name!r}, translated."""']
                           + self.lines) + "\n"
        fn = _compile_source(source, self.fn_name())
        return Translated(self.kind, self.name, fn, source, tuple(self.captured),
                          direct=tuple(dict.fromkeys(self.direct)), tile_gathers=self.tile_gathers)

    def fn_name(self) -> str:
        clean = "".join(ch if ch.isalnum() else "_" for ch in self.name)
        return f"{self.kind}_mod_{clean}"

    def constant_or_capture(self, node, t: torch.Tensor):
        made_inside = any(u.target is aten.lift_fresh_copy.default for u in node.users)
        if made_inside:
            if t.numel() != 1:
                self.refuse(f"a tensor of shape {tuple(t.shape)} made inside the mod (capture it instead)")
            item = t.item()
            return _Val(repr(bool(item)) if t.dtype == torch.bool else repr(item), t.dtype)
        c = self.capture(t)
        return _Ref(c, list(range(t.dim())), "0", "True")

    def op(self, node):
        target, args, kwargs = node.target, node.args, node.kwargs
        val = node.meta.get("val")
        dtype = val.dtype if isinstance(val, torch.Tensor) else torch.float32
        first = self.env.get(args[0]) if args and isinstance(args[0], torch.fx.Node) else None
        if isinstance(first, _Ref):  # an op on a captured tensor itself, before any element is read
            if target is aten.select.int:
                return self.select(args[0], args[1], args[2])
            if target is aten.index.Tensor:
                return self.index(args[0], args[1], dtype)
            if target in _SAME_TENSOR:
                return first
            if target in _VIEWS:
                self.refuse(f"{target} of a captured tensor (index the tensor as it is, or capture the view)")
        if isinstance(val, torch.Tensor) and val.numel() != 1:
            self.refuse(f"{target} giving a tensor of shape {tuple(val.shape)} per element (a mod must give one "
                        f"value per (b, h, q_idx, kv_idx))")
        if target is aten.detach.default:  # a value without a derivative
            v = self.value(args[0])
            return _Val(v.expr, v.dtype)
        if target is aten.lift_fresh_copy.default or target in _VIEWS:
            return first if first is not None else self.value(args[0])
        if target is aten.index.Tensor:
            return self.index(args[0], args[1], dtype)
        folded = self.fold(node, dtype)
        if folded is not None:
            return folded
        handler = _OPS.get(target)
        if handler is None:
            self.refuse(f"the op {target}")
        return handler(self, args, kwargs, dtype)

    def fold(self, node, dtype):
        """An op whose inputs are all constants, computed here with torch's semantics (Triton
        would fold Python literals with Python's)."""
        values = []
        for a in list(node.args) + list(node.kwargs.values()):
            if isinstance(a, torch.fx.Node):
                v = self.env.get(a)
                if not isinstance(v, _Val) or _literal(v.expr) is None:
                    return None
                values.append(_literal(v.expr))
        if not values:
            return None
        lits = iter(values)

        def sub(a):
            if isinstance(a, torch.fx.Node):
                return torch.tensor(next(lits), dtype=self.env[a].dtype)
            return a

        args = [sub(a) for a in node.args]
        kwargs = {k: sub(v) for k, v in node.kwargs.items()}
        try:
            result = node.target(*args, **kwargs)
        except Exception:
            return None
        if not isinstance(result, torch.Tensor) or result.numel() != 1:
            return None
        return _Val(self.cast(repr(result.item()), dtype), dtype)

    def ref(self, arg) -> _Ref:
        v = self.env.get(arg) if isinstance(arg, torch.fx.Node) else None
        if not isinstance(v, _Ref):
            self.refuse("indexing of a value that is not a captured tensor")
        return v

    def select(self, base, dim, index) -> _Ref:
        ref = self.ref(base)
        if not isinstance(index, int):
            self.refuse("select with a non-constant index")
        dim = dim % len(ref.dims)
        d = ref.dims[dim]
        idx = self.fresh(f"{index} + tl.where({index} < 0, {self.size(ref, d)}, 0)")
        off = self.fresh(f"{ref.offset} + {idx} * {self.stride(ref, d)}")
        return _Ref(ref.c, ref.dims[:dim] + ref.dims[dim + 1:], off, ref.ok)

    def index(self, base, indices, dtype):
        ref = self.ref(base)
        if len(indices) != len(ref.dims) or any(i is None for i in indices):
            self.refuse(f"indexing a captured tensor of {len(ref.dims)} dims with {len(indices)} indices "
                        f"(index every dim)")
        off, ok = ref.offset, ref.ok
        for d, i in zip(ref.dims, indices):
            iv = self.value(i)
            if iv.dtype == torch.bool or iv.dtype.is_floating_point:
                self.refuse(f"an index of dtype {iv.dtype}")
            size = self.size(ref, d)
            if iv.expr in ("b", "h", "q_idx", "kv_idx"):  # never negative; bounds checked on the host
                self.direct.append((ref.c, d, iv.expr))
                wrapped = iv.expr
                ok = self.fresh(f"({ok}) & ({wrapped} < {size})")
            else:  # torch wraps negative indices
                wrapped = self.fresh(f"{iv.expr} + tl.where({iv.expr} < 0, {size}, 0)")
                ok = self.fresh(f"({ok}) & ({wrapped} >= 0) & ({wrapped} < {size})")
            off = self.fresh(f"{off} + {wrapped} * {self.stride(ref, d)}")
        var = self.fresh(f"gather(ARGS[{ref.c + 1}], {off}, {ok})")
        return _Val(self.cast(var, dtype) if dtype != self.captured[ref.c].dtype else var, dtype)


def _literal(expr: str):
    """The value of ``expr`` when it is a Python constant (a literal the emitter wrote), else None."""
    try:
        value = eval(expr, {"__builtins__": {}, "float": float, "True": True, "False": False})  # noqa: S307
    except Exception:
        return None
    return value if isinstance(value, (bool, int, float)) else None


def _compile_source(source: str, name: str):
    """A JITFunction from generated source (kept in linecache: Triton reads the source)."""
    digest = hashlib.sha1(source.encode()).hexdigest()[:16]
    filename = f"<flashtile-mod-{digest}>"
    full = ("import triton\nimport triton.language as tl\n"
            "from flashtile.backends.triton.modlib import floordiv, floordiv_float, remainder, sigmoid, sign, gather\n"
            "from flashtile.backends.triton.scores import tanh\n\n"
            + source)
    linecache.cache[filename] = (len(full), None, full.splitlines(True), filename)
    namespace: dict = {"__name__": f"flashtile_mod_{digest}"}
    exec(compile(full, filename, "exec"), namespace)
    return namespace[name]


# --------------------------------------------------------------------------- the op table
_VIEWS = {aten.view.default, aten._unsafe_view.default, aten.clone.default, aten.alias.default,
          aten.detach.default, aten.expand.default, aten.unsqueeze.default, aten.squeeze.dim,
          aten.squeeze.default, aten.reshape.default, aten.contiguous.default, aten.lift_fresh_copy.default}
# Of those, the ones that leave a captured tensor's indexing as it is.
_SAME_TENSOR = {aten.clone.default, aten.alias.default, aten.detach.default, aten.contiguous.default,
                aten.lift_fresh_copy.default}


def _binary(symbol: str, deriv: Optional[Callable] = None):
    def handler(e: _Emitter, args, kwargs, dtype):
        a, b = e.value(args[0]), e.value(args[1])
        alpha = kwargs.get("alpha", args[2] if len(args) > 2 else None)
        bexpr = b.expr if alpha in (None, 1) else f"({b.expr} * {alpha})"
        bd = b.d if alpha in (None, 1) or b.d is None else f"({b.d} * {alpha})"
        aexpr = a.expr
        if dtype == torch.bool and symbol in ("+", "*"):  # torch: bool + bool is OR, bool * bool AND
            return _Val(e.fresh(f"({aexpr} != 0) {'|' if symbol == '+' else '&'} ({bexpr} != 0)"), torch.bool)
        if symbol == "/" and not a.dtype.is_floating_point and not b.dtype.is_floating_point:
            aexpr, bexpr = f"({aexpr} * 1.0)", f"({bexpr} * 1.0)"  # torch's true division of integers
        var = e.fresh(e.cast(f"{aexpr} {symbol} {bexpr}", dtype))
        d = deriv(e, a, _Val(bexpr, b.dtype, bd), var) if deriv and (a.d or bd) and e.kind == "score" else None
        return _Val(var, dtype, d)
    return handler


# Derivatives with respect to the score (forward mode): a None derivative is a constant's.
def _d_add(e, a, b, out):
    if a.d is None or b.d is None:
        return a.d or b.d
    return e.fresh(f"{a.d} + {b.d}")


def _d_sub(e, a, b, out):
    if b.d is None:
        return a.d
    return e.fresh(f"-({b.d})" if a.d is None else f"{a.d} - {b.d}")


def _d_mul(e, a, b, out):
    if b.d is None:
        return e.fresh(f"{a.d} * {b.expr}")
    if a.d is None:
        return e.fresh(f"{a.expr} * {b.d}")
    return e.fresh(f"{a.d} * {b.expr} + {a.expr} * {b.d}")


def _d_div(e, a, b, out):
    if b.d is None:
        return e.fresh(f"{a.d} / {b.expr}")
    if a.d is None:
        return e.fresh(f"-{out} * {b.d} / {b.expr}")
    return e.fresh(f"({a.d} - {out} * {b.d}) / {b.expr}")


def _rsub(e, args, kwargs, dtype):
    a, b = e.value(args[0]), e.value(args[1])
    alpha = kwargs.get("alpha", 1)
    var = e.fresh(e.cast(f"{b.expr} - {a.expr} * {alpha}", dtype))
    d = None
    if (a.d or b.d) and e.kind == "score":
        d = e.fresh(f"{b.d or 0.0} - ({a.d or 0.0}) * {alpha}")
    return _Val(var, dtype, d)


def _compare(symbol: str):
    def handler(e, args, kwargs, dtype):
        a, b = e.value(args[0]), e.value(args[1])
        return _Val(e.fresh(f"{a.expr} {symbol} {b.expr}"), torch.bool)
    return handler


def _logic(symbol: str):
    def handler(e, args, kwargs, dtype):
        a, b = e.value(args[0]), e.value(args[1])
        if dtype != torch.bool:
            return _Val(e.fresh(e.cast(f"{a.expr} {symbol} {b.expr}", dtype)), dtype)
        return _Val(e.fresh(f"({a.expr} != 0) {symbol} ({b.expr} != 0)"), torch.bool)
    return handler


def _not(e, args, kwargs, dtype):
    a = e.value(args[0])
    if dtype == torch.bool:
        return _Val(e.fresh(f"{a.expr} == 0"), torch.bool)
    return _Val(e.fresh(f"~{a.expr}"), dtype)


def _unary(expr: str, deriv: Optional[str] = None, float_only: bool = True):
    """``expr`` with {x} the input; ``deriv`` with {x}, {y} (the output) and {dx}."""
    def handler(e, args, kwargs, dtype):
        a = e.value(args[0])
        x = e.cast(a.expr, torch.float32) if float_only and not a.dtype.is_floating_point else a.expr
        var = e.fresh(e.cast(expr.format(x=x), dtype))
        d = None
        if a.d is not None and e.kind == "score":
            d = e.fresh(deriv.format(x=x, y=var, dx=a.d)) if deriv else "0.0"
        return _Val(var, dtype, d)
    return handler


def _power(e, x: str, n: int) -> str:
    """x ** n for an integer n by repeated squaring (a negative n: its reciprocal)."""
    if n == 0:
        return f"(tl.zeros_like({x}) + 1.0)"
    result, base, k = None, x, abs(n)
    while k:
        if k & 1:
            result = base if result is None else e.fresh(f"{result} * {base}")
        k >>= 1
        if k:
            base = e.fresh(f"{base} * {base}")
    return result if n > 0 else e.fresh(f"1.0 / {result}")


def _pow(e, args, kwargs, dtype):
    """x ** n for a constant n: integral exponents (2, 2.0, -1, 9) by multiplication (a
    negative base is fine, as in torch), others through exp2/log2 (NaN for a negative base,
    as torch). The derivative is n * x ** (n - 1), 0 at x == 0 for n > 1."""
    a, n = e.value(args[0]), args[1]
    if not isinstance(n, (int, float)) or isinstance(n, bool):
        e.refuse("pow with a tensor exponent")
    integral = float(n).is_integer() and abs(n) <= 64
    x = a.expr if a.dtype.is_floating_point or (integral and n >= 0) else e.cast(a.expr, torch.float32)
    if integral:
        expr = _power(e, x, int(n))
    else:
        expr = f"tl.exp2({float(n)} * tl.log2({e.cast(a.expr, torch.float32)}))"
    var = e.fresh(e.cast(expr, dtype))
    d = None
    if a.d is not None and e.kind == "score":
        if n == 0:
            d = "0.0"
        elif integral:
            d = e.fresh(f"{float(n)} * {_power(e, x, int(n) - 1)} * ({a.d})")
        else:
            d = e.fresh(f"{float(n)} * tl.exp2({float(n) - 1.0} * tl.log2({x})) * ({a.d})")
    return _Val(var, dtype, d)


def _minmax(which: str):
    def handler(e, args, kwargs, dtype):
        a, b = e.value(args[0]), e.value(args[1])
        op = "tl.maximum" if which == "max" else "tl.minimum"
        var = e.fresh(e.cast(f"{op}({a.expr}, {b.expr})", dtype))
        d = None
        if (a.d or b.d) and e.kind == "score":
            cmp = ">" if which == "max" else "<"
            da, db = a.d or "0.0", b.d or "0.0"
            d = e.fresh(f"tl.where({a.expr} {cmp} {b.expr}, {da}, tl.where({a.expr} == {b.expr}, "
                        f"0.5 * ({da} + {db}), {db}))")
        return _Val(var, dtype, d)
    return handler


def _clamp(lo_pos: Optional[int], hi_pos: Optional[int]):
    def handler(e, args, kwargs, dtype):
        a = e.value(args[0])
        lo = args[lo_pos] if lo_pos is not None and len(args) > lo_pos else kwargs.get("min")
        hi = args[hi_pos] if hi_pos is not None and len(args) > hi_pos else kwargs.get("max")
        expr = a.expr
        lv = hv = None
        if lo is not None:
            lv = e.value(lo)
            expr = f"tl.maximum({expr}, {lv.expr})"
        if hi is not None:
            hv = e.value(hi)
            expr = f"tl.minimum({expr}, {hv.expr})"
        var = e.fresh(e.cast(expr, dtype))
        d = None
        if e.kind == "score" and (a.d or (lv is not None and lv.d) or (hv is not None and hv.d)):
            # torch: the input's derivative where lo <= x <= hi, else the bound's that was taken
            d = a.d or "0.0"
            if lv is not None:
                d = e.fresh(f"tl.where({a.expr} < {lv.expr}, {lv.d or 0.0}, {d})")
            if hv is not None:
                d = e.fresh(f"tl.where({a.expr} > {hv.expr}, {hv.d or 0.0}, {d})")
        return _Val(var, dtype, d)
    return handler


def _where(e, args, kwargs, dtype):
    c, a, b = e.value(args[0]), e.value(args[1]), e.value(args[2])
    var = e.fresh(e.cast(f"tl.where({c.expr}, {a.expr}, {b.expr})", dtype))
    d = None
    if (a.d or b.d) and e.kind == "score":
        d = e.fresh(f"tl.where({c.expr}, {a.d or 0.0}, {b.d or 0.0})")
    return _Val(var, dtype, d)


def _to_copy(e, args, kwargs, dtype):
    a = e.value(args[0])
    var = e.fresh(e.cast(a.expr, dtype))
    d = a.d if dtype.is_floating_point else None
    return _Val(var, dtype, d)


def _fill(value_pos: Optional[int], value=None):
    def handler(e, args, kwargs, dtype):
        v = value if value_pos is None else args[value_pos]
        ref = e.value(args[0]) if value_pos != 0 else None
        lit = e.value(v)
        if ref is not None:
            return _Val(e.fresh(e.cast(f"tl.zeros_like({ref.expr}) + {lit.expr}", dtype)), dtype)
        return _Val(e.fresh(e.cast(lit.expr, dtype)), dtype)
    return handler


def _floor_div(e, args, kwargs, dtype):
    a, b = e.value(args[0]), e.value(args[1])
    if dtype.is_floating_point:
        return _Val(e.fresh(e.cast(f"floordiv_float({e.cast(a.expr, dtype)}, {e.cast(b.expr, dtype)})", dtype)),
                    dtype, None)
    return _Val(e.fresh(e.cast(f"floordiv({a.expr}, {b.expr})", dtype)), dtype)


def _div_mode(e, args, kwargs, dtype):
    mode = kwargs.get("rounding_mode", args[2] if len(args) > 2 else None)
    if mode == "floor":
        return _floor_div(e, args, kwargs, dtype)
    if mode == "trunc":
        a, b = e.value(args[0]), e.value(args[1])
        if dtype.is_floating_point:
            x = f"{a.expr} / {b.expr}"
            return _Val(e.fresh(e.cast(f"tl.where({x} < 0, tl.ceil({x}), tl.floor({x}))", dtype)), dtype)
        return _Val(e.fresh(e.cast(f"{a.expr} // {b.expr}", dtype)), dtype)
    return _binary("/", _d_div)(e, args, {}, dtype)


def _mod_derivative(e, a, b, name):
    """d (a mod b) / d score: a's (the quotient is piecewise constant); a divisor that depends
    on the score is refused."""
    if b.d is not None:
        e.refuse(f"{name} by a value that depends on the score")
    return a.d if e.kind == "score" else None


def _remainder(e, args, kwargs, dtype):
    a, b = e.value(args[0]), e.value(args[1])
    return _Val(e.fresh(e.cast(f"remainder({a.expr}, {b.expr})", dtype)), dtype,
                _mod_derivative(e, a, b, "remainder"))


def _fmod(e, args, kwargs, dtype):
    a, b = e.value(args[0]), e.value(args[1])
    return _Val(e.fresh(e.cast(f"{a.expr} % {b.expr}", dtype)), dtype, _mod_derivative(e, a, b, "fmod"))


LN2 = 0.6931471805599453

_OPS = {
    aten.add.Tensor: _binary("+", _d_add), aten.add.Scalar: _binary("+", _d_add),
    aten.sub.Tensor: _binary("-", _d_sub), aten.sub.Scalar: _binary("-", _d_sub),
    aten.rsub.Scalar: _rsub, aten.rsub.Tensor: _rsub,
    aten.mul.Tensor: _binary("*", _d_mul), aten.mul.Scalar: _binary("*", _d_mul),
    aten.div.Tensor: _binary("/", _d_div), aten.div.Scalar: _binary("/", _d_div),
    aten.div.Tensor_mode: _div_mode, aten.div.Scalar_mode: _div_mode,
    aten.floor_divide.default: _floor_div, aten.floor_divide.Scalar: _floor_div,
    aten.remainder.Tensor: _remainder, aten.remainder.Scalar: _remainder,
    aten.fmod.Tensor: _fmod, aten.fmod.Scalar: _fmod,
    aten.neg.default: _unary("-{x}", "-({dx})", float_only=False),
    aten.abs.default: _unary("tl.abs({x})", "tl.where({x} > 0, {dx}, tl.where({x} < 0, -({dx}), 0.0))",
                             float_only=False),
    aten.reciprocal.default: _unary("1.0 / {x}", "-({dx}) * {y} * {y}"),
    aten.exp.default: _unary("tl.exp({x})", "{y} * ({dx})"),
    aten.exp2.default: _unary("tl.exp2({x})", f"{{y}} * {LN2} * ({{dx}})"),
    aten.log.default: _unary("tl.log({x})", "({dx}) / {x}"),
    aten.log2.default: _unary("tl.log2({x})", f"({{dx}}) / ({{x}} * {LN2})"),
    aten.sqrt.default: _unary("tl.sqrt({x})", "0.5 * ({dx}) / {y}"),
    aten.rsqrt.default: _unary("1.0 / tl.sqrt({x})", "-0.5 * ({dx}) * {y} * {y} * {y}"),
    aten.tanh.default: _unary("tanh({x})", "(1.0 - {y} * {y}) * ({dx})"),
    aten.sigmoid.default: _unary("sigmoid({x})", "{y} * (1.0 - {y}) * ({dx})"),
    aten.sin.default: _unary("tl.sin({x})", "tl.cos({x}) * ({dx})"),
    aten.cos.default: _unary("tl.cos({x})", "-tl.sin({x}) * ({dx})"),
    aten.sign.default: _unary("sign({x})", None, float_only=False),
    aten.floor.default: _unary("tl.floor({x})", None),
    aten.ceil.default: _unary("tl.ceil({x})", None),
    aten.trunc.default: _unary("tl.where({x} < 0, tl.ceil({x}), tl.floor({x}))", None),
    aten.pow.Tensor_Scalar: _pow,
    aten.minimum.default: _minmax("min"), aten.maximum.default: _minmax("max"),
    aten.clamp.default: _clamp(1, 2), aten.clamp.Tensor: _clamp(1, 2),
    aten.clamp_min.default: _clamp(1, None), aten.clamp_max.default: _clamp(None, 1),
    aten.where.self: _where, aten.where.ScalarSelf: _where, aten.where.ScalarOther: _where,
    aten.where.Scalar: _where,
    aten.eq.Tensor: _compare("=="), aten.eq.Scalar: _compare("=="),
    aten.ne.Tensor: _compare("!="), aten.ne.Scalar: _compare("!="),
    aten.lt.Tensor: _compare("<"), aten.lt.Scalar: _compare("<"),
    aten.le.Tensor: _compare("<="), aten.le.Scalar: _compare("<="),
    aten.gt.Tensor: _compare(">"), aten.gt.Scalar: _compare(">"),
    aten.ge.Tensor: _compare(">="), aten.ge.Scalar: _compare(">="),
    aten.logical_and.default: _logic("&"), aten.logical_or.default: _logic("|"),
    aten.logical_xor.default: _logic("^"), aten.logical_not.default: _not,
    aten.bitwise_and.Tensor: _logic("&"), aten.bitwise_and.Scalar: _logic("&"),
    aten.bitwise_or.Tensor: _logic("|"), aten.bitwise_or.Scalar: _logic("|"),
    aten.bitwise_xor.Tensor: _logic("^"), aten.bitwise_xor.Scalar: _logic("^"),
    aten.bitwise_not.default: _not,
    aten._to_copy.default: _to_copy,
    aten.zeros_like.default: _fill(None, 0), aten.ones_like.default: _fill(None, 1),
    aten.full_like.default: _fill(1), aten.scalar_tensor.default: _fill(0),
}

"""What makes the CPU suite fast on a 2-core box without changing what it computes: used by
tests/conftest.py for the pytest workers and by the tests that spawn processes of their own
(tests/parallel: gloo ranks)."""

from __future__ import annotations

import os


def one_torch_thread() -> None:
    """One intra-op thread for torch, unless OMP_NUM_THREADS says otherwise: with two pytest
    workers (or two gloo ranks) on two cores, torch's default of one thread per core
    oversubscribed the box and its small ops took 2.4x as long."""
    if "OMP_NUM_THREADS" in os.environ:
        return
    import torch

    torch.set_num_threads(1)


def interpreter_shortcuts() -> None:
    """Under ``TRITON_INTERPRET=1`` with triton 3.6.0, cut three costs of its interpreter that
    change nothing it computes (other triton versions keep their own code):

    - nested ``@triton.jit`` calls skip a redundant re-patching of triton.language (below);
    - the numpy dtype of a Triton type is looked up once per type (``_memoize_np_dtypes``);
    - the shape tuples of block types and tensors are made once per shape
      (``_share_block_shapes``).

    On the 2-core box (session 41) the dtype memo cut the interpreted tests' time by about
    15%, and sharing the shapes then took the whole suite from 748 s to 446 s.

    Triton 3.6's interpreter patches triton.language's builtins once per launch (and
    restores them after it), then again at every call of a nested ``@triton.jit`` function,
    never restored: ``inspect.getmembers`` over the language modules, about 2 ms a call and a
    quarter of an interpreted decode test's time. A nested call whose language modules the
    launch already patched finds nothing left to patch, so it is skipped here; a call that
    sees another module is patched as before."""
    if os.environ.get("TRITON_INTERPRET") != "1":
        return
    try:
        import triton
        from triton.runtime import interpreter
    except ImportError:
        return
    if triton.__version__ != "3.6.0" or getattr(interpreter, "_flashtile_tests_patched", False):
        return
    import inspect

    import triton.language as tl

    patch_lang, run_grid = interpreter._patch_lang, interpreter.GridExecutor.__call__
    launch = {"langs": None}  # the language modules the current launch has patched

    def lang_modules(fn) -> frozenset:
        return frozenset(id(v) for v in fn.__globals__.values() if inspect.ismodule(v) and v in (tl, tl.core))

    def patch_once_per_launch(fn):
        langs = lang_modules(fn)
        if launch["langs"] is not None and langs <= launch["langs"]:
            return interpreter._LangPatchScope()  # nothing to restore (a nested call's never is)
        scope = patch_lang(fn)
        launch["langs"] = langs | (launch["langs"] or frozenset())
        return scope

    def grid_call(self, *args, **kwargs):
        launch["langs"] = None
        try:
            return run_grid(self, *args, **kwargs)
        finally:
            launch["langs"] = None

    interpreter._patch_lang = patch_once_per_launch
    interpreter.GridExecutor.__call__ = grid_call
    _memoize_np_dtypes(interpreter, tl)
    _share_block_shapes(tl.core)
    interpreter._flashtile_tests_patched = True


def _memoize_np_dtypes(interpreter, tl) -> None:
    """Triton 3.6's ``interpreter._get_np_dtype`` (the numpy dtype of a Triton type, asked at
    nearly every interpreted op) builds a 19-entry dict of Triton dtypes, each hashed in
    Python, on every call: 15% of the wall time of the packed replay and varlen tests on the
    2-core box (59-63 s against 50-51, alternating runs). The answer depends on
    the scalar type alone (a block's element type; every pointer is uint64), so it is kept
    per type name here. Called by ``interpreter_shortcuts``, under its version check."""
    find = interpreter._get_np_dtype
    known = {}

    def np_dtype(tt_dtype):
        scalar = tt_dtype.element_ty if isinstance(tt_dtype, tl.block_type) else tt_dtype
        name = scalar.name
        if name not in known:
            known[name] = find(scalar)
        return known[name]

    interpreter._get_np_dtype = np_dtype


def _share_block_shapes(core) -> None:
    """Every interpreted op makes a ``block_type`` and a ``tensor``, and each builds its shape
    as a new ``triton.language.tuple`` (whose type builds a name string from every element):
    about a fifth of an interpreted test's time. Shapes repeat, so the tuples are made once
    per shape here and shared (nothing in the interpreter's path writes into a shape). The
    first block_type of a shape takes Triton's own checks (which refuse a bad shape, never
    kept); the name and every attribute are as Triton's ``__init__`` sets them. Called by
    ``interpreter_shortcuts``, under its version check."""
    import builtins
    import math

    block_init, tensor_init = core.block_type.__init__, core.tensor.__init__
    shapes = {}  # shape as ints -> (block_type.shape, its numel, tensor.shape, tensor.numel)

    def shared_block_type_init(self, element_ty, shape):
        assert isinstance(shape, (list, core.tuple))
        values = shape.values if isinstance(shape, core.tuple) else shape
        key = builtins.tuple(v.value if isinstance(v, core.constexpr) else v for v in values)
        if not all(type(v) is int for v in key):  # not a plain shape: Triton's own path, nothing kept
            return block_init(self, element_ty, shape)
        known = shapes.get(key)
        if known is None:
            block_init(self, element_ty, shape)
            known = shapes[key] = (self.shape, self.numel, core.tuple([core.constexpr(s) for s in self.shape]),
                                   core.constexpr(math.prod(self.shape)))
        else:
            self.element_ty = element_ty
            self.shape, self.numel = known[0], known[1]
            self.name = f'<{self.shape}, {self.element_ty}>'
        self._flashtile_tensor_shape = known[2:]

    def shared_tensor_init(self, handle, type):
        shared = getattr(type, "_flashtile_tensor_shape", None)
        if shared is None or not type.is_block():
            return tensor_init(self, handle, type)
        self.handle = handle
        self.type = type
        self.dtype = type.scalar
        self.shape, self.numel = shared

    core.block_type.__init__ = shared_block_type_init
    core.tensor.__init__ = shared_tensor_init

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


def skip_nested_lang_patches() -> None:
    """Triton 3.6's interpreter patches triton.language's builtins once per launch (and
    restores them after it), then again at every call of a nested ``@triton.jit`` function,
    never restored: ``inspect.getmembers`` over the language modules, about 2 ms a call and a
    quarter of an interpreted decode test's time. A nested call whose language modules the
    launch already patched finds nothing left to patch, so it is skipped here; a call that
    sees another module is patched as before. Test speed only: what the kernels compute is
    the interpreter's own. Other triton versions keep their own code."""
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
    interpreter._flashtile_tests_patched = True


def _memoize_np_dtypes(interpreter, tl) -> None:
    """Triton 3.6's ``interpreter._get_np_dtype`` (the numpy dtype of a Triton type, asked at
    nearly every interpreted op) builds a 19-entry dict of Triton dtypes, each hashed in
    Python, on every call: about 5% of an interpreted backward test. The answer depends on
    the scalar type alone (a block's element type; every pointer is uint64), so it is kept
    per type name here. Called by ``skip_nested_lang_patches``, under its version check."""
    find = interpreter._get_np_dtype
    known = {}

    def np_dtype(tt_dtype):
        scalar = tt_dtype.element_ty if isinstance(tt_dtype, tl.block_type) else tt_dtype
        name = scalar.name
        if name not in known:
            known[name] = find(scalar)
        return known[name]

    interpreter._get_np_dtype = np_dtype

"""The direct launch path (flashtile.runtime.launch): its specialization key must be at least
as fine as Triton's own, or a launch could run a binary built for other arguments."""

from __future__ import annotations

import pytest

torch = pytest.importorskip("torch")
triton = pytest.importorskip("triton")
from hypothesis import given, settings, strategies as st  # noqa: E402

from flashtile.runtime import launch  # noqa: E402


def _triton_spec(a):
    from triton._C.libtriton import native_specialize_impl
    from triton.backends.nvidia.compiler import CUDABackend

    return native_specialize_impl(CUDABackend, a, False, True, True)


_EDGES = [0, 1, 2, 15, 16, 17, -1, -16, 2**31 - 16, 2**31 - 1, 2**31, 2**31 + 16, -(2**31), -(2**31) - 1,
          2**40, 2**63 - 16, 2**63, 2**63 + 16, 2**64 - 16]


_SCALARS = _EDGES + [0.0, 1.0, -2.5, 1e30, None, True, False]


def test_equal_keys_mean_equal_triton_specialization_at_the_edges():
    for a in _SCALARS:
        for b in _SCALARS:
            if launch.arg_key(a) == launch.arg_key(b):
                assert _triton_spec(a) == _triton_spec(b), (a, b)


@settings(max_examples=300, deadline=None)
@given(st.integers(-(2**63), 2**64 - 1), st.sampled_from(_SCALARS))
def test_equal_keys_mean_equal_triton_specialization(a, b):
    if launch.arg_key(a) == launch.arg_key(b):
        assert _triton_spec(a) == _triton_spec(b), (a, b)


def _tensors():
    base = torch.zeros(4096, dtype=torch.uint8)
    out = []
    for dtype in (torch.float16, torch.bfloat16, torch.float32, torch.uint8, torch.int64):
        for offset_bytes in (0, 2, 8, 16, 24, 32):
            size = dtype.itemsize if hasattr(dtype, "itemsize") else torch.tensor([], dtype=dtype).element_size()
            if offset_bytes % size:
                continue
            out.append(base[offset_bytes:offset_bytes + 64 * size].view(dtype))
    return out


def test_tensor_keys_refine_triton_specialization():
    ts = _tensors()
    assert len({launch.arg_key(t) for t in ts}) > 5
    for a in ts:
        for b in ts:
            if launch.arg_key(a) == launch.arg_key(b):
                assert _triton_spec(a) == _triton_spec(b)
            if _triton_spec(a) != _triton_spec(b):
                assert launch.arg_key(a) != launch.arg_key(b)


def test_descriptor_keys_refine_triton_specialization():
    from triton.tools.tensor_descriptor import TensorDescriptor

    descs = []
    for dtype in (torch.float16, torch.bfloat16):
        t = torch.zeros(2, 3, 64, 128, dtype=dtype)
        for rows in (64, 128):
            for d in (64, 128):
                descs.append(TensorDescriptor(t, list(t.shape), list(t.stride()), [1, 1, rows, d]))
    for a in descs:
        for b in descs:
            if launch.arg_key(a) == launch.arg_key(b):
                assert _triton_spec(a) == _triton_spec(b)


def test_gluon_descriptor_keys_refine_triton_specialization():
    """Gluon descriptors carry a shared-memory layout: the key holds the layout object
    (compared by value), Triton's specialization its string."""
    from triton.experimental.gluon import language as gl
    from triton.experimental.gluon.nvidia.hopper import TensorDescriptor

    descs = []
    for dtype, gl_dtype in ((torch.float16, gl.float16), (torch.bfloat16, gl.bfloat16)):
        t = torch.zeros(2, 3, 64, 128, dtype=dtype)
        for rows in (32, 64):
            for inner in (16, 32, 64):  # three layouts (32-, 64-, 128-byte swizzle) for one block shape
                layout = gl.NVMMASharedLayout.get_default_for([1, 1, rows, inner], gl_dtype)
                descs.append(TensorDescriptor(t, list(t.shape), list(t.stride()), [1, 1, rows, 128], layout))
    # Equal by value, printed differently (an int where a bool belongs): Triton keys on the print.
    odd = gl.NVMMASharedLayout(swizzle_byte_width=128, element_bitwidth=16, rank=4, transposed=0)
    same = gl.NVMMASharedLayout(swizzle_byte_width=128, element_bitwidth=16, rank=4, transposed=False)
    t = torch.zeros(2, 3, 64, 128, dtype=torch.float16)
    descs += [TensorDescriptor(t, list(t.shape), list(t.stride()), [1, 1, 64, 128], lay) for lay in (odd, same)]
    assert odd == same and str(odd) != str(same)
    # 13: `same` is the fp16, 64-row, 128-byte-swizzle layout already in the list
    assert len({launch.arg_key(d) for d in descs}) == len({str(_triton_spec(d)) for d in descs}) == 13
    for a in descs:
        for b in descs:
            assert (launch.arg_key(a) == launch.arg_key(b)) == (_triton_spec(a) == _triton_spec(b)), (a, b)


def test_unknown_argument_types_take_tritons_path():
    class Odd:
        pass

    assert launch.arg_key(Odd()) is launch._UNKNOWN
    import numpy as np

    assert launch.arg_key(np.int64(3)) is launch._UNKNOWN


def test_full_args_follow_the_kernel_signature(monkeypatch):
    """What the direct call passes must line up with every parameter of the kernel."""
    monkeypatch.delenv("TRITON_INTERPRET", raising=False)
    from triton.runtime.jit import JITFunction

    @triton.jit
    def k(a, b, n, BLOCK: triton.language.constexpr, FLAG: triton.language.constexpr = 3):
        pass

    if not isinstance(k, JITFunction):  # TRITON_INTERPRET=1 at import gives an InterpretedFunction
        k = JITFunction(k.fn)
    lz = launch.Launcher(k)
    assert lz.full_args((1, 2, 5), {"BLOCK": 64}) == [1, 2, 5, 64, 3]
    assert lz.full_args((1, 2, 5), {"FLAG": 1, "BLOCK": 64}) == [1, 2, 5, 64, 1]


def test_no_launch_hooks_by_default_and_an_added_one_is_seen():
    """Direct launches pass no hooks, so they must only run while none is installed."""
    assert not launch.hooks_installed()
    hooks = triton.knobs.runtime.launch_enter_hook

    def hook(metadata):
        pass

    hooks.add(hook)
    try:
        assert launch.hooks_installed()
    finally:
        hooks.remove(hook)
    assert not launch.hooks_installed()


def test_the_interpreter_takes_tritons_path(monkeypatch):
    monkeypatch.setenv("TRITON_INTERPRET", "1")
    assert not launch.fast_ok()
    monkeypatch.setenv("TRITON_INTERPRET", "0")
    monkeypatch.setenv("FLASHTILE_FAST_LAUNCH", "0")
    assert not launch.fast_ok()


@pytest.mark.gpu
def test_direct_launches_hit_and_match(monkeypatch):
    """Second call of a shape goes direct; misaligned inputs and odd lengths get their own
    binaries; every direct launch is checked against Triton's own lookup. The Triton
    kernels only (FLASHTILE_WS=0): on Hopper the aligned backward calls take the Gluon
    kernels, and only the misaligned one reached the Triton dK/dV kernel (H100, session 24)."""
    monkeypatch.setenv("FLASHTILE_LAUNCH_CHECK", "1")
    monkeypatch.setenv("FLASHTILE_WS", "0")
    import flashtile
    from flashtile.backends.triton import backward, forward

    torch.manual_seed(0)
    outs = []
    for seqlen, offset in ((512, 0), (512, 0), (500, 0), (512, 1), (512, 0)):
        n = 2 * seqlen * 4 * 64
        buf = torch.randn(3 * n + offset, device="cuda", dtype=torch.float16)
        q, k, v = (buf[offset + i * n: offset + (i + 1) * n].view(2, seqlen, 4, 64) for i in range(3))
        before = len(forward._launch_fwd.cache)
        leaves = [t.detach().requires_grad_(True) for t in (q, k, v)]
        out = flashtile.flash_attn_func(*leaves, causal=True)
        out.backward(torch.ones_like(out))
        ref = torch.nn.functional.scaled_dot_product_attention(
            *(t.transpose(1, 2).float() for t in (q, k, v)), is_causal=True).transpose(1, 2)
        torch.testing.assert_close(out.float(), ref, atol=2e-3, rtol=0)
        outs.append((before, len(forward._launch_fwd.cache)))
        assert all(t.grad is not None and torch.isfinite(t.grad).all() for t in leaves)
    assert outs[1][0] == outs[1][1], "the repeated shape compiled or re-keyed instead of launching directly"
    assert outs[3][1] == outs[3][0] + 1, "a misaligned input must get its own key"
    assert len(backward._launch_dkdv.cache) >= 3


class _FakeCompiled:
    function = "fn"
    packed_metadata = "meta"

    def __init__(self):
        self.runs = []

    def run(self, *args):
        self.runs.append(args)


class _FakeKernel:
    """What Launcher needs of a JITFunction; counts the launches that go through Triton."""

    __name__ = "fake"

    def __init__(self):
        self.arg_names = ["a", "n", "BLOCK"]
        self.params = [None, None, type("P", (), {"default": 7})()]
        self.debug = False
        self.pre_run_hooks = []
        self.used_global_vals = {}
        self.triton_launches = 0
        self.compiled = []

    def __getitem__(self, grid):
        def launch(*args, **kwargs):
            self.triton_launches += 1
            self.compiled.append(_FakeCompiled())
            return self.compiled[-1]
        return launch


@pytest.fixture
def fake_launcher(monkeypatch):
    class Active:
        @staticmethod
        def get_current_device():
            return 0

        @staticmethod
        def get_current_stream(device):
            return 1234

    monkeypatch.setattr(launch, "driver", type("D", (), {"active": Active})())
    monkeypatch.setattr(launch, "fast_ok", lambda: True)
    monkeypatch.delenv("FLASHTILE_LAUNCH_CHECK", raising=False)
    fn = _FakeKernel()
    return fn, launch.Launcher(fn)


def test_launcher_goes_direct_on_a_known_key(fake_launcher):
    fn, lz = fake_launcher
    t = torch.zeros(8)
    lz((3,), (t, 32), {"BLOCK": 16}, 4, 2)
    lz((3,), (t, 32), {"BLOCK": 16}, 4, 2)
    assert fn.triton_launches == 1
    (grid_x, grid_y, grid_z, stream, function, meta, *rest), = fn.compiled[0].runs
    assert (grid_x, grid_y, grid_z, stream, function, meta) == (3, 1, 1, 1234, "fn", "meta")
    assert rest[3:] == [t, 32, 16]  # launch metadata and hooks, then every parameter in order
    lz((3,), (t, 33), {"BLOCK": 16}, 4, 2)  # 33 is not divisible by 16: another binary
    lz((3,), (t, 32), {"BLOCK": 16}, 8, 2)  # other warps
    assert fn.triton_launches == 3


def test_launcher_rekeys_on_triton_debug_and_instrumentation(fake_launcher, monkeypatch):
    fn, lz = fake_launcher
    t = torch.zeros(8)
    lz((1,), (t, 32), {"BLOCK": 16}, 4, 2)
    fn.debug = True
    lz((1,), (t, 32), {"BLOCK": 16}, 4, 2)
    assert fn.triton_launches == 2
    monkeypatch.setattr(triton.knobs.compilation, "instrumentation_mode", "proton")
    lz((1,), (t, 32), {"BLOCK": 16}, 4, 2)
    assert fn.triton_launches == 3


def test_launcher_leaves_unknown_arguments_and_changed_globals_to_triton(fake_launcher):
    import numpy as np

    fn, lz = fake_launcher
    t = torch.zeros(8)
    lz((1,), (t, np.int64(32)), {"BLOCK": 16}, 4, 2)
    lz((1,), (t, np.int64(32)), {"BLOCK": 16}, 4, 2)
    lz((1,), (t, 2**70), {"BLOCK": 16}, 4, 2)
    assert fn.triton_launches == 3 and not lz.cache
    lz((1,), (t, 32), {"BLOCK": 16}, 4, 2)
    fn.used_global_vals = {("MODE", 0): (1, {"MODE": 2})}
    with pytest.raises(RuntimeError, match="MODE"):
        lz((1,), (t, 32), {"BLOCK": 16}, 4, 2)

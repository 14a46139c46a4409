"""GPU backward tests (``pytest -m gpu``): QUALITY.md's gradient rule, determinism, races,
torch.compile, opcheck and CUDA-graph capture, through the default dispatch (on Hopper,
plain/causal fp16/bf16 calls at d64/d128 run the Gluon backward: test_backward_sm90_gpu.py).
The tests named for a Triton variant set FLASHTILE_WS=0 so that they run it."""

from __future__ import annotations

import pytest
import torch

import flashtile
from cases import Case, check_flash_grads, make_inputs

pytestmark = [pytest.mark.gpu, pytest.mark.usefixtures("poison_outputs")]

SEQ_PAIRS = [(1, 1), (1, 239), (239, 1), (3, 799), (113, 203), (128, 217), (127, 513), (1023, 1024),
             (1024, 1023), (2048, 2048)]
HEAD_DIMS = [16, 32, 40, 59, 64, 80, 96, 111, 128, 160, 192, 224, 256]
HEADS = [(6, 6), (6, 2), (6, 1)]
DTYPES = [torch.float16, torch.bfloat16]


def _matrix():
    cases, n = [], 0
    for dtype in DTYPES:
        for head_dim in HEAD_DIMS:
            for seqs in SEQ_PAIRS:
                h, hk = HEADS[n % 3]
                layout = ("contiguous", "transposed", "packed")[(n // 3) % 3]
                cases.append(Case(*seqs, head_dim, dtype=dtype, causal=bool(n % 2), batch=2, nheads=h,
                                  nheads_k=hk, layout=layout))
                n += 1
    return cases


@pytest.mark.parametrize("case", _matrix(), ids=lambda c: c.id)
def test_matrix(case):
    check_flash_grads(case, device="cuda")


@pytest.mark.parametrize("case", [c for c in _matrix() if c.head_dim in (64, 128)], ids=lambda c: c.id)
def test_matrix_triton_kernels(case, monkeypatch):
    """The Triton backward where the Gluon one takes these calls by default (Hopper)."""
    monkeypatch.setenv("FLASHTILE_WS", "0")
    check_flash_grads(case, device="cuda")


@pytest.mark.parametrize("seqs", [(1, 1), (2, 2), (5, 5), (17, 17), (1, 17), (17, 1), (2, 5), (5, 2)])
@pytest.mark.parametrize("causal", [False, True])
def test_tiny_seqlens_no_nan(seqs, causal):
    check_flash_grads(Case(*seqs, 64, dtype=torch.bfloat16, causal=causal), device="cuda")


@pytest.mark.parametrize("dtype", DTYPES, ids=["fp16", "bf16"])
@pytest.mark.parametrize("kind", ["window", "softcap", "alibi"])
def test_features(dtype, kind):
    extra = {"window": dict(window=(200, 17)), "softcap": dict(softcap=30.0, dist="q5", causal=True),
             "alibi": dict(alibi="batch", causal=True)}[kind]
    check_flash_grads(Case(777, 1029, 128, dtype=dtype, nheads=6, nheads_k=2, **extra), device="cuda")


@pytest.mark.parametrize("mask_kind", ["bool", "float"])
def test_sdpa_mask_gradients(mask_kind):
    from flashtile.testing import GRAD_FACTOR, assert_close, plain_attention

    g = torch.Generator(device="cuda").manual_seed(4)
    B, H, Hk, L, S, E = 2, 6, 2, 700, 900, 128
    q, k, v = (torch.randn(B, h, n, E, generator=g, device="cuda", dtype=torch.bfloat16)
               for h, n in ((H, L), (Hk, S), (Hk, S)))
    mask = (torch.rand(B, 1, L, S, generator=g, device="cuda") > 0.4 if mask_kind == "bool"
            else torch.randn(1, H, L, S, generator=g, device="cuda").to(torch.bfloat16))
    dout = torch.randn(B, H, L, E, generator=g, device="cuda", dtype=torch.bfloat16)
    full = mask.expand(B, H, L, S)

    def grads(fn, dt):
        leaves = [t.to(dt).requires_grad_(True) for t in (q, k, v)]
        return torch.autograd.grad(fn(*leaves), leaves, dout.to(dt))

    got = grads(lambda a, b, c: flashtile.scaled_dot_product_attention(a, b, c, attn_mask=mask, enable_gqa=True),
                torch.bfloat16)
    ref = grads(lambda a, b, c: plain_attention(a, b, c, scale=E ** -0.5, attn_mask=full)[0], torch.float64)
    base = grads(lambda a, b, c: plain_attention(a, b, c, scale=E ** -0.5, attn_mask=full)[0], torch.bfloat16)
    for name, a, r, b in zip(("dq", "dk", "dv"), got, ref, base):
        assert_close(f"sdpa {mask_kind} {name}", a, r, b, factor=GRAD_FACTOR)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32], ids=["bf16", "fp16", "fp32"])
def test_sdpa_rows_hidden_by_finfo_min(dtype):
    # transformers' additive masks hide keys with torch.finfo(dtype).min; rows hidden entirely
    # come out as torch's SDPA gives them (bf16/fp32: the mean of v, the gradients of that
    # even softmax; fp16: -65504 keeps the q.k differences), forward and backward.
    from flashtile.testing import FORWARD_FACTOR, GRAD_FACTOR, assert_close, plain_attention

    g = torch.Generator(device="cuda").manual_seed(7)
    B, H, L, S, E = 2, 4, 300, 333, 64
    q, k, v, dout = (torch.randn(B, H, n, E, generator=g, device="cuda", dtype=dtype) for n in (L, S, S, L))
    hide = torch.zeros(B, 1, L, S, dtype=torch.bool, device="cuda")
    hide[..., 250:] = True
    hide[:, :, 10:20, :] = True
    hide[:, :, 299, :] = True
    mask = torch.zeros(B, 1, L, S, dtype=dtype, device="cuda").masked_fill(hide, torch.finfo(dtype).min)
    full = mask.expand(B, H, L, S)

    def run(fn, dt):
        leaves = [t.to(dt).requires_grad_(True) for t in (q, k, v)]
        out = fn(*leaves)
        return (out.detach(), *torch.autograd.grad(out, leaves, dout.to(dt)))

    got = run(lambda a, b, c: flashtile.scaled_dot_product_attention(a, b, c, attn_mask=mask), dtype)
    ref = run(lambda a, b, c: plain_attention(a, b, c, scale=E ** -0.5, attn_mask=full)[0], torch.float64)
    base = run(lambda a, b, c: plain_attention(a, b, c, scale=E ** -0.5, attn_mask=full)[0], dtype)
    for name, a, r, b in zip(("out", "dq", "dk", "dv"), got, ref, base):
        assert_close(f"finfo.min {name}", a, r, b, factor=FORWARD_FACTOR if name == "out" else GRAD_FACTOR)
    if dtype != torch.float16:
        want = v.double().mean(dim=2, keepdim=True).expand(B, H, 11, E)
        rows = got[0][:, :, list(range(10, 20)) + [299]].double()
        assert (rows - want).abs().max() < (1e-5 if dtype == torch.float32 else 2e-2)


def _grads_once(q, k, v, dout, **kw):
    leaves = [t.detach().requires_grad_(True) for t in (q, k, v)]
    out = flashtile.flash_attn_func(*leaves, **kw)
    return (out.detach(),) + torch.autograd.grad(out, leaves, dout)


def test_deterministic_50_reruns():
    q, k, v, _ = make_inputs(Case(2048, 2048, 128, dtype=torch.bfloat16, batch=2, nheads=8, nheads_k=2), "cuda")
    dout = torch.randn_like(q)
    first = _grads_once(q, k, v, dout, causal=True, deterministic=True)
    for _ in range(50):
        for a, b in zip(_grads_once(q, k, v, dout, causal=True, deterministic=True), first):
            assert torch.equal(a, b)


@pytest.mark.parametrize("deterministic", [True, False])
def test_race_hunt_batch_60(deterministic):
    """Many programs at once: everything bitwise over reruns, except dQ of the default
    backward at d64 on Hopper (the one-pass kernel sums it in a varying order; its accuracy
    is checked in test_backward_sm90_gpu.py::test_one_pass_race_hunt)."""
    q, k, v, _ = make_inputs(Case(517, 517, 64, dtype=torch.float16, batch=60, nheads=4, nheads_k=4), "cuda")
    dout = torch.randn_like(q)
    first = _grads_once(q, k, v, dout, deterministic=deterministic)
    for _ in range(20):
        again = _grads_once(q, k, v, dout, deterministic=deterministic)
        for name, a, b in zip(("out", "dq", "dk", "dv"), again, first):
            if name == "dq" and not deterministic:
                torch.testing.assert_close(a, b, rtol=2e-3, atol=2e-3)
            else:
                assert torch.equal(a, b), name


def _one_pass(head_dim: int) -> bool:
    """Whether a default backward at this head dim takes the one-pass kernel here (its dQ
    rounding varies between runs)."""
    from flashtile.backends import registry

    call = registry.Call(tuple(torch.cuda.get_device_capability()), "bfloat16", head_dim, 4096, scale=0.1)
    return registry.backward(call).kernel == "sm90.backward_onepass"


def test_torch_compile_fullgraph():
    q, k, v = (torch.randn(2, 1024, 8, 128, device="cuda", dtype=torch.bfloat16, requires_grad=True) for _ in range(3))

    def f(q_, k_, v_):
        return flashtile.flash_attn_func(q_, k_, v_, causal=True).float().square().sum()

    compiled = torch.compile(f, fullgraph=True)
    got = torch.autograd.grad(compiled(q, k, v), (q, k, v))
    want = torch.autograd.grad(f(q, k, v), (q, k, v))
    for name, a, b in zip(("dq", "dk", "dv"), got, want):
        if name == "dq" and _one_pass(128):  # dQ summed in a varying order
            torch.testing.assert_close(a, b, rtol=2e-3, atol=2e-3)
        else:
            assert torch.equal(a, b), name


def test_opcheck_cuda():
    from flashtile import autograd  # noqa: F401

    q, k, v = (torch.randn(1, 2, n, 64, device="cuda", dtype=torch.bfloat16, requires_grad=True) for n in (90, 130, 130))
    torch.library.opcheck(torch.ops.flashtile.attn_fwd.default, (q, k, v, 0.125, 40, -1, 0, 0.0, None, None))


@pytest.mark.parametrize("shape", [(512, 64, torch.float16), (1024, 128, torch.bfloat16), (600, 256, torch.bfloat16)],
                         ids=["d64-triton", "d128-gluon", "d256-gluon"])
def test_cuda_graph_capture(shape):
    """Capture a training step and replay it. On Hopper the d128 and d256 cases run the
    Gluon kernels: the forward's dynamic schedule allocates and zeroes its work counter
    inside the capture, so every replay starts from 0 (short causal d64 runs the Triton
    forward; d64 and d128 take the one-pass Gluon backward, whose float32 dQ is zeroed in
    the capture)."""
    S, D, dtype = shape
    q, k, v = (torch.randn(2, S, 8, D, device="cuda", dtype=dtype, requires_grad=True) for _ in range(3))
    dout = torch.randn(2, S, 8, D, device="cuda", dtype=dtype)
    step = lambda: torch.autograd.grad(flashtile.flash_attn_func(q, k, v, causal=True), (q, k, v), dout)
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        for _ in range(3):  # warm-up: compile every kernel outside the capture
            eager = step()
    torch.cuda.current_stream().wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        captured = step()
    for _ in range(2):  # the second replay sees what the first left in the graph's buffers
        graph.replay()
        torch.cuda.synchronize()
        for name, a, b in zip(("dq", "dk", "dv"), captured, eager):
            if name == "dq" and _one_pass(D):  # dQ summed in a varying order
                torch.testing.assert_close(a, b, rtol=2e-3, atol=2e-3)
            else:
                assert torch.equal(a, b), name


def test_backward_memory_is_linear():
    B, S, H, D = 1, 16384, 16, 128
    q, k, v = (torch.randn(B, S, H, D, device="cuda", dtype=torch.bfloat16, requires_grad=True) for _ in range(3))
    dout = torch.randn(B, S, H, D, device="cuda", dtype=torch.bfloat16)
    torch.autograd.grad(flashtile.flash_attn_func(q, k, v), (q, k, v), dout)  # compile first
    torch.cuda.synchronize()
    torch.cuda.reset_peak_memory_stats()
    before = torch.cuda.memory_allocated()
    out = flashtile.flash_attn_func(q, k, v)
    torch.autograd.grad(out, (q, k, v), dout)
    torch.cuda.synchronize()
    extra = torch.cuda.max_memory_allocated() - before
    # out + lse saved, delta, dq/dk/dv: a few times the inputs, never (S, S) = 512 MiB per head.
    assert extra < 8 * q.numel() * q.element_size(), extra


@pytest.mark.parametrize("dtype", DTYPES, ids=["fp16", "bf16"])
def test_dropout_rate_reproducibility_and_backward_mask(dtype):
    # q = 0 and one-hot values expose the kept weights through the output (see the
    # interpreter test for the construction).
    B, Sq, H, Sk, D, p = 4, 256, 4, 128, 128, 0.2
    q = torch.zeros(B, Sq, H, D, device="cuda", dtype=dtype)
    k = torch.randn(B, Sk, H, D, device="cuda", dtype=dtype)
    v = torch.zeros(B, Sk, H, D, device="cuda", dtype=dtype)
    v[:, torch.arange(Sk), :, torch.arange(Sk)] = 1.0
    torch.manual_seed(11)
    keep = flashtile.flash_attn_func(q, k, v, dropout_p=p) > 0
    torch.manual_seed(11)
    assert torch.equal(flashtile.flash_attn_func(q, k, v, dropout_p=p) > 0, keep)
    assert abs(1.0 - keep.float().mean().item() - p) < 0.01
    keep = keep.permute(0, 2, 1, 3)  # (B, H, Sq, Sk)

    g = torch.Generator(device="cuda").manual_seed(3)
    qr, kr, vr = (torch.randn(B, n, H, D, device="cuda", dtype=dtype, generator=g) for n in (Sq, Sk, Sk))
    dout = torch.randn(B, Sq, H, D, device="cuda", dtype=dtype, generator=g)
    leaves = [t.clone().requires_grad_(True) for t in (qr, kr, vr)]
    torch.manual_seed(11)
    got = torch.autograd.grad(flashtile.flash_attn_func(*leaves, dropout_p=p), leaves, dout)

    def reference(dt):
        ls = [t.to(dt).requires_grad_(True) for t in (qr, kr, vr)]
        qd, kd, vd = (t.transpose(1, 2) for t in ls)
        probs = torch.softmax((qd @ kd.transpose(-1, -2)).float() * D ** -0.5, -1).to(dt) * keep / (1 - p)
        return torch.autograd.grad((probs @ vd).transpose(1, 2), ls, dout.to(dt))

    from flashtile.testing import GRAD_FACTOR, assert_close

    for name, a, r, b in zip(("dq", "dk", "dv"), got, reference(torch.float64), reference(dtype)):
        assert_close(f"dropout {name}", a, r, b, factor=GRAD_FACTOR)


@pytest.mark.parametrize("case", [c for i, c in enumerate(_matrix()) if i % 7 == 0], ids=lambda c: c.id)
def test_atomic_dq_variant(case, monkeypatch):
    monkeypatch.setenv("FLASHTILE_WS", "0")
    monkeypatch.setenv("FLASHTILE_BWD_DQ", "atomic")
    check_flash_grads(case, device="cuda")


@pytest.mark.parametrize("case", [c for i, c in enumerate(_matrix()) if i % 7 == 3], ids=lambda c: c.id)
def test_one_loop_dkdv_variant(case, monkeypatch):
    # BwdConfig.split_phases=False (one masked query loop in the dk/dv kernel): the
    # candidate for the table once it is timed (docs/perf-notes.md, registers and spills).
    from dataclasses import replace

    from flashtile.backends import configs

    monkeypatch.setenv("FLASHTILE_WS", "0")
    table = configs.default_bwd_config
    monkeypatch.setattr(configs, "default_bwd_config", lambda *a, **kw: replace(table(*a, **kw), split_phases=False))
    check_flash_grads(case, device="cuda")

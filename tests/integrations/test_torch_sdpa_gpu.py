"""The SDPA provider on the GPU (``pytest -m gpu``): with it active, PyTorch's flash backend
of F.scaled_dot_product_attention and varlen_attn run flashtile's kernels, matching
flashtile's own API and PyTorch's kernels under QUALITY.md's rule, forward and backward,
eager and under torch.compile; what it cannot take goes back to PyTorch's kernel."""

from __future__ import annotations

import pytest
import torch
from torch.nn.attention import SDPBackend, sdpa_kernel

import flashtile
from flashtile.integrations import torch_sdpa
from flashtile.testing import FORWARD_FACTOR, GRAD_FACTOR, assert_close

pytestmark = [pytest.mark.gpu]


@pytest.fixture
def provider():
    torch_sdpa.activate()
    torch_sdpa.FALLBACKS.clear()
    yield
    torch_sdpa.deactivate()


def _inputs(batch, heads, heads_k, seqlen, dim, dtype, seed=0):
    g = torch.Generator(device="cpu").manual_seed(seed)
    q = torch.randn(batch, heads, seqlen, dim, generator=g).to("cuda", dtype)
    k, v = (torch.randn(batch, heads_k, seqlen, dim, generator=g).to("cuda", dtype) for _ in range(2))
    return q, k, v, torch.randn(batch, heads, seqlen, dim, generator=g).to("cuda", dtype)


def _varlen_attn(q, k, v, cu, max_len, causal):
    """torch's varlen_attn, whichever causal argument the installed torch takes (is_causal
    in some releases; window_size (-1, 0) in 2.11 and 2.13)."""
    import inspect

    from torch.nn.attention.varlen import varlen_attn

    if "is_causal" in inspect.signature(varlen_attn).parameters:
        return varlen_attn(q, k, v, cu, cu, max_len, max_len, is_causal=causal)
    return varlen_attn(q, k, v, cu, cu, max_len, max_len, window_size=(-1, 0) if causal else (-1, -1))


def _run(fn, q, k, v, dout):
    leaves = [t.clone().requires_grad_(True) for t in (q, k, v)]
    out = fn(*leaves)
    return (out, *torch.autograd.grad(out, leaves, dout))


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16], ids=["fp16", "bf16"])
@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("heads_k", [16, 4])
@pytest.mark.parametrize("compiled, how", [(False, "bhsd"), (True, "bhsd"), (False, "bshd")])
def test_sdpa_flash_backend_runs_flashtile(provider, dtype, causal, heads_k, compiled, how):
    """Values and gradients, and the strides of PyTorch's own kernel (out laid out as query,
    each gradient as its input) for contiguous inputs and for views of (B, S, H, D) buffers."""
    q, k, v, dout = _inputs(2, 16, heads_k, 1027, 128, dtype)
    if how == "bshd":
        q, k, v, dout = (t.transpose(1, 2).contiguous().transpose(1, 2) for t in (q, k, v, dout))

    def sdpa(q, k, v):
        with sdpa_kernel(SDPBackend.FLASH_ATTENTION):
            return torch.nn.functional.scaled_dot_product_attention(q, k, v, is_causal=causal,
                                                                    enable_gqa=heads_k != 16)

    fn = torch.compile(sdpa) if compiled else sdpa
    got = _run(fn, q, k, v, dout)
    own = _run(lambda q, k, v: flashtile.scaled_dot_product_attention(q, k, v, is_causal=causal,
                                                                      enable_gqa=heads_k != 16), q, k, v, dout)
    ref = _run(lambda q, k, v: flashtile.scaled_dot_product_attention(q, k, v, is_causal=causal,
                                                                      enable_gqa=heads_k != 16),
               *(t.float() for t in (q, k, v)), dout.float())
    torch_sdpa.deactivate()
    base = _run(sdpa, q, k, v, dout)
    torch_sdpa.activate()
    for name, a, b, r, p, factor in zip(("out", "dq", "dk", "dv"), got, own, ref, base,
                                        (FORWARD_FACTOR, GRAD_FACTOR, GRAD_FACTOR, GRAD_FACTOR)):
        assert (a.float() - b.float()).abs().max() <= 1e-2 * b.float().abs().max() + 1e-3, name
        assert_close(name, a, r, p, factor)
        assert a.stride() == p.stride(), name
    assert not torch_sdpa.FALLBACKS


def test_varlen_attn_runs_flashtile(provider):
    pytest.importorskip("torch.nn.attention.varlen")
    g = torch.Generator(device="cpu").manual_seed(3)
    cu = torch.tensor([0, 100, 1100, 1600], dtype=torch.int32, device="cuda")
    q, k, v = (torch.randn(1600, 8, 64, generator=g).to("cuda", torch.bfloat16).requires_grad_(True)
               for _ in range(3))
    out = _varlen_attn(q, k, v, cu, 1000, True)
    want = flashtile.flash_attn_varlen_func(q, k, v, cu, cu, 1000, 1000, causal=True)
    assert (out.float() - want.float()).abs().max() < 1e-2
    dout = torch.randn_like(out)
    got = torch.autograd.grad(out, (q, k, v), dout)
    exp = torch.autograd.grad(want, (q, k, v), dout)
    for a, b in zip(got, exp):
        assert (a.float() - b.float()).abs().max() <= 1e-2 * b.float().abs().max() + 1e-3
    assert not torch_sdpa.FALLBACKS


def test_dropout_goes_back_to_pytorch(provider):
    q, k, v, _ = _inputs(1, 4, 4, 256, 64, torch.bfloat16)
    with sdpa_kernel(SDPBackend.FLASH_ATTENTION):
        out = torch.nn.functional.scaled_dot_product_attention(q, k, v, dropout_p=0.1)
    assert out.shape == q.shape
    assert torch_sdpa._kernel_getter() is not None  # torch.library.get_kernel (2.11 and 2.13 have it)
    assert torch_sdpa.FALLBACKS[("_scaled_dot_product_flash_attention", "dropout")] == 1


def test_transformers_sdpa_model_through_the_provider(provider):
    """A transformers Llama with attn_implementation="sdpa" (no padding: SDPA gets is_causal
    and nothing else, so its flash backend takes the calls): with the provider active the
    flash ops run flashtile (no fallback), the logits agree with PyTorch's flash backend's
    within bf16's rounding, and every greedy token the provider picks is PyTorch's best up to
    a near-tie (teacher forcing, as test_transformers_gpu.py). generate's prefill passes SDPA
    an explicit mask (transformers of the device image, H100 session 24: "No available
    kernel" with the flash backend alone), so generate may also use the efficient backend;
    its decode steps (one query, no mask) take the flash backend, hence flashtile."""
    transformers = pytest.importorskip("transformers")
    config = transformers.LlamaConfig(vocab_size=1000, hidden_size=512, intermediate_size=1024, num_hidden_layers=2,
                                      num_attention_heads=8, num_key_value_heads=2, max_position_embeddings=2048)
    torch.manual_seed(0)
    model = transformers.LlamaForCausalLM(config).to("cuda", torch.bfloat16).eval()
    model.set_attn_implementation("sdpa")
    ids = torch.randint(0, 1000, (2, 700), generator=torch.Generator().manual_seed(1)).cuda()
    with torch.no_grad(), sdpa_kernel(SDPBackend.FLASH_ATTENTION):
        got = model(ids).logits.float()
        with sdpa_kernel([SDPBackend.FLASH_ATTENTION, SDPBackend.EFFICIENT_ATTENTION]):
            tokens = model.generate(ids, max_new_tokens=16, do_sample=False, pad_token_id=0)
        torch_sdpa.deactivate()
        ref = model(ids).logits.float()
        forced = model(tokens).logits.float()[:, ids.shape[1] - 1:-1]
        torch_sdpa.activate()
    diff = (got - ref).abs().max().item()
    assert diff <= 0.05 * ref.abs().max().item(), diff
    chosen = tokens[:, ids.shape[1]:]
    gap = forced.max(-1).values - forced.gather(-1, chosen[..., None])[..., 0]
    assert (gap <= 4 * diff + 1e-3).all(), gap.max()
    assert not torch_sdpa.FALLBACKS


def test_sdpa_through_the_provider_in_a_cuda_graph(provider):
    """F.scaled_dot_product_attention (flash backend) and varlen_attn with the provider
    active, captured in a CUDA graph and replayed on new inputs: each replay is the eager
    call's result (the provider's path reads no metadata on the host while capturing)."""
    pytest.importorskip("torch.nn.attention.varlen")
    q, k, v, _ = _inputs(2, 8, 2, 1024, 128, torch.bfloat16)
    cu = torch.tensor([0, 300, 2048], dtype=torch.int32, device="cuda")
    flat = [t.transpose(1, 2).reshape(2048, t.shape[1], 128).contiguous() for t in (q, k, v)]

    def step():
        with sdpa_kernel(SDPBackend.FLASH_ATTENTION):
            a = torch.nn.functional.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=True)
        b = _varlen_attn(flat[0], flat[1].repeat_interleave(4, 1), flat[2].repeat_interleave(4, 1), cu, 1748, True)
        return a, b

    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        for _ in range(2):
            step()  # warm up: compiles and plans outside the capture
    torch.cuda.current_stream().wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        outs = step()
    for seed in range(3):
        g = torch.Generator(device="cpu").manual_seed(10 + seed)
        for t in (q, k, v, *flat):
            t.copy_(torch.randn(t.shape, generator=g).to("cuda", t.dtype))
        graph.replay()
        torch.cuda.synchronize()
        want = step()
        for got, exp in zip(outs, want):
            assert torch.equal(got, exp)
    assert not torch_sdpa.FALLBACKS

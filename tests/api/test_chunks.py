"""Chunked local attention (``attention_chunk``, FA3's name; Llama 4) on CPU: the torch twin
and the Triton kernels under TRITON_INTERPRET=1, forward and backward, in flash_attn_func,
flash_attn_varlen_func and flash_attn_with_kvcache, against the independent float64 oracle
(tests/oracle.py) and QUALITY.md's rule, NaN-poisoned outputs. Chunks smaller than, equal
to and larger than the interpreter's 16-row tiles, so blocks span several chunks, one, or
a part of one; rows at negative positions (seqlen_q > seqlen_k) see no key."""

from __future__ import annotations

import pytest
import torch

import flashtile
from cases import Case, check_flash_case, check_flash_grads
from oracle import dense_attention
from test_kvcache import _case, _run_and_check
from varlen_cases import VarlenCase, check_varlen

pytestmark = pytest.mark.usefixtures("poison_outputs")

SHAPES = [(37, 53), (53, 37), (64, 64), (1, 40), (40, 1)]


# The Triton kernels (the interpreter: 2-5 s a case) take each shape once and each chunk
# size at least once per causal flag; the torch twin takes every pair.
TRITON_PAIRS = {((37, 53), 5), ((53, 37), 16), ((64, 64), 24), ((1, 40), 5), ((40, 1), 16)}


@pytest.mark.parametrize("seqs", SHAPES, ids=lambda s: f"{s[0]}x{s[1]}")
@pytest.mark.parametrize("chunk", [5, 16, 24])
@pytest.mark.parametrize("causal", [False, True])
def test_against_the_oracle(backend, seqs, chunk, causal):
    """out, lse and the gradients against tests/oracle.py, which builds the chunk test from
    Python's floor division element by element (no code shared with the kernels)."""
    if backend == "triton" and (seqs, chunk) not in TRITON_PAIRS:
        pytest.skip("the Triton kernels take TRITON_PAIRS (each shape and chunk size); the twin every pair")
    sq, sk = seqs
    g = torch.Generator().manual_seed(sq * 7 + chunk)
    q = torch.randn(2, sq, 4, 16, generator=g)
    k, v = (torch.randn(2, sk, 2, 16, generator=g) for _ in range(2))
    leaves = [t.clone().requires_grad_(True) for t in (q, k, v)]
    out, lse, _ = flashtile.flash_attn_func(*leaves, causal=causal, attention_chunk=chunk, return_attn_probs=True)
    ref_leaves = [t.double().requires_grad_(True) for t in (q, k, v)]
    ro, rl = dense_attention(*(t.transpose(1, 2) for t in ref_leaves), scale=0.25, diag_offset=sk - sq,
                             window_right=0 if causal else -1, chunk=chunk)
    ro = ro.transpose(1, 2)
    torch.testing.assert_close(out.double(), ro, atol=2e-6, rtol=1e-5)
    assert torch.equal(torch.isneginf(lse), torch.isneginf(rl))
    finite = torch.isfinite(rl)
    torch.testing.assert_close(lse.double()[finite], rl[finite], atol=2e-6, rtol=1e-5)
    dout = torch.randn(out.shape, generator=g)
    got = torch.autograd.grad(out, leaves, dout)
    want = torch.autograd.grad(ro, ref_leaves, dout.double())
    for name, a, b in zip(("dq", "dk", "dv"), got, want):
        torch.testing.assert_close(a.double(), b, atol=5e-6, rtol=1e-5, msg=name)


@pytest.mark.parametrize("case", [
    Case(45, 60, 16, window=(9, 3), softcap=5.0, alibi="heads", batch=1, nheads=2, nheads_k=1, chunk=12),
    Case(70, 70, 32, causal=True, window=(20, 0), batch=1, nheads=2, nheads_k=2, chunk=16, sink="large"),
    Case(33, 41, 40, dtype=torch.float32, causal=True, batch=2, nheads=4, nheads_k=1, chunk=7, layout="transposed"),
], ids=lambda c: c.id)
def test_with_windows_softcap_alibi_and_sinks(backend, case):
    check_flash_case(case)
    check_flash_grads(case)


def test_a_chunk_changes_the_result_and_a_whole_chunk_does_not():
    g = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(1, 40, 2, 16, generator=g) for _ in range(3))
    plain = flashtile.flash_attn_func(q, k, v, causal=True)
    assert torch.equal(flashtile.flash_attn_func(q, k, v, causal=True, attention_chunk=40), plain)
    assert torch.equal(flashtile.flash_attn_func(q, k, v, causal=True, attention_chunk=2**31 - 1), plain)
    assert (flashtile.flash_attn_func(q, k, v, causal=True, attention_chunk=8) - plain).abs().max() > 0.1


def test_effective_chunk():
    from flashtile.problem.window import effective_chunk

    assert effective_chunk(0, -1, 10, 10, 0) == 0
    assert effective_chunk(10, 0, 10, 10, 0) == 0  # positions and keys all in chunk 0
    assert effective_chunk(9, 0, 10, 10, 0) == 9
    assert effective_chunk(100, -1, 10, 5, -5) == 100  # rows at negative positions see keys without it
    assert effective_chunk(100, 0, 10, 5, -5) == 0  # causal: they see none anyway
    assert effective_chunk(100, 2, 10, 5, -5) == 100  # row -2 sees key 0 through the window's right side
    assert effective_chunk(100, -1, 50, 50, 0, varlen=True) == 100  # a packed call may hold such rows
    assert effective_chunk(100, 0, 50, 50, 0, varlen=True) == 0


@pytest.mark.parametrize("causal", [False, True])
def test_varlen(backend, causal):
    """Chunks count from each sequence's first key: every document of a packed batch
    matches its own fixed-length call."""
    check_varlen(VarlenCase((19, 0, 33, 4, 40), (25, 4, 33, 0, 40), causal=causal, chunk=8, sink=causal))


def test_varlen_with_seqused_and_pages(backend):
    check_varlen(VarlenCase((9, 14, 30), (12, 30, 33), page_size=16, seqused_q=(9, 10, 30), seqused_k=(12, 17, 33),
                            causal=True, chunk=6))


@pytest.mark.parametrize("num_splits", [1, 3])
@pytest.mark.parametrize("page", [0, 16], ids=["rows", "page16"])
def test_kvcache(backend, num_splits, page):
    """Decoding with chunks of 32 over caches of 0-198 keys: queries on both sides of a
    chunk boundary (sq 3), splits and pages."""
    q, k, v, kc, vc, table, seqlens = _case(batch=3, sq=3, new=3, heads=(8, 2), d=32, capacity=200,
                                             seqlens=(0, 62, 196), page=page)
    _run_and_check(q, k, v, kc, vc, seqlens, table=table, causal=True, num_splits=num_splits, chunk=32)


def test_kvcache_noncausal_with_leftpad(backend):
    q, k, v, kc, vc, _, seqlens = _case(batch=3, sq=2, new=2, heads=(4, 2), d=16, capacity=60,
                                         seqlens=(10, 30, 55))
    _run_and_check(q, k, v, kc, vc, seqlens, chunk=7, leftpad=torch.tensor([0, 5, 13], dtype=torch.int32))


@pytest.mark.parametrize("value,error,match", [
    (-1, ValueError, "attention_chunk must be >= 1"),
    (2**31, ValueError, "attention_chunk must be >= 1"),
    (2.0, TypeError, "attention_chunk must be an int"),
    (True, TypeError, "attention_chunk must be an int"),
])
def test_bad_chunks_are_refused_by_every_entry_point(value, error, match):
    q = torch.randn(1, 5, 2, 16)
    with pytest.raises(error, match=match):
        flashtile.flash_attn_func(q, q, q, attention_chunk=value)
    cu = torch.tensor([0, 5], dtype=torch.int32)
    with pytest.raises(error, match=match):
        flashtile.flash_attn_varlen_func(q[0], q[0], q[0], cu, cu, 5, 5, attention_chunk=value)
    cache = torch.zeros(1, 8, 2, 16)
    before = cache.clone()
    with pytest.raises(error, match=match):
        flashtile.flash_attn_with_kvcache(q[:, :1], cache, cache, q[:, :1], q[:, :1], cache_seqlens=2,
                                          attention_chunk=value)
    assert torch.equal(cache, before)


def test_the_registry_keeps_chunks_off_the_gluon_kernels():
    from flashtile.backends import registry

    call = registry.Call(capability=(9, 0), dtype="bfloat16", head_dim=128, seqlen_q=8192, window_right=0,
                         chunk=True)
    for choice in (registry.forward(call), registry.backward(call)):
        assert choice.family == "triton" and any("chunked attention" in why for why in choice.why)


def test_repeated_calls_do_not_reuse_another_chunks_plan():
    """flash_attn_func keeps a validated call per key: the chunk is part of the key."""
    g = torch.Generator().manual_seed(1)
    q, k, v = (torch.randn(1, 30, 2, 16, generator=g) for _ in range(3))
    a = flashtile.flash_attn_func(q, k, v, causal=True, attention_chunk=4)
    b = flashtile.flash_attn_func(q, k, v, causal=True, attention_chunk=8)
    c = flashtile.flash_attn_func(q, k, v, causal=True, attention_chunk=4)
    assert not torch.equal(a, b) and torch.equal(a, c)

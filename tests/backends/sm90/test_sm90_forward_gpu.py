"""GPU tests of the warp-specialized Gluon forward (``backends/sm90/forward.py``, Hopper only).

Every case asserts that the Gluon kernel really ran (a spy counts its launches), so the
matrix cannot pass on the Triton kernel alone; out and LSE are NaN-poisoned first and
checked with the accuracy rule against float64. The edge cases are the kernel's own:
sequence ends inside a tile (TMA zero-fill, masked last key tile, clipped stores), rows
past the diagonal with no key (bottom-right causal with seqlen_q > seqlen_k), GQA, the
(B, S, H, D) layout and packed views read in place through 4-D descriptors.
"""

from __future__ import annotations

import dataclasses

import pytest
import torch

import flashtile
from cases import Case, check_flash_case, check_flash_grads, rotating_cases, spy_calls
from flashtile.testing import assert_close, plain_attention

pytestmark = [pytest.mark.gpu, pytest.mark.usefixtures("poison_outputs")]


@pytest.fixture
def ws_calls(monkeypatch):
    if torch.cuda.get_device_capability()[0] != 9:
        pytest.skip("the Gluon forward is for sm90 (Hopper)")
    from flashtile.backends.sm90 import forward as forward_sm90

    from flashtile.backends import configs

    # Every call in the kernel's scope takes it, whatever the table prefers for speed.
    for key, cfg in list(configs._SM90_FWD.items()):
        monkeypatch.setitem(configs._SM90_FWD, key, dataclasses.replace(cfg, use_ws=True))
    return spy_calls(monkeypatch, forward_sm90, "attention_forward_ws")


SEQ_PAIRS = [(1, 1), (17, 17), (64, 64), (127, 129), (128, 128), (129, 127), (200, 1000), (1000, 200),
             (1000, 1000), (4097, 4097)]


@pytest.mark.parametrize("case", rotating_cases((64, 128, 256), SEQ_PAIRS, ((8, 8), (8, 2), (8, 1))),
                         ids=lambda c: c.id)
def test_ws_matrix(case, ws_calls):
    check_flash_case(case, device="cuda")
    assert len(ws_calls) == 1 and ws_calls[0]["causal"] == (case.causal and case.seqlen_q > 1), ws_calls


@pytest.mark.parametrize("seqs", [(1, 1), (333, 333), (2048, 2048)])
def test_sdpa_top_left_causal(seqs, ws_calls):
    L, S = seqs
    g = torch.Generator(device="cuda").manual_seed(3)
    q, k, v = (torch.randn(2, 8, n, 128, device="cuda", dtype=torch.bfloat16, generator=g) for n in (L, S, S))
    out = flashtile.scaled_dot_product_attention(q, k, v, is_causal=True)
    ref = torch.nn.functional.scaled_dot_product_attention(q.double(), k.double(), v.double(), is_causal=True)
    base = torch.nn.functional.scaled_dot_product_attention(q, k, v, is_causal=True)
    assert_close("sdpa causal", out, ref, base)
    assert len(ws_calls) == 1


def test_batch_heads_beyond_grid_limit(ws_calls):
    check_flash_case(Case(5, 7, 64, batch=70_000, nheads=1, nheads_k=1), device="cuda")
    assert len(ws_calls) == 1


@pytest.mark.parametrize("case", [Case(300, 300, 128, dtype=torch.bfloat16, causal=True, nheads=4, nheads_k=2),
                                  Case(257, 513, 64, dtype=torch.float16, nheads=4, nheads_k=1)],
                         ids=lambda c: c.id)
def test_ws_gradients(case, ws_calls):
    # The backward recomputes from this kernel's out and LSE.
    check_flash_grads(case, device="cuda")
    assert len(ws_calls) == 1


def test_out_of_scope_and_switch_use_the_triton_kernel(ws_calls, monkeypatch):
    check_flash_case(Case(300, 300, 128, dtype=torch.bfloat16, softcap=20.0), device="cuda")
    check_flash_case(Case(300, 300, 128, dtype=torch.bfloat16, window=(64, 0)), device="cuda")
    check_flash_case(Case(300, 300, 96, dtype=torch.bfloat16), device="cuda")
    check_flash_case(Case(300, 300, 192, dtype=torch.bfloat16), device="cuda")
    check_flash_case(Case(300, 300, 128, dtype=torch.bfloat16, scale=-0.05), device="cuda")
    assert ws_calls == []
    monkeypatch.setenv("FLASHTILE_WS", "0")
    check_flash_case(Case(300, 300, 128, dtype=torch.bfloat16), device="cuda")
    assert ws_calls == []
    monkeypatch.setenv("FLASHTILE_WS", "1")
    check_flash_case(Case(300, 300, 128, dtype=torch.bfloat16), device="cuda")
    assert len(ws_calls) == 1


def test_deterministic_bitwise(ws_calls):
    q, k, v = (torch.randn(4, 2048, 8, 128, device="cuda", dtype=torch.bfloat16) for _ in range(3))
    first = flashtile.flash_attn_func(q, k, v, causal=True)
    for _ in range(5):
        assert torch.equal(flashtile.flash_attn_func(q, k, v, causal=True), first)
    assert len(ws_calls) == 6


@pytest.mark.parametrize("seqs", [(1500, 1777), (1777, 300)], ids=lambda s: f"Q{s[0]}-K{s[1]}")
@pytest.mark.parametrize("head_dim", [128, 256])
@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("schedule", ["one-per-item", "persistent", "dynamic"])
def test_every_schedule(seqs, head_dim, causal, schedule, ws_calls):
    """Persistent (programs walk several work items: ring phases and Q/O staging carried
    across items), one program per item, and the dynamic schedule (items claimed from an
    atomic counter and handed to the consumers through shared memory; the default),
    whichever the default is for the call. With seqlen_q > seqlen_k and causal, whole
    work items see no key (n_tiles == 0)."""
    from flashtile.backends.sm90.forward import attention_forward_ws

    g = torch.Generator(device="cuda").manual_seed(5)
    B, H, Hk, D = 3, 10, 2, head_dim
    Sq, Sk = seqs
    q = torch.randn(B, H, Sq, D, device="cuda", dtype=torch.bfloat16, generator=g)
    k, v = (torch.randn(B, Hk, Sk, D, device="cuda", dtype=torch.bfloat16, generator=g) for _ in range(2))
    out = torch.full_like(q, float("nan"))
    lse = torch.full((B, H, Sq), float("nan"), device="cuda")
    attention_forward_ws(q, k, v, out, lse, scale=D ** -0.5, diag_offset=Sk - Sq, causal=causal,
                         persistent=schedule == "persistent", dynamic=schedule == "dynamic")
    kwargs = dict(scale=D ** -0.5, diag_offset=Sk - Sq, window_right=0 if causal else -1)
    ref, ref_lse = plain_attention(q, k, v, dtype=torch.float64, **kwargs)
    base, base_lse = plain_attention(q, k, v, **kwargs)
    assert_close("out", out, ref, base)
    assert_close("lse", lse, ref_lse, base_lse)


@pytest.mark.parametrize("seqs", [(1500, 1777), (1777, 300)], ids=lambda s: f"Q{s[0]}-K{s[1]}")
@pytest.mark.parametrize("head_dim", [64, 128, 256])
@pytest.mark.parametrize("schedule", ["persistent", "dynamic"])
def test_sinks_in_the_epilogue(seqs, head_dim, schedule, ws_calls):
    """``attention_forward_ws(sink=)``: one logit per query head in the denominator (small,
    large and -inf sinks), causal with rows that see no key (Q1777-K300: out 0, lse the
    sink, or -inf with a -inf sink). The registry sends calls with a sink here only once
    this passes on a GPU (``sm90.scope.forward_scope``)."""
    from flashtile.backends.sm90.forward import attention_forward_ws

    g = torch.Generator(device="cuda").manual_seed(7)
    B, H, Hk, D = 2, 6, 2, head_dim
    Sq, Sk = seqs
    q = torch.randn(B, H, Sq, D, device="cuda", dtype=torch.bfloat16, generator=g)
    k, v = (torch.randn(B, Hk, Sk, D, device="cuda", dtype=torch.bfloat16, generator=g) for _ in range(2))
    sink = torch.tensor([-1.0, 0.5, 3.0, 12.0, float("-inf"), 2.0], device="cuda")
    out = torch.full_like(q, float("nan"))
    lse = torch.full((B, H, Sq), float("nan"), device="cuda")
    attention_forward_ws(q, k, v, out, lse, scale=D ** -0.5, diag_offset=Sk - Sq, causal=True,
                         persistent=schedule == "persistent", dynamic=schedule == "dynamic", sink=sink)
    kwargs = dict(scale=D ** -0.5, diag_offset=Sk - Sq, window_right=0, sink=sink)
    ref, ref_lse = plain_attention(q, k, v, dtype=torch.float64, **kwargs)
    base, base_lse = plain_attention(q, k, v, **kwargs)
    assert_close("out", out, ref, base)
    assert_close("lse", lse, ref_lse, base_lse)


def test_dynamic_schedule_is_bitwise_repeatable(ws_calls):
    """Which program takes an item varies between runs of the dynamic schedule; what each
    item computes does not (each row block is one item, in a fixed key order)."""
    from flashtile.backends.sm90.forward import attention_forward_ws

    q, k, v = (torch.randn(2, 8, 3000, 128, device="cuda", dtype=torch.bfloat16) for _ in range(3))
    outs = []
    for _ in range(5):
        out = torch.full_like(q, float("nan"))
        lse = torch.full(q.shape[:3], float("nan"), device="cuda")
        attention_forward_ws(q, k, v, out, lse, scale=128 ** -0.5, diag_offset=0, causal=True, dynamic=True)
        outs.append((out, lse))
    assert all(torch.equal(o, outs[0][0]) and torch.equal(l_, outs[0][1]) for o, l_ in outs[1:])
    ref, _ = plain_attention(q, k, v, dtype=torch.float64, scale=128 ** -0.5, diag_offset=0, window_right=0)
    base, _ = plain_attention(q, k, v, scale=128 ** -0.5, diag_offset=0, window_right=0)
    assert_close("out", outs[0][0], ref, base)

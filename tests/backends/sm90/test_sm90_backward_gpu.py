"""GPU tests of the warp-specialized Gluon backward (``backends/sm90/backward_split.py``, and at d64
and d128 ``backends/sm90/backward_onepass.py``, deterministic calls too but packed ones and causal
ones below 2048 queries, which FLASHTILE_BWD_DQ=onepass sends there as well; Hopper only).

Every case asserts that the Gluon kernels really ran (a spy counts their launches), so the
matrix cannot pass on the Triton backward alone; gradient buffers are NaN-poisoned first
(an element the kernels never write fails) and checked with the accuracy rule
(QUALITY.md: at most GRAD_FACTOR x PyTorch's own error) against float64. The edge
cases are the kernels' own: sequence ends inside a tile (TMA zero-fill, clipped stores,
the masked last key tile of the dQ kernel), causal rows with no key (seqlen_q >
seqlen_k), key blocks that no query sees (SDPA's top-left causal with seqlen_q <
seqlen_k: their dK/dV are zeros), GQA/MQA (dK/dV summed over the query heads of a group),
the (B, S, H, D) layout and packed views read in place, and a loss on the returned LSE
(folded into Delta).
"""

from __future__ import annotations

import pytest
import torch

import flashtile
from cases import Case, _grads, check_flash_grads, make_inputs, reference, rotating_cases, spy_calls
from flashtile.backends.sm90.scope import ONEPASS_HEAD_DIMS
from flashtile.testing import GRAD_FACTOR, assert_close
from varlen_cases import VarlenCase, check_varlen

pytestmark = [pytest.mark.gpu, pytest.mark.usefixtures("poison_outputs")]


@pytest.fixture
def bwd_ws_calls(monkeypatch):
    if torch.cuda.get_device_capability()[0] != 9:
        pytest.skip("the Gluon backward is for sm90 (Hopper)")
    from flashtile.backends.sm90 import backward_split as backward_sm90, backward_onepass as backward_sm90_onepass

    calls = spy_calls(monkeypatch, backward_sm90, "attention_backward_ws")
    return spy_calls(monkeypatch, backward_sm90_onepass, "attention_backward_onepass", calls)


SEQ_PAIRS = [(1, 1), (17, 17), (64, 64), (127, 129), (129, 127), (200, 1000), (1000, 200), (1000, 1000)]


@pytest.mark.parametrize("case", rotating_cases((64, 128, 256), SEQ_PAIRS, ((6, 6), (6, 2), (6, 1))),
                         ids=lambda c: c.id)
def test_ws_grad_matrix(case, bwd_ws_calls):
    check_flash_grads(case, device="cuda")
    assert len(bwd_ws_calls) == 1 and bwd_ws_calls[0]["causal"] == (case.causal and case.seqlen_q > 1), bwd_ws_calls
    one_pass = case.head_dim in ONEPASS_HEAD_DIMS  # the default there (not deterministic)
    assert bwd_ws_calls[0]["fn"] == ("attention_backward_onepass" if one_pass else "attention_backward_ws")


@pytest.mark.parametrize("head_dim", [128, 256])
def test_long_causal_gqa(head_dim, bwd_ws_calls):
    """Many query blocks per key block and many key tiles per query block (ring phases
    wrap many times in every kernel)."""
    check_flash_grads(Case(2100, 2100, head_dim, dtype=torch.bfloat16, causal=True, batch=1, nheads=4, nheads_k=2),
                      device="cuda")
    assert len(bwd_ws_calls) == 1


@pytest.mark.parametrize("head_dim", ONEPASS_HEAD_DIMS)
@pytest.mark.parametrize("nheads", [2, 4], ids=["mha", "gqa"])
@pytest.mark.parametrize("rule", [False, True], ids=["knob", "rule"])
def test_one_pass_pair_groups(rule, nheads, head_dim, bwd_ws_calls, monkeypatch):
    """The grid's grouped order (``backward_onepass.pair_group``) with 4 of the 6 (batch, kv
    head) pairs a group, so the last group holds 2: set by the experiments' knob at 700 keys
    (where the rule takes every pair in one group), or by the rule itself at the length whose
    key blocks fill a quarter of the card's SMs (MHA with ``GROUP_MHA``, GQA by default).
    Every key block must run once (the outputs are poisoned)."""
    from flashtile.backends.sm90 import backward_onepass as op
    from flashtile.runtime.device import sm_count

    monkeypatch.setenv("FLASHTILE_PLANS", "0")  # a plan would replay another order's launch
    seqlen = 700
    if rule:
        blocks = sm_count(torch.cuda.current_device()) // 4
        seqlen = 2 * op.BLOCK * blocks - 50  # the last block partial
        monkeypatch.setattr(op, "GROUP_MHA", True)  # causal MHA is pair-major by default
        assert op.pair_group(True, blocks, 6, sm_count(torch.cuda.current_device()), nheads > 2) == 4
    else:
        monkeypatch.setattr(op, "PAIR_GROUP", 4)
    check_flash_grads(Case(seqlen, seqlen, head_dim, dtype=torch.bfloat16, causal=True, batch=3, nheads=nheads,
                           nheads_k=2), device="cuda")
    assert len(bwd_ws_calls) == 1 and bwd_ws_calls[0]["fn"] == "attention_backward_onepass"


@pytest.mark.parametrize("knob", [4, None], ids=["group4", "rule"])
@pytest.mark.parametrize("nheads", [2, 4], ids=["mha", "gqa"])
def test_split_pair_groups(knob, nheads, bwd_ws_calls, monkeypatch):
    """The d256 dV and dK kernels' grouped grid (``backward_split.PAIR_GROUP``; session 48's
    default for causal GQA): 4 of the 6 (batch, kv head) pairs a group (the last group short),
    or the default (GQA: every pair in one group at this length; MHA: pair-major). Every key
    block must run once (the outputs are poisoned)."""
    from flashtile.backends.sm90 import backward_split as bw

    monkeypatch.setenv("FLASHTILE_PLANS", "0")  # a plan would replay another order's launch
    monkeypatch.setattr(bw, "PAIR_GROUP", knob)
    check_flash_grads(Case(700, 700, 256, dtype=torch.bfloat16, causal=True, batch=3, nheads=nheads, nheads_k=2),
                      device="cuda")
    assert len(bwd_ws_calls) == 1 and bwd_ws_calls[0]["fn"] == "attention_backward_ws"


def test_out_of_scope_and_switch_use_the_triton_backward(bwd_ws_calls, monkeypatch):
    check_flash_grads(Case(200, 200, 128, dtype=torch.bfloat16, softcap=20.0), device="cuda")
    check_flash_grads(Case(200, 200, 128, dtype=torch.bfloat16, window=(64, 0)), device="cuda")
    check_flash_grads(Case(200, 200, 96, dtype=torch.bfloat16), device="cuda")
    check_flash_grads(Case(200, 200, 256, dtype=torch.bfloat16, window=(64, 0)), device="cuda")
    assert bwd_ws_calls == []
    monkeypatch.setenv("FLASHTILE_WS", "0")
    check_flash_grads(Case(200, 200, 128, dtype=torch.bfloat16), device="cuda")
    assert bwd_ws_calls == []
    monkeypatch.setenv("FLASHTILE_WS", "1")
    check_flash_grads(Case(200, 200, 128, dtype=torch.bfloat16), device="cuda")
    assert len(bwd_ws_calls) == 1


@pytest.mark.parametrize("head_dim", [64, 128, 256])
def test_bitwise_reproducible(head_dim, bwd_ws_calls):
    """deterministic=True: the split kernels (no atomics, no reductions: every gradient
    element is written by one program in a fixed order), at d64 too: causal with 1537
    queries, below ``scope.DETERMINISTIC_ONEPASS_MIN_SEQLEN``."""
    g = torch.Generator(device="cuda").manual_seed(7)
    q, k, v = (torch.randn(2, 1537, n, head_dim, device="cuda", dtype=torch.bfloat16,
                           generator=g).requires_grad_(True) for n in (8, 2, 2))
    dout = torch.randn(2, 1537, 8, head_dim, device="cuda", dtype=torch.bfloat16, generator=g)
    out = flashtile.flash_attn_func(q, k, v, causal=True, deterministic=True)
    first = torch.autograd.grad(out, (q, k, v), dout, retain_graph=True)
    for _ in range(10):
        again = torch.autograd.grad(out, (q, k, v), dout, retain_graph=True)
        assert all(torch.equal(a, b) for a, b in zip(again, first))
    assert len(bwd_ws_calls) == 11 and {c["fn"] for c in bwd_ws_calls} == {"attention_backward_ws"}


def _record_constexpr(monkeypatch, module, launcher: str, name: str) -> list:
    """Wrap ``module.launcher`` (a ``Launcher``) so that each launch's constexpr ``name`` is
    recorded; returns the (live) list."""
    seen, launch = [], getattr(module, launcher)

    def recording(grid, args, constexprs, *rest):
        seen.append(constexprs[name])
        return launch(grid, args, constexprs, *rest)

    monkeypatch.setattr(module, launcher, recording)
    return seen


def _checked_first_grads(case, seed: int, label: str, **kwargs):
    """``flash_attn_func``'s gradients for a random dout (``seed``) on ``case``'s inputs,
    checked with the accuracy rule; returns what reruns need: (out, the leaves, dout, the
    float64 and the dtype references' gradients, the first gradients)."""
    q, k, v, _ = make_inputs(case, "cuda", 0)
    g = torch.Generator(device="cuda").manual_seed(seed)
    dout = torch.randn(q.shape, device="cuda", dtype=case.dtype, generator=g)
    ref = _grads(lambda *a: reference(case, *a, None, torch.float64)[0], (q, k, v), dout.double())[1:]
    base = _grads(lambda *a: reference(case, *a, None, case.dtype)[0], (q, k, v), dout)[1:]
    leaves = [t.detach().requires_grad_(True) for t in (q, k, v)]
    out = flashtile.flash_attn_func(*leaves, causal=case.causal, **kwargs)
    first = torch.autograd.grad(out, leaves, dout, retain_graph=True)
    for name, a, r, b in zip(("dq", "dk", "dv"), first, ref, base):
        assert_close(f"{label} {name}", a, r, b, factor=GRAD_FACTOR)
    return out, leaves, dout, ref, base, first


@pytest.mark.parametrize("head_dim", ONEPASS_HEAD_DIMS)
@pytest.mark.parametrize("causal", [False, True])
def test_one_pass_race_hunt(causal, head_dim, bwd_ws_calls):
    """The one-pass kernel at batch 60 (many programs add into each dQ tile at once, GQA):
    dK and dV bitwise equal over reruns (each program owns its keys), dQ within the
    accuracy rule every time (its float32 sums arrive in a varying order)."""
    case = Case(333, 333, head_dim, dtype=torch.bfloat16, causal=causal, batch=60, nheads=4, nheads_k=2)
    out, leaves, dout, ref, base, first = _checked_first_grads(case, 3, "one-pass")
    for _ in range(5):
        dq, dk, dv = torch.autograd.grad(out, leaves, dout, retain_graph=True)
        assert torch.equal(dk, first[1]) and torch.equal(dv, first[2])
        assert_close("one-pass dq again", dq, ref[0], base[0], factor=GRAD_FACTOR)
    assert len(bwd_ws_calls) == 6 and {c["fn"] for c in bwd_ws_calls} == {"attention_backward_onepass"}


@pytest.mark.parametrize("seqlens, batch", [((1537, 1537), 2), ((700, 1537), 3), ((1537, 700), 3), ((333, 333), 60)],
                         ids=lambda x: str(x))
@pytest.mark.parametrize("head_dim", ONEPASS_HEAD_DIMS)
@pytest.mark.parametrize("causal, order", [(False, "rotated"), (False, "ascending"), (True, "causal")])
def test_one_pass_deterministic(causal, order, head_dim, seqlens, batch, bwd_ws_calls, monkeypatch):
    """FLASHTILE_BWD_DQ=onepass with deterministic=True: the one-pass kernel adds dQ's parts
    in a fixed order (``_det_turn``), so dQ, dK and dV are bitwise equal over reruns, and
    within the accuracy rule. Without causal in both orders (each key block from a query
    tile of its own, ``det_rotate``'s choice at these lengths, or every block from the
    first); causal with seqlen_q < seqlen_k and > seqlen_k (the turn count follows the
    bottom-right diagonal; rows that see no key); GQA, one wave of programs and several
    (batch 60)."""
    from flashtile.backends.sm90 import backward_onepass

    monkeypatch.setenv("FLASHTILE_BWD_DQ", "onepass")
    rule, rotated = backward_onepass.det_rotate, []

    def det_rotate(*args):
        rotated.append(order == "rotated" and rule(*args))
        return rotated[-1]

    monkeypatch.setattr(backward_onepass, "det_rotate", det_rotate)
    case = Case(*seqlens, head_dim, dtype=torch.bfloat16, causal=causal, batch=batch, nheads=8, nheads_k=2)
    out, leaves, dout, _, _, first = _checked_first_grads(case, 5, "deterministic one-pass", deterministic=True)
    for _ in range(5):
        again = torch.autograd.grad(out, leaves, dout, retain_graph=True)
        assert all(torch.equal(a, b) for a, b in zip(again, first))
    assert len(bwd_ws_calls) == 6 and {c["fn"] for c in bwd_ws_calls} == {"attention_backward_onepass"}
    assert all(c["deterministic"] for c in bwd_ws_calls)
    assert rotated == ([] if causal else [order == "rotated"] * 6)


@pytest.mark.parametrize("q_rows", [128, 64])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16], ids=str)
@pytest.mark.parametrize("causal", [False, True])
def test_one_pass_query_steps(causal, dtype, q_rows, bwd_ws_calls, monkeypatch):
    """d64 with 128 queries per step (``backward_onepass.Q_ROWS[64]``, the default since
    session 37: FA3's d64 tiling) and with 64, the earlier default: the matrix's sequence pairs
    (a step's second 64 rows past seqlen_q, causal rows with no key, key blocks no query
    sees), MHA and GQA, and batch 60 (many programs adding into each dQ tile). The
    accumulator is padded to q_rows rows and zeroed by the Delta launch (its last program
    zeroes the padding)."""
    from flashtile.backends.sm90 import backward_onepass

    monkeypatch.setitem(backward_onepass.Q_ROWS, 64, q_rows)
    for i, (seqlen_q, seqlen_k) in enumerate(SEQ_PAIRS + [(2100, 2100)]):
        nheads_k = (6, 2, 1)[i % 3]
        check_flash_grads(Case(seqlen_q, seqlen_k, 64, dtype=dtype, causal=causal, nheads=6, nheads_k=nheads_k),
                          device="cuda")
    check_flash_grads(Case(333, 333, 64, dtype=dtype, causal=causal, batch=60, nheads=4, nheads_k=2),
                      device="cuda")
    assert len(bwd_ws_calls) == len(SEQ_PAIRS) + 2
    assert bwd_ws_calls[len(SEQ_PAIRS)]["dq_accum"].shape[2] == -(-2100 // q_rows) * q_rows  # 2176 or 2112
    assert {c["fn"] for c in bwd_ws_calls} == {"attention_backward_onepass"}


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16], ids=str)
@pytest.mark.parametrize("causal", [False, True])
def test_one_pass_query_split(causal, dtype, bwd_ws_calls, monkeypatch):
    """d64 with the warpgroups splitting each step's queries (``backward_onepass.Q_SPLIT``,
    session 51: S and dP of 64 queries x 128 keys per warpgroup, dQ from dS in registers,
    P and dS handed between the warpgroups for dV and dK, dQ slots of 64 rows x 64 columns):
    the matrix's sequence pairs (a step's second half past seqlen_q, causal rows with no
    key, key blocks no query sees), MHA, GQA and MQA, a negative and a zero softmax scale
    (the causal mask acts after it), then batch 60 five times (many programs adding into each
    dQ tile: dK and dV bitwise equal over reruns, dQ within the accuracy rule each time),
    then a deterministic call twice (every gradient bitwise equal).
    Every call takes the split (the dQ cast reads 64-row tiles, not 128)."""
    from flashtile.backends.sm90 import backward_onepass

    monkeypatch.setattr(backward_onepass, "Q_SPLIT", True)
    tiles = _record_constexpr(monkeypatch, backward_onepass, "_launch_convert", "QROWS")
    for i, (seqlen_q, seqlen_k) in enumerate(SEQ_PAIRS + [(2100, 2100)]):
        check_flash_grads(Case(seqlen_q, seqlen_k, 64, dtype=dtype, causal=causal, nheads=6,
                               nheads_k=(6, 2, 1)[i % 3]), device="cuda")
    for scale in (-0.125, 0.0):  # the causal mask acts after the scale (``_wide_causal_p``)
        check_flash_grads(Case(200, 300, 64, dtype=dtype, causal=causal, nheads=4, nheads_k=2, scale=scale),
                          device="cuda")
    case = Case(333, 333, 64, dtype=dtype, causal=causal, batch=60, nheads=4, nheads_k=2)
    out, leaves, dout, ref, base, first = _checked_first_grads(case, 3, "query split")
    for _ in range(5):
        dq, dk, dv = torch.autograd.grad(out, leaves, dout, retain_graph=True)
        assert torch.equal(dk, first[1]) and torch.equal(dv, first[2])
        assert_close("query split dq again", dq, ref[0], base[0], factor=GRAD_FACTOR)
    # deterministic (the one-pass kernel at any length without causal, from 2048 queries with it)
    seqlen = 2100 if causal else 333
    case = Case(seqlen, seqlen, 64, dtype=dtype, causal=causal, batch=2, nheads=4, nheads_k=2)
    out, leaves, dout, _, _, first = _checked_first_grads(case, 4, "deterministic query split", deterministic=True)
    again = torch.autograd.grad(out, leaves, dout)
    assert all(torch.equal(a, b) for a, b in zip(again, first))
    assert tiles == [64] * (len(SEQ_PAIRS) + 11)
    assert {c["fn"] for c in bwd_ws_calls} == {"attention_backward_onepass"}
    assert [c["deterministic"] for c in bwd_ws_calls[-2:]] == [True, True]


def test_one_pass_switch(bwd_ws_calls, monkeypatch):
    """FLASHTILE_BWD_DQ=split keeps d64 on the split kernels; unset, it takes the one-pass one."""
    case = Case(517, 300, 64, dtype=torch.float16, causal=True, nheads=6, nheads_k=2)
    monkeypatch.setenv("FLASHTILE_BWD_DQ", "split")
    check_flash_grads(case, device="cuda")
    monkeypatch.delenv("FLASHTILE_BWD_DQ")
    check_flash_grads(case, device="cuda")
    assert [c["fn"] for c in bwd_ws_calls] == ["attention_backward_ws", "attention_backward_onepass"]


@pytest.mark.parametrize("head_dim", [128, 256])
@pytest.mark.parametrize("seqs", [(100, 1000), (1000, 100), (333, 333)], ids=lambda s: f"L{s[0]}-S{s[1]}")
def test_sdpa_top_left_causal(seqs, head_dim, bwd_ws_calls):
    """diag_offset 0 with L < S: key blocks past the last query have no step at all."""
    L, S = seqs
    g = torch.Generator(device="cuda").manual_seed(11)
    q, k, v = (torch.randn(2, 4, n, head_dim, device="cuda", dtype=torch.bfloat16, generator=g) for n in (L, S, S))
    dout = torch.randn(2, 4, L, head_dim, device="cuda", dtype=torch.bfloat16, generator=g)

    def grads(fn, dtype):
        leaves = [t.detach().to(dtype).requires_grad_(True) for t in (q, k, v)]
        return torch.autograd.grad(fn(*leaves), leaves, dout.to(dtype))

    sdpa = torch.nn.functional.scaled_dot_product_attention
    got = grads(lambda *a: flashtile.scaled_dot_product_attention(*a, is_causal=True), torch.bfloat16)
    ref = grads(lambda *a: sdpa(*a, is_causal=True), torch.float64)
    base = grads(lambda *a: sdpa(*a, is_causal=True), torch.bfloat16)
    for name, a, r, b in zip(("dq", "dk", "dv"), got, ref, base):
        assert_close(f"sdpa causal {name}", a, r, b, factor=GRAD_FACTOR)
    if L < S:
        assert torch.equal(got[1][:, :, L:], torch.zeros_like(got[1][:, :, L:]))
    assert len(bwd_ws_calls) == 1


def test_lse_gradient(bwd_ws_calls):
    """A loss on softmax_lse (a z-loss, say) reaches the kernels through Delta."""
    case = Case(300, 517, 128, dtype=torch.bfloat16, causal=True, nheads=4, nheads_k=2)
    q, k, v, _ = make_inputs(case, "cuda", 0)
    g = torch.Generator(device="cuda").manual_seed(1)
    dout = torch.randn(q.shape, device="cuda", generator=g)
    w = torch.randn(case.batch, case.nheads, case.seqlen_q, device="cuda", generator=g)

    def grads(fn):
        leaves = [t.detach().clone().requires_grad_(True) for t in (q, k, v)]
        out, lse = fn(*leaves)
        loss = (out.double() * dout.double()).sum() + (lse.double() * w.double()).sum()
        return torch.autograd.grad(loss, leaves)

    got = grads(lambda *a: flashtile.flash_attn_func(*a, causal=True, return_attn_probs=True)[:2])
    ref = grads(lambda *a: reference(case, *a, None, torch.float64))
    base = grads(lambda *a: reference(case, *a, None, case.dtype))
    for name, a, r, b in zip(("dq", "dk", "dv"), got, ref, base):
        assert_close(f"lse loss {name}", a, r, b, factor=GRAD_FACTOR)
    assert len(bwd_ws_calls) == 1


@pytest.mark.parametrize("head_dim", ONEPASS_HEAD_DIMS)
@pytest.mark.parametrize("causal", [False, True])
def test_one_pass_packed_sequences(causal, head_dim, bwd_ws_calls, monkeypatch):
    """FLASHTILE_BWD_DQ=onepass: packed calls on the one-pass kernel (the default for
    non-causal ones since H100 run 118; causal ones only with the switch). Documents end
    inside key blocks and query tiles, so the kernel reads the next document's rows, which
    must add exactly nothing: its keys masked out of P (non-causal; the diagonal's mask when
    causal), its query rows' P zero (their dQ reductions add zeros
    into the neighbour's rows), a last dK/dV tile stored from registers with its rows masked.
    A document with no queries (its keys' dK/dV are zeros), one with no keys, a 1-token one,
    q and k lengths that differ (bottom-right diagonals), GQA; 1472 query rows in all (a
    multiple of 64), so the last document's last tile runs past the accumulator's rows of its
    head into the next head's. QUALITY's rule against float64 with NaN-poisoned gradients,
    then dK and dV bitwise equal on a rerun (each program owns its keys) and dQ within the
    rule again."""
    monkeypatch.setenv("FLASHTILE_BWD_DQ", "onepass")
    case = VarlenCase((0, 1, 17, 113, 9, 1000, 332), (5, 1, 130, 113, 0, 700, 300), head_dim=head_dim,
                      dtype=torch.bfloat16, nheads=6, nheads_k=2, causal=causal)
    first = check_varlen(case, device="cuda")
    again = check_varlen(case, device="cuda")
    assert torch.equal(first[3], again[3]) and torch.equal(first[4], again[4])
    assert len(bwd_ws_calls) == 2 and {c["fn"] for c in bwd_ws_calls} == {"attention_backward_onepass"}
    assert all(c["varlen"] is not None for c in bwd_ws_calls)


@pytest.mark.parametrize("head_dim", ONEPASS_HEAD_DIMS)
@pytest.mark.parametrize("causal", [False, True])
def test_one_pass_native_dq_order(causal, head_dim, bwd_ws_calls, monkeypatch):
    """``dq_swizzle="native"``, the default at both head dims since session 41 (``backward_onepass.
    native_offset_bases``: the consumers store dQ in their registers' order, the reducer
    adds whole slots into a dQ in that order, the postprocess puts rows and columns back):
    the matrix's sequence pairs (a last tile past seqlen_q, causal rows with no key), MHA
    and GQA, batch 60 (many programs adding into each tile) under the accuracy rule against
    float64, NaN-poisoned; then a packed call with the same default takes the 128-byte
    swizzle and passes too."""
    from flashtile.backends.sm90 import backward_onepass

    monkeypatch.setitem(backward_onepass.DQ_SWIZZLE, head_dim, backward_onepass.DQ_NATIVE)
    native = _record_constexpr(monkeypatch, backward_onepass, "_launch", "DQ_NATIVE")
    for i, (seqlen_q, seqlen_k) in enumerate(SEQ_PAIRS + [(2100, 2100)]):
        check_flash_grads(Case(seqlen_q, seqlen_k, head_dim, dtype=torch.bfloat16, causal=causal, nheads=6,
                               nheads_k=(6, 2, 1)[i % 3]), device="cuda")
    check_flash_grads(Case(333, 333, head_dim, dtype=torch.bfloat16, causal=causal, batch=60, nheads=4, nheads_k=2),
                      device="cuda")
    assert native == [True] * (len(SEQ_PAIRS) + 2)
    assert {c["fn"] for c in bwd_ws_calls} == {"attention_backward_onepass"}
    monkeypatch.setenv("FLASHTILE_BWD_DQ", "onepass")
    check_varlen(VarlenCase((0, 17, 113, 1000), (5, 130, 113, 700), head_dim=head_dim, dtype=torch.bfloat16,
                            nheads=6, nheads_k=2, causal=causal), device="cuda")
    assert bwd_ws_calls[-1]["varlen"] is not None and native[-1] is False

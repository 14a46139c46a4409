"""Host-side rules of the Gluon backward (CPU): which calls may take it. The kernels are
GPU-only (tests/test_backward_sm90_gpu.py) and compile-checked for sm_90a in
test_sm90_compile.py."""

from __future__ import annotations

import pytest

torch = pytest.importorskip("torch")
pytest.importorskip("triton")

from flashtile.backends.sm90.backward_split import ws_applies  # noqa: E402


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
def test_ws_scope(dtype):
    q = torch.zeros(1, dtype=dtype)
    plain = dict(window_left=-1, window_right=-1, softcap=0.0, alibi_slopes=None, attn_mask=None, dropout_p=0.0)
    for d in (64, 128, 256):
        assert ws_applies(q, d, 0.125, **plain)
        assert ws_applies(q, d, 0.125, **dict(plain, window_right=0))  # causal
    for d in (32, 80, 96, 192, 512):
        assert not ws_applies(q, d, 0.125, **plain)
    for scale in (0.0, -0.1, 1e-46, 1e31):
        assert not ws_applies(q, 128, scale, **plain)
    assert not ws_applies(torch.zeros(1), 128, 0.125, **plain)  # fp32
    for extra in (dict(window_left=5), dict(window_right=3), dict(softcap=30.0), dict(dropout_p=0.1),
                  dict(alibi_slopes=torch.zeros(1)), dict(attn_mask=torch.zeros(1))):
        assert not ws_applies(q, 128, 0.125, **dict(plain, **extra)), extra


def test_cpu_tensors_never_reach_the_gluon_backward(monkeypatch, triton_backend):
    """The dispatch in backends/triton/backward.py looks at the device first: the interpreter and CPU
    tensors keep the Triton kernels (the Gluon kernels are sm90-only)."""
    from flashtile.backends.sm90 import backward_split as backward_sm90

    def boom(*args, **kwargs):
        raise AssertionError("Gluon backward called for a CPU tensor")

    monkeypatch.setattr(backward_sm90, "attention_backward_ws", boom)
    import flashtile

    q, k, v = (torch.randn(1, 37, 2, 64, dtype=torch.float16, requires_grad=True) for _ in range(3))
    flashtile.flash_attn_func(q, k, v, causal=True).float().sum().backward()
    assert q.grad is not None and torch.isfinite(q.grad.float()).all()


def test_launch_arguments_are_checked_before_any_work():
    from flashtile.backends.sm90.backward_split import attention_backward_ws

    t = torch.zeros(1, 1, 1, 64, dtype=torch.bfloat16)
    lse = torch.zeros(1, 1, 1)
    args = (t, t, t, t, lse, lse, t, t, t)
    with pytest.raises(ValueError, match="kernels"):  # "dk" alone exists at d256 only (its own kernel)
        attention_backward_ws(*args, scale=0.125, diag_offset=0, causal=False, kernels=("dk",))
    t256 = torch.zeros(1, 1, 1, 256, dtype=torch.bfloat16)
    with pytest.raises(ValueError, match="kernels"):
        attention_backward_ws(t256, t256, t256, t256, lse, lse, t256, t256, t256, scale=0.125, diag_offset=0,
                              causal=False, kernels=("dq", "dkv"))
    with pytest.raises(ValueError, match="fixed rings"):  # d256's dV and dK kernels: DV_RING, DK_RING
        attention_backward_ws(t256, t256, t256, t256, lse, lse, t256, t256, t256, scale=0.125, diag_offset=0,
                              causal=False, dkdv_num_buf=4)
    with pytest.raises(ValueError, match="ring slots"):
        attention_backward_ws(*args, scale=0.125, diag_offset=0, causal=False, dkdv_num_buf=1)
    with pytest.raises(ValueError, match="dkdv_block_q"):
        attention_backward_ws(*args, scale=0.125, diag_offset=0, causal=False, dkdv_block_q=96)
    with pytest.raises(ValueError, match="dkdv_block_q"):  # d256's split kernels step by 64 queries
        attention_backward_ws(t256, t256, t256, t256, lse, lse, t256, t256, t256, scale=0.125, diag_offset=0,
                              causal=False, dkdv_block_q=128)
    with pytest.raises(ValueError, match="ring slots"):
        attention_backward_ws(*args, scale=0.125, diag_offset=0, causal=False, dq_num_buf=1)


def test_one_pass_scope(monkeypatch):
    """The one-pass kernel (issue 17) takes d64 and d128 unless the call is deterministic or
    FLASHTILE_BWD_DQ says split (or atomic: the Triton kernels' own variant)."""
    from flashtile.backends.sm90.backward_onepass import ONEPASS_HEAD_DIMS, applies

    assert ONEPASS_HEAD_DIMS == (64, 128)
    monkeypatch.delenv("FLASHTILE_BWD_DQ", raising=False)
    assert applies(64, deterministic=False) and applies(128, deterministic=False)
    assert not applies(64, deterministic=True) and not applies(128, deterministic=True)
    assert not any(applies(d, deterministic=False) for d in (32, 96, 256))
    for value, expect in (("auto", True), ("", True), ("split", False), ("atomic", False)):
        monkeypatch.setenv("FLASHTILE_BWD_DQ", value)
        assert applies(64, deterministic=False) == expect, value


def test_one_pass_or_split_by_determinism(monkeypatch, triton_backend):
    """backends/triton/backward.py's choice between the Gluon kernels, with the device check faked (the
    kernels themselves are GPU-only): each spy raises as soon as it is chosen."""
    import flashtile
    from flashtile.backends.triton import backward
    from flashtile.backends.sm90 import backward_split as backward_sm90, backward_onepass as backward_sm90_onepass
    from flashtile.runtime import replay as plan

    monkeypatch.setenv("FLASHTILE_PLANS", "0")
    plan.clear()
    monkeypatch.setattr(backward, "_gluon_applies", lambda *args, **kwargs: True)

    class Chosen(Exception):
        pass

    def spy(name):
        def launch(*args, **kwargs):
            raise Chosen(name)
        return launch

    monkeypatch.setattr(backward_sm90, "attention_backward_ws", spy("split"))
    monkeypatch.setattr(backward_sm90_onepass, "attention_backward_onepass", spy("one-pass"))

    def chosen(head_dim, **kwargs):
        q, k, v = (torch.randn(1, 40, 2, head_dim, dtype=torch.float16, requires_grad=True) for _ in range(3))
        out = flashtile.flash_attn_func(q, k, v, causal=True, **kwargs)
        with pytest.raises(Chosen) as err:
            out.float().sum().backward()
        return str(err.value)

    monkeypatch.delenv("FLASHTILE_BWD_DQ", raising=False)
    assert chosen(64) == "one-pass"
    assert chosen(64, deterministic=True) == "split"
    assert chosen(128) == "one-pass"
    assert chosen(128, deterministic=True) == "split"
    assert chosen(256) == "split"
    torch.use_deterministic_algorithms(True)
    try:
        assert chosen(64) == "split"
    finally:
        torch.use_deterministic_algorithms(False)
    monkeypatch.setenv("FLASHTILE_BWD_DQ", "split")
    assert chosen(64) == "split"


def test_one_pass_postprocess_casts_the_padded_accumulator(triton_backend):
    """``_dq_convert``: rows of the float32 dQ (padded to 64 rows) cast into a strided dq
    view, nothing past seqlen_q written (NaN-filled rows stay NaN)."""
    from flashtile.backends.sm90.backward_onepass import _launch_convert

    B, H, S, D, rows = 2, 3, 70, 64, 128
    acc = torch.randn(B, H, rows, D)
    base = torch.full((B, S + 5, H, D), float("nan"), dtype=torch.float16)
    dq = base[:, :S].transpose(1, 2)  # (B, H, S, D) view of a (B, S, H, D) buffer, rows to spare
    _launch_convert((2, B * H), (acc, dq, H, S, rows, *dq.stride()[:3]), dict(BLOCK_M=64, HEAD_D=D), 4, 1)
    assert torch.equal(dq, acc[:, :, :S].to(torch.float16))
    assert base[:, S:].isnan().all()


def test_one_pass_arguments_are_checked_before_any_work():
    from flashtile.backends.sm90.backward_onepass import attention_backward_onepass

    t = torch.zeros(1, 2, 8, 32, dtype=torch.float16)
    lse = torch.zeros(1, 2, 8)
    with pytest.raises(ValueError, match="head dims"):
        attention_backward_onepass(t, t, t, t, lse, lse, t, t, t, scale=0.1, diag_offset=0, causal=False)
    t = torch.zeros(1, 2, 8, 64, dtype=torch.float16)
    with pytest.raises(ValueError, match="num_buf"):
        attention_backward_onepass(t, t, t, t, lse, lse, t, t, t, scale=0.1, diag_offset=0, causal=False, num_buf=1)


@pytest.mark.parametrize("causal, nheads_k, block_major", [(True, 2, True), (True, 1, True), (True, 4, False),
                                                           (False, 2, False), (False, 4, False)])
def test_one_pass_grid_order(causal, nheads_k, block_major, monkeypatch):
    """Causal GQA launches block-major (every (batch, kv head)'s heaviest key blocks first);
    MHA and non-causal keep pair-major (run 104: block-major lost 4-27% on causal MHA)."""
    from flashtile.backends.sm90 import backward_onepass as op

    launches = []
    monkeypatch.setattr(op, "_launch", lambda grid, args, constexprs, *rest: launches.append((grid, constexprs)))
    monkeypatch.setattr(op, "_launch_convert", lambda *a: None)
    q = torch.zeros(2, 4, 300, 64, dtype=torch.float16)
    kv = torch.zeros(2, nheads_k, 300, 64, dtype=torch.float16)
    lse = torch.zeros(2, 4, 300)
    op.attention_backward_onepass(q, kv, kv, q, lse, lse, q, kv, kv, scale=0.1, diag_offset=0, causal=causal)
    (grid, constexprs), = launches
    assert grid == (3 * 2 * nheads_k,) and constexprs["KEYS_OUTER"] is block_major

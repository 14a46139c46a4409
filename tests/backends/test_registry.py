"""The registry (backends/registry.py): the one place a kernel family is chosen, and the
sm90 scope it asks (backends/sm90/scope.py). The launch path, ``flashtile explain`` and
these tests all read the same answers."""

from __future__ import annotations

from dataclasses import replace

import pytest

torch = pytest.importorskip("torch")
pytest.importorskip("triton")

from flashtile.backends import registry  # noqa: E402
from flashtile.backends.sm90 import scope  # noqa: E402

HOPPER = (9, 0)


def _call(**kw):
    base = dict(capability=HOPPER, dtype="bfloat16", head_dim=128, seqlen_q=4096, scale=0.125)
    base.update(kw)
    return registry.Call(**base)


@pytest.mark.parametrize("dtype", ["float16", "bfloat16"])
def test_gluon_scope(dtype):
    for d in (64, 128, 256):
        assert scope.kernels_scope(_call(dtype=dtype, head_dim=d)) is None
        assert scope.kernels_scope(_call(dtype=dtype, head_dim=d, window_right=0)) is None  # causal
    for d in (32, 80, 96, 192, 512):
        assert "head dims" in scope.kernels_scope(_call(dtype=dtype, head_dim=d))
    for s in (0.0, -0.1, 1e-46, 1e31):
        assert "softmax_scale" in scope.kernels_scope(_call(dtype=dtype, scale=s))
    assert "fp16/bf16" in scope.kernels_scope(_call(dtype="float32"))
    for extra, word in ((dict(window_left=5), "left window"), (dict(window_right=3), "right window"),
                        (dict(softcap=30.0), "softcap"), (dict(dropout=True), "dropout"), (dict(alibi=True), "ALiBi"),
                        (dict(mask=True), "mask")):
        assert word in scope.kernels_scope(_call(dtype=dtype, **extra)), extra


def test_forward_choices():
    assert registry.forward(_call()).kernel == "sm90.forward"
    # short causal d64: the table keeps the Triton kernel's 64-row tiles (H200 run 23)
    short = registry.forward(_call(head_dim=64, window_right=0, seqlen_q=1024))
    assert short.kernel == "triton.forward" and "sm90 table" in short.why[0] and short.config.block_m == 64
    assert registry.forward(_call(head_dim=64, seqlen_q=1024)).kernel == "sm90.forward"
    for call, word in ((_call(softcap=5.0), "softcap"), (_call(head_dim=96), "head dims"),
                       (_call(capability=(8, 0)), "Hopper"), (_call(aligned=False), "TMA-ready"),
                       (_call(varlen=True, seqused=True), "seqused")):
        choice = registry.forward(call)
        assert choice.family == "triton" and word in choice.why[0], (call, choice)
        assert not choice.config.use_ws
    assert registry.forward(_call(varlen=True)).kernel == "sm90.forward"
    # TMA loads only for TMA-ready tensors of a fixed-length call
    d256 = _call(head_dim=256, softcap=1.0)
    assert registry.forward(d256).config.use_tma
    assert not registry.forward(replace(d256, aligned=False)).config.use_tma
    assert not registry.forward(replace(d256, varlen=True)).config.use_tma


def test_forward_switch_and_interpreter(monkeypatch):
    monkeypatch.setenv("FLASHTILE_WS", "0")
    choice = registry.forward(_call())
    assert choice.kernel == "triton.forward" and choice.why == ("FLASHTILE_WS=0",)
    interp = registry.forward(_call(capability=None))
    assert interp.kernel == "triton.forward" and interp.config.block_m == 16


def test_backward_choices(monkeypatch):
    monkeypatch.delenv("FLASHTILE_BWD_DQ", raising=False)
    assert registry.backward(_call(head_dim=64)).kernel == "sm90.backward_onepass"
    assert registry.backward(_call(head_dim=128)).kernel == "sm90.backward_onepass"
    assert registry.backward(_call(head_dim=256)).kernel == "sm90.backward_split_d256"
    # deterministic: the one-pass kernel's ordered dQ sums without causal at every length,
    # causal ones from 2048 queries on
    for d in (64, 128):
        for seqlen_q in (128, 2048, 4096):
            plain = registry.backward(_call(head_dim=d, seqlen_q=seqlen_q, deterministic=True))
            assert plain.kernel == "sm90.backward_onepass", (d, seqlen_q)
        for seqlen_q, kernel in ((128, "split"), (2047, "split"), (2048, "onepass"), (8192, "onepass")):
            causal = registry.backward(_call(head_dim=d, seqlen_q=seqlen_q, window_right=0, deterministic=True))
            assert causal.kernel == f"sm90.backward_{kernel}", (d, seqlen_q)
    det = registry.backward(_call(head_dim=128, seqlen_q=1024, window_right=0, deterministic=True))
    assert "deterministic and causal" in det.why[0] and "2048" in det.why[0]
    packed_det = registry.backward(_call(head_dim=64, seqlen_q=8192, varlen=True, deterministic=True))
    assert packed_det.kernel == "sm90.backward_split" and "packed" in packed_det.why[0]
    # packed calls: the one-pass kernel without causal and at d64 (where it won), the split
    # kernels for causal ones at d128
    assert registry.backward(_call(head_dim=128, varlen=True)).kernel == "sm90.backward_onepass"
    packed = registry.backward(_call(head_dim=128, varlen=True, window_right=0))
    assert packed.kernel == "sm90.backward_split" and "FLASHTILE_BWD_DQ=onepass" in packed.why[0]
    assert registry.backward(_call(head_dim=64, varlen=True, window_right=0)).kernel == "sm90.backward_onepass"
    assert registry.backward(_call(head_dim=256, varlen=True)).kernel == "triton.backward"
    assert registry.backward(_call(head_dim=64, varlen=True, seqused=True)).family == "triton"
    # the backward does not consult the forward's table: short causal d64 is Gluon here
    assert registry.backward(_call(head_dim=64, window_right=0, seqlen_q=1024)).family == "sm90"
    for value, kernel in (("auto", "sm90.backward_onepass"), ("", "sm90.backward_onepass"),
                          ("onepass", "sm90.backward_onepass"), ("split", "sm90.backward_split"),
                          ("atomic", "sm90.backward_split")):
        monkeypatch.setenv("FLASHTILE_BWD_DQ", value)
        assert registry.backward(_call(head_dim=64)).kernel == kernel, value
    # causal packed calls too, and deterministic fixed-length ones (its ordered dQ sums); never
    # deterministic packed calls or d256
    monkeypatch.setenv("FLASHTILE_BWD_DQ", "onepass")
    assert registry.backward(_call(head_dim=128, varlen=True, window_right=0)).kernel == "sm90.backward_onepass"
    assert registry.backward(_call(head_dim=128, deterministic=True)).kernel == "sm90.backward_onepass"
    assert registry.backward(_call(head_dim=64, window_right=0, deterministic=True)).kernel == "sm90.backward_onepass"
    assert registry.backward(_call(head_dim=64, varlen=True, deterministic=True)).kernel == "sm90.backward_split"
    assert registry.backward(_call(head_dim=256, deterministic=True)).kernel == "sm90.backward_split_d256"
    assert registry.backward(_call(head_dim=256, varlen=True)).kernel == "triton.backward"
    monkeypatch.setenv("FLASHTILE_BWD_DQ", "atomic")
    triton_atomic = registry.backward(_call(head_dim=64, softcap=2.0))
    assert triton_atomic.kernel == "triton.backward_atomic" and triton_atomic.config.fused_dq
    assert registry.backward(_call(head_dim=64, softcap=2.0, deterministic=True)).kernel == "triton.backward"
    monkeypatch.setenv("FLASHTILE_BWD_DQ", "sometimes")
    with pytest.raises(ValueError, match="FLASHTILE_BWD_DQ"):
        registry.backward(_call())


def test_backend_for_devices(monkeypatch):
    cpu, cuda = torch.device("cpu"), torch.device("cuda")
    monkeypatch.delenv("FLASHTILE_BACKEND", raising=False)
    assert registry.backend(cpu) == "twin" and registry.backend(cuda) == "kernels"
    monkeypatch.setenv("FLASHTILE_BACKEND", "torch")
    assert registry.backend(cuda) == "twin"
    monkeypatch.setenv("FLASHTILE_BACKEND", "triton")
    monkeypatch.setenv("TRITON_INTERPRET", "1")
    assert registry.backend(cpu) == "kernels"
    monkeypatch.delenv("TRITON_INTERPRET")
    with pytest.raises(ValueError, match="TRITON_INTERPRET=1"):
        registry.backend(cpu)


def test_the_launch_asks_the_registry(monkeypatch, triton_backend):
    """backends/run.py takes the registry's answer: with the device facts faked (the Gluon
    kernels are GPU-only), each spy raises as soon as its kernel is chosen."""
    import flashtile
    from flashtile.backends import layout, run
    from flashtile.backends.sm90 import backward_onepass, backward_split
    from flashtile.runtime import replay

    monkeypatch.setenv("FLASHTILE_PLANS", "0")
    replay.clear()

    class Chosen(Exception):
        pass

    seen = []

    def spy(name):
        def launch(*args, **kwargs):
            seen.append(kwargs)
            raise Chosen(name)
        return launch

    monkeypatch.setattr(backward_split, "attention_backward_ws", spy("split"))
    monkeypatch.setattr(backward_onepass, "attention_backward_onepass", spy("one-pass"))

    def chosen(head_dim, **kwargs):
        q, k, v = (torch.randn(1, 40, 2, head_dim, dtype=torch.float16, requires_grad=True) for _ in range(3))
        out = flashtile.flash_attn_func(q, k, v, causal=True, **kwargs)  # the interpreter's forward
        with monkeypatch.context() as m:
            m.setattr(run, "capability_of", lambda t: HOPPER)
            m.setattr(layout, "tma_ready", lambda *t: True)
            with pytest.raises(Chosen) as err:
                out.float().sum().backward()
        return str(err.value)

    monkeypatch.delenv("FLASHTILE_BWD_DQ", raising=False)
    poisoned = backward_onepass.accumulator
    monkeypatch.setattr(backward_onepass, "accumulator", lambda q: poisoned(q).fill_(float("nan")))
    assert chosen(64) == "one-pass"
    acc = seen[-1]["dq_accum"]  # zeroed by the Delta launch, no memset; 128 queries a step at d64:
    assert acc.shape == (1, 2, 128, 64) and torch.equal(acc, torch.zeros_like(acc))  # the padding zeroed too
    with monkeypatch.context() as m:  # 64 queries per step: padded to 64 rows
        m.setitem(backward_onepass.Q_ROWS, 64, 64)
        assert chosen(64) == "one-pass"
    acc = seen[-1]["dq_accum"]
    assert acc.shape == (1, 2, 64, 64) and torch.equal(acc, torch.zeros_like(acc))
    assert chosen(64, deterministic=True) == "split"
    assert chosen(128) == "one-pass" and seen[-1]["deterministic"] is False
    assert chosen(128, deterministic=True) == "split"
    assert chosen(256) == "split"
    torch.use_deterministic_algorithms(True)
    try:
        assert chosen(64) == "split"
    finally:
        torch.use_deterministic_algorithms(False)
    monkeypatch.setenv("FLASHTILE_BWD_DQ", "onepass")  # deterministic calls on its ordered dQ sums
    assert chosen(64, deterministic=True) == "one-pass" and seen[-1]["deterministic"] is True
    torch.use_deterministic_algorithms(True)
    try:
        assert chosen(128) == "one-pass" and seen[-1]["deterministic"] is True
    finally:
        torch.use_deterministic_algorithms(False)
    monkeypatch.setenv("FLASHTILE_BWD_DQ", "split")
    assert chosen(64) == "split"

    def chosen_packed(head_dim=64):  # two documents of 40 and 24 rows
        q, k, v = (torch.randn(64, 2, head_dim, dtype=torch.float16, requires_grad=True) for _ in range(3))
        cu = torch.tensor([0, 40, 64], dtype=torch.int32)
        out = flashtile.flash_attn_varlen_func(q, k, v, cu, cu, 40, 40, causal=True)
        with monkeypatch.context() as m:
            m.setattr(run, "capability_of", lambda t: HOPPER)
            m.setattr(layout, "tma_ready", lambda *t: True)
            with pytest.raises(Chosen) as err:
                out.float().sum().backward()
        return str(err.value), seen[-1]["varlen"]

    monkeypatch.delenv("FLASHTILE_BWD_DQ")
    name, (_, keys, queries) = chosen_packed(128)  # causal d128: the split kernels, a key and a query work list
    assert name == "split" and keys[1] > 0 and queries[1] > 0
    assert chosen_packed(64)[0] == "one-pass"  # causal d64: the one-pass kernel
    monkeypatch.setenv("FLASHTILE_BWD_DQ", "onepass")
    name, (varlen, (table, cap), *rest) = chosen_packed()  # one program per block of 128 keys
    assert name == "one-pass" and rest == [] and varlen.batch == 2 and int(table[0]) == 2 <= cap
    assert seen[-1]["dq_accum"] is None  # packed rows do not tile it: the kernel's host zeroes its own


def test_every_kernel_is_described():
    assert set(registry.KERNELS) >= {"twin", "triton.forward", "triton.backward", "triton.backward_atomic",
                                     "triton.decode", "sm90.forward", "sm90.backward_split",
                                     "sm90.backward_split_d256", "sm90.backward_onepass"}
    assert registry.decode().kernel == "triton.decode"

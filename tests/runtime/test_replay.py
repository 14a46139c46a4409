"""Launch plans (flashtile.runtime.replay): a replayed call must give bitwise what the full path
gives, miss the cache whenever anything it depends on changes, and never skip a check.

Under TRITON_INTERPRET=1 replays go through ``kernel[grid]`` on views of the recorded
sources (the generic mode); ``runtime.stubs.stub_launches`` exercises the raw mode (the argument
lists handed to Triton's C launcher) without a GPU."""

from __future__ import annotations

import concurrent.futures
import os

import pytest

torch = pytest.importorskip("torch")
pytest.importorskip("triton")

from hypothesis import given, settings, strategies as st  # noqa: E402

import flashtile  # noqa: E402
from flashtile.runtime import replay as plan  # noqa: E402

pytestmark = pytest.mark.skipif(os.environ.get("TRITON_INTERPRET") != "1",
                                reason="set TRITON_INTERPRET=1 (make test does) to run the Triton kernels on CPU")


@pytest.fixture
def replays(plan_replays, triton_backend):
    return plan_replays


def _same(a, b):
    if isinstance(a, torch.Tensor):
        return a.shape == b.shape and a.stride() == b.stride() and a.dtype == b.dtype and torch.equal(a, b)
    if isinstance(a, (tuple, list)):
        return len(a) == len(b) and all(_same(x, y) for x, y in zip(a, b))
    return a == b


def _qkv(b, sq, sk, h, hk, d, dtype=torch.float32, layout="bshd", seed=0):
    g = torch.Generator().manual_seed(seed)
    if layout == "bshd":
        q = torch.randn(b, sq, h, d, generator=g, dtype=dtype)
        k = torch.randn(b, sk, hk, d, generator=g, dtype=dtype)
        v = torch.randn(b, sk, hk, d, generator=g, dtype=dtype)
    else:  # (b, h, s, d) storage seen as (b, s, h, d): other strides, same values
        q = torch.randn(b, h, sq, d, generator=g, dtype=dtype).transpose(1, 2)
        k = torch.randn(b, hk, sk, d, generator=g, dtype=dtype).transpose(1, 2)
        v = torch.randn(b, hk, sk, d, generator=g, dtype=dtype).transpose(1, 2)
    return q, k, v


FWD_CASES = [
    dict(shape=(2, 33, 47, 2, 2, 16)),
    dict(shape=(1, 64, 64, 4, 2, 32), causal=True),
    dict(shape=(1, 50, 20, 2, 1, 16), causal=True, layout="bhsd"),
    dict(shape=(2, 17, 40, 2, 2, 16), window_size=(7, 3)),
    dict(shape=(1, 40, 40, 2, 2, 16), softcap=5.0, dtype=torch.float16),
    dict(shape=(2, 24, 31, 4, 2, 16), alibi=True, causal=True),
]


@pytest.mark.parametrize("case", FWD_CASES, ids=lambda c: "-".join(f"{k}{v}" for k, v in c.items()))
def test_replayed_forward_is_bitwise_the_full_path(case, replays, plans_off):
    b, sq, sk, h, hk, d = case["shape"]
    kwargs = {k: case[k] for k in ("causal", "window_size", "softcap") if k in case}
    dtype = case.get("dtype", torch.float32)
    first = _qkv(b, sq, sk, h, hk, d, dtype, case.get("layout", "bshd"), seed=1)
    if case.get("alibi"):
        kwargs["alibi_slopes"] = torch.rand(h)
    flashtile.flash_attn_func(*first, **kwargs)  # records
    assert replays["n"] == 0
    again = _qkv(b, sq, sk, h, hk, d, dtype, case.get("layout", "bshd"), seed=2)
    got = flashtile.flash_attn_func(*again, return_attn_probs=True, **kwargs)
    got = flashtile.flash_attn_func(*again, return_attn_probs=True, **kwargs)  # the first records this key
    assert replays["n"] == 1
    want = plans_off(lambda: flashtile.flash_attn_func(*again, return_attn_probs=True, **kwargs))
    assert _same(got, want)


@pytest.mark.parametrize("case", ["plain", "packed", "bhsd", "chunk", "deterministic", "sink", "sink-half-chunk"])
def test_replayed_training_step_is_bitwise_the_full_path(case, replays, plans_off, monkeypatch):
    """A training call without per-call tensors but its sink (``dispatch.attention_keyed``)
    replays its forward and its backward as one plan each on the caller's tensors, bitwise
    the full path: packed (overlapping) views, another layout, a chunk in the op's
    arguments, the deterministic switch and a learnable sink (float32, or float16 read
    through a cast, its gradient included) each keep their own plans and their gradients."""
    if case == "deterministic":
        monkeypatch.setattr(torch, "are_deterministic_algorithms_enabled", lambda: True)

    def step(seed):
        kwargs = dict(causal=True, attention_chunk=16 if case.endswith("chunk") else 0)
        sink = []
        if case.startswith("sink"):
            g = torch.Generator().manual_seed(seed + 50)
            sink = [torch.randn(2, generator=g, dtype=torch.float16 if "half" in case else torch.float32)
                    .requires_grad_()]
            kwargs["learnable_sink"] = sink[0]
        if case == "packed":
            qkv = torch.randn(1, 24, 3, 2, 16, generator=torch.Generator().manual_seed(seed)).requires_grad_()
            out = flashtile.flash_attn_qkvpacked_func(qkv, **kwargs)
            leaves = [qkv]
        else:
            shape = (2, 40, 56, 4, 2, 16) if case == "plain" else (1, 24, 40, 2, 1, 16)
            leaves = [t.detach().requires_grad_() for t in _qkv(*shape, seed=seed,
                                                                  layout="bhsd" if case == "bhsd" else "bshd")]
            out = flashtile.flash_attn_func(*leaves, **kwargs)
        grads = torch.autograd.grad(out, leaves + sink, torch.ones_like(out))
        return (out.detach(), *grads)

    step(1)
    assert replays["n"] == 0
    from flashtile.api import flash as api

    (entry,) = api._PLANS.entries.values()
    assert "attn_fwd_keyed" in entry.below  # the keyed path took it
    got = step(2)
    assert replays["n"] == 2  # the forward's plan and the backward's
    assert _same(got, plans_off(lambda: step(2)))


@pytest.mark.parametrize("case", ["causal", "3d", "gqa", "dropout"])
def test_sdpa_calls_replay_bitwise(case, replays, plans_off):
    """``flashtile.scaled_dot_product_attention`` without a mask or sink validates once per key:
    a repeated call without grad replays its whole plan, one with grad replays its forward and
    backward plans; both bitwise the full path. With dropout (a fresh seed per call, drawn
    outside any plan) the same torch seed gives the same result on either path."""
    kwargs = dict(is_causal=case != "gqa", enable_gqa=case == "gqa", dropout_p=0.3 if case == "dropout" else 0.0)
    shape = (2, 24, 16) if case == "3d" else (1, 2, 24, 16)
    kshape = (1, 1, 30, 16) if case == "gqa" else shape

    def inputs(seed, grad=False):
        g = torch.Generator().manual_seed(seed)
        return [torch.randn(s, generator=g).requires_grad_(grad) for s in (shape, kshape, kshape)]

    def call(seed):
        torch.manual_seed(seed)  # the dropout's seed
        return flashtile.scaled_dot_product_attention(*inputs(seed), **kwargs)

    def step(seed):
        torch.manual_seed(seed)
        leaves = inputs(seed, grad=True)
        out = flashtile.scaled_dot_product_attention(*leaves, **kwargs)
        return (out.detach(), *torch.autograd.grad(out, leaves, torch.ones_like(out)))

    call(1)
    step(1)
    assert replays["n"] == 0
    got = call(2), step(2)
    if case != "dropout":
        assert replays["n"] == 3  # the call's plan, the step's forward and backward
    assert _same(got, plans_off(lambda: (call(2), step(2))))


@pytest.mark.parametrize("api", ["flash", "sdpa"])
def test_backward_plan_follows_the_saved_tensors_strides(api, replays, plans_off):
    """A saved-tensors hook may hand the backward its tensors with other strides than the
    forward saved (``.contiguous()`` of a transposed view here): the backward's plan is found
    by the saved tensors' keys too, so those gradients are right, not read with the strides
    of the warm plan."""
    def step(seed, hook):
        g = torch.Generator().manual_seed(seed)
        # each API's layout as a transposed view: flash's (batch, seqlen, heads, dim) of
        # (batch, heads, seqlen, dim) memory, SDPA's the other way round
        shape = (1, 2, 32, 16) if api == "flash" else (1, 32, 2, 16)
        leaves = [torch.randn(shape, generator=g).transpose(1, 2).requires_grad_() for _ in range(3)]
        pack = (lambda t: t.contiguous()) if hook else (lambda t: t)
        with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
            if api == "flash":
                out = flashtile.flash_attn_func(*leaves, causal=True)
            else:
                out = flashtile.scaled_dot_product_attention(*leaves, is_causal=True)
        return (out.detach(), *torch.autograd.grad(out, leaves, torch.ones_like(out)))

    for seed in (1, 2, 3):
        step(seed, hook=False)
    assert _same(step(4, hook=True), plans_off(lambda: step(4, hook=True)))


@pytest.mark.parametrize("api", ["flash", "sdpa", "varlen"])
def test_training_step_unpacks_its_saved_tensors_once(api, replays, plans_off):
    """The keyed backward reads its saved tensors once: each read runs the saved-tensor hooks
    again, which non-reentrant activation checkpointing refuses and which would make an
    offloading hook copy twice (and, inside the backward's recording, put the hook's own
    buffers into the plan). Checkpointed steps, and a hook whose unpack makes a new tensor
    each time, give bitwise the full path's gradients with one unpack per saved tensor."""
    from torch.utils.checkpoint import checkpoint

    cu = torch.tensor([0, 9, 9, 30], dtype=torch.int32)

    def attend(q, k, v):
        if api == "flash":
            return flashtile.flash_attn_func(q, k, v, causal=True)
        if api == "sdpa":
            return flashtile.scaled_dot_product_attention(q, k, v, is_causal=True)
        return flashtile.flash_attn_varlen_func(q, k, v, cu, cu, 21, 21, causal=True)

    def leaves(seed):
        g = torch.Generator().manual_seed(seed)
        shape = {"varlen": (30, 2, 16), "flash": (1, 30, 2, 16), "sdpa": (1, 2, 30, 16)}[api]
        return [torch.randn(shape, generator=g).requires_grad_() for _ in range(3)]

    def checkpointed(seed):
        x = leaves(seed)
        out = checkpoint(attend, *x, use_reentrant=False)
        return (out.detach(), *torch.autograd.grad(out, x, torch.ones_like(out)))

    unpacks = {"n": 0}

    def unpack(t):
        unpacks["n"] += 1
        return t.clone()  # a new tensor each time, as an offloading hook's copy back

    def hooked(seed):
        x = leaves(seed)
        with torch.autograd.graph.saved_tensors_hooks(lambda t: t, unpack):
            out = attend(*x)
        unpacks["n"] = 0
        grads = torch.autograd.grad(out, x, torch.ones_like(out))
        return (out.detach(), *grads)

    for seed in (1, 2):  # the first records the plans, the second replays them
        assert _same(checkpointed(seed), plans_off(lambda: checkpointed(seed)))
        got = hooked(seed)
        assert unpacks["n"] == 5, unpacks  # q, k, v, out, lse
        assert _same(got, plans_off(lambda: hooked(seed)))


@pytest.mark.parametrize("keyed", [True, False])
def test_a_sink_changed_in_place_before_the_backward_raises(keyed, triton_backend, monkeypatch):
    """A float32 sink reaches the kernels as the caller's own tensor (no cast copy): it is a
    saved tensor, so changing it in place between the forward and the backward raises, as
    for q, k or v, instead of a gradient computed from the new values (on the keyed path
    and on the full one)."""
    if not keyed:
        monkeypatch.setenv("FLASHTILE_PLANS", "0")
    g = torch.Generator().manual_seed(0)
    leaves = [torch.randn(1, 20, 2, 16, generator=g).requires_grad_() for _ in range(3)]
    sink = torch.randn(2, generator=g).requires_grad_()
    for step in range(3):
        out = flashtile.flash_attn_func(*leaves, causal=True, learnable_sink=sink)
        if step == 2:
            with torch.no_grad():
                sink.add_(3.0)
            with pytest.raises(RuntimeError, match="modified by an inplace operation"):
                torch.autograd.grad(out, leaves + [sink], torch.ones_like(out))
        else:
            torch.autograd.grad(out, leaves + [sink], torch.ones_like(out))


def test_backward_plan_follows_dout_layout_and_the_lse_gradient(replays, plans_off):
    """A training call finds its backward's entry from the forward's by dout, dlse and the
    switches alone (``autograd._attn_bwd_planned``): each of these must get its own plan."""
    def step(seed, transposed_dout, lse_loss):
        leaves = [t.requires_grad_() for t in _qkv(1, 24, 30, 2, 1, 16, seed=seed)]
        out, lse, _ = flashtile.flash_attn_func(*leaves, causal=True, return_attn_probs=True)
        g = torch.Generator().manual_seed(seed + 100)
        dout = (torch.randn(1, 2, 24, 16, generator=g).transpose(1, 2) if transposed_dout
                else torch.randn(1, 24, 2, 16, generator=g))
        outputs, grads = ((out, lse), (dout, torch.randn(lse.shape, generator=g))) if lse_loss else ((out,), (dout,))
        return (out.detach(), *torch.autograd.grad(outputs, leaves, grads))

    combos = [(False, False), (True, False), (False, True), (True, True)]
    for combo in combos:
        step(1, *combo)
    n = replays["n"]
    for combo in combos:
        assert _same(step(2, *combo), plans_off(lambda: step(2, *combo))), combo
    # every forward and the two backwards without an LSE gradient replayed (with one, the
    # backward subtracts dlse from Delta with a torch op, which a plan does not record)
    assert replays["n"] == n + len(combos) + 2


def test_packed_and_aliased_inputs_get_their_own_plans(replays, plans_off):
    qkv = torch.randn(2, 30, 3, 2, 16)
    flashtile.flash_attn_qkvpacked_func(qkv, causal=True)
    got = flashtile.flash_attn_qkvpacked_func(qkv * 2, causal=True)
    assert replays["n"] == 1
    assert _same(got, plans_off(lambda: flashtile.flash_attn_qkvpacked_func(qkv * 2, causal=True)))
    # The same tensor as q, k and v, then three tensors: one key, two overlap signatures.
    x = torch.randn(1, 20, 2, 16)
    a = flashtile.flash_attn_func(x, x, x)
    b = flashtile.flash_attn_func(x, x.clone(), x.clone())
    c = flashtile.flash_attn_func(x, x, x)
    assert replays["n"] == 2  # the second call recorded its own signature
    assert _same(a, b) and _same(a, c)
    y = torch.randn(1, 20, 2, 16)
    flashtile.flash_attn_func(y, x, x)  # a third signature: k is v, q apart
    z = torch.randn(1, 20, 2, 16)
    assert _same(flashtile.flash_attn_func(z, y, y), plans_off(lambda: flashtile.flash_attn_func(z, y, y)))
    assert replays["n"] == 3


def test_varlen_and_kvcache_replay(replays, plans_off):
    cu = torch.tensor([0, 5, 5, 19, 30], dtype=torch.int32)
    q = torch.randn(30, 2, 16)
    k, v = torch.randn(30, 1, 16), torch.randn(30, 1, 16)
    run = lambda s: flashtile.flash_attn_varlen_func(q * s, k, v, cu, cu, 14, 14, causal=True)  # noqa: E731
    run(1.0)
    n = replays["n"]
    got = run(2.0)
    assert replays["n"] > n
    assert _same(got, plans_off(lambda: run(2.0)))
    k_cache, v_cache = torch.randn(3, 24, 1, 16), torch.randn(3, 24, 1, 16)
    lens = torch.tensor([3, 10, 17], dtype=torch.int32)
    decode = lambda s: flashtile.flash_attn_with_kvcache(  # noqa: E731
        torch.randn(3, 1, 2, 16, generator=torch.Generator().manual_seed(s)), k_cache, v_cache,
        cache_seqlens=lens, causal=True)
    decode(1)
    n = replays["n"]
    got = decode(2)
    assert replays["n"] > n
    assert _same(got, plans_off(lambda: decode(2)))



def test_varlen_call_replays_whole_and_checks_new_metadata(replays, plans_off):
    """A packed call is validated once per key and then replays one plan of the whole call
    (the API's); new metadata tensors under a warm key are still checked (bad values
    raise) and read by the replay (another split of the same tokens, bitwise the full path)."""
    from flashtile.api import varlen as api

    g = torch.Generator().manual_seed(1)
    q = torch.randn(30, 2, 16, generator=g)
    k, v = torch.randn(30, 1, 16, generator=g), torch.randn(30, 1, 16, generator=g)
    run = lambda cu: flashtile.flash_attn_varlen_func(q, k, v, cu, cu, 16, 16, causal=True)  # noqa: E731
    first = torch.tensor([0, 5, 5, 19, 30], dtype=torch.int32)
    for _ in range(3):
        run(first)
    (entry,) = api._PLANS.entries.values()
    assert [type(p) for p in entry.plans.values()] == [plan.Plan]
    other = torch.tensor([0, 12, 20, 20, 30], dtype=torch.int32)
    n = replays["n"]
    got = run(other)
    assert replays["n"] > n
    assert _same(got, plans_off(lambda: run(other)))
    assert not _same(got, run(first))
    with pytest.raises(ValueError, match="non-decreasing"):
        run(torch.tensor([0, 12, 8, 20, 30], dtype=torch.int32))
    with pytest.raises(ValueError, match=r"cu_seqlens_q\[-1\]"):
        run(torch.tensor([0, 12, 20, 20, 29], dtype=torch.int32))

@pytest.mark.parametrize("case", ["plain", "seqused", "chunk", "padding", "sink"])
def test_packed_training_step_replays_with_each_calls_metadata(case, replays, plans_off):
    """A packed training call (``flash_attn_varlen_func`` with grad, no ALiBi, dropout or paged
    keys) takes the keyed autograd path: its forward and backward replay one plan each,
    recorded on q, k, v, the metadata tensors and the sink (its gradient checked too), so
    another split of the same tokens under the warm key gets its own attention and
    gradients, bitwise the full path, also when two
    steps' forwards run before their backwards; bad metadata still raises."""
    g = torch.Generator().manual_seed(1)
    base = [torch.randn(30, 2, 16, generator=g), torch.randn(30, 1, 16, generator=g),
            torch.randn(30, 1, 16, generator=g)]
    kwargs = dict(causal=True, attention_chunk=4 if case == "chunk" else 0)
    if case == "padding":
        kwargs["padding_sequences"] = True
    sinks = []
    if case == "sink":  # one leaf for every step
        sinks = [torch.randn(2, generator=g).requires_grad_()]
        kwargs["learnable_sink"] = sinks[0]

    def forward(cu):
        leaves = [t.clone().requires_grad_() for t in base]
        extra = {}
        if case == "seqused":
            extra["seqused_k"] = (cu[1:] - cu[:-1]).clamp(max=6).to(torch.int32)
        end = 26 if case == "padding" else 30  # padded: rows and keys past cu[-1] attend to nothing
        cu = torch.cat([cu[:-1], cu.new_tensor([end])])
        return leaves, flashtile.flash_attn_varlen_func(*leaves, cu, cu.clone(), 16, 16, **kwargs, **extra)

    def backward(leaves, out):
        return (out.detach(), *torch.autograd.grad(out, leaves + sinks, torch.ones_like(out)))

    def step(cu):
        return backward(*forward(cu))

    def two_steps(cu_a, cu_b):
        """Two forwards, then their backwards in reverse order."""
        runs = [forward(cu_a), forward(cu_b)]
        return [backward(*run) for run in runs[::-1]]

    first = torch.tensor([0, 5, 5, 19, 30], dtype=torch.int32)
    for _ in range(3):
        step(first)
    from flashtile.api import varlen as api

    (entry,) = api._PLANS.entries.values()
    assert "attn_fwd_keyed" in entry.below
    other = torch.tensor([0, 12, 20, 20, 30], dtype=torch.int32)
    n = replays["n"]
    got = step(other)
    assert replays["n"] == n + 2  # the forward's plan and the backward's
    assert _same(got, plans_off(lambda: step(other)))
    assert not _same(got[1], step(first)[1])
    assert _same(two_steps(first, other), plans_off(lambda: two_steps(first, other)))
    with pytest.raises(ValueError, match="non-decreasing"):
        step(torch.tensor([0, 12, 8, 20, 30], dtype=torch.int32))


def test_a_changed_argument_misses(replays):
    q, k, v = _qkv(1, 24, 24, 2, 2, 16)
    variants = [
        lambda: flashtile.flash_attn_func(q, k, v),
        lambda: flashtile.flash_attn_func(q, k, v, causal=True),
        lambda: flashtile.flash_attn_func(q, k, v, softmax_scale=0.5),
        lambda: flashtile.flash_attn_func(q, k, v, window_size=(3, 3)),
        lambda: flashtile.flash_attn_func(q, k, v, window_size=[3, 3]),
        lambda: flashtile.flash_attn_func(q.half(), k.half(), v.half()),
        lambda: flashtile.flash_attn_func(q.transpose(1, 2).contiguous().transpose(1, 2), k, v),
        lambda: flashtile.flash_attn_func(q[:, :20], k, v),
        lambda: flashtile.flash_attn_func(q, k, v, return_attn_probs=True),
    ]
    outs = [f() for f in variants]
    assert replays["n"] == 0  # nine keys
    for f, want in zip(variants, outs):
        assert _same(f(), want)
    assert replays["n"] == len(variants)


def test_bad_input_raises_on_a_warm_cache(replays):
    q, k, v = _qkv(1, 24, 24, 2, 2, 16)
    for _ in range(2):
        flashtile.flash_attn_func(q, k, v, causal=True)
    assert replays["n"] == 1
    with pytest.raises(TypeError, match="causal"):
        flashtile.flash_attn_func(q, k, v, causal=1)
    with pytest.raises(ValueError, match="head dim"):
        flashtile.flash_attn_func(q, k[..., :8], v[..., :8], causal=True)
    with pytest.raises(ValueError, match="dropout_p"):
        flashtile.flash_attn_func(q, k, v, causal=True, dropout_p=1.5)
    with pytest.raises(TypeError, match="alibi_slopes"):
        flashtile.flash_attn_func(q, k, v, causal=True, alibi_slopes=[0.5, 0.25])
    assert replays["n"] == 1


def test_unplannable_calls_stay_correct(replays, plans_off):
    q, k, v = _qkv(1, 24, 24, 2, 2, 16)
    # Dropout draws a Philox key per call (an RNG op): the call is not planned as a whole
    # (only the kernels' op, which takes the key as an input), and stays reproducible.
    from flashtile.api import flash

    torch.manual_seed(3)
    a = [flashtile.flash_attn_func(q, k, v, dropout_p=0.3) for _ in range(4)]
    torch.manual_seed(3)
    b = [plans_off(lambda: flashtile.flash_attn_func(q, k, v, dropout_p=0.3)) for _ in range(4)]
    assert all(_same(x, y) for x, y in zip(a, b)) and not _same(a[0], a[1])
    [entry] = flash._PLANS.entries.values()
    assert list(entry.plans.values()) == [plan._UNPLANNABLE]
    n = replays["n"]
    # A tensor window_size is not a key: the ordinary path every time.
    w = torch.tensor([2, 2])
    assert _same(flashtile.flash_attn_func(q, k, v, window_size=w), flashtile.flash_attn_func(q, k, v, window_size=w))
    assert len(flash._PLANS.entries) == 1 and replays["n"] == n + 1  # the kernels' op replayed, not the call


def test_a_dead_functorch_wrapper_is_not_planned(replays, plans_off):
    """A tensor that outlived a ``torch.func`` transform (a dead wrapper: no storage, so no
    data pointer for a key) takes the ordinary path, with and without grad, and gets the
    plain tensor's results."""
    leaked = []

    def loss(x):
        leaked.append(x)
        return x.sum()

    q, k, v = _qkv(1, 16, 16, 2, 2, 16)
    torch.func.grad(loss)(q)
    dead = leaked[0]
    assert torch._C._functorch.is_functorch_wrapped_tensor(dead)
    for _ in range(2):
        assert _same(flashtile.flash_attn_func(dead, k, v, causal=True), flashtile.flash_attn_func(q, k, v, causal=True))
    leaf = k.clone().requires_grad_(True)
    out = flashtile.flash_attn_func(dead, leaf, v, causal=True)
    want = plans_off(lambda: torch.autograd.grad(flashtile.flash_attn_func(q, leaf, v, causal=True).sum(), leaf))
    assert _same(torch.autograd.grad(out.sum(), leaf), want)


def test_threads_with_different_shapes(replays, monkeypatch, plans_off):
    """Lookups, recordings and replays run concurrently; the kernels themselves one at a
    time (Triton's interpreter patches builtins while it runs a kernel)."""
    import threading

    from flashtile.runtime import launch

    lock = threading.RLock()
    for cls, name in ((launch.Launcher, "_launch"), (plan._GenericLaunch, "__call__")):
        original = getattr(cls, name)

        def locked(*args, _original=original, **kwargs):
            with lock:
                return _original(*args, **kwargs)

        monkeypatch.setattr(cls, name, locked)
    shapes = [(1, 16 + 8 * i, 24, 2, 2, 16) for i in range(4)]
    inputs = [_qkv(*s, seed=i) for i, s in enumerate(shapes)]
    want = [plans_off(lambda x=x: flashtile.flash_attn_func(*x, causal=True)) for x in inputs]

    def work(i):
        return [flashtile.flash_attn_func(*inputs[i], causal=True) for _ in range(3)]

    with concurrent.futures.ThreadPoolExecutor(4) as pool:
        results = list(pool.map(work, [0, 1, 2, 3, 3, 2, 1, 0]))
    for i, outs in zip([0, 1, 2, 3, 3, 2, 1, 0], results):
        assert all(_same(o, want[i]) for o in outs)
    assert replays["n"] > 0


def _roles(args, tensors):
    """A raw launch's arguments with each address replaced by what it points into."""
    out, fresh = [], {}
    for a in args:
        if type(a) is int and a > 2**20:
            for name, t in tensors.items():
                if t.data_ptr() <= a < t.data_ptr() + max(1, t.untyped_storage().nbytes()):
                    out.append((name, a - t.data_ptr()))
                    break
            else:
                out.append(("new", fresh.setdefault(a, len(fresh))))
        else:
            out.append(a)
    return out


def test_raw_replay_hands_the_c_launcher_the_full_paths_arguments(triton_backend, plans_off):
    """With launches stubbed: the argument list a replay passes to the C launcher is the
    ordinary path's, with this call's addresses in it."""
    q, k, v = _qkv(2, 40, 56, 4, 2, 16)
    log: list = []
    from flashtile.runtime.stubs import stub_launches

    with stub_launches(log):
        flashtile.flash_attn_func(q, k, v, causal=True)  # records (stubbed ordinary launch)
        q2, k2, v2 = (t.clone() for t in (q, k, v))
        log.clear()
        flashtile.flash_attn_func(q2, k2, v2, causal=True)
        replayed = list(log)
        log.clear()
        plans_off(lambda: flashtile.flash_attn_func(q2, k2, v2, causal=True))
        ordinary = list(log)
    assert len(replayed) == len(ordinary) == 1
    names = dict(q=q2, k=k2, v=v2)
    assert _roles(replayed[0], names) == _roles(ordinary[0], names)
    assert any(isinstance(r, tuple) and r and r[0] == "k" for r in _roles(replayed[0], names))


def test_stream_counter_on_cpu_is_a_fresh_zero():
    c = plan.stream_counter(torch.device("cpu"))
    assert c.dtype == torch.int32 and c.tolist() == [0]


def test_a_counter_made_during_a_recording_is_not_one_of_its_steps():
    """The stream's work counter is made on a process's first call, which may be a call
    being recorded: its allocation and fill must not become steps of that plan (a fresh
    zeroed buffer every replay, that no launch reads: H200 run 90)."""
    rec = plan.Recorder([])
    plan._local.recorder = rec
    try:
        with rec:
            counter = plan._new_counter(torch.device("cpu"), rec)
            torch.zeros(2)  # the recorder itself still notes the call's own buffers
    finally:
        plan._local.recorder = None
    assert counter.tolist() == [0] and counter.dtype == torch.int32
    assert len(rec.slots) == 1 and rec.slots[0].shape == (2,) and rec.paused == 0


@settings(max_examples=300, deadline=None)
@given(st.lists(st.tuples(st.integers(0, 200), st.integers(0, 60)), max_size=10))
def test_overlap_signature_is_every_overlapping_pair(spans):
    """``plan._overlaps`` (part of a plan's key: which inputs share bytes, at what offsets)
    finds exactly the overlapping pairs, in (i, j) order (one sweep over the inputs by
    address: identical tensors, nested spans and empty tensors among them)."""
    bases, extents = [b for b, _ in spans], [e for _, e in spans]
    want = tuple((i, j, bases[j] - bases[i]) for i in range(len(spans)) for j in range(i + 1, len(spans))
                 if extents[i] and extents[j] and bases[i] < bases[j] + extents[j] and bases[j] < bases[i] + extents[i])
    assert plan._overlaps(bases, extents) == want
    assert plan._overlaps(bases, extents, [i for i, e in enumerate(extents) if e]) == want  # a plan entry's way

"""Launch plans on the GPU: raw replays (Triton's C launcher with recorded arguments) give
bitwise the full path's results, and the dynamic schedule's work counter (one per device
and stream, reset by the kernel) is never shared wrongly by streams or CUDA graphs."""

from __future__ import annotations

import pytest

torch = pytest.importorskip("torch")
pytest.importorskip("triton")

import flashtile  # noqa: E402
from flashtile.runtime import replay as plan  # noqa: E402
from flashtile.backends.sm90.scope import ONEPASS_HEAD_DIMS  # noqa: E402

pytestmark = pytest.mark.gpu


@pytest.fixture
def replays(plan_replays):
    return plan_replays


def _rand(*shape, dtype=torch.bfloat16, seed=0):
    g = torch.Generator(device="cuda").manual_seed(seed)
    return torch.randn(*shape, device="cuda", dtype=dtype, generator=g)


def _equal(a, b):
    if isinstance(a, torch.Tensor):
        return a.shape == b.shape and a.stride() == b.stride() and torch.equal(a, b)
    return all(_equal(x, y) for x, y in zip(a, b))


@pytest.mark.parametrize("d", [64, 128, 256])
@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_forward_replay_is_bitwise(d, causal, dtype, replays, plans_off):
    for seed in (1, 2, 3):
        q, k, v = (_rand(2, 700, 4, d, dtype=dtype, seed=seed * 3 + i) for i in range(3))
        got = flashtile.flash_attn_func(q, k, v, causal=causal, return_attn_probs=True)
    assert replays["raw"] == 2
    want = plans_off(lambda: flashtile.flash_attn_func(q, k, v, causal=causal, return_attn_probs=True))
    assert _equal(got[:2], want[:2])
    torch.cuda.synchronize()
    assert all(c.item() == 0 for c in plan._COUNTERS.values())  # the kernel left its counter at 0


@pytest.mark.parametrize("d", [64, 128])
def test_training_step_replay_is_bitwise(d, replays, plans_off):
    def step(seed):
        leaves = [_rand(2, 600, 4, d, seed=seed * 3 + i).requires_grad_() for i in range(3)]
        out = flashtile.flash_attn_func(*leaves, causal=True)
        return (out.detach(), *torch.autograd.grad(out, leaves, torch.ones_like(out)))

    step(1)
    got = step(2)
    assert replays["raw"] == 2
    want = plans_off(lambda: step(2))
    if d in ONEPASS_HEAD_DIMS:  # the one-pass backward: dQ summed in a varying order, the rest bitwise
        assert _equal(got[:1] + got[2:], want[:1] + want[2:])
        torch.testing.assert_close(got[1], want[1], rtol=2e-3, atol=2e-3)
    else:
        assert _equal(got, want)


def test_varlen_and_decode_replay_is_bitwise(replays, plans_off):
    cu = torch.tensor([0, 100, 100, 612, 1000], dtype=torch.int32, device="cuda")
    k, v = _rand(1000, 2, 128, seed=1), _rand(1000, 2, 128, seed=2)
    run = lambda s: flashtile.flash_attn_varlen_func(_rand(1000, 8, 128, seed=s), k, v, cu, cu,  # noqa: E731
                                                     512, 512, causal=True)
    run(3)
    got = run(4)
    k_cache, v_cache = _rand(8, 4096, 2, 128, seed=5), _rand(8, 4096, 2, 128, seed=6)
    lens = torch.tensor([1, 100, 4000, 4096, 7, 2048, 3000, 50], dtype=torch.int32, device="cuda")
    decode = lambda s: flashtile.flash_attn_with_kvcache(_rand(8, 1, 8, 128, seed=s), k_cache, v_cache,  # noqa: E731
                                                         cache_seqlens=lens, causal=True)
    decode(7)
    got_decode = decode(8)
    assert replays["raw"] >= 2
    assert _equal(got, plans_off(lambda: run(4)))
    assert _equal(got_decode, plans_off(lambda: decode(8)))


def test_two_streams_do_not_share_a_counter(replays):
    q = [_rand(4, 1024, 16, 128, seed=i) for i in range(2)]
    want = [flashtile.flash_attn_func(x, x, x, causal=True) for x in q]
    streams = [torch.cuda.Stream() for _ in range(2)]
    torch.cuda.synchronize()
    outs = [[], []]
    for _ in range(20):
        for i, s in enumerate(streams):
            with torch.cuda.stream(s):
                outs[i].append(flashtile.flash_attn_func(q[i], q[i], q[i], causal=True))
    torch.cuda.synchronize()
    for i in range(2):
        assert all(torch.equal(o, want[i]) for o in outs[i])
    keys = {key for key in plan._COUNTERS}
    assert len({s for _, s in keys}) >= 3  # the default stream and the two side streams
    assert all(c.item() == 0 for c in plan._COUNTERS.values())


def test_graph_replay_next_to_eager_calls(replays):
    q = _rand(2, 1024, 8, 128, seed=1)
    other = _rand(2, 1024, 8, 128, seed=2)
    want_q = flashtile.flash_attn_func(q, q, q, causal=True)
    want_other = flashtile.flash_attn_func(other, other, other, causal=True)
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        for _ in range(2):
            flashtile.flash_attn_func(q, q, q, causal=True)  # warm up: the key's plan
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        static_out = flashtile.flash_attn_func(q, q, q, causal=True)
    graph_stream = torch.cuda.Stream()
    eager = []
    for _ in range(10):
        with torch.cuda.stream(graph_stream):
            graph.replay()
        eager.append(flashtile.flash_attn_func(other, other, other, causal=True))
        graph_stream.synchronize()
        assert torch.equal(static_out, want_q)
    torch.cuda.synchronize()
    assert all(torch.equal(o, want_other) for o in eager)


def _entries(caches):
    """Every plan entry of ``caches``, those kept in another entry's ``below`` included."""
    todo = [e for c in caches for e in c.entries.values()]
    while todo:
        e = todo.pop()
        yield e
        todo.extend(b for b in e.below.values() if hasattr(b, "plans"))


def test_the_counter_made_by_a_recorded_call_is_not_in_its_plan(replays):
    """The first call of a process makes the stream's counter while its plan is being
    recorded; the plan must not allocate and zero a buffer of its own on every replay
    (H200 run 90: a training forward paid an allocation and a fill kernel per call)."""

    plan.clear()  # no counter yet
    leaves = [_rand(4, 512, 16, 128, seed=i).requires_grad_() for i in range(3)]
    for _ in range(3):
        flashtile.flash_attn_func(*leaves, causal=True)
    assert plan._COUNTERS  # the dynamic schedule ran
    # a call with grad keeps its forward's plan below the API's entry (the keyed path)
    plans = [p for e in _entries(plan._CACHES) for p in e.plans.values() if type(p) is plan.Plan]
    assert plans and replays["raw"] >= 1
    for p in plans:
        assert len(p.slots) == 2 and all(kind != "fill" for kind, *_ in p.steps)  # out and LSE only

"""flash_attn_with_kvcache on the GPU (``pytest -m gpu``): the CPU matrix's reference at
fp16/bf16 under the accuracy rule, a decode loop against the prefill of the whole
sequence, and a decode step captured in a CUDA graph with changing cache_seqlens."""

from __future__ import annotations

import pytest
import torch

import flashtile
from test_kvcache import _case, _keep_status, _run_and_check, _spy_launches

pytestmark = [pytest.mark.gpu, pytest.mark.usefixtures("poison_outputs")]


def _cuda(*tensors):
    return [None if t is None else t.cuda() for t in tensors]


def _capture(step, warm_up=None, times=1):
    """A CUDA graph of ``step()`` and what the capture returned, after ``times`` calls of
    ``warm_up`` (default: ``step``) on a side stream (PyTorch's capture idiom: the first
    calls compile and allocate outside the capture)."""
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        for _ in range(times):
            (warm_up or step)()
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        got = step()
    return graph, got


def _generation_case(batch, page):
    """A generation step on the GPU (GQA 32/8, d128, bf16, one new token; lengths random below
    8000 in caches of 8192, pages of ``page`` or rows): (q, k, v, k_cache, v_cache, table,
    cache_seqlens)."""
    seqlens = [int(x) for x in torch.randint(1, 8000, (batch,), generator=torch.Generator().manual_seed(batch))]
    return _cuda(*_case(batch=batch, sq=1, new=1, heads=(32, 8), d=128, capacity=8192, seqlens=seqlens,
                        dtype=torch.bfloat16, page=page))


def _capacity(k_cache, table):
    """Tokens a sequence's cache holds (its block table's pages, or the cache's rows)."""
    return table.shape[1] * k_cache.shape[1] if table is not None else k_cache.shape[1]


def _steps_by_check(monkeypatch, qkv, caches, lens, kw, count):
    """``count`` generation steps, each on fresh q, k, v (shaped as ``qkv``) under every
    FLASHTILE_DECODE_CHECK mode of ``caches`` (mode -> the (k_cache, v_cache) it appends to):
    yields (step, (q, k, v), {mode: (out, lse)})."""
    for step in range(count):
        qkv = tuple(torch.randn_like(t) for t in qkv)
        got = {}
        for mode, c in caches.items():
            monkeypatch.setenv("FLASHTILE_DECODE_CHECK", mode)
            got[mode] = flashtile.flash_attn_with_kvcache(qkv[0], *c, *qkv[1:], cache_seqlens=lens, **kw)
        yield step, qkv, got


def _replay_a_bad_length(graph, out, lse, lens, caches, capacity):
    """Replays a captured step with the last sequence's length at its capacity (no room for
    the new token): every out and lse NaN, the caches untouched."""
    lens[-1] = capacity
    before = [c.clone() for c in caches]
    graph.replay()
    torch.cuda.synchronize()
    assert out.isnan().all() and lse.isnan().all()
    assert all(torch.equal(a, b) for a, b in zip(caches, before))


def _as_captured(monkeypatch, fn):
    """``fn()`` eagerly with the launches a captured step takes: under capture ``auto`` keeps
    the combine kernel and takes the spread check where the step allows it, else the check
    kernel (``decode.fuse_step``, ``decode.spread_step``), where an eager step with a small
    cache read folds both into the decode kernel (the same sums in another order)."""
    with monkeypatch.context() as m:
        m.setenv("FLASHTILE_DECODE_COMBINE", "separate")
        m.setenv("FLASHTILE_DECODE_CHECK", "spread")
        return fn()


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16], ids=["fp16", "bf16"])
@pytest.mark.parametrize("page", [0, 16, 256])
@pytest.mark.parametrize("sq", [1, 4])
@pytest.mark.parametrize("num_splits, check", [(0, "auto"), (1, "auto"), (0, "spread")])
def test_matrix(monkeypatch, dtype, page, sq, num_splits, check):
    """The CPU matrix's cases against the float64 reference (the accuracy rule), with the
    kernels ``auto`` takes for these eager steps (the check and the combine folded into the
    decode kernel where it splits), and with the spread check (a captured step's)."""
    if check == "spread":
        monkeypatch.setenv("FLASHTILE_DECODE_CHECK", "spread")
        monkeypatch.setenv("FLASHTILE_DECODE_COMBINE", "separate")
    q, k, v, kc, vc, table, seqlens = _case(batch=4, sq=sq, new=sq, heads=(32, 8), d=128, capacity=600,
                                             seqlens=(0, 1, 333, 590), dtype=dtype, page=page)
    q, k, v, kc, vc, table, seqlens = _cuda(q, k, v, kc, vc, table, seqlens)
    _run_and_check(q, k, v, kc, vc, seqlens, table=table, causal=True, num_splits=num_splits)


@pytest.mark.parametrize("page", [16, 48])
@pytest.mark.parametrize("num_splits", [0, 1])
@pytest.mark.parametrize("slice_max", [512, 0])
def test_paged_table_slice(monkeypatch, page, num_splits, slice_max):
    """decode.PAGE_SLICE_MAX (512 by default): the page gather with the split's table entries
    in registers, and (0) the per-key table read of splits that span more pages."""
    from flashtile.backends.triton import decode

    monkeypatch.setattr(decode, "PAGE_SLICE_MAX", slice_max)
    monkeypatch.setenv("FLASHTILE_PLANS", "0")
    q, k, v, kc, vc, table, seqlens = _case(batch=4, sq=4, new=4, heads=(32, 8), d=128, capacity=2000,
                                             seqlens=(0, 1, 1333, 1990), dtype=torch.bfloat16, page=page)
    q, k, v, kc, vc, table, seqlens = _cuda(q, k, v, kc, vc, table, seqlens)
    _run_and_check(q, k, v, kc, vc, seqlens, table=table, causal=True, num_splits=num_splits)


@pytest.mark.parametrize("d", [64, 256])
@pytest.mark.parametrize("sq", [1, 7])
def test_head_dims_rotary_windows(d, sq):
    q, k, v, kc, vc, _, seqlens = _case(batch=3, sq=sq, new=sq, heads=(16, 4), d=d, capacity=1000,
                                         seqlens=(10, 500, 990), dtype=torch.bfloat16)
    pos = torch.arange(1000, dtype=torch.float64)[:, None] * 10000 ** (-torch.arange(d // 4) / (d // 4))[None, :]
    rotary = [t.float().cuda() for t in (torch.cos(pos), torch.sin(pos))]
    q, k, v, kc, vc, seqlens = _cuda(q, k, v, kc, vc, seqlens)
    _run_and_check(q, k, v, kc, vc, seqlens, rotary=rotary, window=(300, 0), softcap=5.0,
                   leftpad=torch.tensor([0, 100, 7], dtype=torch.int32, device="cuda"))


def test_bad_device_metadata_writes_nothing():
    """CUDA metadata is checked on the device (no synchronisation): a bad value leaves the
    cache bitwise unchanged and makes the output NaN."""
    q, k, v, kc, vc, table, seqlens = _cuda(*_case(page=16, capacity=40, dtype=torch.float16))
    before = kc.clone(), vc.clone()
    bad = seqlens.clone()
    bad[1] = _capacity(kc, table)  # 3 pages of 16: 48 keys, no room for the new one
    out = flashtile.flash_attn_with_kvcache(q, kc, vc, k, v, cache_seqlens=bad, block_table=table)
    assert out.isnan().all() and torch.equal(kc, before[0]) and torch.equal(vc, before[1])
    out = flashtile.flash_attn_with_kvcache(q, kc, vc, k, v, cache_seqlens=seqlens, block_table=table)
    assert not out.isnan().any() and not torch.equal(kc, before[0])


def test_compiled_decode_step():
    B, S, H, Hk, D = 2, 256, 8, 2, 64
    kc = torch.randn(B, S, Hk, D, device="cuda", dtype=torch.bfloat16)
    vc = torch.randn_like(kc)
    q = torch.randn(B, 1, H, D, device="cuda", dtype=torch.bfloat16)
    k, v = (torch.randn(B, 1, Hk, D, device="cuda", dtype=torch.bfloat16) for _ in range(2))
    seqlens = torch.tensor([3, 200], dtype=torch.int32, device="cuda")

    def step(q, kc, vc, k, v, seqlens):
        return flashtile.flash_attn_with_kvcache(q, kc, vc, k, v, cache_seqlens=seqlens, causal=True) * 2

    kc2, vc2 = kc.clone(), vc.clone()
    want = step(q, kc2, vc2, k, v, seqlens)
    got = torch.compile(step, fullgraph=True)(q, kc, vc, k, v, seqlens)
    assert torch.equal(got, want) and torch.equal(kc, kc2) and torch.equal(vc, vc2)


def test_decode_loop_matches_prefill():
    g = torch.Generator(device="cuda").manual_seed(0)
    B, S, H, Hk, D, steps = 2, 200, 8, 2, 128, 64
    q, k, v = (torch.randn(B, S, h, D, device="cuda", dtype=torch.bfloat16, generator=g) for h in (H, Hk, Hk))
    full = flashtile.flash_attn_func(q, k, v, causal=True)
    prefill = S - steps
    kc = torch.zeros(B, S, Hk, D, device="cuda", dtype=torch.bfloat16)
    vc = torch.zeros_like(kc)
    seqlens = torch.zeros(B, dtype=torch.int32, device="cuda")
    out = flashtile.flash_attn_with_kvcache(q[:, :prefill], kc, vc, k[:, :prefill], v[:, :prefill],
                                            cache_seqlens=seqlens, causal=True)
    outs = [out]
    seqlens += prefill
    for t in range(prefill, S):
        outs.append(flashtile.flash_attn_with_kvcache(q[:, t:t + 1], kc, vc, k[:, t:t + 1], v[:, t:t + 1],
                                                      cache_seqlens=seqlens, causal=True))
        seqlens += 1
    torch.testing.assert_close(torch.cat(outs, 1), full, atol=2e-2, rtol=2e-2)
    assert torch.equal(kc, k) and torch.equal(vc, v)


def test_cuda_graph_decode_step(monkeypatch):
    B, S, H, Hk, D = 4, 512, 16, 4, 128
    kc = torch.randn(B, S, Hk, D, device="cuda", dtype=torch.bfloat16)
    vc = torch.randn_like(kc)
    q = torch.randn(B, 1, H, D, device="cuda", dtype=torch.bfloat16)
    k, v = (torch.randn(B, 1, Hk, D, device="cuda", dtype=torch.bfloat16) for _ in range(2))
    seqlens = torch.tensor([0, 100, 300, 500], dtype=torch.int32, device="cuda")

    def step():
        return flashtile.flash_attn_with_kvcache(q, kc, vc, k, v, cache_seqlens=seqlens, causal=True)

    graph, static = _capture(step, times=3)
    for _ in range(3):
        seqlens += 1
        graph.replay()
        torch.cuda.synchronize()
        kc2, vc2 = kc.clone(), vc.clone()
        ref = _as_captured(monkeypatch, lambda: flashtile.flash_attn_with_kvcache(
            q, kc2.clone(), vc2.clone(), k, v, cache_seqlens=seqlens, causal=True))
        assert torch.equal(static, ref)
        eager = flashtile.flash_attn_with_kvcache(q, kc2, vc2, k, v, cache_seqlens=seqlens, causal=True)
        torch.testing.assert_close(eager, ref)  # fused eagerly: bf16's tolerance


@pytest.mark.parametrize("window, sq", [((-1, 2**31 - 1), 1), ((2**31 - 1, -1), 7), ((2**31 - 1, 2**31 - 1), 3)])
@pytest.mark.parametrize("num_splits", [0, 1])
def test_huge_window_sides_hide_nothing(window, sq, num_splits):
    """Issue 40: a window side of 2**31 - 1 once overflowed the decode kernel's int32 bounds
    and hid every key (out 0, lse -inf); it is unbounded, as flash-attn trims it."""
    q, k, v, kc, vc, _, seqlens = _case(batch=3, sq=sq, new=sq, heads=(16, 4), d=128, capacity=700,
                                         seqlens=(0, 5, 690), dtype=torch.bfloat16)
    q, k, v, kc, vc, seqlens = _cuda(q, k, v, kc, vc, seqlens)
    out = _run_and_check(q, k, v, kc, vc, seqlens, window=window, num_splits=num_splits)
    assert torch.isfinite(out).all()


@pytest.mark.parametrize("page", [0, 16, 256])
@pytest.mark.parametrize("sq", [1, 4])
@pytest.mark.parametrize("num_splits", [0, 1, 7])
def test_fused_append_is_the_separate_append_bitwise(monkeypatch, page, sq, num_splits):
    """The decode kernel's own append (FLASHTILE_DECODE_APPEND=fused, the default: each
    program writes its split's new keys, a CTA barrier, then reads them back) against the
    append kernel first: out, lse and the caches bit for bit on the GPU, where the barrier
    is real (the interpreter runs a program's threads as one)."""
    q, k, v, kc, vc, table, seqlens = _cuda(*_case(batch=4, sq=sq, new=sq, heads=(32, 8), d=128, capacity=600,
                                                  seqlens=(0, 63, 333, 590), dtype=torch.bfloat16, page=page))
    kw = dict(cache_seqlens=seqlens, block_table=table, causal=True, num_splits=num_splits, return_softmax_lse=True)
    got = {}
    for mode in ("separate", "fused"):
        monkeypatch.setenv("FLASHTILE_DECODE_APPEND", mode)
        caches = kc.clone(), vc.clone()
        got[mode] = (*flashtile.flash_attn_with_kvcache(q, *caches, k, v, **kw), *caches)
    for a, b in zip(got["separate"], got["fused"]):
        assert torch.equal(a, b)


@pytest.mark.parametrize("page", [0, 16])
@pytest.mark.parametrize("batch", [1, 4, 64])
def test_fused_combine_matches_the_combine_kernel(monkeypatch, page, batch):
    """FLASHTILE_DECODE_COMBINE=fused on the GPU, where the splits' programs really run at
    once: the last to arrive at its group's counter merges the others' partials (a CTA
    barrier, one gpu-scope acq_rel atomic, L2 loads). 30 steps, each with new queries
    against the combine kernel on the same step: the partials' scratch comes back at the
    same address every step, so a winner that read a stale partial would read the previous
    step's, which differ; the stream's counters are left at 0."""
    from flashtile.runtime import replay as plan

    q, k, v, kc, vc, table, sl = _generation_case(batch, page)
    kw = dict(cache_seqlens=sl, block_table=table, causal=True, return_softmax_lse=True)
    for step in range(30):
        q = torch.randn_like(q)
        monkeypatch.setenv("FLASHTILE_DECODE_COMBINE", "separate")
        want, want_lse = flashtile.flash_attn_with_kvcache(q, kc.clone(), vc.clone(), k, v, **kw)
        monkeypatch.setenv("FLASHTILE_DECODE_COMBINE", "fused")
        out, lse = flashtile.flash_attn_with_kvcache(q, kc.clone(), vc.clone(), k, v, **kw)
        assert (out.float() - want.float()).abs().max() <= 1e-2 * want.float().abs().max(), step
        torch.testing.assert_close(lse, want_lse, atol=1e-4, rtol=1e-5)
    torch.cuda.synchronize()
    assert all(int(c.abs().sum()) == 0 for c in plan._COUNTERS.values())


@pytest.mark.parametrize("combine", ["separate", "fused"])
@pytest.mark.parametrize("page", [0, 16])
@pytest.mark.parametrize("batch", [1, 4, 64])
def test_fused_check_matches_the_check_kernel(monkeypatch, page, batch, combine):
    """FLASHTILE_DECODE_CHECK=fused on the GPU, where the decode kernel's programs run at once
    and in no promised order: the first to take a ticket checks the metadata, the others
    wait for its verdict before their first write. 30 generation steps (each appends one
    token) bitwise equal to the check kernel's, in a CUDA graph too; then a bad length (the
    last sequence past its cache) on the same graph: every out and lse NaN, the caches
    untouched; the stream's counters left at 0 (a wait that never ended would hang here:
    the run's timeout names it)."""
    from flashtile.runtime import replay as plan

    q, k, v, kc, vc, table, sl = _generation_case(batch, page)
    monkeypatch.setenv("FLASHTILE_DECODE_COMBINE", combine)
    kw = dict(block_table=table, causal=True, return_softmax_lse=True)
    caches = {mode: (kc.clone(), vc.clone()) for mode in ("separate", "fused")}
    for step, (q, k, v), got in _steps_by_check(monkeypatch, (q, k, v), caches, sl, kw, 30):
        assert torch.equal(got["separate"][0], got["fused"][0]) and torch.equal(got["separate"][1], got["fused"][1])
        assert all(torch.equal(a, b) for a, b in zip(caches["separate"], caches["fused"])), step
    torch.cuda.synchronize()
    assert all(int(c.abs().sum()) == 0 for c in plan._COUNTERS.values())
    monkeypatch.setenv("FLASHTILE_DECODE_CHECK", "fused")
    lens = sl.clone()
    graph, (out, lse) = _capture(lambda: flashtile.flash_attn_with_kvcache(q, *caches["fused"], k, v,
                                                                         cache_seqlens=lens, **kw))
    for _ in range(3):
        want = flashtile.flash_attn_with_kvcache(q, *(c.clone() for c in caches["fused"]), k, v, cache_seqlens=lens,
                                                 **kw)
        graph.replay()
        torch.cuda.synchronize()
        assert torch.equal(out, want[0]) and torch.equal(lse, want[1])
    _replay_a_bad_length(graph, out, lse, lens, caches["fused"], _capacity(kc, table))
    assert all(int(c.abs().sum()) == 0 for c in plan._COUNTERS.values())


@pytest.mark.parametrize("page", [0, 16])
def test_padding_sequences_on_the_device_check(monkeypatch, page):
    """padding_sequences=True with CUDA metadata (checked on the device, as under CUDA
    graphs in transformers' continuous batching): rows of cache_seqlens -1 and block_table
    rows of -1 write and read nothing and give 0 / -inf; the real rows are the call without
    them, caches included (bf16, the kernels' own paths)."""
    q, k, v, kc, vc, table, seqlens = _cuda(*_case(batch=6, sq=1, new=1, heads=(32, 8), d=128, capacity=4096,
                                                  seqlens=(7, 0, 3000, 0, 4095 - 1, 0), dtype=torch.bfloat16,
                                                  page=page))
    real, fake = torch.tensor([0, 2, 4], device="cuda"), torch.tensor([1, 3, 5], device="cuda")
    padded = seqlens.clone()
    padded[fake] = -1
    if table is not None:
        table = table.clone()
        table[fake] = -1
    caches, ref = (kc.clone(), vc.clone()), (kc.clone(), vc.clone())
    kw = dict(causal=True, num_splits=3, return_softmax_lse=True)
    with monkeypatch.context() as m:  # both calls on one path: the one a captured step takes
        m.setenv("FLASHTILE_DECODE_CHECK", "spread")
        m.setenv("FLASHTILE_DECODE_COMBINE", "separate")
        out, lse = flashtile.flash_attn_with_kvcache(q, *caches, k, v, cache_seqlens=padded, block_table=table,
                                                     padding_sequences=True, **kw)
        sub = dict(block_table=table[real]) if table is not None else dict(cache_batch_idx=real.to(torch.int32))
        want, want_lse = flashtile.flash_attn_with_kvcache(q[real], *ref, k[real], v[real],
                                                           cache_seqlens=seqlens[real], **sub, **kw)
    torch.testing.assert_close(out[real], want)  # bf16's tolerance: the same sums, maybe another addressing
    torch.testing.assert_close(lse[real], want_lse, atol=1e-5, rtol=1e-5)
    assert torch.equal(out[fake], torch.zeros_like(out[fake])) and torch.isneginf(lse[fake]).all()
    assert torch.equal(caches[0], ref[0]) and torch.equal(caches[1], ref[1])


def test_padded_decode_step_in_a_cuda_graph(monkeypatch):
    """The padded decode step transformers' continuous batching captures: cache_seqlens -1
    rows and block_table rows of -1, metadata updated in place between replays, the fused
    append; each replay is bitwise the eager call on the same values with the captured
    launches (``_as_captured``)."""
    q, k, v, kc, vc, table, seqlens = _cuda(*_case(batch=4, sq=1, new=1, heads=(32, 8), d=128, capacity=2048,
                                                  seqlens=(5, 0, 700, 0), dtype=torch.bfloat16, page=16))
    lens = seqlens.clone()
    lens[[1, 3]] = -1
    tab = table.clone()
    tab[[1, 3]] = -1
    kw = dict(cache_seqlens=lens, block_table=tab, causal=True, padding_sequences=True, return_softmax_lse=True)
    caches = kc.clone(), vc.clone()
    graph, (out, lse) = _capture(lambda: flashtile.flash_attn_with_kvcache(q, *caches, k, v, **kw),
                                 lambda: flashtile.flash_attn_with_kvcache(q, kc.clone(), vc.clone(), k, v, **kw),
                                 times=2)
    for step in range(3):
        lens.copy_(torch.tensor([6 + step, -1, 701 + step, -1], dtype=torch.int32))
        before = caches[0].clone(), caches[1].clone()
        graph.replay()
        torch.cuda.synchronize()
        ref = before[0].clone(), before[1].clone()
        want, want_lse = _as_captured(monkeypatch, lambda: flashtile.flash_attn_with_kvcache(q, *ref, k, v, **kw))
        assert torch.equal(out, want) and torch.equal(lse, want_lse), step
        assert torch.equal(caches[0], ref[0]) and torch.equal(caches[1], ref[1]), step
        assert torch.equal(out[[1, 3]], torch.zeros_like(out[[1, 3]]))


def test_padded_varlen_in_a_cuda_graph():
    """Varlen with tokens past cu_seqlens[-1] (padding_sequences) captured and replayed with
    cu_seqlens changed in place: the padding rows give 0, the real rows the eager call's."""
    g = torch.Generator().manual_seed(3)
    q, k, v = (torch.randn(512, 8, 64, generator=g).to("cuda", torch.bfloat16) for _ in range(3))
    cu = torch.tensor([0, 100, 400], dtype=torch.int32, device="cuda")
    kw = dict(causal=True, padding_sequences=True)
    graph, out = _capture(lambda: flashtile.flash_attn_varlen_func(q, k, v, cu, cu, 400, 400, **kw), times=2)
    for ends in ((0, 100, 400), (0, 250, 300), (0, 0, 512)):
        cu.copy_(torch.tensor(ends, dtype=torch.int32))
        graph.replay()
        torch.cuda.synchronize()
        want = flashtile.flash_attn_varlen_func(q, k, v, cu.clone(), cu.clone(), 512, 512, **kw)
        assert torch.equal(out, want), ends
        assert torch.equal(out[ends[-1]:], torch.zeros_like(out[ends[-1]:]))


@pytest.mark.parametrize("check", ["separate", "spread"])
@pytest.mark.parametrize("page", [0, 16])
def test_pdl_matches_plain_launches(monkeypatch, page, check):
    """FLASHTILE_PDL=on: the check, decode and combine kernels of a step (the separate
    kernels, so that both PDL launches happen; or the spread check's decode and finish
    kernels, where the next step's decode kernel reads what this step's finish kernel
    appended) give bitwise the plain launches' results, eagerly over steps whose lengths a
    torch kernel writes just before each step (the decode kernel must wait for it:
    griddepcontrol.wait before its first read), and in a CUDA graph replayed with new
    lengths."""
    monkeypatch.setenv("FLASHTILE_DECODE_COMBINE", "separate")
    monkeypatch.setenv("FLASHTILE_DECODE_CHECK", check)
    q, k, v, kc, vc, table, seqlens = _cuda(*_case(batch=4, sq=1, new=1, heads=(32, 8), d=128, capacity=2048,
                                                  seqlens=(5, 0, 700, 1500), dtype=torch.bfloat16, page=page))
    kw = dict(block_table=table, causal=True, num_splits=8, return_softmax_lse=True)

    def steps(pdl):
        monkeypatch.setenv("FLASHTILE_PDL", pdl)
        caches, lens, outs = (kc.clone(), vc.clone()), seqlens.clone(), []
        for _ in range(4):
            lens.add_(7)
            outs += flashtile.flash_attn_with_kvcache(q, *caches, k, v, cache_seqlens=lens, **kw)
        return outs + list(caches)

    want = steps("off")
    assert all(torch.equal(a, b) for a, b in zip(steps("on"), want))
    lens, caches = seqlens.clone(), (kc.clone(), vc.clone())
    graph, (out, lse) = _capture(
        lambda: flashtile.flash_attn_with_kvcache(q, *caches, k, v, cache_seqlens=lens, **kw),
        lambda: flashtile.flash_attn_with_kvcache(q, kc.clone(), vc.clone(), k, v, cache_seqlens=lens, **kw))
    for step in range(3):
        lens.copy_(seqlens + 11 * (step + 1))
        before = caches[0].clone(), caches[1].clone()
        graph.replay()
        torch.cuda.synchronize()
        monkeypatch.setenv("FLASHTILE_PDL", "off")
        ref = before[0].clone(), before[1].clone()
        want_out, want_lse = flashtile.flash_attn_with_kvcache(q, *ref, k, v, cache_seqlens=lens, **kw)
        monkeypatch.setenv("FLASHTILE_PDL", "on")
        assert torch.equal(out, want_out) and torch.equal(lse, want_lse), step
        assert torch.equal(caches[0], ref[0]) and torch.equal(caches[1], ref[1]), step


@pytest.mark.parametrize("page", [0, 16])
@pytest.mark.parametrize("batch", [1, 4, 8])
def test_spread_check_matches_the_check_kernel(monkeypatch, page, batch):
    """FLASHTILE_DECODE_CHECK=spread on the GPU, where the decode kernel's programs run at
    once: 20 generation steps (each appends one token) give the check kernel's caches
    bitwise and its outputs to bf16 rounding (the new key is read in a key tile of its own,
    so the probabilities round to bf16 against other running maxima: ``test_matrix`` holds
    the spread check to the float64 reference), in a CUDA graph too; a bad length and a bad
    page give the check kernel's status; on the graph a bad length makes every out and lse
    NaN and leaves the caches untouched. Batch 1 appends in programs of its own
    (``decode.finish_appenders``: 40 programs), batch 4 and 8 in the merge programs (batch 16's
    128 programs run unsplit on a row cache, so without the spread check)."""
    q, k, v, kc, vc, table, sl = _generation_case(batch, page)
    monkeypatch.setenv("FLASHTILE_DECODE_COMBINE", "separate")
    kw = dict(block_table=table, causal=True, return_softmax_lse=True)
    caches = {mode: (kc.clone(), vc.clone()) for mode in ("separate", "spread")}
    for step, (q, k, v), got in _steps_by_check(monkeypatch, (q, k, v), caches, sl, kw, 20):
        torch.testing.assert_close(got["spread"][0], got["separate"][0], atol=2e-3, rtol=0.016)
        torch.testing.assert_close(got["spread"][1], got["separate"][1], rtol=1e-5, atol=1e-5)
        assert all(torch.equal(a, b) for a, b in zip(caches["separate"], caches["spread"])), step
    with monkeypatch.context() as m:  # the status, eagerly (plans off: every call runs decode.decode)
        m.setenv("FLASHTILE_PLANS", "0")
        found = _keep_status(m)
        capacity = _capacity(kc, table)
        bad = [dict(cache_seqlens=torch.where(torch.arange(batch, device="cuda") == batch - 1, capacity, sl))]
        if page:
            t = table.clone()
            t[batch // 2, int(sl[batch // 2]) // page] = -3
            bad.append(dict(cache_seqlens=sl, block_table=t))
        for args in bad:
            statuses = []
            for mode in ("separate", "spread"):
                m.setenv("FLASHTILE_DECODE_CHECK", mode)
                flashtile.flash_attn_with_kvcache(q, kc.clone(), vc.clone(), k, v, **{**kw, **args})
                statuses.append(tuple(found[-1].tolist()))
            assert statuses[0] == statuses[1] and statuses[0][0] != 0, statuses
        assert found.spread == len(bad)
    monkeypatch.setenv("FLASHTILE_DECODE_CHECK", "spread")
    lens = sl.clone()
    graph, (out, lse) = _capture(lambda: flashtile.flash_attn_with_kvcache(q, *caches["spread"], k, v,
                                                                         cache_seqlens=lens, **kw))
    for _ in range(3):
        lens += 1
        ref = [c.clone() for c in caches["spread"]]
        want = flashtile.flash_attn_with_kvcache(q, *ref, k, v, cache_seqlens=lens, **kw)
        graph.replay()
        torch.cuda.synchronize()
        assert torch.equal(out, want[0]) and torch.equal(lse, want[1])
        assert all(torch.equal(a, b) for a, b in zip(caches["spread"], ref))
    _replay_a_bad_length(graph, out, lse, lens, caches["spread"], _capacity(kc, table))


def test_auto_keeps_the_kernels_under_capture(monkeypatch):
    """``decode.fuse_step`` on the GPU, with CUDA's own capture query: an eager step this
    small is one launch (the combine and the check folded into the decode kernel); the same
    step captured in a CUDA graph launches the decode kernel with the spread check and the
    kernel that merges and appends after it (plans off: every call runs the Python
    launchers, which the spy counts)."""
    counts = _spy_launches(monkeypatch)
    q, k, v, kc, vc, _, seqlens = _cuda(*_case(batch=2, sq=1, new=1, heads=(32, 8), d=128, capacity=2048,
                                               seqlens=(5, 1000), dtype=torch.bfloat16))
    kw = dict(cache_seqlens=seqlens, num_splits=4)
    flashtile.flash_attn_with_kvcache(q, kc, vc, k, v, **kw)
    assert counts == {"_launch_decode": 1}, counts
    _as_captured(monkeypatch, lambda: flashtile.flash_attn_with_kvcache(q, kc, vc, k, v, **kw))  # compile first
    torch.cuda.synchronize()
    counts.clear()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        flashtile.flash_attn_with_kvcache(q, kc, vc, k, v, **kw)
    assert counts == {"_launch_decode": 1, "_launch_finish": 1}, counts


def test_wave_per_sm_on_this_gpu():
    """The split rule's DRAM bandwidth (``runtime.device.dram_gbps``, from the driver) is a real
    figure on this card, and the one wave of long splits holds two programs per SM on an H200,
    one on an H100 SXM (``decode.WAVE_GBPS_PER_SM``)."""
    from flashtile.backends.triton import decode
    from flashtile.runtime.device import dram_gbps

    index = torch.cuda.current_device()
    gbps, name = dram_gbps(index), torch.cuda.get_device_name(index)
    assert 500 < gbps < 20000, (name, gbps)
    if name == "NVIDIA H200":
        assert decode.wave_per_sm(torch.device("cuda", index)) == 2, (name, gbps)
    if name == "NVIDIA H100 80GB HBM3":
        assert decode.wave_per_sm(torch.device("cuda", index)) == 1, (name, gbps)


@pytest.mark.parametrize("batch, page", [(1, 0), (4, 0), (4, 256)])
def test_one_wave_of_long_splits(batch, page):
    """A long cache at small batch (GQA 32/8, d128, 32k keys) takes the one-wave split count,
    ``wave_per_sm`` programs per SM (16 splits at batch 1 on an H100; 33 on an H200, which
    become 32 once each split is a whole number of key tiles: run 240), and matches the
    float64 reference."""
    import triton

    from flashtile.backends.triton import decode

    capacity = 32768
    seqlens = tuple(capacity - 1 - 997 * i for i in range(batch))
    q, k, v, kc, vc, table, seqlens = _cuda(*_case(batch=batch, sq=1, new=1, heads=(32, 8), d=128,
                                                   capacity=capacity, seqlens=seqlens, dtype=torch.bfloat16,
                                                   page=page))
    splits, size = decode.split_plan(q, kc, table, 0)
    sms = torch.cuda.get_device_properties(q.device).multi_processor_count
    one_wave = decode.wave_per_sm(q.device) * sms // (batch * 8)
    block_n = decode.block_sizes(128, 4)[1]
    assert decode.choose_splits(0, batch * 8, capacity, block_n, q.device, page=page) == one_wave
    assert size == decode.split_keys(capacity, one_wave, block_n), (splits, size)
    assert splits == triton.cdiv(capacity, size), (splits, size)
    _run_and_check(q, k, v, kc, vc, seqlens, table=table, causal=True)

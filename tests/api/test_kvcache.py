"""flash_attn_with_kvcache on CPU (the torch twin, and the Triton kernels under
TRITON_INTERPRET=1) against a float64 reference written from the definition: rotate,
append, attend. Also the cache after the call, bad calls that must leave it untouched,
and flash_attn_combine."""

from __future__ import annotations

import math

import pytest
import torch
from hypothesis import example, given, settings, strategies as st

import flashtile
from flashtile.testing import assert_close, plain_attention


pytestmark = pytest.mark.usefixtures("poison_outputs")


def _rotate(x, cos, sin, positions, interleaved):
    """Rotary embedding in float64, written from its definition (pairs rotate by angle)."""
    x = x.double().clone()
    half = cos.shape[1]
    for b in range(x.shape[0]):
        for s in range(x.shape[1]):
            c, sn = cos[positions[b][s]].double(), sin[positions[b][s]].double()
            for j in range(half):
                i1, i2 = (2 * j, 2 * j + 1) if interleaved else (j, j + half)
                a, bb = x[b, s, :, i1].clone(), x[b, s, :, i2].clone()
                x[b, s, :, i1] = a * c[j] - bb * sn[j]
                x[b, s, :, i2] = a * sn[j] + bb * c[j]
    return x


def _reference(q, k_cache, v_cache, k, v, seqlens, *, rotary=None, interleaved=True, batch_idx=None,
               leftpad=None, table=None, causal=False, window=(-1, -1), softcap=0.0, alibi=None, sink=None,
               chunk=0, dtype=torch.float64):
    """(out (batch, Sq, H, D), lse (batch, H, Sq), the caches afterwards as float64)."""
    batch, sq, nheads, d = q.shape
    kc, vc = k_cache.double().clone(), v_cache.double().clone()
    new = 0 if k is None else k.shape[1]
    pads = [0] * batch if leftpad is None else leftpad.tolist()
    # flash-attn rotates q at its own positions when causal or windowed, after trimming a
    # window side of at least the cache's capacity to -1 (no window)
    capacity = k_cache.shape[1] * (1 if table is None else table.shape[1])
    local = causal or any(0 <= side < capacity for side in window)
    # rotary positions are cache indices (leftpad included), as flash-attn's kernel uses them
    q_pos = [[n + (i if local else 0) for i in range(sq)] for n in seqlens]
    k_pos = [[n + i for i in range(new)] for n in seqlens]
    qd = q.double()
    if rotary is not None:
        qd = _rotate(q, *rotary, q_pos, interleaved)
        if k is not None:
            k = _rotate(k, *rotary, k_pos, interleaved)
    outs, lses = [], []
    left, right = window
    if causal:
        right = 0
    for b in range(batch):
        n = seqlens[b]
        if table is not None:
            page = k_cache.shape[1]
            slots = [(int(table[b, t // page]), t % page) for t in range(n + new)]
        else:
            row = b if batch_idx is None else int(batch_idx[b])
            slots = [(row, t) for t in range(n + new)]
        for i in range(new):
            kc[slots[n + i]] = k[b, i].double().to(k_cache.dtype).double()
            vc[slots[n + i]] = v[b, i].double().to(v_cache.dtype).double()
        keys = torch.stack([kc[s] for s in slots[pads[b]:]]) if n + new > pads[b] else kc.new_zeros(0, *kc.shape[2:])
        vals = torch.stack([vc[s] for s in slots[pads[b]:]]) if n + new > pads[b] else vc.new_zeros(0, *vc.shape[2:])
        lk = keys.shape[0]
        qb = qd[b].to(q.dtype if dtype != torch.float64 else torch.float64)
        o, lse = plain_attention(qb.transpose(0, 1)[None], keys.transpose(0, 1)[None].to(qb.dtype),
                                 vals.transpose(0, 1)[None].to(qb.dtype), scale=1 / math.sqrt(d),
                                 diag_offset=lk - sq, window_left=left, window_right=right, softcap=softcap,
                                 alibi_slopes=None if alibi is None else alibi[b:b + 1], sink=sink, chunk=chunk,
                                 dtype=dtype)
        outs.append(o[0].transpose(0, 1))
        lses.append(lse[0])
    return torch.stack(outs), torch.stack(lses), kc, vc


def _case(batch=3, sq=1, new=1, heads=(4, 2), d=16, capacity=40, seqlens=(0, 17, 30), dtype=torch.float32, seed=0,
          page=0, extra_blocks=3):
    g = torch.Generator().manual_seed(seed)
    h, hk = heads
    q = torch.randn(batch, sq, h, d, generator=g).to(dtype)
    k = torch.randn(batch, new, hk, d, generator=g).to(dtype) if new else None
    v = torch.randn(batch, new, hk, d, generator=g).to(dtype) if new else None
    table = None
    if page:
        blocks = -(-capacity // page)
        num = batch * blocks + extra_blocks
        k_cache = torch.randn(num, page, hk, d, generator=g).to(dtype)
        v_cache = torch.randn(num, page, hk, d, generator=g).to(dtype)
        table = torch.randperm(num, generator=g)[:batch * blocks].reshape(batch, blocks).to(torch.int32)
    else:
        k_cache = torch.randn(batch, capacity, hk, d, generator=g).to(dtype)
        v_cache = torch.randn(batch, capacity, hk, d, generator=g).to(dtype)
    return q, k, v, k_cache, v_cache, table, torch.tensor(seqlens, dtype=torch.int32)


def _run_and_check(q, k, v, k_cache, v_cache, seqlens, **kw):
    ref_kw = {n: kw[n] for n in ("batch_idx", "leftpad", "table", "causal", "window", "softcap", "alibi",
                                 "interleaved", "sink", "chunk") if n in kw}
    rotary = kw.get("rotary")
    want, want_lse, kc, vc = _reference(q, k_cache, v_cache, k, v, seqlens.tolist(), rotary=rotary, **ref_kw)
    # the low-precision reference rounds the rotated q and k to q's dtype, as the kernels do:
    # its LSE error sets the LSE's tolerance (at fp32 inputs it is ~1e-7)
    base, base_lse, _, _ = _reference(q, k_cache, v_cache, k, v, seqlens.tolist(), rotary=rotary, dtype=q.dtype,
                                      **ref_kw)
    before_k = k_cache.clone()  # v_cache is compared with its reference whole, bit for bit
    out, lse = flashtile.flash_attn_with_kvcache(
        q, k_cache, v_cache, k, v, rotary_cos=None if rotary is None else rotary[0],
        rotary_sin=None if rotary is None else rotary[1], cache_seqlens=seqlens,
        cache_batch_idx=kw.get("batch_idx"), cache_leftpad=kw.get("leftpad"), block_table=kw.get("table"),
        causal=kw.get("causal", False), window_size=kw.get("window", (-1, -1)), softcap=kw.get("softcap", 0.0),
        rotary_interleaved=kw.get("interleaved", True), alibi_slopes=kw.get("alibi"),
        num_splits=kw.get("num_splits", 0), return_softmax_lse=True, learnable_sink=kw.get("sink"),
        attention_chunk=kw.get("chunk", 0))
    assert_close("out", out, want, base)
    assert_close("lse", lse, want_lse, base_lse)
    # the appended rows hold the (rotated) new keys; nothing else changed, bit for bit
    changed = (k_cache != before_k).flatten(2).any(-1)
    torch.testing.assert_close(k_cache.double(), kc, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(v_cache.double(), vc, atol=0, rtol=0)
    untouched = ~((kc != before_k.double()).flatten(2).any(-1))
    assert not (changed & untouched).any()
    return out


@pytest.mark.parametrize("sq", [1, 2, 7])
@pytest.mark.parametrize("causal", [False, True])
def test_decode_append_attend(backend, sq, causal):
    q, k, v, kc, vc, _, seqlens = _case(sq=sq, new=sq)
    _run_and_check(q, k, v, kc, vc, seqlens, causal=causal)


@pytest.mark.slow(seconds=55)
def test_long_prefill_chunk_and_ragged_lengths(backend):
    q, k, v, kc, vc, _, seqlens = _case(batch=2, sq=128, new=128, capacity=300, seqlens=(0, 171), d=16)
    _run_and_check(q, k, v, kc, vc, seqlens, causal=True)


def test_no_append_whole_cache(backend):
    q, _, _, kc, vc, _, _ = _case(new=0, seqlens=(40, 40, 40))
    want, _, _, _ = _reference(q, kc, vc, None, None, [40, 40, 40])
    out = flashtile.flash_attn_with_kvcache(q, kc, vc)  # cache_seqlens None: the whole cache
    assert_close("out", out, want, None)


@pytest.mark.parametrize("page", [1, 16, 64, 256])
def test_paged_cache(backend, page):
    capacity = 300 if page == 256 else 70
    q, k, v, kc, vc, table, seqlens = _case(page=page, capacity=capacity, sq=2, new=2,
                                             seqlens=(0, capacity - 40, capacity - 2))
    _run_and_check(q, k, v, kc, vc, seqlens, table=table, causal=True)


def test_cache_batch_idx_and_leftpad(backend):
    q, k, v, kc, vc, _, seqlens = _case(batch=2, capacity=40, seqlens=(20, 33))
    kc, vc = torch.cat([kc, kc.flip(0)]), torch.cat([vc, vc.flip(0)])  # 4 cache rows for 2 sequences
    _run_and_check(q, k, v, kc, vc, seqlens, batch_idx=torch.tensor([3, 0], dtype=torch.int32))
    q, k, v, kc, vc, _, seqlens = _case(batch=2, capacity=40, seqlens=(20, 33), sq=3, new=3)
    _run_and_check(q, k, v, kc, vc, seqlens, leftpad=torch.tensor([5, 33], dtype=torch.int32), causal=True)


@pytest.mark.parametrize("interleaved", [True, False], ids=["gptj", "neox"])
@pytest.mark.parametrize("causal", [False, True])
def test_rotary(backend, interleaved, causal):
    q, k, v, kc, vc, _, seqlens = _case(sq=3, new=3, d=16, seqlens=(0, 10, 30))
    pos = torch.arange(64, dtype=torch.float64)[:, None] * 10000 ** (-torch.arange(3) / 3)[None, :]
    rotary = (torch.cos(pos).float(), torch.sin(pos).float())  # rotary_dim 6 < headdim 16
    _run_and_check(q, k, v, kc, vc, seqlens, rotary=rotary, interleaved=interleaved, causal=causal,
                   leftpad=torch.tensor([0, 4, 0], dtype=torch.int32))


@pytest.mark.parametrize("page", [0, 16])
@pytest.mark.parametrize("past, local", [(-1, True), (0, False), (None, False)], ids=["below", "at", "huge"])
def test_rotary_window_at_the_capacity_is_no_window(backend, page, past, local):
    """flash-attn's rule: a window side of at least the cache's capacity (its 40 rows, or the
    table's 3 pages x 16 = 48 keys) is trimmed to -1 before it decides where q rotates, so
    window_size=(capacity, -1) rotates every query row at cache_seqlens, as no window does,
    and (capacity - 1, -1) at the rows' own positions."""
    q, k, v, kc, vc, table, seqlens = _case(sq=3, new=3, d=16, seqlens=(0, 10, 30), page=page)
    capacity = kc.shape[1] * (1 if table is None else table.shape[1])  # rows, or pages x page size
    left = 2**31 - 1 if past is None else capacity + past
    pos = torch.arange(64, dtype=torch.float64)[:, None] * 10000 ** (-torch.arange(4) / 4)[None, :]
    rotary = (torch.cos(pos).float(), torch.sin(pos).float())
    kw = dict(rotary=rotary, window=(left, -1)) | (dict(table=table) if page else {})
    out = _run_and_check(q, k, v, kc.clone(), vc.clone(), seqlens, **kw)
    # the same call without a window: equal when q rotates at cache_seqlens, else not
    plain = _run_and_check(q, k, v, kc.clone(), vc.clone(), seqlens, **(kw | dict(window=(-1, -1))))
    assert torch.equal(out, plain) != local


@pytest.mark.parametrize("heads", [(8, 2), (8, 1)], ids=["gqa", "mqa"])
def test_gqa_windows_softcap_alibi(backend, heads):
    q, k, v, kc, vc, _, seqlens = _case(sq=4, new=4, heads=heads, seqlens=(3, 20, 36))
    _run_and_check(q, k, v, kc, vc, seqlens, window=(6, 0), softcap=3.0,
                   alibi=torch.rand(3, heads[0], generator=torch.Generator().manual_seed(2)) * 0.3)


@pytest.mark.parametrize("num_splits", [1, 3, 0])
def test_num_splits_accepted(backend, num_splits):
    q, k, v, kc, vc, _, seqlens = _case()
    _run_and_check(q, k, v, kc, vc, seqlens, causal=True, num_splits=num_splits)


@pytest.mark.parametrize("bad, error, match", [
    (dict(cache_seqlens=torch.tensor([0, 17, 40], dtype=torch.int32)), ValueError, r"cache_seqlens\[2\] \+ seqlen_new"),
    (dict(cache_seqlens=torch.tensor([0, -1, 3], dtype=torch.int32)), ValueError, r"cache_seqlens\[1\] = -1"),
    (dict(cache_seqlens=torch.tensor([0, 17, 30])), TypeError, "cache_seqlens must be int32"),
    (dict(cache_batch_idx=torch.tensor([0, 1, 3], dtype=torch.int32)), ValueError, r"cache_batch_idx\[2\] = 3"),
    (dict(cache_leftpad=torch.tensor([1, 0, 0], dtype=torch.int32)), ValueError, r"cache_leftpad\[0\] = 1"),
    (dict(k=None), ValueError, "k and v must be given together"),
    (dict(rotary_cos=torch.ones(30, 4), rotary_sin=torch.zeros(30, 4)), ValueError, "rotary_cos/rotary_sin hold 30"),
    (dict(rotary_cos=torch.ones(64, 9), rotary_sin=torch.zeros(64, 9)), ValueError, "rotary_dim"),
    (dict(num_splits=-1), ValueError, "num_splits must be >= 0"),
    (dict(v=torch.zeros(3, 1, 2, 16, dtype=torch.float16)), TypeError, "q and v must have the same dtype"),
])
def test_bad_calls_leave_the_cache_untouched(bad, error, match):
    q, k, v, kc, vc, _, seqlens = _case()
    args = dict(k=k, v=v, cache_seqlens=seqlens)
    args.update(bad)
    before = kc.clone(), vc.clone()
    with pytest.raises(error, match=match):
        flashtile.flash_attn_with_kvcache(q, kc, vc, **args)
    assert torch.equal(kc, before[0]) and torch.equal(vc, before[1])


def test_bad_paged_calls_leave_the_cache_untouched():
    q, k, v, kc, vc, table, seqlens = _case(page=16, capacity=40)
    before = kc.clone(), vc.clone()
    bad = table.clone()
    bad[2, 1] = kc.shape[0]
    with pytest.raises(ValueError, match=r"block_table\[2, 1\]"):
        flashtile.flash_attn_with_kvcache(q, kc, vc, k, v, cache_seqlens=seqlens, block_table=bad)
    with pytest.raises(ValueError, match="cannot be combined with a paged cache"):
        flashtile.flash_attn_with_kvcache(q, kc, vc, k, v, cache_seqlens=seqlens, block_table=table,
                                          cache_batch_idx=torch.zeros(3, dtype=torch.int32))
    assert torch.equal(kc, before[0]) and torch.equal(vc, before[1])


def test_combine_equals_the_whole(backend):
    g = torch.Generator().manual_seed(4)
    q, k, v = (torch.randn(2, 5, 4, 16, generator=g) for _ in range(3))
    k, v = (torch.randn(2, 60, 4, 16, generator=g) for _ in range(2))
    out, lse, _ = flashtile.flash_attn_func(q, k, v, return_attn_probs=True)
    parts = [flashtile.flash_attn_func(q, k[:, a:b], v[:, a:b], return_attn_probs=True) for a, b in
             ((0, 7), (7, 7 + 40), (47, 60))]
    got, got_lse = flashtile.flash_attn_combine(torch.stack([p[0] for p in parts]).float(),
                                                torch.stack([p[1] for p in parts]))
    torch.testing.assert_close(got, out, atol=2e-6, rtol=1e-5)
    torch.testing.assert_close(got_lse, lse, atol=2e-6, rtol=1e-6)
    # a row no split saw: 0 and -inf, never NaN
    none_seen, none_lse = flashtile.flash_attn_combine(torch.zeros(2, 1, 1, 1, 4),
                                                       torch.full((2, 1, 1, 1), float("-inf")))
    assert torch.equal(none_seen, torch.zeros_like(none_seen)) and torch.isneginf(none_lse).all()


def _spy_launches(monkeypatch):
    """Count the kv-cache kernels' launches (name -> number); plans off (a replay skips the Python launchers)."""
    from flashtile.backends.triton import decode
    from flashtile.runtime import replay as plan

    monkeypatch.setenv("FLASHTILE_PLANS", "0")
    plan.clear()
    counts = {}
    for name in ("_launch_check", "_launch_append", "_launch_decode", "_launch_combine", "_launch_finish"):
        launcher = getattr(decode, name)

        def spy(*args, _name=name, _orig=launcher._launch, **kw):
            counts[_name] = counts.get(_name, 0) + 1
            return _orig(*args, **kw)

        monkeypatch.setattr(launcher, "_launch", spy)
    return counts


@pytest.mark.parametrize("append", ["fused", "separate"])
@pytest.mark.parametrize("num_splits", [1, 3])  # 0 (choose): FUSED_CASES' paged64-gqa and most other tests
@pytest.mark.parametrize("page", [0, 16, 64], ids=["rows", "page16", "page64"])
@pytest.mark.parametrize("sq", [1, 3])
def test_split_kv(triton_backend, monkeypatch, num_splits, page, sq, append):
    """The split-KV kernel and its combine: ragged lengths over several key tiles, GQA,
    contiguous rows and pages (64: one page per key tile; 16: a page per key); the new keys
    appended by the decode kernel (fused, the default) or by the append kernel first. The
    combine kernel: a step this small would fold it into the decode kernel by default
    (``test_auto_folds_a_small_eager_step``)."""
    monkeypatch.setenv("FLASHTILE_DECODE_APPEND", append)
    monkeypatch.setenv("FLASHTILE_DECODE_COMBINE", "separate")
    counts = _spy_launches(monkeypatch)
    q, k, v, kc, vc, table, seqlens = _case(batch=4, sq=sq, new=sq, heads=(8, 2), d=32, capacity=320,
                                             seqlens=(0, 5, 129, 320 - sq), page=page)
    _run_and_check(q, k, v, kc, vc, seqlens, table=table, causal=True, num_splits=num_splits)
    assert counts["_launch_decode"] == 1 and counts.get("_launch_append", 0) == (append == "separate")
    assert counts.get("_launch_combine", 0) == (num_splits != 1)


FUSED_CASES = {
    # new keys that span several splits (128 new keys, splits of 64 or 128 keys), rows and pages
    "chunk-across-splits": dict(case=dict(batch=2, sq=60, new=60, capacity=320, seqlens=(0, 230), d=16),
                                call=dict(causal=True, num_splits=5)),
    "paged16-splits": dict(case=dict(batch=3, sq=5, new=5, capacity=200, seqlens=(0, 63, 190), page=16),
                           call=dict(causal=True, num_splits=4)),
    "paged64-gqa": dict(case=dict(batch=3, sq=2, new=2, heads=(8, 2), capacity=256, seqlens=(1, 64, 250), page=64),
                        call=dict(causal=True, num_splits=0)),
    "rotary-leftpad": dict(case=dict(sq=3, new=3, d=16, seqlens=(0, 10, 30)),
                           call=dict(rotary=True, interleaved=False, causal=True, leftpad=(0, 4, 0))),
    "batch-idx-window": dict(case=dict(batch=3, sq=1, new=1, capacity=300, seqlens=(20, 33, 280)),
                             call=dict(batch_idx=(2, 0, 1), window=(40, 0), num_splits=5)),
    "new-past-the-queries": dict(case=dict(sq=1, new=6, capacity=80, seqlens=(0, 30, 74)), call=dict()),
}


COMBINE_CASES = {
    # (case, call): GQA with row blocks of several groups (sq 4 x group 4 = 16 rows), pages,
    # windows that leave splits (and rows) empty, sinks, softcap, speculative queries
    "gqa-rows": (dict(batch=3, sq=4, new=4, heads=(8, 2), capacity=320, seqlens=(0, 150, 310)),
                 dict(causal=True, num_splits=5)),
    "paged-window": (dict(batch=3, sq=1, new=1, capacity=256, seqlens=(3, 100, 250), page=16),
                     dict(window=(20, 0), num_splits=8)),
    "sink-softcap": (dict(batch=2, sq=2, new=2, heads=(8, 2), capacity=300, seqlens=(0, 290)),
                     dict(causal=True, softcap=5.0, sink=True, num_splits=4)),
    "mostly-empty": (dict(batch=2, sq=1, new=0, capacity=320, seqlens=(1, 2)), dict(num_splits=5)),
}


@pytest.mark.parametrize("chunk", [0, 1, 2])
@pytest.mark.parametrize("name", list(COMBINE_CASES))
def test_fused_combine_matches_the_combine_kernel(triton_backend, monkeypatch, name, chunk):
    """FLASHTILE_DECODE_COMBINE=fused: no combine launch; the last split of each (sequence,
    kv head, row block) to finish merges the partials, ``chunk`` splits a step (0: the
    default, here one step for every split; 1 and 2: several steps, a partial last one).
    Out and lse agree with the combine kernel's (the same sums in another order) and with
    the reference; its counters (from stream_counter) are left at 0, so a second call with
    them gives the same results."""
    from flashtile.backends.triton import decode

    if chunk:
        monkeypatch.setattr(decode, "combine_chunk", lambda block_m, block_dv: chunk)

    case, call = COMBINE_CASES[name]
    q, k, v, kc, vc, table, seqlens = _case(**case)
    sink = torch.tensor([0.3, -1.0, 2.0, 0.0] * (q.shape[2] // 4)) if call.get("sink") else None
    kw = dict(cache_seqlens=seqlens, block_table=table, causal=call.get("causal", False),
              window_size=call.get("window", (-1, -1)), softcap=call.get("softcap", 0.0),
              num_splits=call["num_splits"], learnable_sink=sink, return_softmax_lse=True)
    assert decode.split_plan(q, kc, table, call["num_splits"])[0] > 1
    counters = torch.full((64,), 0, dtype=torch.int32)
    monkeypatch.setattr(decode, "stream_counter", lambda device, size: counters[:max(size, 1)])
    counts = _spy_launches(monkeypatch)
    got = {}
    for mode in ("separate", "fused", "fused"):
        monkeypatch.setenv("FLASHTILE_DECODE_COMBINE", mode)
        out, lse = flashtile.flash_attn_with_kvcache(q, kc.clone(), vc.clone(), k, v, **kw)
        assert counts.pop("_launch_combine", 0) == (mode == "separate")
        assert torch.equal(counters, torch.zeros_like(counters))  # left at 0 for the next launch
        got.setdefault(mode, []).append((out, lse))
    (want, want_lse), = got["separate"]
    for out, lse in got["fused"]:
        torch.testing.assert_close(out, want, atol=1e-6, rtol=1e-6)
        torch.testing.assert_close(lse, want_lse, atol=1e-6, rtol=1e-6)
    assert torch.equal(got["fused"][0][0], got["fused"][1][0])
    ref_kw = {n: kw[n.replace("window", "window_size")] for n in ("causal", "window", "softcap")}
    _run_and_check(q, k, v, kc.clone(), vc.clone(), seqlens, table=table, num_splits=call["num_splits"],
                   sink=sink, **ref_kw)


def test_fused_combine_skips_a_split_a_row_does_not_see(triton_backend, monkeypatch):
    """Two query rows of one block, split at key 64: the second split's only key (64) is seen
    by row 1, not by row 0 (causal). With inf in that key's value row, row 0's partial of the
    second split is 0 * inf = NaN; both combines leave it out (its LSE is -inf), so row 0 is
    finite and the same either way."""
    g = torch.Generator().manual_seed(3)
    q = torch.randn(1, 2, 1, 16, generator=g)
    kc, vc = torch.randn(1, 128, 1, 16, generator=g), torch.randn(1, 128, 1, 16, generator=g)
    vc[0, 64] = float("inf")
    seqlens = torch.tensor([65], dtype=torch.int32)
    got = {}
    for mode in ("separate", "fused"):
        monkeypatch.setenv("FLASHTILE_DECODE_COMBINE", mode)
        got[mode] = flashtile.flash_attn_with_kvcache(q, kc, vc, cache_seqlens=seqlens, causal=True, num_splits=2,
                                                      return_softmax_lse=True)
    assert torch.isfinite(got["separate"][0][0, 0]).all()
    torch.testing.assert_close(got["fused"][0][0, 0], got["separate"][0][0, 0], atol=1e-6, rtol=1e-6)
    torch.testing.assert_close(got["fused"][1], got["separate"][1], atol=1e-6, rtol=1e-6)


CHECK_CASES = {**COMBINE_CASES,
               "one-split-rows": (dict(batch=3, sq=2, new=2), dict(causal=True, num_splits=1)),
               "one-split-pages": (dict(batch=3, sq=1, new=0, page=8), dict(num_splits=1))}


@pytest.mark.parametrize("combine", ["separate", "fused"])
@pytest.mark.parametrize("name", list(CHECK_CASES))
def test_fused_check_matches_the_check_kernel(triton_backend, monkeypatch, name, combine):
    """FLASHTILE_DECODE_CHECK=fused: metadata checked on the device by the decode kernel
    itself (its first program), no check launch; a good call is bitwise the call with the
    check kernel, the counters are left at 0 (a second call gives the same), and a bad value
    (the last sequence's length past the cache) makes every out and lse NaN with the cache
    untouched, whether the call appends or not."""
    from flashtile.backends.triton import decode

    case, call = CHECK_CASES[name]
    q, k, v, kc, vc, table, seqlens = _case(**case)
    sink = torch.tensor([0.3, -1.0, 2.0, 0.0] * (q.shape[2] // 4)) if call.get("sink") else None
    kw = dict(block_table=table, causal=call.get("causal", False), window_size=call.get("window", (-1, -1)),
              softcap=call.get("softcap", 0.0), num_splits=call["num_splits"], learnable_sink=sink,
              return_softmax_lse=True)
    counters = torch.full((96,), 0, dtype=torch.int32)
    monkeypatch.setattr(decode, "stream_counter", lambda device, size: counters[:max(size, 1)])
    monkeypatch.setenv("FLASHTILE_KVCACHE_CHECK", "device")
    monkeypatch.setenv("FLASHTILE_DECODE_COMBINE", combine)
    counts = _spy_launches(monkeypatch)
    got = {}
    for mode in ("separate", "fused", "fused"):
        monkeypatch.setenv("FLASHTILE_DECODE_CHECK", mode)
        caches = kc.clone(), vc.clone()
        out, lse = flashtile.flash_attn_with_kvcache(q, *caches, k, v, cache_seqlens=seqlens, **kw)
        assert counts.pop("_launch_check", 0) == (mode == "separate")
        assert torch.equal(counters, torch.zeros_like(counters))  # left at 0 for the next launch
        got.setdefault(mode, []).append((out, lse, *caches))
    want = got["separate"][0]
    for result in got["fused"]:
        assert all(torch.equal(a, b) for a, b in zip(result, want))
    bad = seqlens.clone()
    bad[-1] = (table.shape[1] * kc.shape[1] if table is not None else kc.shape[1]) - case.get("new", 1) + 1
    before = kc.clone(), vc.clone()
    out, lse = flashtile.flash_attn_with_kvcache(q, kc, vc, k, v, cache_seqlens=bad, **kw)
    assert counts.pop("_launch_check", 0) == 0
    assert torch.equal(kc, before[0]) and torch.equal(vc, before[1])
    assert out.isnan().all() and lse.isnan().all()
    assert torch.equal(counters, torch.zeros_like(counters))


@pytest.mark.parametrize("page", [0, 16])
def test_auto_folds_a_small_eager_step(triton_backend, monkeypatch, page):
    """FLASHTILE_DECODE_COMBINE and _CHECK ``auto`` (the defaults): an eager step whose cache
    read (``decode.fuse_step``: every cache row or table page, keys and values) is at most
    ``decode.FUSE_BYTES_MAX`` bytes is one launch, the combine and the device check inside
    the decode kernel; a larger read, or a step under CUDA-graph capture (simulated), takes
    the spread check: no check kernel, and the combine's work in ``finish_kernel``. The
    results are the separate kernels' to float32 reassociation. A plan recorded eagerly is
    not replayed under capture: the key holds the capture state."""
    from flashtile.backends.triton import decode
    from flashtile.runtime import replay

    monkeypatch.setenv("FLASHTILE_KVCACHE_CHECK", "device")
    q, k, v, kc, vc, table, seqlens = _case(batch=3, heads=(8, 2), capacity=300, seqlens=(0, 170, 290), page=page)
    rows = 300 if page == 0 else table.shape[1] * page
    read = 3 * rows * 2 * (16 + 16) * 4  # batch x cached rows x kv heads x (d + dv) x 4 bytes
    assert decode.fuse_step(q, kc, vc, table)
    wide = vc.new_empty(*vc.shape[:3], 257)  # past 256 value columns (MLA's 512): never folded
    assert not decode.fuse_step(q, kc, wide, table) and decode.fuse_step(q, kc, wide[..., :256], table)
    monkeypatch.setattr(decode, "FUSE_BYTES_MAX", read - 1)
    assert not decode.fuse_step(q, kc, vc, table)
    monkeypatch.setattr(decode, "FUSE_BYTES_MAX", read)
    counts = _spy_launches(monkeypatch)
    kw = dict(cache_seqlens=seqlens, block_table=table, num_splits=3, return_softmax_lse=True)

    def step(**env):
        with monkeypatch.context() as m:
            for name, value in env.items():
                m.setenv(name, value)
            caches = kc.clone(), vc.clone()
            return (*flashtile.flash_attn_with_kvcache(q, *caches, k, v, **kw), *caches)

    def launches():
        got = {name: counts.pop(name, 0) for name in ("_launch_check", "_launch_combine", "_launch_finish")}
        return got["_launch_check"], got["_launch_combine"], got["_launch_finish"]

    want = step(FLASHTILE_DECODE_COMBINE="separate", FLASHTILE_DECODE_CHECK="separate")
    assert launches() == (1, 1, 0)
    for fold in (True, False):  # at the bound, and one byte below the read
        monkeypatch.setattr(decode, "FUSE_BYTES_MAX", read if fold else read - 1)
        got = step()
        assert launches() == ((0, 0, 0) if fold else (0, 0, 1))
        for a, b in zip(got, want):
            torch.testing.assert_close(a, b, atol=1e-6, rtol=1e-6)
    monkeypatch.setattr(decode, "FUSE_BYTES_MAX", read)
    # plans on: two eager steps record and replay the key's plan (no Python launcher runs);
    # under capture the key differs, so its own recording runs the separate kernels
    monkeypatch.delenv("FLASHTILE_PLANS")
    replay.clear()
    step(), step()
    counts.clear()
    step()
    assert launches() == (0, 0, 0)
    monkeypatch.setattr(replay, "capturing", lambda t: True)
    monkeypatch.setattr(decode, "capturing", lambda t: True)
    got = step()
    assert launches() == (0, 0, 1)
    for a, b in zip(got, want):
        torch.testing.assert_close(a, b, atol=1e-6, rtol=1e-6)
    with monkeypatch.context() as m:  # the separate check under capture: the same kernels' results
        m.setenv("FLASHTILE_DECODE_CHECK", "separate")
        got = step()
        assert launches() == (1, 1, 0)
        assert all(torch.equal(a, b) for a, b in zip(got, want))
    # metadata checked on the host: no plan of the whole call, the kernels' own plan keys on it
    monkeypatch.setenv("FLASHTILE_KVCACHE_CHECK", "host")
    for captured in (False, True):
        monkeypatch.setattr(replay, "capturing", lambda t: captured)
        monkeypatch.setattr(decode, "capturing", lambda t: captured)
        if not captured:
            replay.clear()
            step(), step()
            counts.clear()
        step()
        assert launches() == (0, int(captured), 0)


def test_pdl_only_on_a_hopper_gpu(triton_backend, monkeypatch):
    """FLASHTILE_PDL=on: the decode and combine kernels are launched with Programmatic
    Dependent Launch (the ``launch_pdl`` option and the kernels' PDL constexpr: each waits
    before it touches memory) only for CUDA tensors on sm_90 or later, never under the
    interpreter, which has no inline PTX: there a call is bitwise the call without it."""
    from flashtile.backends.triton import decode
    from flashtile.runtime import stubs

    monkeypatch.setenv("FLASHTILE_DECODE_COMBINE", "separate")
    q, k, v, kc, vc, _, seqlens = _case(batch=2, heads=(8, 2), capacity=300, seqlens=(40, 290))
    kw = dict(cache_seqlens=seqlens, num_splits=3, return_softmax_lse=True)
    want = flashtile.flash_attn_with_kvcache(q, kc.clone(), vc.clone(), k, v, **kw)
    monkeypatch.setenv("FLASHTILE_PDL", "on")
    assert not decode.use_pdl(q)
    got = flashtile.flash_attn_with_kvcache(q, kc.clone(), vc.clone(), k, v, **kw)
    assert all(torch.equal(a, b) for a, b in zip(got, want))
    # the decision, as on a GPU: the switch, the capability, not the interpreter
    with monkeypatch.context() as m:
        m.setattr(decode, "capability_of", lambda t: (9, 0))
        assert not decode.use_pdl(q)  # TRITON_INTERPRET=1
        m.setattr(decode.settings, "interpret", lambda: False)
        assert decode.use_pdl(q)
        m.setenv("FLASHTILE_PDL", "off")
        assert not decode.use_pdl(q)
        m.setenv("FLASHTILE_PDL", "on")
        m.setattr(decode, "capability_of", lambda t: (8, 9))
        assert not decode.use_pdl(q)
    # the launches (stubbed: the interpreter cannot run them) as use_pdl decides
    monkeypatch.setattr(decode, "use_pdl", lambda q: decode.settings.pdl())
    seen = {}
    for name in ("_launch_decode", "_launch_combine"):
        launcher = getattr(decode, name)
        monkeypatch.setattr(launcher, "_launch", lambda grid, args, constexprs, *rest, _n=name, _f=launcher._launch:
                            (seen.setdefault(_n, []).append(dict(constexprs)), _f(grid, args, constexprs, *rest))[1])
    monkeypatch.setenv("FLASHTILE_PLANS", "0")
    for pdl in ("on", "off"):
        monkeypatch.setenv("FLASHTILE_PDL", pdl)
        with stubs.stub_launches():
            flashtile.flash_attn_with_kvcache(q, kc.clone(), vc.clone(), k, v, **kw)
    for name in ("_launch_decode", "_launch_combine"):
        on, off = seen[name]
        assert on["PDL"] is True and on["launch_pdl"] is True, name
        assert off["PDL"] is False and "launch_pdl" not in off, name


def test_fused_combine_keeps_a_failed_check_nan(triton_backend, monkeypatch):
    """A bad value found by the device check: NaN out and lse through the fused combine too,
    and the cache untouched."""
    monkeypatch.setenv("FLASHTILE_DECODE_COMBINE", "fused")
    monkeypatch.setenv("FLASHTILE_KVCACHE_CHECK", "device")
    q, k, v, kc, vc, _, seqlens = _case(capacity=300, seqlens=(0, 170, 290))
    bad = seqlens.clone()
    bad[2] = 300
    before = kc.clone(), vc.clone()
    out, lse = flashtile.flash_attn_with_kvcache(q, kc, vc, k, v, cache_seqlens=bad, num_splits=3,
                                                 return_softmax_lse=True)
    assert torch.equal(kc, before[0]) and torch.equal(vc, before[1])
    assert out.isnan().all() and lse.isnan().all()


@pytest.mark.parametrize("check", ["host", "device"])
@pytest.mark.parametrize("mode", ["default", "separate-append", "separate-combine", "separate-check", "separate"])
@pytest.mark.parametrize("page", [0, 16])
def test_padding_sequences(backend, monkeypatch, page, mode, check):
    """padding_sequences=True (transformers' continuous batching under CUDA graphs pads a
    decode batch with sequences of cache_seqlens -1 and block_table rows of -1): those rows
    write nothing and read nothing, their out is 0 and lse -inf, and the real rows are what
    a call without them gives, the caches included. Without the flag, -1 is an error."""
    if backend == "torch" and (mode != "default" or check == "device"):
        pytest.skip("kernel switches")
    if mode == "separate-append":
        monkeypatch.setenv("FLASHTILE_DECODE_APPEND", "separate")
    # a step this small folds both by default (``decode.fuse_step``); "separate": the check
    # and combine kernels, as a captured step runs them
    if mode in ("separate-combine", "separate"):
        monkeypatch.setenv("FLASHTILE_DECODE_COMBINE", "separate")
    if mode in ("separate-check", "separate"):
        monkeypatch.setenv("FLASHTILE_DECODE_CHECK", "separate")
    monkeypatch.setenv("FLASHTILE_KVCACHE_CHECK", check)
    q, k, v, kc, vc, table, seqlens = _case(batch=5, sq=1, new=1, heads=(8, 2), capacity=160,
                                             seqlens=(7, 0, 100, 0, 159 - 1), page=page)
    real = torch.tensor([0, 2, 4])
    fake = torch.tensor([1, 3])
    padded = seqlens.clone()
    padded[fake] = -1
    if table is not None:
        table = table.clone()
        table[fake] = -1
    kw = dict(causal=True, num_splits=3, return_softmax_lse=True)
    caches = kc.clone(), vc.clone()
    out, lse = flashtile.flash_attn_with_kvcache(q, *caches, k, v, cache_seqlens=padded, block_table=table,
                                                 padding_sequences=True, **kw)
    ref_caches = kc.clone(), vc.clone()
    sub_table = None if table is None else table[real]
    if table is None:  # row b of the cache for sequence b: the subset call names its rows
        kw["cache_batch_idx"] = real.to(torch.int32)
    want, want_lse = flashtile.flash_attn_with_kvcache(q[real], *ref_caches, k[real], v[real],
                                                       cache_seqlens=seqlens[real], block_table=sub_table, **kw)
    torch.testing.assert_close(out[real], want, atol=1e-6, rtol=1e-6)
    torch.testing.assert_close(lse[real], want_lse, atol=1e-6, rtol=1e-6)
    assert torch.equal(out[fake], torch.zeros_like(out[fake]))
    assert torch.isneginf(lse[fake]).all()
    assert torch.equal(caches[0], ref_caches[0]) and torch.equal(caches[1], ref_caches[1])
    if check == "host":
        with pytest.raises(ValueError, match=r"cache_seqlens\[1\] = -1 must be >= 0 \(or pass padding_sequences"):
            flashtile.flash_attn_with_kvcache(q, kc.clone(), vc.clone(), k, v, cache_seqlens=padded,
                                              block_table=table, causal=True)


@pytest.mark.parametrize("check", ["host", "device"])
def test_padding_rows_ignore_their_batch_idx_and_leftpad(backend, monkeypatch, check):
    """A padding row's cache_batch_idx and cache_leftpad are never used: values that would
    be errors in a real row (a row past the cache, a pad past the length) pass, and the
    cache rows they name are untouched."""
    if backend == "torch" and check == "device":
        pytest.skip("the device check runs on the kernels")
    monkeypatch.setenv("FLASHTILE_KVCACHE_CHECK", check)
    q, k, v, kc, vc, _, seqlens = _case(batch=3, sq=2, new=2, capacity=40, seqlens=(5, 0, 30))
    padded = seqlens.clone()
    padded[1] = -1
    caches = kc.clone(), vc.clone()
    out, lse = flashtile.flash_attn_with_kvcache(q, *caches, k, v, cache_seqlens=padded, causal=True,
                                                 cache_batch_idx=torch.tensor([0, 99, 2], dtype=torch.int32),
                                                 cache_leftpad=torch.tensor([1, 999, 0], dtype=torch.int32),
                                                 padding_sequences=True, return_softmax_lse=True)
    assert torch.equal(caches[0][1], kc[1]) and torch.equal(caches[1][1], vc[1])  # row 1: nobody's
    assert torch.equal(out[1], torch.zeros_like(out[1])) and torch.isneginf(lse[1]).all()
    assert not torch.equal(caches[0][2], kc[2])  # row 2 got its keys


def test_a_long_append_takes_the_append_kernel(triton_backend, monkeypatch):
    """More new tokens than decode.FUSED_APPEND_MAX (a prefill chunk through the cache): the
    append kernel runs first even under the fused default."""
    from flashtile.backends.triton import decode

    counts = _spy_launches(monkeypatch)
    new = decode.FUSED_APPEND_MAX + 1
    q, k, v, kc, vc, _, seqlens = _case(batch=2, sq=new, new=new, capacity=160, seqlens=(0, 90))
    _run_and_check(q, k, v, kc, vc, seqlens, causal=True)
    assert counts["_launch_append"] == 1


@pytest.mark.parametrize("name", list(FUSED_CASES))
def test_fused_append_is_the_separate_append_bitwise(triton_backend, monkeypatch, name):
    """FLASHTILE_DECODE_APPEND=fused (the decode kernel writes the new keys of its split,
    then reads them back) against the append kernel first: out, lse and both caches the
    same bit for bit (the same arithmetic), and right against the reference."""
    spec = FUSED_CASES[name]
    q, k, v, kc, vc, table, seqlens = _case(**spec["case"])
    call = dict(spec["call"])
    kw = dict(cache_seqlens=seqlens, block_table=table, causal=call.get("causal", False),
              window_size=call.get("window", (-1, -1)), num_splits=call.get("num_splits", 0),
              rotary_interleaved=call.get("interleaved", True), return_softmax_lse=True)
    if call.get("rotary"):
        pos = torch.arange(kc.shape[1] + 8, dtype=torch.float64)[:, None] * 10000 ** (-torch.arange(4) / 4)[None, :]
        kw.update(rotary_cos=torch.cos(pos).float(), rotary_sin=torch.sin(pos).float())
    if "leftpad" in call:
        kw["cache_leftpad"] = torch.tensor(call["leftpad"], dtype=torch.int32)
    if "batch_idx" in call:
        kw["cache_batch_idx"] = torch.tensor(call["batch_idx"], dtype=torch.int32)
    results = {}
    counts = _spy_launches(monkeypatch)
    for mode in ("separate", "fused"):
        monkeypatch.setenv("FLASHTILE_DECODE_APPEND", mode)
        caches = kc.clone(), vc.clone()
        out, lse = flashtile.flash_attn_with_kvcache(q, *caches, k, v, **kw)
        results[mode] = (out, lse, *caches)
        assert counts.pop("_launch_append", 0) == (mode == "separate")
    for a, b in zip(results["separate"], results["fused"]):
        assert torch.equal(a, b)
    assert not torch.equal(results["fused"][2], kc)  # the keys were appended
    ref_kw = dict(table=table, causal=kw["causal"], window=kw["window_size"], interleaved=kw["rotary_interleaved"])
    if "cache_leftpad" in kw:
        ref_kw["leftpad"] = kw["cache_leftpad"]
    if "cache_batch_idx" in kw:
        ref_kw["batch_idx"] = kw["cache_batch_idx"]
    rotary = (kw["rotary_cos"], kw["rotary_sin"]) if "rotary_cos" in kw else None
    want, want_lse, want_kc, want_vc = _reference(q, kc, vc, k, v, seqlens.tolist(), rotary=rotary, **ref_kw)
    torch.testing.assert_close(results["fused"][0].double(), want, atol=2e-5, rtol=2e-5)
    torch.testing.assert_close(results["fused"][2].double(), want_kc, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(results["fused"][3].double(), want_vc, atol=0, rtol=0)


def _spy_page_slices(monkeypatch, slice_max):
    """decode.PAGE_SLICE_MAX set to ``slice_max`` (plans off); returns the live list of each
    decode launch's PAGE_SLICE."""
    from flashtile.backends.triton import decode

    monkeypatch.setattr(decode, "PAGE_SLICE_MAX", slice_max)
    slices = []
    orig = decode._launch_decode._launch

    def spy(grid, args, constexprs, *rest):
        slices.append(constexprs["PAGE_SLICE"])
        return orig(grid, args, constexprs, *rest)

    monkeypatch.setenv("FLASHTILE_PLANS", "0")
    monkeypatch.setattr(decode._launch_decode, "_launch", spy)
    return slices


@pytest.mark.parametrize("num_splits", [1, 3, 0])
@pytest.mark.parametrize("page", [1, 16, 48])
@pytest.mark.parametrize("slice_max", [512, 0])
def test_paged_table_slice(triton_backend, monkeypatch, page, num_splits, slice_max):
    """decode.PAGE_SLICE_MAX (512 by default): the per-key page gather with each split's table
    entries read once into registers, and (0) the per-key table read that a split spanning
    more pages than that takes; 48-key pages do not divide the 64-key tiles, so a split's
    first tile starts inside a page."""
    slices = _spy_page_slices(monkeypatch, slice_max)
    q, k, v, kc, vc, table, seqlens = _case(batch=4, sq=3, new=3, heads=(8, 2), d=32, capacity=320,
                                             seqlens=(0, 5, 129, 317), page=page)
    _run_and_check(q, k, v, kc, vc, seqlens, table=table, causal=True, num_splits=num_splits)
    assert len(slices) == 1 and (slices[0] >= 16 if slice_max else slices[0] == 0)


@pytest.mark.parametrize("page, slice_max, want", [(16, 16, 16), (16, 15, 0), (48, 8, 16), (48, 7, 0)])
def test_paged_table_slice_spans_exact_pages(triton_backend, monkeypatch, page, slice_max, want):
    """``decode.pages_spanned``, unsplit caches: 256 keys in pages of 16 (which divide the
    64-key tile) are exactly 16 pages, so a slice limit of 16 takes the table slice (the
    extra page once counted for every layout sent such a split to the per-key table read)
    and 15 does not; 288 keys in pages of 48 (not a divisor: a tile may start inside a
    page) read up to cdiv(320, 48) + 1 = 8 pages, within a limit of 8 and past one of 7."""
    slices = _spy_page_slices(monkeypatch, slice_max)
    capacity = 256 if page == 16 else 288
    q, k, v, kc, vc, table, seqlens = _case(batch=2, sq=1, new=1, heads=(4, 2), d=32, capacity=capacity,
                                             seqlens=(200, capacity - 1), page=page)
    _run_and_check(q, k, v, kc, vc, seqlens, table=table, num_splits=1)
    assert slices == [want], slices


@pytest.mark.parametrize("num_splits, check", [(1, "host"), (4, "host"), (4, "spread")])
def test_split_kv_windows_softcap_alibi_rotary(triton_backend, monkeypatch, num_splits, check):
    """Every option with split-KV; with the spread check too (metadata checked on the device:
    the new keys read from k, v in a tile of their own, rotated, then appended by
    ``finish_kernel``)."""
    monkeypatch.setenv("FLASHTILE_DECODE_COMBINE", "separate")  # the combine kernel (not folded: ``auto``)
    if check == "spread":
        monkeypatch.setenv("FLASHTILE_KVCACHE_CHECK", "device")
        monkeypatch.setenv("FLASHTILE_DECODE_CHECK", "spread")
    counts = _spy_launches(monkeypatch)
    q, k, v, kc, vc, _, seqlens = _case(batch=3, sq=5, new=5, heads=(8, 1), d=32, capacity=300,
                                         seqlens=(40, 170, 295))
    pos = torch.arange(300, dtype=torch.float64)[:, None] * 10000 ** (-torch.arange(8) / 8)[None, :]
    _run_and_check(q, k, v, kc, vc, seqlens, window=(70, 3), softcap=2.0, num_splits=num_splits,
                   rotary=(torch.cos(pos).float(), torch.sin(pos).float()), interleaved=False,
                   alibi=torch.rand(3, 8, generator=torch.Generator().manual_seed(3)) * 0.2,
                   leftpad=torch.tensor([0, 9, 100], dtype=torch.int32))
    assert counts.get("_launch_combine", 0) == (num_splits > 1 and check == "host")
    assert counts.get("_launch_finish", 0) == (check == "spread")


@pytest.mark.parametrize("num_splits, page, check", [(1, 0, "host"), (3, 0, "host"), (1, 16, "host"), (3, 16, "host"),
                                                     (3, 16, "spread")])
def test_sinks(backend, monkeypatch, num_splits, page, check):
    """A learnable sink enters once per row: in the decode kernel with one split, in the
    combine with several (a sink added per split would count it num_splits times); in the
    spread check's last kernel too. Large sinks (around log(len_k) and above); an empty cache
    before the append, a window. (The fused combine's sink:
    ``test_fused_combine_matches_the_combine_kernel``.)"""
    if check == "spread" and backend != "triton":
        pytest.skip("the spread check is the Triton kernels'")
    monkeypatch.setenv("FLASHTILE_DECODE_COMBINE", "separate")
    if check == "spread":
        monkeypatch.setenv("FLASHTILE_KVCACHE_CHECK", "device")
        monkeypatch.setenv("FLASHTILE_DECODE_CHECK", "spread")
    counts = _spy_launches(monkeypatch) if backend == "triton" else {}
    q, k, v, kc, vc, table, seqlens = _case(batch=3, sq=2, new=2, heads=(8, 2), d=32, capacity=200,
                                             seqlens=(0, 63, 198), page=page)
    sink = torch.randn(8, generator=torch.Generator().manual_seed(9)) * 2 + 4
    _run_and_check(q, k, v, kc, vc, seqlens, table=table, causal=True, num_splits=num_splits, sink=sink,
                   window=(40, 0))
    if backend == "triton":
        assert counts.get("_launch_combine", 0) == (num_splits > 1 and check == "host")
        assert counts.get("_launch_finish", 0) == (check == "spread")


def test_sink_on_rows_that_see_no_key(backend):
    # the causal query 0 of a 2-query call against a cache of 1 key (no append) sees nothing
    q, _, _, kc, vc, _, seqlens = _case(batch=2, sq=2, new=0, capacity=8, seqlens=(1, 5))
    sink = torch.tensor([0.5, 1.0, -1.0, 2.0])
    out, lse = flashtile.flash_attn_with_kvcache(q, kc, vc, cache_seqlens=seqlens, causal=True,
                                                 return_softmax_lse=True, learnable_sink=sink)
    assert torch.equal(out[0, 0], torch.zeros_like(out[0, 0]))
    assert torch.equal(lse[0, :, 0], sink)
    _run_and_check(q, None, None, kc, vc, seqlens, causal=True, sink=sink)


class _Found(list):
    spread = 0  # decode launches that took the spread check


def _keep_status(monkeypatch) -> list:
    """The status tensors of the decode launches that follow (the device check's verdict,
    read after the launch: the check kernel's, the decode kernel's own or the spread check's
    last kernel's); ``.spread`` counts the launches with the spread check."""
    from flashtile.backends.triton import decode

    found = _Found()
    orig = decode.decode

    def keep(*a, **kw):
        orig(*a, **kw)
        found.append(kw["status"])
        found.spread += kw["slots"] is not None

    monkeypatch.setattr(decode, "decode", keep)
    return found


@pytest.mark.parametrize("bad, status", [
    (dict(cache_seqlens=torch.tensor([0, 17, 40], dtype=torch.int32)), (1, 2, 0, 40)),
    (dict(cache_seqlens=torch.tensor([0, -1, 3], dtype=torch.int32)), (1, 1, 0, -1)),
    (dict(cache_leftpad=torch.tensor([0, 18, 0], dtype=torch.int32)), (2, 1, 0, 18)),
    (dict(cache_batch_idx=torch.tensor([0, 1, 3], dtype=torch.int32)), (3, 2, 0, 3)),
    (dict(rotary_cos=torch.ones(30, 4), rotary_sin=torch.zeros(30, 4)), (5, 2, 0, 31)),
])
@pytest.mark.parametrize("where", ["separate", "fused"])
def test_device_check(triton_backend, monkeypatch, bad, status, where):
    """FLASHTILE_KVCACHE_CHECK=device (what CUDA metadata gets): a bad value found by the
    check kernel (or the decode kernel's own check: FLASHTILE_DECODE_CHECK=fused) leaves the
    cache bitwise unchanged and makes out and lse NaN; a good call is the same as with the
    host's check. (The spread check, which needs a split step: ``test_spread_check``.)"""
    found = _keep_status(monkeypatch)
    monkeypatch.setenv("FLASHTILE_DECODE_CHECK", where)
    monkeypatch.setenv("FLASHTILE_KVCACHE_CHECK", "device")
    monkeypatch.setenv("FLASHTILE_PLANS", "0")  # a replay does not call decode.decode
    q, k, v, kc, vc, _, seqlens = _case()
    args = dict(k=k, v=v, cache_seqlens=seqlens)
    good = flashtile.flash_attn_with_kvcache(q, kc.clone(), vc.clone(), **args)
    assert tuple(found[-1].tolist()) == (0, 0, 0, 0) and not found.spread
    monkeypatch.setenv("FLASHTILE_KVCACHE_CHECK", "host")
    assert torch.equal(good, flashtile.flash_attn_with_kvcache(q, kc.clone(), vc.clone(), **args))
    monkeypatch.setenv("FLASHTILE_KVCACHE_CHECK", "device")
    args.update(bad)
    before = kc.clone(), vc.clone()
    out, lse = flashtile.flash_attn_with_kvcache(q, kc, vc, **args, return_softmax_lse=True)
    assert tuple(found[-1].tolist()) == status
    assert torch.equal(kc, before[0]) and torch.equal(vc, before[1])
    assert out.isnan().all() and lse.isnan().all()
    # the same through a launch plan: recorded on a good call, replayed on the bad one
    monkeypatch.delenv("FLASHTILE_PLANS")
    good_args = dict(k=k, v=v, cache_seqlens=seqlens)
    for t in ("cache_leftpad", "cache_batch_idx", "rotary_cos", "rotary_sin"):
        if t in bad:
            good_args[t] = {"cache_leftpad": torch.zeros(3, dtype=torch.int32),
                            "cache_batch_idx": torch.arange(3, dtype=torch.int32),
                            "rotary_cos": torch.ones(64, 4), "rotary_sin": torch.zeros(64, 4)}[t]
    for _ in range(2):
        flashtile.flash_attn_with_kvcache(q, kc.clone(), vc.clone(), **good_args)
    if "rotary_cos" in bad:
        return  # a shorter table is another key
    out = flashtile.flash_attn_with_kvcache(q, kc, vc, **args)
    assert torch.equal(kc, before[0]) and torch.equal(vc, before[1]) and out.isnan().all()


@pytest.mark.parametrize("check, combine", [("separate", "separate"), ("fused", "separate"), ("fused", "fused"),
                                            ("spread", "separate")])
def test_device_check_with_splits(triton_backend, monkeypatch, check, combine):
    """The device check with split-KV: status and the partial results share one scratch
    allocation (``decode.scratch``); recorded on good calls and replayed on a bad one, the
    cache stays unchanged and out and lse are NaN through the combine. The same with the
    check in the decode kernel, and with the combine there too (one launch a step); and with
    the spread check (each split checks what it reads, the kernel after it appends), equal
    to float32 rounding (it reads the new key in a key tile of its own)."""
    from flashtile.backends.triton import decode

    found = _keep_status(monkeypatch)
    monkeypatch.setenv("FLASHTILE_DECODE_CHECK", check)
    monkeypatch.setenv("FLASHTILE_DECODE_COMBINE", combine)
    monkeypatch.setenv("FLASHTILE_KVCACHE_CHECK", "device")
    q, k, v, kc, vc, _, seqlens = _case(capacity=300, seqlens=(0, 170, 290))
    assert decode.split_plan(q, kc, None, 3)[0] == 3
    args = dict(cache_seqlens=seqlens, num_splits=3, return_softmax_lse=True)
    caches = [(kc.clone(), vc.clone()) for _ in range(4)]
    got = [flashtile.flash_attn_with_kvcache(q, *c, k, v, **args) for c in caches[:3]]
    assert found.spread == (check == "spread")  # the first call; the others replay its plan
    monkeypatch.setenv("FLASHTILE_KVCACHE_CHECK", "host")
    want = flashtile.flash_attn_with_kvcache(q, *caches[3], k, v, **args)
    monkeypatch.setenv("FLASHTILE_KVCACHE_CHECK", "device")
    for (out, lse), c in zip(got, caches):
        assert torch.equal(c[0], caches[3][0]) and torch.equal(c[1], caches[3][1])
        if check == "spread":
            torch.testing.assert_close(out, want[0], rtol=0, atol=1e-6)
            torch.testing.assert_close(lse, want[1], rtol=0, atol=1e-6)
        else:
            assert torch.equal(out, want[0]) and torch.equal(lse, want[1])
    bad = seqlens.clone()
    bad[2] = 300  # no room for the new key
    before = kc.clone(), vc.clone()
    out, lse = flashtile.flash_attn_with_kvcache(q, kc, vc, k, v, **{**args, "cache_seqlens": bad})
    assert torch.equal(kc, before[0]) and torch.equal(vc, before[1])
    assert out.isnan().all() and lse.isnan().all()


@pytest.mark.parametrize("paged", [False, True])
def test_spread_check(triton_backend, monkeypatch, paged):
    """The spread check (FLASHTILE_DECODE_CHECK=spread) reports what the check kernel reports
    (status), for errors in any sequence and split, in every check's order (values before
    pages, earlier sequences first, the lowest page); a bad call leaves the caches untouched
    and out and lse NaN; a good one (padding sequences too) appends what the check kernel's
    step appends. The paged cases append in ``finish_kernel``'s programs of their own (forced:
    ``decode.finish_appenders``), the row caches in its merge programs."""
    from flashtile.backends.triton import decode

    assert decode.finish_appenders(3, 1, 4, 2, 1, torch.device("cpu")) == 0  # 12 + 6 programs past 16 "SMs"
    assert decode.finish_appenders(2, 1, 4, 2, 1, torch.device("cpu")) == 4
    assert decode.finish_appenders(2, 1, 4, 2, 0, torch.device("cpu")) == 0  # nothing to append
    if paged:
        monkeypatch.setattr(decode, "finish_appenders", lambda batch, seqlen, heads, heads_k, new, dev: batch * heads_k)
    found = _keep_status(monkeypatch)
    monkeypatch.setenv("FLASHTILE_KVCACHE_CHECK", "device")
    monkeypatch.setenv("FLASHTILE_DECODE_COMBINE", "separate")
    monkeypatch.setenv("FLASHTILE_PLANS", "0")
    q, k, v, kc, vc, table, seqlens = _case(capacity=300, seqlens=(0, 170, 250), page=16 if paged else 0)
    base = dict(cache_seqlens=seqlens, block_table=table, num_splits=3, return_softmax_lse=True)
    capacity = 304 if paged else 300

    def lens(*n):
        return torch.tensor(n, dtype=torch.int32)

    # (arguments, the status code the check kernel gives: module decode's OK, BAD_SEQLEN, ...)
    cases = [({}, 0), (dict(cache_seqlens=lens(0, 170, capacity)), 1),
             (dict(cache_seqlens=lens(-1, 170, 250), padding_sequences=True), 0),
             (dict(rotary_cos=torch.ones(200, 4), rotary_sin=torch.zeros(200, 4)), 5)]
    if paged:
        def bad_table(*where):
            t = table.clone()
            for b, j, value in where:
                t[b, j] = value
            return t

        cases += [(dict(block_table=bad_table((2, 15, -1), (2, 3, kc.shape[0]))), 4),  # two splits: the lower page
                  (dict(block_table=bad_table((1, 3, -2)), cache_seqlens=lens(0, 170, capacity)), 4),  # earlier first
                  (dict(block_table=bad_table((2, 8, -1)), cache_seqlens=lens(0, capacity, 250)), 1),
                  (dict(block_table=bad_table((1, 11, -1), (0, 1, -1))), 0)]  # past the sequences' pages
    else:
        cases += [(dict(cache_leftpad=lens(0, 171, 0)), 2), (dict(cache_batch_idx=lens(0, 3, -1)), 3)]
    for case, code in cases:
        runs = []
        for check in ("separate", "spread"):
            monkeypatch.setenv("FLASHTILE_DECODE_CHECK", check)
            c = kc.clone(), vc.clone()
            out, lse = flashtile.flash_attn_with_kvcache(q, *c, k, v, **{**base, **case})
            runs.append((tuple(found[-1].tolist()), out, lse, *c))
        (status, out, lse, k1, v1), (status2, out2, lse2, k2, v2) = runs
        assert status2 == status and status[0] == code, (case, status, status2)
        assert torch.equal(k1, k2) and torch.equal(v1, v2)
        if code:
            assert torch.equal(k2, kc) and torch.equal(v2, vc) and out2.isnan().all() and lse2.isnan().all()
        else:
            assert not torch.equal(k2, kc)
            torch.testing.assert_close(out2, out, rtol=0, atol=1e-6)
            torch.testing.assert_close(lse2, lse, rtol=0, atol=1e-6)
    assert found.spread == len(cases)


@pytest.mark.parametrize("where", ["separate", "fused"])
def test_device_check_paged(triton_backend, monkeypatch, where):
    found = _keep_status(monkeypatch)
    monkeypatch.setenv("FLASHTILE_DECODE_CHECK", where)
    monkeypatch.setenv("FLASHTILE_KVCACHE_CHECK", "device")
    monkeypatch.setenv("FLASHTILE_PLANS", "0")
    q, k, v, kc, vc, table, seqlens = _case(page=16, capacity=40)
    bad = table.clone()
    bad[2, 1] = kc.shape[0]
    bad[2, 2] = -1
    bad[0, 2] = -5  # past sequence 0's pages (it holds 1 key): never read, not an error
    before = kc.clone(), vc.clone()
    out = flashtile.flash_attn_with_kvcache(q, kc, vc, k, v, cache_seqlens=seqlens, block_table=bad)
    assert tuple(found[-1].tolist()) == (4, 2, 1, kc.shape[0])
    assert torch.equal(kc, before[0]) and torch.equal(vc, before[1]) and out.isnan().all()



@pytest.mark.parametrize("latent", [False, True])
def test_compiled_decode_step(triton_backend, monkeypatch, latent):
    """A generation step under torch.compile(fullgraph=True) on the kernels (metadata checked
    on the device, as CUDA metadata is): bitwise the eager step, caches included; with
    MLA's latent cache too (v_cache a view of k_cache: under tracing the validation cannot
    read addresses, ``validate._column_view``)."""
    monkeypatch.setenv("FLASHTILE_KVCACHE_CHECK", "device")
    torch._dynamo.reset()
    g = torch.Generator().manual_seed(0)
    B, S, H, Hk, D, Dv = 2, 48, 4, 1, 24, 16
    kc = torch.randn(B, S, Hk, D, generator=g)
    q, k = torch.randn(B, 1, H, D, generator=g), torch.randn(B, 1, Hk, D, generator=g)
    vc, v = (kc[..., :Dv], k[..., :Dv]) if latent else (torch.randn(B, S, Hk, Dv, generator=g),
                                                         torch.randn(B, 1, Hk, Dv, generator=g))
    seqlens = torch.tensor([3, 40], dtype=torch.int32)

    def step(q, kc, vc, k, v, seqlens):
        return flashtile.flash_attn_with_kvcache(q, kc, vc, k, v, cache_seqlens=seqlens, causal=True) * 2

    kc2 = kc.clone()
    vc2 = kc2[..., :Dv] if latent else vc.clone()
    want = step(q, kc2, vc2, k, v, seqlens)
    got = torch.compile(step, fullgraph=True)(q, kc, vc, k, v, seqlens)
    assert torch.equal(got, want) and torch.equal(kc, kc2) and torch.equal(vc, vc2)

def test_repeated_calls_skip_validation(triton_backend, monkeypatch):
    """Metadata checked on the device: a repeated call with one key is validated once and
    then replays one plan of the whole call (one key made per call, the API's), bitwise the
    same as the full path; a changed shape or flag is another key and is validated (bad
    ones still raise)."""
    from flashtile.api import kvcache as api
    from flashtile.problem import validate
    from flashtile.runtime import replay as plan

    monkeypatch.setenv("FLASHTILE_KVCACHE_CHECK", "device")
    calls, keys = [], []
    full, make_key = validate.window, plan.make_key
    monkeypatch.setattr(validate, "window", lambda w: (calls.append(w), full(w))[1])
    monkeypatch.setattr(plan, "make_key", lambda *a: (keys.append(1), make_key(*a))[1])
    q, k, v, kc, vc, table, seqlens = _case(page=16, capacity=40, heads=(4, 2))
    alibi = torch.rand(4)
    args = dict(cache_seqlens=seqlens, block_table=table, causal=True, alibi_slopes=alibi, return_softmax_lse=True)
    api._PLANS.clear()
    outs = [flashtile.flash_attn_with_kvcache(q, kc.clone(), vc.clone(), k, v, **args) for _ in range(4)]
    assert len(calls) == 1
    # the first call: the API's key, and the kernels' refused (None) while the API's plan is
    # recorded; then the API's alone (a replay)
    assert len(keys) == 2 + 1 + 1 + 1
    (entry,) = api._PLANS.entries.values()
    assert [type(p) for p in entry.plans.values()] == [plan.Plan]
    monkeypatch.setenv("FLASHTILE_PLANS", "0")
    kc2 = kc.clone()
    want = flashtile.flash_attn_with_kvcache(q, kc2, vc.clone(), k, v, **args)
    monkeypatch.delenv("FLASHTILE_PLANS")
    for out, lse in outs:
        assert torch.equal(out, want[0]) and torch.equal(lse, want[1])
    with pytest.raises(ValueError, match="window_size"):
        flashtile.flash_attn_with_kvcache(q, kc, vc, k, v, **{**args, "window_size": (-3, 0)})
    with pytest.raises(TypeError, match="v must be float16"):
        flashtile.flash_attn_with_kvcache(q, kc, vc, k, v.double(), **args)


def test_choose_splits():
    """The split heuristic (backends.triton.decode.choose_splits; a CPU device counts 16 SMs): at
    most one program per four SMs with short splits, about 1.5 per SM (a split at most 1024 keys
    and 2 key tiles on rows, 2048 keys and 4 tiles with a page gather); else about one program per
    SM in one wave when fewer than two per SM (rounded down up to one per two SMs, to the nearest
    above), a page gather of at most two programs per SM two per SM (at least the splits its table
    slice needs), about 12 per SM when more, at most one split per 4 key tiles; an explicit count
    capped by tiles."""
    from flashtile.backends.triton.decode import choose_splits

    cpu = torch.device("cpu")
    assert choose_splits(0, 2, 4096, 64, cpu) == 12  # 24 // 2, 342 keys a split
    assert choose_splits(0, 1, 64 * 12, 64, cpu) == 6  # 12 tiles: splits of at least 2
    assert choose_splits(0, 2, 16384, 64, cpu) == 8  # 1366 keys a split: one per SM, 16 // 2
    assert choose_splits(0, 8, 131072, 64, cpu) == 2  # 16 // 8: one per SM
    assert choose_splits(0, 3, 131072, 64, cpu) == 5  # 16 // 3, rounded down: one wave
    assert choose_splits(0, 5, 64 * 8, 64, cpu) == 2  # 16 // 5 = 3, 8 tiles: splits of at least 4
    assert choose_splits(0, 9, 131072, 64, cpu) == 2  # 9 > 16 / 2: 16 / 9 to the nearest
    assert choose_splits(0, 11, 131072, 64, cpu) == 1  # 16 / 11 = 1.45: one wave unsplit
    assert choose_splits(0, 16, 131072, 64, cpu) == 1
    assert choose_splits(0, 31, 131072, 64, cpu) == 1
    assert choose_splits(0, 64, 4096, 64, cpu) == 3  # >= 32 programs: cdiv(192, 64)
    assert choose_splits(0, 400, 4096, 64, cpu) == 1
    # pages of 16 (a gather): 1.5 per SM while splits stay short, else two per SM (run 202)
    assert choose_splits(0, 4, 8192, 64, cpu, page=16) == 6  # 24 // 4, 1366 keys a split
    assert choose_splits(0, 4, 12289, 64, cpu, page=16) == 8  # 2049 keys at 6: 32 // 4
    assert choose_splits(0, 5, 8192, 64, cpu, page=16) == 6  # 5 > 16 / 4: 32 // 5
    assert choose_splits(0, 16, 8192, 64, cpu, page=16) == 2  # 32 // 16
    # ... but never past the table slice: 512 pages of 16 are 8192 keys, 511 of 48 (a page
    # may start inside a tile) 24512
    assert choose_splits(0, 8, 131072, 64, cpu, page=16) == 16  # cdiv(131072, 8192), not 32 // 8
    assert choose_splits(0, 8, 131072, 64, cpu, page=48) == 6  # cdiv(131072, 24512)
    assert choose_splits(0, 40, 8192, 64, cpu, page=16) == 5  # 40 > 2 x 16: cdiv(192, 40)
    assert choose_splits(0, 8, 131072, 64, cpu, page=256) == 2  # whole tiles: the rows' 16 // 8
    assert choose_splits(0, 1, 100, 64, cpu) == 1
    assert choose_splits(500, 1, 640, 64, cpu) == 10  # one per key tile at most
    assert choose_splits(3, 1000, 640, 64, cpu) == 3


def test_choose_splits_two_per_sm(monkeypatch):
    """Where the DRAM feeds more than ``WAVE_GBPS_PER_SM`` per SM (an H200), the one wave of
    long splits holds two programs per SM; the short splits, the page gather and the many-wave
    count do not change, nor does an explicit count."""
    from flashtile.backends.triton import decode

    cpu = torch.device("cpu")
    monkeypatch.setattr(decode, "wave_per_sm", lambda device: 2)
    assert decode.choose_splits(0, 2, 16384, 64, cpu) == 16  # 32 // 2 (one per SM: 8)
    assert decode.choose_splits(0, 8, 131072, 64, cpu) == 4  # 32 // 8 (2)
    assert decode.choose_splits(0, 9, 131072, 64, cpu) == 3  # 32 // 9 (2)
    assert decode.choose_splits(0, 20, 131072, 64, cpu) == 2  # 20 > 32 / 2: 32 / 20 to the nearest (1)
    assert decode.choose_splits(0, 31, 131072, 64, cpu) == 1
    assert decode.choose_splits(0, 8, 131072, 64, cpu, page=256) == 4  # whole tiles: the rows' count
    assert decode.choose_splits(0, 2, 4096, 64, cpu) == 12  # short splits: 1.5 per SM as before
    assert decode.choose_splits(0, 16, 8192, 64, cpu, page=16) == 2  # the gather: two per SM as before
    assert decode.choose_splits(0, 64, 4096, 64, cpu) == 3  # many waves as before
    assert decode.choose_splits(3, 1, 640, 64, cpu) == 3


@pytest.mark.parametrize("per_sm, wave", [(3352.3 / 132, 1), (4800.0 / 132, 2), (30.0, 1), (2039.0 / 114, 1),
                                           (None, 1)])
def test_wave_per_sm(monkeypatch, per_sm, wave):
    """``wave_per_sm`` from the driver's DRAM bandwidth per SM (H100 SXM, H200, a card at
    exactly 30 GB/s per SM, H100 PCIe, a MIG slice: None); a CPU device (the interpreter)
    keeps one."""
    from flashtile.backends.triton import decode

    monkeypatch.setattr(decode, "dram_gbps_per_sm", lambda index: per_sm)
    assert decode.wave_per_sm(torch.device("cuda", 0)) == wave
    assert decode.wave_per_sm(torch.device("cpu")) == 1


def test_dram_gbps_per_sm_refuses_a_mig_slice(monkeypatch):
    """A MIG slice's SM count is its own but its memory clock and bus width are the card's:
    no figure (``runtime.device.dram_gbps_per_sm``), so the split rule keeps one per SM."""
    from flashtile.runtime import device

    monkeypatch.setattr(torch.cuda, "get_device_name", lambda index: "NVIDIA H100 80GB HBM3 MIG 1g.10gb")
    device.dram_gbps_per_sm.cache_clear()
    try:
        assert device.dram_gbps_per_sm(0) is None
    finally:
        device.dram_gbps_per_sm.cache_clear()


@settings(max_examples=300, deadline=None)
@given(programs=st.integers(1, 32), capacity=st.integers(1, 1 << 19),
       page=st.sampled_from([16, 32, 48, 8, 24, 1, 2, 3]))
@example(programs=32, capacity=2 * 512 * 48, page=48)  # two splits of 512 pages of 48 would span 513
def test_gather_splits_fit_the_table_slice(programs, capacity, page):
    """``choose_splits`` with a page gather of at most two programs per SM (16 SMs on a CPU
    device): every split of ``split_plan``'s size reads its pages through a table slice
    (``pages_spanned`` at most ``PAGE_SLICE_MAX``; run 202: B8 x 32k at 3 splits, past it,
    492 us against 357 at 4) unless the count is capped at ``MAX_SPLITS`` (pages of 1-3 on
    long caches). The short splits of batch 1-4 too: pages of 1-3 hold fewer keys a slice
    than their 2048."""
    from flashtile.backends.triton import decode

    splits = decode.choose_splits(0, programs, capacity, 64, torch.device("cpu"), page=page)
    split_size = decode.split_keys(capacity, splits, 64)
    assert splits == decode.MAX_SPLITS or decode.pages_spanned(split_size, page, 64) <= decode.PAGE_SLICE_MAX


# --------------------------------------------------------------------------- issue 40's fuzz defects
@pytest.mark.parametrize("window, sq, cache_len", [((-1, 2**31 - 1), 1, 4), ((2**31 - 1, -1), 7, 1),
                                                   ((2**31 - 1, 2**31 - 1), 3, 5), ((2**31 - 2, 0), 2, 4)])
def test_huge_window_sides_hide_nothing(backend, window, sq, cache_len):
    """A window side at least the cache length is unbounded, as flash-attn trims it; on the
    decode kernel such a side once overflowed int32 (t_last + diag + right + 1) and hid every
    key: out 0, lse -inf instead of attention over the whole cache."""
    g = torch.Generator().manual_seed(5)
    q = torch.randn(1, sq, 2, 16, generator=g)
    kc, vc = (torch.randn(1, 6, 1, 16, generator=g) for _ in range(2))
    causal = window[1] == 0
    out, lse = flashtile.flash_attn_with_kvcache(q, kc, vc, cache_seqlens=cache_len, window_size=window,
                                                 return_softmax_lse=True)
    want, want_lse = flashtile.flash_attn_with_kvcache(q, kc, vc, cache_seqlens=cache_len, causal=causal,
                                                       return_softmax_lse=True)
    ref, ref_lse, _, _ = _reference(q, kc, vc, None, None, [cache_len], causal=causal)
    assert torch.isfinite(lse).all()
    assert_close("out", out, ref, None)
    assert_close("lse", lse, ref_lse, None)
    torch.testing.assert_close(out, want, atol=0, rtol=0)
    torch.testing.assert_close(lse, want_lse, atol=0, rtol=0)


def test_cache_with_more_rows_than_the_batch(backend):
    """Without cache_batch_idx, sequence b uses cache row b (flash-attn: indices 0 ..
    batch - 1): a cache allocated for a larger batch is used in its first rows, the others
    stay bitwise untouched."""
    q, k, v, kc, vc, _, seqlens = _case(batch=2, capacity=40, seqlens=(20, 33), sq=2, new=2)
    g = torch.Generator().manual_seed(9)
    spare_k, spare_v = torch.randn(2, 40, 2, 16, generator=g), torch.randn(2, 40, 2, 16, generator=g)
    kc, vc = torch.cat([kc, spare_k]), torch.cat([vc, spare_v])  # 4 cache rows, 2 sequences
    _run_and_check(q, k, v, kc, vc, seqlens, causal=True)
    assert torch.equal(kc[2:], spare_k) and torch.equal(vc[2:], spare_v)


def test_cache_with_fewer_rows_than_the_batch_is_refused():
    q, k, v, kc, vc, _, seqlens = _case(batch=3)
    with pytest.raises(ValueError, match="k_cache holds 2 sequences but q 3"):
        flashtile.flash_attn_with_kvcache(q, kc[:2], vc[:2], k, v, cache_seqlens=seqlens)


def test_empty_page_pool(backend):
    """A paged cache with no pages at all, when no sequence needs one: every row sees no key
    (out 0, lse -inf), where the twin's page gather once raised IndexError."""
    pool = torch.randn(0, 4, 2, 8)
    q = torch.randn(2, 3, 4, 8)
    out, lse = flashtile.flash_attn_with_kvcache(q, pool, pool.clone(), cache_seqlens=0,
                                                 block_table=torch.zeros(2, 1, dtype=torch.int32),
                                                 return_softmax_lse=True)
    assert torch.equal(out, torch.zeros_like(out)) and torch.isneginf(lse).all()


def test_paged_cache_overflow_names_block_table(backend):
    """A paged cache whose cache_seqlens plus new keys overflow block_table's capacity: an
    error that names block_table, a ValueError (as every argument error here) and a
    RuntimeError (what flash-attn raises: its regression test for #2709); the cache stays
    untouched."""
    from flashtile.problem.validate import BlockTableCapacityError

    q, k, v, kc, vc, table, _ = _case(page=16, capacity=40, sq=2, new=2)
    seqlens = torch.tensor([0, 17, 47], dtype=torch.int32)  # 47 + 2 > 3 pages of 16
    before = kc.clone(), vc.clone()
    for error in (ValueError, RuntimeError, BlockTableCapacityError):
        with pytest.raises(error, match=r"block_table holds \(3 blocks of 16\)"):
            flashtile.flash_attn_with_kvcache(q, kc, vc, k, v, cache_seqlens=seqlens, block_table=table)
    assert torch.equal(kc, before[0]) and torch.equal(vc, before[1])

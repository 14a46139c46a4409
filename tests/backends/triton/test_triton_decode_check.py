"""The device check of kv-cache metadata (``backends.triton.decode.check_kernel``) against a
plain-Python statement of its contract: the status (code, sequence, index, value) of the first
sequence with a bad value, each sequence checked in the order seqlen, leftpad, batch_idx,
rotary, block_table; padding sequences (a negative length, with ``padding``) skipped."""

from __future__ import annotations

import os

import numpy as np
import pytest

torch = pytest.importorskip("torch")
pytest.importorskip("triton")
from hypothesis import given, settings, strategies as st  # noqa: E402

pytestmark = pytest.mark.skipif(os.environ.get("TRITON_INTERPRET") != "1",
                                reason="set TRITON_INTERPRET=1 (make test does) to run the Triton kernels on CPU")


def expected_status(lens, pads, rows, table, *, new, queries, capacity, batch_cache, num_blocks, page, rotary_len,
                    rotary_local, padding):
    for b, n in enumerate(lens):
        if padding and n < 0:
            continue
        if n < 0 or n + new > capacity:
            return 1, b, 0, n
        if pads is not None and not 0 <= pads[b] <= n:
            return 2, b, 0, pads[b]
        if rows is not None and not 0 <= rows[b] < batch_cache:
            return 3, b, 0, rows[b]
        if rotary_len >= 0:
            need = n + max(new, queries if rotary_local else 1)
            if need > rotary_len:
                return 5, b, 0, need
        if table is not None:
            for j in range(-(-(n + new) // page)):
                if not 0 <= table[b][j] < num_blocks:
                    return 4, b, j, table[b][j]
    return 0, 0, 0, 0


@settings(max_examples=60, deadline=None)
@given(seed=st.integers(0, 2**32 - 1), batch=st.integers(1, 12), paged=st.booleans(),
       block_e=st.sampled_from([16, 64, 2048]), extras=st.booleans(), padding=st.booleans(),
       bad_rate=st.sampled_from([0.0, 0.02, 0.1, 0.4]))
def test_check_kernel_reports_the_first_bad_value(seed, batch, paged, block_e, extras, padding, bad_rate):
    from flashtile.backends.triton import decode

    rng = np.random.default_rng(seed)
    new = int(rng.integers(0, 4))
    queries = int(rng.integers(1, 5))
    page = int(rng.integers(1, 9)) if paged else 0
    width = int(rng.integers(1, 40)) if paged else 0
    capacity = width * page if paged else int(rng.integers(1, 64))
    num_blocks = int(rng.integers(1, 3 * batch * max(width, 1) + 1))
    batch_cache = batch + int(rng.integers(0, 3))

    def maybe_bad(good, bad):
        return [int(b) if rng.random() < bad_rate else int(g) for g, b in zip(good, bad)]

    lens = maybe_bad(rng.integers(0, max(capacity - new, 0) + 1, batch), rng.integers(-3, capacity + 4, batch))
    if padding:
        lens = [-1 if rng.random() < 0.2 else n for n in lens]
    pads = maybe_bad([rng.integers(0, max(n, 0) + 1) for n in lens], rng.integers(-2, capacity + 2, batch)) \
        if extras else None
    rows = maybe_bad(rng.integers(0, batch_cache, batch), rng.integers(-2, batch_cache + 2, batch)) if extras else None
    rotary_len = int(rng.integers(capacity // 2, capacity + 8)) if extras else -1
    table = None
    if paged:
        table = [maybe_bad(rng.integers(0, num_blocks, width), rng.integers(-3, num_blocks + 3, width))
                 for _ in range(batch)]
        for b, n in enumerate(lens):  # entries past a sequence's pages (a padding one's: all) are never read
            for j in range(0 if padding and n < 0 else max(0, -(-(n + new) // page)), width):
                if rng.random() < 0.5:
                    table[b][j] = -1 if rng.random() < 0.5 else num_blocks
    as_t = lambda x: None if x is None else torch.tensor(x, dtype=torch.int32)  # noqa: E731
    status = torch.full((4,), -7, dtype=torch.int32)
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(decode, "CHECK_BLOCK_E", block_e)  # several table steps at small sizes too
        decode.check_metadata(status, as_t(lens), as_t(pads), as_t(rows), as_t(table), new=new, queries=queries,
                              capacity=capacity, batch_cache=batch_cache, num_blocks=num_blocks, page=page,
                              rotary_len=rotary_len, rotary_local=bool(extras and queries > 1), padding=padding)
    want = expected_status(lens, pads, rows, table, new=new, queries=queries, capacity=capacity,
                           batch_cache=batch_cache, num_blocks=num_blocks, page=page, rotary_len=rotary_len,
                           rotary_local=bool(extras and queries > 1), padding=padding)
    assert tuple(status.tolist()) == want

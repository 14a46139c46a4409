"""The device-built work list of packed sequences (backends/worklist.py) under TRITON_INTERPRET=1:
every (sequence, block) exactly once, longest first when sorted, the sequence metadata
clamped so that unchecked values stay inside the tensors."""

from __future__ import annotations

import math
import os

import pytest
import torch

pytestmark = pytest.mark.skipif(os.environ.get("TRITON_INTERPRET") != "1",
                                reason="set TRITON_INTERPRET=1 (make test does) to run the Triton kernels on CPU")


def _build(lens_q, lens_k, tables, window=(-1, -1), used_q=None, used_k=None, max_q=None, max_k=None, cu=None):
    from flashtile.backends.worklist import build_work_items
    from flashtile.problem.spec import Varlen

    def offsets(lens):
        return torch.tensor([0, *torch.tensor(lens, dtype=torch.int64).cumsum(0).tolist()], dtype=torch.int32)

    cu_q, cu_k = (offsets(lens_q), offsets(lens_k)) if cu is None else cu
    meta = Varlen(cu_q, cu_k,
                  None if used_q is None else torch.tensor(used_q, dtype=torch.int32),
                  None if used_k is None else torch.tensor(used_k, dtype=torch.int32),
                  max(lens_q) if max_q is None else max_q, max(lens_k) if max_k is None else max_k)
    return build_work_items(meta, sum(lens_q), sum(lens_k), tables, *window)


def _decode(table, cap, batch):
    t = table.tolist()
    count = t[0]
    seqs, blks = t[16:16 + count], t[16 + cap:16 + cap + count]
    meta = [t[16 + 2 * cap + 4 * b:16 + 2 * cap + 4 * b + 4] for b in range(batch)]
    prefix = t[16 + 2 * cap + 4 * batch:16 + 2 * cap + 5 * batch]
    return count, list(zip(seqs, blks)), meta, prefix


def _cost(meta, b, blk, block, keys, left, right):
    """Keys a query block sees / queries a key block is seen by (the window around each
    sequence's bottom-right diagonal), by brute force."""
    _, len_q, _, len_k = meta[b]
    d = len_k - len_q
    rows = range(blk * block, min(blk * block + block, len_k if keys else len_q))
    if keys:
        return sum(any((left < 0 or j >= i + d - left) and (right < 0 or j <= i + d + right) for j in rows)
                   for i in range(len_q))
    return sum(any((left < 0 or j >= i + d - left) and (right < 0 or j <= i + d + right) for i in rows)
               for j in range(len_k))


@pytest.mark.parametrize("window", [(-1, -1), (-1, 0), (5, 3)], ids=["full", "causal", "window"])
def test_every_block_once_longest_first(window):
    lens_q, lens_k = [5, 0, 70, 1, 33, 16], [9, 4, 64, 0, 40, 16]
    tables = [(16, False), (32, True), (8, False)]
    built = _build(lens_q, lens_k, tables, window)
    assert len(built) == 3
    for (table, cap), (block, keys) in zip(built, tables):
        count, items, meta, prefix = _decode(table, cap, len(lens_q))
        lens = lens_k if keys else lens_q
        want = sorted((b, i) for b, n in enumerate(lens) for i in range(math.ceil(n / block)))
        assert count == len(want) <= cap and sorted(items) == want
        assert [m[1] for m in meta] == lens_q and [m[3] for m in meta] == lens_k
        assert prefix == [sum(math.ceil(n / block) for n in lens[:b]) for b in range(len(lens))]
        costs = [_cost(meta, b, i, block, keys, *window) for b, i in items]
        assert costs == sorted(costs, reverse=True), (block, keys, costs)


def test_seqused_and_bad_offsets_are_clamped():
    # seqused shortens the sequences; offsets that decrease or pass the end (never checked
    # inside a CUDA graph capture) are clamped into the tensors instead of addressing memory
    # outside them.
    built = _build([10, 20], [10, 20], [(8, False)], used_q=[3, 50], used_k=[-1, 7])
    (table, cap), = built
    _, items, meta, _ = _decode(table, cap, 2)
    assert meta == [[0, 3, 0, 0], [10, 20, 10, 7]]
    bad = (torch.tensor([0, 25, 5], dtype=torch.int32), torch.tensor([0, -3, 40], dtype=torch.int32))
    (table, cap), = _build([10, 20], [10, 20], [(8, False)], cu=bad)
    _, items, meta, _ = _decode(table, cap, 2)
    for start_q, len_q, start_k, len_k in meta:
        assert 0 <= start_q and start_q + len_q <= 30 and 0 <= start_k and start_k + len_k <= 30
        assert len_q >= 0 and len_k >= 0


def test_many_items_take_the_unsorted_path():
    # More items than one program sorts (SORT_LIMIT): sequence order, causal query blocks
    # of a sequence from the last one.
    from flashtile.backends.worklist import SORT_LIMIT

    lens = [1] * (SORT_LIMIT + 500) + [0, 40, 3]
    (table, cap), = _build(lens, lens, [(16, False)], window=(-1, 0))
    count, items, _, _ = _decode(table, cap, len(lens))
    assert count == SORT_LIMIT + 500 + 3 + 1
    assert items[:3] == [(0, 0), (1, 0), (2, 0)]
    assert items[-4:] == [(len(lens) - 2, 2), (len(lens) - 2, 1), (len(lens) - 2, 0), (len(lens) - 1, 0)]

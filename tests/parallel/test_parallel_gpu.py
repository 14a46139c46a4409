"""Context parallelism on NCCL, one GPU a rank (the device kinds with 2, 4 or 8 GPUs): ring
attention (zigzag, contiguous) and Ulysses in bf16 on flashtile's GPU kernels, forward and
gradients of every rank's shard under the accuracy rule against float64 attention of the
whole sequence; and the fp32 merge's error flat in the number of ranks."""

from __future__ import annotations

import json
import os
import socket

import pytest
import torch
import torch.multiprocessing as mp

pytestmark = pytest.mark.gpu

CONFIGS = [
    dict(layout="zigzag", causal=True),
    dict(layout="contiguous", causal=True),
    dict(layout="zigzag", causal=False, heads=(8, 8)),
    dict(layout="zigzag", causal=True, window=(300, 0), softcap=30.0),
    dict(layout="contiguous", causal=False, window=(100, 50)),  # some ranks' blocks see no key
    dict(layout="contiguous", causal=True, ulysses=True),
]
TOKENS_PER_RANK = 512  # a multiple of 2 x 128: every zigzag chunk is whole tiles


def _world() -> int:
    n = torch.cuda.device_count() if torch.cuda.is_available() else 0
    if n < 2:
        pytest.skip(f"needs 2 or more CUDA GPUs (NCCL), found {n}")
    return n


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _reference(q, k, v, dout, cfg, dtype):
    """(out, dq, dk, dv) of plain attention on the whole sequence in ``dtype`` (flash layout)."""
    from flashtile.testing import plain_attention

    left, right = cfg.get("window", (-1, -1))
    if cfg["causal"]:
        right = 0
    leaves = [t.to(dtype).transpose(1, 2).detach().requires_grad_() for t in (q, k, v)]
    softcap = cfg.get("softcap", 0.0)
    out, _ = plain_attention(*leaves, scale=q.shape[-1] ** -0.5, window_left=left, window_right=right,
                             softcap=softcap, dtype=dtype)
    grads = torch.autograd.grad(out, leaves, dout.to(dtype).transpose(1, 2))
    return [t.transpose(1, 2) for t in (out.detach(), *grads)]


def _worker(rank, world, port, out_dir):
    os.environ.setdefault("NCCL_NVLS_ENABLE", "0")  # NVLink multicast stays off (device/KINDS.md)
    import torch.distributed as dist

    from flashtile.parallel import ring_attention, shard_sequence, ulysses_attention
    from flashtile.testing import FORWARD_FACTOR, GRAD_FACTOR, compare

    device = torch.device("cuda", rank)
    torch.cuda.set_device(device)
    dist.init_process_group("nccl", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world,
                            device_id=device)
    results = []
    total = TOKENS_PER_RANK * world
    for n, cfg in enumerate(CONFIGS):
        h, hk = cfg.get("heads", (8, 2))
        g = torch.Generator().manual_seed(n)
        q, dout = (torch.randn(1, total, h, 128, generator=g).to(device) for _ in range(2))
        k, v = (torch.randn(1, total, hk, 128, generator=g).to(device) for _ in range(2))
        ref = _reference(q, k, v, dout, cfg, torch.float64)
        base = _reference(q, k, v, dout, cfg, torch.bfloat16)
        layout = cfg["layout"]
        local = [shard_sequence(t.bfloat16(), layout=layout).requires_grad_() for t in (q, k, v)]
        kw = dict(causal=cfg["causal"], window_size=cfg.get("window", (-1, -1)), softcap=cfg.get("softcap", 0.0))
        if cfg.get("ulysses"):
            out = ulysses_attention(*local, **kw)
        else:
            out = ring_attention(*local, layout=layout, **kw)
        grads = torch.autograd.grad(out, local, shard_sequence(dout.bfloat16(), layout=layout))
        verdicts = []
        for i, (name, got) in enumerate(zip(("out", "dq", "dk", "dv"), (out, *grads))):
            shard = [shard_sequence(t[i], layout=layout) for t in (ref, base)]
            verdicts.append(compare(name, got.detach(), shard[0], shard[1], FORWARD_FACTOR if i == 0 else GRAD_FACTOR))
        results.append({"cfg": cfg, "ok": all(v.ok for v in verdicts), "verdicts": [str(v) for v in verdicts]})
    # The merge's error against float64 for 2, 4, ... ranks over the same sequence: flat in the
    # number of ranks (an fp32 merge), where a bf16 merge would grow with it.
    g = torch.Generator().manual_seed(123)
    total = TOKENS_PER_RANK * 2
    q, k, v = (torch.randn(1, total, 8, 128, generator=g).to(device) for _ in range(3))
    ref = _reference(q, k, v, torch.zeros_like(q), dict(causal=True), torch.float64)[0]
    errs = {}
    size = 2
    while size <= world:
        group = dist.new_group(list(range(size)))
        if rank < size:
            shards = [shard_sequence(t.bfloat16(), group=group) for t in (q, k, v)]
            out = ring_attention(*shards, group=group, causal=True)
            err = (out.double() - shard_sequence(ref, group=group)).abs().max()
        else:
            err = torch.zeros((), dtype=torch.float64, device=device)
        dist.all_reduce(err, op=dist.ReduceOp.MAX)
        errs[size] = err.item()
        size *= 2
    results.append({"merge_error_by_world": errs})
    with open(os.path.join(out_dir, f"rank{rank}.json"), "w") as f:
        json.dump(results, f)
    dist.barrier()
    dist.destroy_process_group()


def test_ring_and_ulysses_on_nccl(tmp_path):
    world = _world()
    mp.spawn(_worker, args=(world, _free_port(), str(tmp_path)), nprocs=world, join=True)
    for rank in range(world):
        results = json.load(open(tmp_path / f"rank{rank}.json"))
        for r in results[:-1]:
            assert r["ok"], (rank, r["cfg"], r["verdicts"])
        errs = {int(s): e for s, e in results[-1]["merge_error_by_world"].items()}
        assert max(errs.values()) <= 2.0 * errs[2] + 1e-3, errs

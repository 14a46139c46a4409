"""Context parallelism with flashtile: one long sequence sharded over the ranks.

    torchrun --nproc_per_node=4 examples/context_parallel.py            # gloo on CPU
    torchrun --nproc_per_node=8 examples/context_parallel.py --cuda     # NCCL, one GPU a rank

Every rank builds the same random sequence, keeps its zigzag shard, runs ring attention
forward and backward, and checks its output and gradients against one-process attention
on the whole sequence (rank 0 prints the differences and timings).
"""

from __future__ import annotations

import argparse
import os
import time

import torch
import torch.distributed as dist

import flashtile
from flashtile.parallel import ring_attention, shard_sequence, ulysses_attention


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--cuda", action="store_true")
    p.add_argument("--seqlen", type=int, default=4096, help="the whole sequence")
    p.add_argument("--heads", type=int, default=8)
    p.add_argument("--kv-heads", type=int, default=2)
    p.add_argument("--headdim", type=int, default=64)
    args = p.parse_args()
    dist.init_process_group("nccl" if args.cuda else "gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    device = torch.device("cuda", int(os.environ.get("LOCAL_RANK", 0))) if args.cuda else torch.device("cpu")
    if args.cuda:
        torch.cuda.set_device(device)
    dtype = torch.bfloat16 if args.cuda else torch.float32
    g = torch.Generator().manual_seed(0)
    shape = (1, args.seqlen, args.heads, args.headdim)
    kv_shape = (1, args.seqlen, args.kv_heads, args.headdim)
    q, k, v, dout = (torch.randn(s, generator=g).to(device, dtype) for s in (shape, kv_shape, kv_shape, shape))
    for name, layout, fn in (("ring zigzag", "zigzag", ring_attention), ("ring contiguous", "contiguous", ring_attention),
                             ("ulysses", "contiguous", ulysses_attention)):
        local = [shard_sequence(t, layout=layout).requires_grad_() for t in (q, k, v)]
        start = time.perf_counter()
        kwargs = dict(causal=True) if fn is ulysses_attention else dict(causal=True, layout=layout)
        out = fn(*local, **kwargs)
        grads = torch.autograd.grad(out, local, shard_sequence(dout, layout=layout))
        if args.cuda:
            torch.cuda.synchronize()
        seconds = time.perf_counter() - start
        full = [t.clone().requires_grad_() for t in (q, k, v)]
        ref = flashtile.flash_attn_func(*full, causal=True)
        ref_grads = torch.autograd.grad(ref, full, dout)
        errs = [(out - shard_sequence(ref.detach(), layout=layout)).abs().max()]
        errs += [(a - shard_sequence(b, layout=layout)).abs().max() for a, b in zip(grads, ref_grads)]
        worst = torch.stack(errs).float()
        dist.all_reduce(worst, op=dist.ReduceOp.MAX)
        if rank == 0:
            print(f"{name:16s} world {world}: max |diff| out {worst[0]:.2e}, dq {worst[1]:.2e}, dk {worst[2]:.2e}, "
                  f"dv {worst[3]:.2e}; forward + backward {seconds * 1e3:.1f} ms on rank 0", flush=True)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()

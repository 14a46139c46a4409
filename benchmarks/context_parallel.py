"""Context parallelism: time per training step of one long sequence sharded over N GPUs.

    torchrun --nproc_per_node=8 benchmarks/context_parallel.py --out rows.jsonl      # NCCL, a GPU a rank
    python3 benchmarks/context_parallel.py --cpu-smoke                                # 2 gloo ranks on CPU

For each total sequence length (default 128k, 512k, 1M tokens; d128, GQA 32/8, bf16,
causal, batch 1) and each implementation (`ring_attention` zigzag and contiguous,
`ulysses_attention`), every rank holds its shard and the script times forward + backward
(events, the slowest rank's median of ``--reps``). Beside it, in the same run:

- ``single``: the one-GPU time of the same total work (`flash_attn_func` on the whole
  sequence, rank 0 alone) where it is not over ``--single-max`` tokens; scaling efficiency =
  single / (N x step time). Above that size the row says so instead of extrapolating.
- ``compute``: the same step with the ring's point-to-point exchange replaced by a no-op
  (the same kernels on the same shapes), and ``comm``: the exchange alone (the K/V hops of
  the forward, K/V and dK/dV hops of the backward). The share of communication hidden
  under compute = (compute + comm - step) / comm, clipped to [0, 1].
- ``err``: where the single run exists, the relative L2 error of the gathered output
  against it (the fp32 merge keeps it flat in N; a bf16 merge would grow).

Rows (JSON lines, ``--out``) and a table on rank 0. ``--cpu-smoke`` spawns 2 gloo ranks on
tiny fp32 shapes (the torch twin), the check CI runs; it measures nothing worth reading.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time
from contextlib import contextmanager

import torch
import torch.distributed as dist

import flashtile
from flashtile.parallel import ring, ring_attention, shard_sequence, ulysses_attention, unshard_sequence

IMPLS = ("ring-zigzag", "ring-contiguous", "ulysses")


def parse(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--seqlen", type=int, nargs="+", default=[131072, 524288, 1048576], help="total tokens")
    p.add_argument("--heads", type=int, default=32)
    p.add_argument("--kv-heads", type=int, default=8)
    p.add_argument("--headdim", type=int, default=128)
    p.add_argument("--impl", nargs="+", choices=IMPLS, default=list(IMPLS))
    p.add_argument("--reps", type=int, default=3)
    p.add_argument("--single-max", type=int, default=262144,
                   help="largest total length also timed on one GPU (default: %(default)s)")
    p.add_argument("--no-breakdown", action="store_true", help="skip the compute-only and comm-only timings")
    p.add_argument("--out", help="JSON lines file for the rows (rank 0 writes)")
    p.add_argument("--cpu-smoke", action="store_true", help="2 gloo ranks on CPU, tiny shapes")
    return p.parse_args(argv)


class _NoComm:
    """Stands in for ring._Ring: the same calls, no exchange (each block stays where it is)."""

    def __init__(self, group, world, rank):
        self.pending = None

    def start(self, tensors):
        self.pending = list(tensors)

    def finish(self):
        out, self.pending = self.pending, None
        return out


@contextmanager
def no_communication():
    saved = ring._Ring
    ring._Ring = _NoComm
    try:
        yield
    finally:
        ring._Ring = saved


def timed(fn, reps, device):
    """Median seconds of ``fn`` over ``reps`` after one warm-up, the slowest rank's."""
    fn()
    times = []
    for _ in range(reps):
        dist.barrier()
        if device.type == "cuda":
            torch.cuda.synchronize()
        t = time.perf_counter()
        fn()
        if device.type == "cuda":
            torch.cuda.synchronize()
        times.append(time.perf_counter() - t)
    worst = torch.tensor([statistics.median(times)], dtype=torch.float64, device=device)
    dist.all_reduce(worst, op=dist.ReduceOp.MAX)
    return float(worst)


def comm_only(local_k, local_v, world, rank, backward=True):
    """The ring's exchanges alone: world - 1 hops of (K, V), and with the backward as many
    more of (K, V) and of fp32 (dK, dV)."""
    r = ring._Ring(None, world, rank)
    block = (local_k, local_v)
    grads = (local_k.float(), local_v.float())
    for _ in range(world - 1):
        r.start(block)
        block = tuple(r.finish())
    if backward:
        for _ in range(world - 1):
            r.start(block)
            g = ring._Ring(None, world, rank)
            g.start(grads)
            block = tuple(r.finish())
            grads = tuple(g.finish())


def step_fn(impl, q, k, v, dout):
    layout = "contiguous" if impl in ("ring-contiguous", "ulysses") else "zigzag"
    local = [shard_sequence(t, layout=layout).detach().requires_grad_() for t in (q, k, v)]
    local_dout = shard_sequence(dout, layout=layout)
    if impl == "ulysses":
        def fwd():
            return ulysses_attention(*local, causal=True)
    else:
        def fwd():
            return ring_attention(*local, causal=True, layout=layout)

    def step():
        out = fwd()
        torch.autograd.grad(out, local, local_dout)
        return out
    return step, layout, local


def main(argv=None) -> int:
    args = parse(argv)
    if args.cpu_smoke:
        return cpu_smoke(args)
    cuda = torch.cuda.is_available() and os.environ.get("FLASHTILE_CP_CPU") != "1"
    if not dist.is_initialized():
        dist.init_process_group("nccl" if cuda else "gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    device = torch.device("cuda", int(os.environ.get("LOCAL_RANK", 0))) if cuda else torch.device("cpu")
    if cuda:
        torch.cuda.set_device(device)
    dtype = torch.bfloat16 if cuda else torch.float32
    rows = []
    for total in args.seqlen:
        if total % (2 * world):
            raise SystemExit(f"--seqlen {total} must be a multiple of 2 x world size ({2 * world})")
        g = torch.Generator(device=device).manual_seed(total)
        shape = (1, total, args.heads, args.headdim)
        kv_shape = (1, total, args.kv_heads, args.headdim)
        q, dout = (torch.randn(shape, generator=g, device=device, dtype=dtype) for _ in range(2))
        k, v = (torch.randn(kv_shape, generator=g, device=device, dtype=dtype) for _ in range(2))
        single = ref = None
        if total <= args.single_max:
            if rank == 0:
                full = [t.detach().clone().requires_grad_() for t in (q, k, v)]

                def one():
                    out = flashtile.flash_attn_func(*full, causal=True)
                    torch.autograd.grad(out, full, dout)
                    return out
                one()
                ts = []
                for _ in range(args.reps):
                    if cuda:
                        torch.cuda.synchronize()
                    t = time.perf_counter()
                    ref = one()
                    if cuda:
                        torch.cuda.synchronize()
                    ts.append(time.perf_counter() - t)
                single = statistics.median(ts)
                ref = ref.detach()
            box = [single]
            dist.broadcast_object_list(box, src=0)
            single = box[0]
        for impl in args.impl:
            step, layout, local = step_fn(impl, q, k, v, dout)
            t_step = timed(step, args.reps, device)
            row = dict(impl=impl, world=world, seqlen=total, heads=args.heads, kv_heads=args.kv_heads,
                       headdim=args.headdim, dtype=str(dtype).split(".")[-1], causal=True, step_s=t_step,
                       single_s=single, efficiency=(single / (world * t_step)) if single else None)
            if not args.no_breakdown and impl != "ulysses":
                with no_communication():
                    t_compute = timed(step, args.reps, device)
                lk, lv = (shard_sequence(t, layout=layout) for t in (k, v))
                t_comm = timed(lambda: comm_only(lk.contiguous(), lv.contiguous(), world, rank), args.reps, device)
                hidden = (t_compute + t_comm - t_step) / t_comm if t_comm > 0 else None
                row.update(compute_s=t_compute, comm_s=t_comm,
                           comm_hidden=None if hidden is None else min(max(hidden, 0.0), 1.0))
            out = step()
            gathered = unshard_sequence(out.detach().contiguous(), layout=layout)
            if rank == 0 and ref is not None:
                row["err"] = float((gathered.float() - ref.float()).norm() / ref.float().norm())
            rows.append(row)
            if rank == 0:
                print(format_row(row), flush=True)
            del step, local, out, gathered
            if cuda:
                torch.cuda.empty_cache()
    if rank == 0 and args.out:
        with open(args.out, "a") as f:
            for row in rows:
                f.write(json.dumps(row) + "\n")
    dist.barrier()
    if os.environ.get("FLASHTILE_CP_SMOKE") != "1":  # the smoke workers leave their own way
        dist.destroy_process_group()
    return 0


def format_row(row) -> str:
    def ms(key):
        return "-" if row.get(key) is None else f"{row[key] * 1e3:9.1f}"
    eff = "-" if row.get("efficiency") is None else f"{100 * row['efficiency']:.0f}%"
    hid = "-" if row.get("comm_hidden") is None else f"{100 * row['comm_hidden']:.0f}%"
    err = "-" if row.get("err") is None else f"{row['err']:.1e}"
    return (f"{row['impl']:16s} N={row['world']} S={row['seqlen']:>8} step {ms('step_s')} ms | one GPU "
            f"{ms('single_s')} ms, efficiency {eff} | compute {ms('compute_s')} comm {ms('comm_s')} ms, "
            f"hidden {hid} | err {err}")


def _smoke_worker(rank, world, port, out):
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank), WORLD_SIZE=str(world),
                      LOCAL_RANK=str(rank), FLASHTILE_CP_CPU="1", FLASHTILE_CP_SMOKE="1")
    dist.init_process_group("gloo", rank=rank, world_size=world)
    torch.set_num_threads(1)
    main(["--seqlen", "128", "--heads", "4", "--kv-heads", "2", "--headdim", "16", "--reps", "1",
          "--single-max", "128", "--out", out])
    # Leave without gloo's teardown (it can abort a rank: tests/test_parallel.py's
    # _leave_together): a file barrier after main's gloo barrier, then os._exit.
    import time

    mark = f"{out}.left"
    open(f"{mark}{rank}", "w").close()
    deadline = time.monotonic() + 60
    while not all(os.path.exists(f"{mark}{r}") for r in range(world)) and time.monotonic() < deadline:
        time.sleep(0.01)
    sys.stdout.flush()
    os._exit(0)


def cpu_smoke(args) -> int:
    """Two gloo ranks on CPU, tiny shapes: the script's whole path, rows in ``args.out``."""
    import socket
    import tempfile

    import torch.multiprocessing as mp

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    out = args.out or os.path.join(tempfile.mkdtemp(), "cp-smoke.jsonl")
    mp.spawn(_smoke_worker, args=(2, port, out), nprocs=2, join=True)
    rows = [json.loads(line) for line in open(out)]  # rank 0 printed them
    return 0 if len(rows) == len(IMPLS) else 1


if __name__ == "__main__":
    sys.exit(main())

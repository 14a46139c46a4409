"""Ring attention: exact attention over a sequence sharded across the ranks of a process
group, key/value blocks passed around the ring with torch.distributed point-to-point ops.

Every rank holds ``local_seqlen`` tokens of q, k and v. Layouts of the global sequence
(length ``N * local_seqlen`` for N ranks):

    contiguous  rank r holds tokens [r L, (r + 1) L)
    zigzag      the sequence in 2N chunks of L / 2; rank r holds chunks r and 2N - 1 - r,
                so every rank does the same causal work

Each (local query chunk, visiting key chunk) pair is one call of flashtile's canonical
problem with diagonal offset ``start_q - start_k`` (global positions: causal and windows
are those of the whole sequence), which returns its output and LSE. Partial results merge
in float32 in the overflow-safe form

    out = out - sigmoid(lse_b - lse) * (out - out_b),   lse = lse - logsigmoid(lse - lse_b)

(a block that sees no key has lse_b = -inf and changes nothing). The backward recomputes
each pair against the global out and LSE (the kernels' backward needs nothing else), adds
dQ locally in float32 and sends dK/dV around the ring with their block, one extra hop
bringing them home.
"""

from __future__ import annotations

from typing import Optional

import torch

from flashtile import dispatch
from flashtile.parallel.group import as_group, check_same_across_ranks, group_info
from flashtile.problem import validate
from flashtile.problem.spec import Problem
from flashtile.problem.window import effective_window

LAYOUTS = ("zigzag", "contiguous")


def chunk_starts(rank: int, world: int, local_seqlen: int, layout: str) -> list[tuple[int, int, int]]:
    """(local row, global start, length) of the chunks rank ``rank`` holds."""
    if layout == "contiguous":
        return [(0, rank * local_seqlen, local_seqlen)]
    half = local_seqlen // 2
    return [(0, rank * half, half), (half, (2 * world - 1 - rank) * half, half)]


def shard_sequence(x: torch.Tensor, group=None, layout: str = "zigzag", seq_dim: int = 1,
                   rank: Optional[int] = None, world: Optional[int] = None) -> torch.Tensor:
    """This rank's shard of a full sequence ``x`` (split along ``seq_dim``) in ``layout``."""
    if world is None or rank is None:
        world, rank = group_info(group)
    validate.sequence_layout(layout, LAYOUTS)
    total = x.shape[seq_dim]
    parts = 2 * world if layout == "zigzag" else world
    validate.shard_length(total, parts, layout, world)
    local = total // world
    pieces = [x.narrow(seq_dim, start, n) for _, start, n in chunk_starts(rank, world, local, layout)]
    return torch.cat(pieces, dim=seq_dim)


def unshard_sequence(x: torch.Tensor, group=None, layout: str = "zigzag", seq_dim: int = 1) -> torch.Tensor:
    """The full sequence from every rank's shard (an all-gather; the inverse of
    ``shard_sequence``). Not differentiable."""
    import torch.distributed as dist

    world, _ = group_info(group)
    shards = [torch.empty_like(x) for _ in range(world)]
    dist.all_gather(shards, x.contiguous(), group=as_group(group))
    local = x.shape[seq_dim]
    total = local * world
    out = x.new_empty((*x.shape[:seq_dim], total, *x.shape[seq_dim + 1:]))
    for r, shard in enumerate(shards):
        for row, start, n in chunk_starts(r, world, local, layout):
            out.narrow(seq_dim, start, n).copy_(shard.narrow(seq_dim, row, n))
    return out


def positions(local_seqlen: int, group=None, layout: str = "zigzag", device=None) -> torch.Tensor:
    """Global positions (local_seqlen,) of this rank's tokens (for rotary embeddings)."""
    world, rank = group_info(group)
    return torch.cat([torch.arange(start, start + n, device=device)
                      for _, start, n in chunk_starts(rank, world, local_seqlen, layout)])


def _merge(out, lse, out_b, lse_b):
    """Merge a block's (out_b, lse_b) into the running float32 (out, lse), in place-free form.
    out: (B, H, S, D) float32, lse: (B, H, S) float32; -inf means "nothing seen yet"."""
    if out is None:
        return out_b.float(), lse_b.float()
    lse_b = lse_b.float()
    both = torch.isfinite(lse) | torch.isfinite(lse_b)
    # sigmoid(lse_b - lse): with lse = -inf (nothing yet) it is 1, with lse_b = -inf 0
    diff = torch.where(both, lse_b - lse, torch.zeros_like(lse))
    weight = torch.where(torch.isneginf(lse_b), 0.0, torch.where(torch.isneginf(lse), 1.0, torch.sigmoid(diff)))
    out = out - weight[..., None] * (out - out_b.float())
    new_lse = torch.where(torch.isneginf(lse_b), lse,
                          torch.where(torch.isneginf(lse), lse_b, lse - torch.nn.functional.logsigmoid(lse - lse_b)))
    return out, new_lse


def _pair_problem(q_start: int, k_start: int, seqlen_q: int, seqlen_k: int, problem):
    """The canonical problem of a query chunk at global row q_start against a key chunk at
    k_start (diagonal offset q_start - k_start, window normalised), or None when no query of
    the pair sees any key (a causal pair above the diagonal, or out of the window): such
    pairs are skipped, forward and backward."""
    left, right = effective_window(problem.window_left, problem.window_right, seqlen_q, seqlen_k, q_start - k_start)
    p = Problem(problem.scale, q_start - k_start, left, right, problem.softcap)
    if p.window_right >= 0 and (seqlen_q - 1) + p.diag_offset + p.window_right < 0:
        return None
    if p.window_left >= 0 and p.diag_offset - p.window_left > seqlen_k - 1:
        return None
    return p


def _pair_backward(dout4, q4, k4, v4, out4, lse, p):
    """Gradients of one chunk pair (problem ``p`` from ``_pair_problem``) against the global
    out and LSE: (dq, dk, dv) as (B, H, S, D) float32. The Triton backward where it runs,
    else the same formulas in torch."""
    if dispatch.runs_kernels(q4.device):
        from flashtile import autograd  # noqa: F401  (registers the ops)

        dq, dk, dv, _ = torch.ops.flashtile.attn_bwd(
            dout4.transpose(1, 2), q4, k4, v4, out4.transpose(1, 2), lse.contiguous(), p.scale, p.diag_offset,
            p.window_left, p.window_right, p.softcap, None, None)
        return dq.transpose(1, 2).float(), dk.transpose(1, 2).float(), dv.transpose(1, 2).float()
    return _pair_backward_torch(dout4, q4, k4, v4, out4, lse, p)


def _pair_backward_torch(dout4, q4, k4, v4, out4, lse, p):
    """The backward formulas of backends/triton/backward.py in float32 torch (dense per pair)."""
    from flashtile.backends.twin.attention import visible_mask_rows

    group = q4.shape[1] // k4.shape[1]
    qf, kf, vf, do, o = (t.float() for t in (q4, k4, v4, dout4, out4))
    kr, vr = kf.repeat_interleave(group, 1), vf.repeat_interleave(group, 1)
    raw = qf @ kr.transpose(-1, -2)
    if p.softcap > 0:
        t = torch.tanh(raw * (p.scale / p.softcap))
        s = p.softcap * t
        dfac = p.scale * (1 - t * t)
    else:
        s = raw * p.scale
        dfac = p.scale
    visible = visible_mask_rows(0, q4.shape[2], k4.shape[2], p.diag_offset, p.window_left, p.window_right, q4.device)
    lse_safe = torch.where(torch.isneginf(lse), torch.inf, lse.float())
    prob = torch.where(visible, torch.exp(s - lse_safe[..., None]), 0.0)
    delta = (do * o).sum(-1, keepdim=True)
    dv = prob.transpose(-1, -2) @ do
    ds = prob * (do @ vr.transpose(-1, -2) - delta) * dfac
    dq = ds @ kr
    dk = ds.transpose(-1, -2) @ qf
    b, h, sk, d = dk.shape
    dk = dk.reshape(b, h // group, group, sk, d).sum(2)
    dv = dv.reshape(b, h // group, group, sk, d).sum(2)
    return dq, dk, dv


class _Ring:
    """Point-to-point exchange with the ring neighbours (batched isend/irecv)."""

    def __init__(self, group, world, rank):
        import torch.distributed as dist

        self.dist, self.group = dist, group
        ranks = dist.get_process_group_ranks(group) if group is not None else list(range(world))
        self.send_to = ranks[(rank + 1) % world]
        self.recv_from = ranks[(rank - 1) % world]
        self.pending = None

    def start(self, tensors):
        """Send ``tensors`` to the next rank and receive the same shapes from the previous."""
        incoming = [torch.empty(t.shape, dtype=t.dtype, device=t.device) for t in tensors]
        ops = []
        for t, r in zip(tensors, incoming):
            ops.append(self.dist.P2POp(self.dist.isend, t.contiguous(), self.send_to, self.group))
            ops.append(self.dist.P2POp(self.dist.irecv, r, self.recv_from, self.group))
        self.pending = (self.dist.batch_isend_irecv(ops), incoming)

    def finish(self):
        requests, incoming = self.pending
        for req in requests:
            req.wait()
        self.pending = None
        return incoming


def _forward(q4, k4, v4, problem, group, world, rank, layout):
    """Merged float32 (out (B, H, L, D), lse (B, H, L)) of the local queries."""
    local = q4.shape[2]
    mine = chunk_starts(rank, world, local, layout)
    ring = _Ring(group, world, rank)
    out = [None] * len(mine)
    lse = [None] * len(mine)
    kv = (k4, v4)
    for step in range(world):
        src = (rank - step) % world
        if step + 1 < world:
            ring.start(kv)  # the next block travels while this one is computed
        theirs = chunk_starts(src, world, local, layout)
        for c, (row_q, start_q, n_q) in enumerate(mine):
            for row_k, start_k, n_k in theirs:
                p = _pair_problem(start_q, start_k, n_q, n_k, problem)
                if p is not None:
                    o, l = dispatch.attention(q4[:, :, row_q:row_q + n_q], kv[0][:, :, row_k:row_k + n_k],
                                      kv[1][:, :, row_k:row_k + n_k], p, None, None)
                    out[c], lse[c] = _merge(out[c], lse[c], o, l)
        if step + 1 < world:
            kv = tuple(ring.finish())
    b, h, _, d = q4.shape
    for c, (_, _, n_q) in enumerate(mine):
        if out[c] is None:  # causal zigzag never leaves a chunk empty, but a window can
            out[c] = q4.new_zeros((b, h, n_q, d), dtype=torch.float32)
            lse[c] = torch.full((b, h, n_q), float("-inf"), device=q4.device)
    return torch.cat(out, dim=2), torch.cat(lse, dim=2)


class _RingAttention(torch.autograd.Function):
    @staticmethod
    def forward(ctx, q4, k4, v4, problem, group, world, rank, layout):
        with torch.no_grad():
            out, lse = _forward(q4, k4, v4, problem, group, world, rank, layout)
        out_q = out.to(q4.dtype)
        ctx.save_for_backward(q4, k4, v4, out_q, lse)
        ctx.args = (problem, group, world, rank, layout)
        return out_q, lse

    @staticmethod
    def backward(ctx, dout, dlse):
        if dlse is not None and bool((dlse != 0).any()):
            raise NotImplementedError("ring_attention: gradients through the returned LSE are not supported")
        q4, k4, v4, out, lse = ctx.saved_tensors
        problem, group, world, rank, layout = ctx.args
        local = q4.shape[2]
        mine = chunk_starts(rank, world, local, layout)
        ring = _Ring(group, world, rank)
        dq = torch.zeros(q4.shape, dtype=torch.float32, device=q4.device)
        block = (k4, v4, torch.zeros(k4.shape, dtype=torch.float32, device=k4.device),
                 torch.zeros(v4.shape, dtype=torch.float32, device=v4.device))
        dout = dout.to(q4.dtype)
        for step in range(world):
            src = (rank - step) % world
            k_b, v_b, dk_b, dv_b = block
            if step + 1 < world:
                ring.start((k_b, v_b))  # K/V travel ahead; dK/dV follow once this step has added to them
            for row_q, start_q, n_q in mine:
                sq = slice(row_q, row_q + n_q)
                for row_k, start_k, n_k in chunk_starts(src, world, local, layout):
                    sk = slice(row_k, row_k + n_k)
                    p = _pair_problem(start_q, start_k, n_q, n_k, problem)
                    if p is not None:
                        grads = _pair_backward(dout[:, :, sq], q4[:, :, sq], k_b[:, :, sk], v_b[:, :, sk],
                                               out[:, :, sq], lse[:, :, sq], p)
                        dq[:, :, sq] += grads[0]
                        dk_b[:, :, sk] += grads[1]
                        dv_b[:, :, sk] += grads[2]
            if world > 1:
                grad_ring = _Ring(group, world, rank)
                grad_ring.start((dk_b, dv_b))  # this block's gradients go where the block goes next
                if step + 1 < world:
                    k_b, v_b = ring.finish()
                dk_b, dv_b = grad_ring.finish()
            block = (k_b, v_b, dk_b, dv_b)
        # After the last step's hop every block's dK/dV is back home.
        return dq.to(q4.dtype), block[2].to(k4.dtype), block[3].to(v4.dtype), None, None, None, None, None


def ring_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, group=None, *, causal: bool = False,
                   window_size=(-1, -1), softcap: float = 0.0, softmax_scale: Optional[float] = None,
                   layout: str = "zigzag", return_lse: bool = False):
    """Attention of this rank's shard of a sequence sharded over ``group`` (ring exchange).

    Args:
        q: (batch, local_seqlen, nheads, headdim), this rank's tokens in ``layout``
            (``shard_sequence`` makes them); k, v: (batch, local_seqlen, nheads_k, headdim).
            Every rank passes the same shapes.
        group: a torch.distributed ProcessGroup or a 1-D DeviceMesh (default: the world).
        causal, window_size, softcap, softmax_scale: as in ``flash_attn_func``, over the
            global sequence (top-left = bottom-right: the global problem is square).
        layout: "zigzag" (rank r holds chunks r and 2N - 1 - r of 2N; balanced causal
            work; local_seqlen must be even) or "contiguous".
        return_lse: also return the LSE (batch, nheads, local_seqlen) float32 (not
            differentiable).

    Returns:
        out (batch, local_seqlen, nheads, headdim), or (out, lse). Differentiable in q, k, v.
        With one rank it is the local kernel.
    """
    problem = validate.ring_call(q, k, v, causal, window_size, softcap, softmax_scale, layout, LAYOUTS)
    world, rank = group_info(group)
    group = as_group(group)
    if world > 1:
        check_same_across_ranks(q, k, group, world)
    if world == 1:
        layout = "contiguous"
    out, lse = _RingAttention.apply(q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2), problem, group, world,
                                    rank, layout)
    out = out.transpose(1, 2)
    return (out, lse.detach()) if validate.flag("return_lse", return_lse) else out

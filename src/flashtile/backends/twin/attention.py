"""Attention with flashtile's full mask semantics, in plain torch ops, chunked over queries.

This is the CPU path of the canonical internal call that both public APIs reduce to, and
the readable twin of the Triton forward kernel: same visibility rule, same score pipeline
(scale, softcap, ALiBi, float mask), same empty-row convention (out 0, LSE -inf).

It processes ``chunk_size`` query rows at a time, so memory is O(Sq) at fixed Sk: the
largest intermediate is a (B, H, chunk_size, Sk) score block, never (Sq, Sk) for the whole
sequence. Grouped-query attention folds the query heads of a group into the row dimension
of one matmul against their shared key/value head, so K and V are never repeated per head.

Everything is ordinary differentiable torch (no in-place ops on tensors that carry grad),
so ``torch.autograd`` differentiates it and float64 ``gradcheck`` runs on it.
"""

from __future__ import annotations

import torch
import torch.utils.checkpoint

from flashtile.backends.twin.philox import keep_mask

__all__ = ["chunked_attention_forward", "varlen_forward", "visible_mask", "visible_mask_rows", "host_spans"]


def visible_mask_rows(
    row_start: int,
    row_end: int,
    seqlen_k: int,
    diag_offset: int,
    window_left: int,
    window_right: int,
    device: torch.device | str | None = None,
    chunk: int = 0,
) -> torch.Tensor:
    """Visibility of every key for query rows ``row_start <= i < row_end``.

    Key j is visible to query i iff
    ``(window_left < 0 or j >= i + diag_offset - window_left)`` and
    ``(window_right < 0 or j <= i + diag_offset + window_right)``.
    Causal is ``window_right = 0``; ``diag_offset = Sk - Sq`` aligns the diagonal
    bottom-right (flash-attn), ``diag_offset = 0`` top-left (SDPA). Example, Sq=3, Sk=5,
    causal bottom-right (diag_offset=2)::

        i=0  x x x . .
        i=1  x x x x .
        i=2  x x x x x

    With ``chunk`` > 0 (chunked attention), also ``c <= j < c + chunk`` for c =
    floor((i + diag_offset) / chunk) * chunk: query and key in one chunk of positions.

    Returns:
        bool tensor of shape (row_end - row_start, seqlen_k), True = visible.
    """
    rows = torch.arange(row_start, row_end, device=device, dtype=torch.int64)
    cols = torch.arange(seqlen_k, device=device, dtype=torch.int64)
    # Signed distance of key j from query i's diagonal: 0 on it, > 0 to its right.
    rel = cols[None, :] - (rows[:, None] + diag_offset)
    visible = torch.ones(rel.shape, dtype=torch.bool, device=device)
    if window_left >= 0:
        visible = visible & (rel >= -window_left)
    if window_right >= 0:
        visible = visible & (rel <= window_right)
    if chunk > 0:
        start = torch.div(rows + diag_offset, chunk, rounding_mode="floor")[:, None] * chunk
        visible = visible & (cols[None, :] >= start) & (cols[None, :] < start + chunk)
    return visible


def visible_mask(
    seqlen_q: int,
    seqlen_k: int,
    diag_offset: int,
    window_left: int,
    window_right: int,
    device: torch.device | str | None = None,
    chunk: int = 0,
) -> torch.Tensor:
    """The full (Sq, Sk) bool visibility matrix; see :func:`visible_mask_rows`.

    For tests and small shapes only: it is O(Sq * Sk). The chunked forward builds the rows
    of one chunk at a time with :func:`visible_mask_rows` instead.
    """
    return visible_mask_rows(0, seqlen_q, seqlen_k, diag_offset, window_left, window_right, device, chunk)


def chunked_attention_forward(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    *,
    scale: float,
    diag_offset: int = 0,
    window_left: int = -1,
    window_right: int = -1,
    softcap: float = 0.0,
    alibi_slopes: torch.Tensor | None = None,
    attn_mask: torch.Tensor | None = None,
    chunk_size: int = 256,
    dropout_p: float = 0.0,
    dropout_seed: int | None = None,
    batch_offset: int = 0,
    sink: torch.Tensor | None = None,
    chunk: int = 0,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Exact attention forward in torch ops, ``chunk_size`` query rows at a time.

    Args:
        q: (B, H, Sq, D) queries, any strides.
        k: (B, Hk, Sk, D) keys, any strides; ``H % Hk == 0`` and query head h reads
            key/value head ``h // (H // Hk)``.
        v: (B, Hk, Sk, D) values, same head dim as q.
        scale: softmax scale multiplied into q . k.
        diag_offset: query i's diagonal sits at key ``i + diag_offset``
            (``Sk - Sq`` for flash-attn's bottom-right alignment, 0 for SDPA's top-left).
        window_left, window_right: key j is visible to query i iff
            ``(window_left < 0 or j >= i + diag_offset - window_left)`` and
            ``(window_right < 0 or j <= i + diag_offset + window_right)``; -1 means
            unbounded on that side, causal is ``window_right = 0``.
        softcap: if > 0, scores become ``softcap * tanh(s / softcap)``.
        alibi_slopes: optional float32 (B, H) (may be an expanded, stride-0 view); adds
            ``-alibi_slopes[b, h] * |i + diag_offset - j|`` to the scores.
        attn_mask: optional (B, H, Sq, Sk) (may be expanded, stride 0), bool or floating.
            bool: False hides the key (True = keep). floating: added to the scores.
        chunk_size: query rows per chunk; bounds the score block to (B, H, chunk_size, Sk).
        dropout_p: drop each probability with this chance and scale the kept ones by
            1 / (1 - dropout_p); lse is that of the undropped row. The mask is the kernels'
            own (``philox.keep_mask``): Philox keyed by ``dropout_seed`` (drawn from torch's
            generator when None), element (bh, i, j) with bh = (b + batch_offset) * H + h.
        dropout_seed, batch_offset: the Philox key, and the first batch index (a packed
            call runs one sequence at a time: its index is its b).
        sink: optional (H,) logits, one per query head, that join only the softmax's
            denominator (natural units, not scaled): ``lse_i = log(exp(sink_h) + sum_j
            exp(s_ij))``; a row that sees no key then gets out 0 and lse sink_h.
            Differentiable.
        chunk: chunked attention (0: off): query i sees only keys in its own chunk of
            ``chunk`` positions (:func:`visible_mask_rows`).

    The score of a visible key is, in this order,
    ``s = scale * (q_i . k_j)``; softcap; ``+ alibi``; ``+ float mask``. Then
    ``p = softmax(s)`` over the visible keys, ``out_i = sum_j p_ij v_j`` and
    ``lse_i = log(sum_j exp(s_ij))`` (natural log). A row with no visible key, or whose
    scores are all -inf, gives out 0 and lse -inf (and zero gradients), never NaN; any
    other NaN/inf in the data propagates.

    Arithmetic is float32 for fp16/bf16/fp32 inputs and float64 for float64 inputs.

    Returns:
        out: (B, H, Sq, D) in q.dtype, contiguous.
        lse: (B, H, Sq) float32 (float64 for float64 inputs), contiguous.
    """
    if q.dim() != 4 or k.dim() != 4 or v.dim() != 4:
        raise ValueError(
            f"q, k, v must be 4-D (B, H, S, D); got {tuple(q.shape)}, {tuple(k.shape)}, {tuple(v.shape)}"
        )
    if chunk_size < 1:
        raise ValueError(f"chunk_size must be >= 1, got {chunk_size}")
    batch, num_heads, seqlen_q, head_dim = q.shape
    num_kv_heads, seqlen_k = k.shape[1], k.shape[2]
    if num_kv_heads == 0 or num_heads % num_kv_heads != 0:
        raise ValueError(
            f"query heads ({num_heads}) must be a multiple of key/value heads ({num_kv_heads})"
        )
    group = num_heads // num_kv_heads
    head_dim_v = v.shape[-1]

    compute_dtype = torch.float64 if q.dtype == torch.float64 else torch.float32

    if dropout_p > 0.0 and dropout_seed is None:
        dropout_seed = int(torch.randint(0, 2**62, (1,)).item())
    if seqlen_q == 0 or seqlen_k == 0 or batch == 0 or num_heads == 0:
        # Nothing to attend to (or no rows at all): every row is empty by definition, its
        # LSE the sink's (a graph through the sink keeps its gradient, 0 from out).
        out = torch.zeros(batch, num_heads, seqlen_q, head_dim_v, dtype=q.dtype, device=q.device)
        if torch.is_grad_enabled() and (q.requires_grad or k.requires_grad or v.requires_grad):
            # still in the inputs' graph, with zero gradients (as the kernels give them)
            never = torch.zeros((), dtype=torch.bool, device=q.device)
            for t in (q, k, v):
                if t.requires_grad:
                    out = out + torch.where(never, t.sum(), 0.0).to(q.dtype)
        lse = torch.full(
            (batch, num_heads, seqlen_q), float("-inf"), dtype=compute_dtype, device=q.device
        )
        if sink is not None:
            lse = sink.to(compute_dtype).reshape(1, num_heads, 1).expand(batch, num_heads, seqlen_q)
        return out, lse

    # One cast per tensor, O(Sk): K and V are shared by every chunk and every head of a group.
    k_c = k.to(compute_dtype)
    v_c = v.to(compute_dtype)
    # Splitting the head dim into (Hk, G) is always a view, whatever q's strides are.
    q_grouped = q.reshape(batch, num_kv_heads, group, seqlen_q, head_dim)
    slopes = None
    if alibi_slopes is not None:
        slopes = alibi_slopes.to(compute_dtype).reshape(batch, num_kv_heads, group, 1, 1)
    mask_grouped = None
    if attn_mask is not None:
        mask_grouped = attn_mask.reshape(batch, num_kv_heads, group, seqlen_q, seqlen_k)
    sinks = None
    if sink is not None:
        sinks = sink.to(compute_dtype).reshape(1, num_kv_heads, group, 1, 1)

    out_chunks: list[torch.Tensor] = []
    lse_chunks: list[torch.Tensor] = []
    neg_inf = torch.tensor(float("-inf"), dtype=compute_dtype, device=q.device)

    def attend_rows(row_start: int, row_end: int, q_grouped, k_c, v_c, slopes, mask_grouped, sinks):
        rows = row_end - row_start

        # (B, Hk, G, R, D) -> (B, Hk, G*R, D): the G heads of a group become extra rows of
        # one matmul against their shared K head, instead of repeating K per query head.
        q_rows = q_grouped[:, :, :, row_start:row_end, :].to(compute_dtype)
        q_rows = q_rows.reshape(batch, num_kv_heads, group * rows, head_dim)
        scores = torch.matmul(q_rows, k_c.transpose(-1, -2)) * scale
        scores = scores.reshape(batch, num_kv_heads, group, rows, seqlen_k)

        if softcap > 0:
            scores = softcap * torch.tanh(scores / softcap)

        if slopes is not None:
            # |i + diag_offset - j|: ALiBi is measured from the same diagonal as the window.
            distance = (
                torch.arange(seqlen_k, device=q.device, dtype=torch.int64)[None, :]
                - torch.arange(row_start, row_end, device=q.device, dtype=torch.int64)[:, None]
                - diag_offset
            ).abs()
            scores = scores - slopes * distance.to(compute_dtype)

        visible = visible_mask_rows(
            row_start, row_end, seqlen_k, diag_offset, window_left, window_right, q.device, chunk
        )
        if mask_grouped is not None:
            mask_rows = mask_grouped[:, :, :, row_start:row_end, :]
            if mask_rows.dtype == torch.bool:
                visible = visible & mask_rows
            else:
                scores = scores + mask_rows.to(compute_dtype)
        # Hidden keys get -inf (not a large negative): a valid logit of -1e5 must still win
        # over them, and exp(-inf) is exactly 0.
        scores = torch.where(visible, scores, neg_inf)

        # The max is only a shift that cancels in p and in lse, so it needs no gradient.
        row_max = scores.amax(dim=-1, keepdim=True).detach()
        if sinks is not None:
            row_max = torch.maximum(row_max, sinks.detach().expand_as(row_max))
        # Empty rows have max -inf; shifting by it would give (-inf) - (-inf) = NaN. Shift
        # by 0 instead so their p is exactly 0. A +inf or NaN max is left to propagate.
        row_max = torch.where(row_max == float("-inf"), torch.zeros_like(row_max), row_max)
        probs = torch.exp(scores - row_max)
        row_sum = probs.sum(dim=-1, keepdim=True)
        if sinks is not None:
            # The sink joins the denominator only: no value row, no dropout.
            row_sum = row_sum + torch.exp(sinks - row_max)
        # Only an empty row sums to exactly 0 (a non-empty one holds exp(0) = 1); a NaN sum
        # counts as non-empty so that NaN reaches out and lse.
        nonempty = row_sum != 0
        # Double-where: the untaken branch is computed on a safe value so neither the value
        # nor its gradient (1/l at l=0) can be NaN for empty rows.
        safe_sum = torch.where(nonempty, row_sum, torch.ones_like(row_sum))

        probs_v = probs
        if dropout_p > 0.0:
            heads = torch.arange(num_heads, device=q.device).reshape(1, num_kv_heads, group, 1, 1)
            bh = (torch.arange(batch, device=q.device).reshape(batch, 1, 1, 1, 1) + batch_offset) * num_heads + heads
            keep = keep_mask(dropout_seed, bh, torch.arange(row_start, row_end, device=q.device)[:, None],
                             torch.arange(seqlen_k, device=q.device), dropout_p)
            probs_v = torch.where(keep, probs / (1.0 - dropout_p), torch.zeros_like(probs))
        # (B, Hk, G*R, Sk) @ (B, Hk, Sk, Dv): again no per-head copy of V.
        out_rows = torch.matmul(probs_v.reshape(batch, num_kv_heads, group * rows, seqlen_k), v_c)
        out_rows = out_rows.reshape(batch, num_kv_heads, group, rows, head_dim_v) / safe_sum
        lse_rows = torch.where(nonempty, row_max + torch.log(safe_sum), neg_inf)
        return out_rows.to(q.dtype), lse_rows.squeeze(-1)

    # Under autograd each chunk is checkpointed: only its inputs are kept and its scores
    # are recomputed in the backward (the same dropout mask: it is a function of the seed),
    # so training memory stays O(Sq) too, not the sum of every chunk's scores.
    tensors = (q_grouped, k_c, v_c, slopes, mask_grouped, sinks)
    recompute = torch.is_grad_enabled() and any(t is not None and t.requires_grad for t in tensors)
    for row_start in range(0, seqlen_q, chunk_size):
        row_end = min(row_start + chunk_size, seqlen_q)
        if recompute:
            out_rows, lse_rows = torch.utils.checkpoint.checkpoint(
                attend_rows, row_start, row_end, *tensors, use_reentrant=False)
        else:
            out_rows, lse_rows = attend_rows(row_start, row_end, *tensors)
        out_chunks.append(out_rows)
        lse_chunks.append(lse_rows)

    out = torch.cat(out_chunks, dim=3).reshape(batch, num_heads, seqlen_q, head_dim_v)
    lse = torch.cat(lse_chunks, dim=3).reshape(batch, num_heads, seqlen_q)
    return out, lse


def forward(q4, k4, v4, problem, alibi, mask, seed=None, sink=None) -> tuple[torch.Tensor, torch.Tensor]:
    """The twin of a canonical call (``problem.spec``): q4 (B, H, Sq, D), k4/v4 (B, Hk, Sk,
    D) views -> out (B, H, Sq, D) laid out (B, Sq, H, D) in memory, as the kernels lay it,
    and lse (B, H, Sq) float32. ``seed``: the dropout's Philox key (an int64 tensor), as
    the kernels take it. ``sink``: None or (H,) float32. Differentiable."""
    from flashtile.backends import layout

    out, lse = chunked_attention_forward(
        q4, k4, v4, scale=problem.scale, diag_offset=problem.diag_offset, window_left=problem.window_left,
        window_right=problem.window_right, softcap=problem.softcap, alibi_slopes=alibi, attn_mask=mask,
        dropout_p=problem.dropout_p, dropout_seed=None if seed is None else int(seed.item()), sink=sink,
        chunk=problem.chunk)
    if torch.is_grad_enabled() and (out.requires_grad or lse.requires_grad):
        return out.to(q4.dtype).transpose(1, 2).contiguous().transpose(1, 2), lse.to(torch.float32)
    out4 = layout.bshd_view(q4, v4.shape[-1])
    lse_out = layout.new_lse(q4)
    out4.copy_(out)
    lse_out.copy_(lse)
    return out4, lse_out


def host_spans(varlen) -> list[tuple[int, int, int, int]]:
    """(q start, q length, k start, k length) of every sequence of a packed call
    (``problem.spec.Varlen``), its lengths cut to seqused, read on the host (one copy per
    tensor): for the twin and S_dmask, never for the kernels."""
    cu_q, cu_k, used_q, used_k = (None if t is None else t.tolist() for t in tuple(varlen)[:4])
    spans = []
    for b in range(len(cu_q) - 1):
        len_q, len_k = cu_q[b + 1] - cu_q[b], cu_k[b + 1] - cu_k[b]
        if used_q is not None:
            len_q = min(used_q[b], len_q)
        if used_k is not None:
            len_k = min(used_k[b], len_k)
        spans.append((cu_q[b], len_q, cu_k[b], len_k))
    return spans


def varlen_forward(q4, k4, v4, problem, alibi, varlen, seed=None, sink=None) -> tuple[torch.Tensor, torch.Tensor]:
    """The twin of a packed call: ``chunked_attention_forward`` once per sequence (its
    bounds read on the host: CPU tensors), rows past a sequence's used length 0 / -inf.
    q4 (1, H, total_q, D) -> out (1, H, total_q, D) laid out (1, total_q, H, D), lse (1, H,
    total_q). Sequence b draws its dropout mask as batch b (as the kernels). ``sink``: None
    or (H,) float32; rows of a sequence with no keys get lse sink (rows outside every
    sequence keep -inf). Differentiable."""
    heads, total_q = q4.shape[1], q4.shape[2]
    if seed is not None:
        dropout_seed = int(seed.item())
    else:  # one key for every sequence
        dropout_seed = int(torch.randint(0, 2**62, (1,)).item()) if problem.dropout_p > 0.0 else None
    outs, lses, row = [], [], 0

    def gap(start, end):
        # Rows that see no key: 0 / -inf, still in q's graph (zero gradient, as the kernels).
        rows = q4[:, :, start:end, :1].expand(-1, -1, -1, v4.shape[-1])
        outs.append(torch.where(torch.zeros((), dtype=torch.bool, device=q4.device), rows, 0.0))
        lses.append(torch.full((1, heads, end - start), float("-inf"), device=q4.device))

    for b, (start_q, len_q, start_k, len_k) in enumerate(host_spans(varlen)):
        if start_q > row:
            gap(row, start_q)
        if len_k == 0 and sink is None:
            row = start_q  # every row of this sequence is empty: a gap, below or at the next one
            continue
        out, lse = chunked_attention_forward(
            q4[:, :, start_q:start_q + len_q], k4[:, :, start_k:start_k + len_k], v4[:, :, start_k:start_k + len_k],
            scale=problem.scale, diag_offset=len_k - len_q, window_left=problem.window_left,
            window_right=problem.window_right, softcap=problem.softcap,
            alibi_slopes=None if alibi is None else alibi[b:b + 1], dropout_p=problem.dropout_p,
            dropout_seed=dropout_seed, batch_offset=b, sink=sink, chunk=problem.chunk)
        outs.append(out.to(q4.dtype))
        lses.append(lse.to(torch.float32))
        row = start_q + len_q
    if total_q > row or not outs:
        gap(row, total_q)
    out = torch.cat(outs, dim=2)
    return out.transpose(1, 2).contiguous().transpose(1, 2), torch.cat(lses, dim=2)

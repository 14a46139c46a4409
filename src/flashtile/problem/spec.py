"""The problem every entry point reduces to: what is computed, without the tensors.

Every public function (``flash_attn_func``, the varlen and kv-cache functions, SDPA, the
context-parallel layers) checks its arguments (``problem.validate``) and reduces them to
the canonical call:

    q and k (B, H/Hk, S, D), v (B, Hk, Sk, Dv) (Dv may differ from D), any strides with unit
    stride along the head dim; out (B, Sq, H, Dv);
    query head h reads key/value head h // (H // Hk). Key j is visible to query i iff
        (window_left  < 0 or j >= i + diag_offset - window_left) and
        (window_right < 0 or j <= i + diag_offset + window_right) and
        (no bool attn_mask, or attn_mask[b, h, i, j]).
    s_ij = scale * q_i.k_j -> softcap * tanh(s / softcap) -> - slope[b, h] * |i + diag_offset - j|
           -> + float attn_mask[b, h, i, j];  out_i = softmax_j(s_ij) v;  lse_i = logsumexp_j s_ij.
    Rows that see no key get out 0 and lse -inf.
    Chunked attention (chunk > 0, FA3's attention_chunk): key j is visible to query i only
    if both lie in one chunk of ``chunk`` positions: c <= j < c + chunk with c =
    floor((i + diag_offset) / chunk) * chunk (a row at a negative position sees no key).
    With a sink (a (H,) float32 logit per query head, natural units, not scaled), it joins
    only the denominator: lse_i = log(exp(sink[h]) + sum_j exp(s_ij)), out_i = sum_j
    exp(s_ij - lse_i) v_j; a row that sees no key gets out 0 and lse sink[h].

A packed (varlen) call is that problem with B = 1 over the packed token axis, each
sequence with its own diagonal len_k - len_q (``Varlen``). ``Problem`` holds the scalars;
the tensors (q, k, v, ALiBi slopes, a mask, the sinks, the varlen metadata) travel beside
it. New score and mask functions and FP8 scales are fields to come (their issues).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, NamedTuple


@dataclass(frozen=True)
class Problem:
    """The scalars of a validated call (module docstring for their meaning).

    The window is normalised (``problem.window.effective_window``): a side that hides no
    key is -1, so ``window_right == 0`` is exactly a causal diagonal that hides a key;
    so is the chunk (``effective_chunk``: 0 when it hides no key). flash-attn's
    bottom-right causal is ``diag_offset = Sk - Sq``, SDPA's top-left 0.
    """

    scale: float
    diag_offset: int = 0
    window_left: int = -1
    window_right: int = -1
    softcap: float = 0.0
    dropout_p: float = 0.0
    deterministic: bool = False
    chunk: int = 0

    @property
    def causal(self) -> bool:
        """The right side of the window is the diagonal (causal, with or without a left side)."""
        return self.window_right == 0

    @property
    def local(self) -> bool:
        """Some side of the window is bounded (causal included)."""
        return self.window_left >= 0 or self.window_right >= 0


class Varlen(NamedTuple):
    """A packed call's metadata (validated): int32 offsets (batch + 1,), optional int32
    used lengths (batch,), and host bounds on the longest sequences. As a tuple it is the
    six trailing arguments of the ``flashtile`` ops, in this order."""

    cu_seqlens_q: Any
    cu_seqlens_k: Any
    seqused_q: Any = None
    seqused_k: Any = None
    max_seqlen_q: int = 0
    max_seqlen_k: int = 0

    @property
    def batch(self) -> int:
        return self.cu_seqlens_q.shape[0] - 1

    @property
    def seqused(self) -> bool:
        """Some sequence may use fewer tokens than its rows (seqused_q or seqused_k)."""
        return self.seqused_q is not None or self.seqused_k is not None


@dataclass(frozen=True)
class CacheSpec:
    """What a ``flash_attn_with_kvcache`` call is besides its tensors: the attention scalars
    (``Problem``'s; the diagonal is per sequence, len_k - seqlen_q) and the cache's shape.

    ``capacity``: keys a sequence's cache holds (rows, or block_table's pages x page size);
    ``batch_cache``: rows of a row cache; ``num_blocks``/``page``: a paged cache's pages
    (0 when not paged); ``new``: keys appended per sequence; ``queries``: seqlen_q;
    ``rotary_len``: positions of the rotary tables (-1: no rotary); ``rotary_local``: q
    rotated at its own positions (causal or windowed calls) rather than at the cache end;
    ``chunk``: chunked attention (0: off), chunks counted from each sequence's first key;
    ``padding``: a sequence with a negative cache_seqlens is padding (``padding_sequences``):
    nothing appended or read, out 0.
    """

    scale: float
    softcap: float
    window_left: int
    window_right: int
    interleaved: bool
    rotary_local: bool
    num_splits: int
    new: int
    queries: int
    capacity: int
    batch_cache: int
    num_blocks: int
    page: int
    rotary_len: int
    chunk: int = 0
    padding: bool = False

"""Attention against a KV cache (``flash_attn_with_kvcache``): append, split-KV decode, combine.

A decode step is bound by reading the cache, so the kernels here are built around that
read:

* **GQA packing.** One program serves all ``group = nheads // nheads_k`` query heads of one
  KV head: its rows are (query token, head in the group) pairs, row r = t * group + g, so
  each K/V tile is read from HBM once per step, not once per query head.
* **Split-KV.** The cache length is cut into ``num_splits`` chunks of ``split_size`` keys
  (a multiple of the key tile); each program takes one chunk and writes its normalised
  output (float32) and LSE; ``combine_kernel`` merges the chunks:
  out = sum_s exp(lse_s - lse) out_s, lse = logsumexp_s lse_s. With one split the decode
  kernel writes the final output itself. ``choose_splits`` fills the GPU when batch x
  nheads_k alone would not. ``FLASHTILE_DECODE_COMBINE=fused`` merges in the decode
  kernel instead: the last split of each group to finish does it (``_last_split_combines``,
  behind a per-group counter that it leaves at 0), and no ``combine_kernel`` runs. On an
  H100 under CUDA graphs it is 1-5 us slower a step (B1 x 4096: 12.1 us against 9.1; B1 x
  8192: 16.8 against 12.0, run 130), as the last split's merge of 16-32 splits is serial
  after every split's work; eager it is faster (one launch less, host bound at small
  batch). So ``auto``, the default, fuses an eager step with a small cache read only
  (``fuse_step``) and never a captured one. Run 129 measured its parts: the arrival costs
  ~1 us, the merge the rest (it was 35.5 us at B1 x 8192 while its loops summed over
  splits across warps).
* **Addressing.** Keys are read where they are: cache row ``cache_batch_idx[b]`` (or b)
  from ``cache_leftpad[b]``, or page ``block_table[b, p // page]`` at ``p % page``. When
  the page size is a multiple of the key tile a tile lies in one page (one table read per
  tile); any other page size gathers the page of every key.
* **Append.** The new keys (rotary, at their cache index) and values go into the cache
  before they are read. For a short append (at most ``FUSED_APPEND_MAX`` tokens: a decode
  step) the decode kernel does it: each program writes the new tokens that fall in its
  split, then a CTA barrier, then its loop reads them back from the cache like any other
  key (a program reads only its own split, and the programs of one split write the same
  values, so none waits on another). A longer one, or ``FLASHTILE_DECODE_APPEND=separate``,
  runs ``append_kernel`` first (one launch more). The decode kernel rotates the queries as
  it loads them.

Sequence b has ``len_k = cache_seqlens[b] + seqlen_new - leftpad[b]`` keys; query token t
sees key j (0-based from leftpad) iff ``j <= t + len_k - seqlen_q + window_right`` and
``j >= t + len_k - seqlen_q - window_left`` (each bound only where that side is limited).
Metadata values are clamped in the kernels (a start in [0, capacity - seqlen_new], a pad
in [0, start], rows and blocks in range), so values no one checked cannot address memory
outside the cache. The values are checked before any write: on the host when they are
there, else by ``check_kernel`` on the device; when it finds an error (``status[0] != 0``)
the append writes nothing and the output and LSE are NaN (see ``flashtile.api.kvcache``).
``FLASHTILE_DECODE_CHECK=fused`` (on an H100 it saves ~6 us of host time a call eager but
costs 1-2 us of GPU time at small batch: ``auto`` as for the combine) checks them in the
decode kernel instead, where it is the call's only writer: the first of its programs to
take a ticket checks, and every program waits for that verdict before its first write
(``decode_kernel``'s docstring), so a decode step with the fused combine is one launch.
``FLASHTILE_DECODE_CHECK=spread`` (``auto``'s choice under CUDA-graph capture and for an
eager step past ``FUSE_BYTES_MAX``, where the step allows it: ``spread_step``) needs no
check launch and no wait: each decode program checks what its split reads
(``_check_split``: one verdict slot each), the decode kernel writes no cache and reads the
new tokens from k and v in a key tile of their own, and ``finish_kernel`` (the combine's
place) merges the splits, appends the new tokens where no slot holds an error, and writes
``check_kernel``'s status. On an H100 under graphs it is 0.1-1.0 us a step faster than the
check kernel's three launches at batch 1-4 (runs 167, 169).
"""

from __future__ import annotations

import triton
import triton.language as tl
from triton.language.extra.cuda import gdc_launch_dependents, gdc_wait

from flashtile.backends.triton.scores import C_LN2, C_LOG2E, LOG2E, add_sink, chunk_start, scores
from flashtile.problem.window import effective_window
from flashtile.runtime.device import capability_of, device_context, device_index, dram_gbps_per_sm, sm_count
from flashtile.runtime.launch import Launcher
from flashtile.runtime import settings
from flashtile.runtime.replay import capturing, stream_counter

# The decode kernel appends the new keys itself (one launch less) when a call brings at
# most this many (a decode step brings 1, speculative decoding a few); a longer chunk (a
# prefill through the cache) takes the append kernel first: its launch is then small next
# to the work, and the decode kernel's append loop would run long in one program per split.
FUSED_APPEND_MAX = 64
# FLASHTILE_DECODE_COMBINE / _CHECK ``auto``: an eager step that reads at most this many
# cache bytes is bound by the host's launches, not by its reads, so it folds the combine and
# the metadata check into the decode kernel (one launch instead of three: H100 eager host
# 45-46 -> 28-30 us, run 130). A longer read, or any step captured in a CUDA graph, keeps the
# two kernels: they cost 1-5 us less GPU time (B1 L8192 12.0 vs 16.8 us under graphs), which
# is what a GPU-bound step pays. 48 MiB is ~20 us of reads on an H100 (B1 x 8k-12k cached
# tokens at 8 KV heads of 128, bf16), below the ~43 us the separate launches cost its host.
FUSE_BYTES_MAX = 48 << 20
# New tokens per step of that loop: the call's count up to 16; 8 above a head dim of 256
# (MLA's 576: 16 a step spilled 32 B on sm_90a, 8 none; sm90_check, session 21).
APPEND_T_MAX = 16
# status codes (status[0]); status[1], status[2] say where, status[3] the value found
OK, BAD_SEQLEN, BAD_LEFTPAD, BAD_BATCH_IDX, BAD_BLOCK, BAD_ROTARY = 0, 1, 2, 3, 4, 5
# the same codes as the kernels see them (a @triton.jit function reads only constexpr globals)
_C_SEQLEN, _C_LEFTPAD, _C_BATCH_IDX, _C_BLOCK, _C_ROTARY = map(
    tl.constexpr, (BAD_SEQLEN, BAD_LEFTPAD, BAD_BATCH_IDX, BAD_BLOCK, BAD_ROTARY))
MAX_SPLITS = 128
# Small batches (``choose_splits``): about 1.5 programs per SM where each split then holds at
# most this many keys, per layout. H100 runs 186-189, GQA 32/8 generation steps under graphs:
# a page gather's best counts held 341-1365 keys a split (batch 8 x 32k keys at 1.5 per SM,
# 10923 keys a split, ran 499 us against 373 at 3 per SM); a row cache's best counts gave
# 1.5 per SM up to 683 keys a split (batch 1 x 4k-16k, batch 2 x 4k-8k, batch 4 x 4k) and
# one per SM from 1365 (batch 1 x 32k, batch 2 x 16k, batch 4 x 8k: 2-4% less there).
FEW_KEYS_MAX_GATHER = 2048
FEW_KEYS_MAX_ROWS = 1024
# One wave of long splits (``choose_splits``): one program per SM while the GPU's DRAM
# bandwidth per SM is at most this many GB/s, else two (``wave_per_sm``). An H100 SXM has
# 25 GB/s per SM: one per SM measured up to 4% faster than two (run 178). An H200 has 36:
# with one per SM its steps read 3.8-3.9 TB/s where cuDNN reads 4.3-4.5 (run 211: 0.88-0.90x
# at batch 8 x 32k, batch 4 x 32k, batch 1 x 131k), the rows at two or more programs per SM
# read 0.98x cuDNN in the same run, and run 75's two per SM read 4.1-4.3 TB/s (0.96-0.99x).
# Never measured near the line: an H100 NVL or a GH200 (about 30 per SM) may fall either side.
WAVE_GBPS_PER_SM = 30
# Table entries the device check reads a step (``_first_bad_page``; 8 warps: 8 a thread), and
# inside the decode kernel (4 warps) when it checks the metadata itself.
CHECK_BLOCK_E = 2048
FUSED_CHECK_BLOCK_E = 1024
# The spread check (FLASHTILE_DECODE_CHECK=spread): table entries a decode program checks a
# step (its split's pages: 16 at 256 keys of pages of 16), and the most verdict slots (batch x
# splits) that ``finish_kernel``'s programs each read as one tile (2 KiB of codes).
SPREAD_BLOCK_E = 128
SPREAD_SLOTS_MAX = 512
# num_stages of the decode kernel. 3 double-buffers the K and V tiles of a row cache. When a
# tile lies in one page ("tile") its block-table read is one more pipeline stage in front
# of the tile, and Triton 3.6 gives K and V two buffers only from 5 stages on (one buffer
# and a full wait per tile at 3 or 4: sm90_check's TTGIR); the H200 measured 4.24 TB/s at 5
# vs 3.59 at 3 (batch 8 x 32768, page 256). A per-key gather ("gather", pages smaller than
# the tile) measured best at 3 (3.77 vs 3.46 TB/s at batch 64 x 8192, page 16).
# benchmarks/sweep_decode.py --stages-paged overrides "tile" and "gather".
STAGES = {"rows": 3, "tile": 5, "gather": 3}
# A per-key page gather whose split spans at most this many pages reads the split's table
# entries once, before the loop, and takes each key's page from registers (tl.gather): its
# K/V addresses then wait on no load inside the loop, which Triton pipelines like a row
# cache. H200 (page 16, best split count): 3.01 -> 3.22 TB/s at batch 8 x 32768, 3.73 ->
# 3.97 at batch 64 x 8192 (0 turns it off; benchmarks/sweep_decode.py --page-slice).
PAGE_SLICE_MAX = 512


@triton.jit
def _rotary_tile(X, row_off, row_ok, offs_d, d_ok, pos, Cos, Sin, stride_cos, rotary_dim,
                 ROTARY: tl.constexpr, INTERLEAVED: tl.constexpr):
    """Rows ``X + row_off`` (BLOCK_R, BLOCK_D) in X's dtype, rotated at positions ``pos``
    over their first ``rotary_dim`` features when ROTARY (computed in float32 and rounded
    back, as ``backends.twin.kvcache.apply_rotary``): GPT-J pairs (2i, 2i + 1) when INTERLEAVED,
    else GPT-NeoX halves (i, i + rotary_dim / 2)."""
    ok = row_ok[:, None] & d_ok[None, :]
    x = tl.load(X + row_off[:, None] + offs_d[None, :], mask=ok, other=0.0)
    if ROTARY:
        half = rotary_dim // 2
        if INTERLEAVED:
            partner = offs_d ^ 1
            idx = offs_d // 2
            first = offs_d % 2 == 0
        else:
            first = offs_d < half
            partner = tl.where(first, offs_d + half, offs_d - half)
            idx = tl.where(first, offs_d, offs_d - half)
        rot = row_ok[:, None] & (offs_d < rotary_dim)[None, :]
        xp = tl.load(X + row_off[:, None] + partner[None, :], mask=rot, other=0.0).to(tl.float32)
        cs = pos.to(tl.int64)[:, None] * stride_cos + idx[None, :]
        c = tl.load(Cos + cs, mask=rot, other=1.0).to(tl.float32)
        s = tl.load(Sin + cs, mask=rot, other=0.0).to(tl.float32)
        xf = x.to(tl.float32)
        # first of a pair: a c - b s; second: b c + a s (xp is the partner)
        y = tl.where(first[None, :], xf * c - xp * s, xf * c + xp * s)
        x = tl.where(rot, y.to(x.dtype), x)
    return x


@triton.jit
def _seq_bounds(SeqLens, LeftPad, b, new, capacity, HAS_LEFTPAD: tl.constexpr):
    """(cache_seqlens[b] clamped to [0, capacity - new], leftpad clamped to [0, that],
    cache_seqlens[b] as given)."""
    raw = tl.load(SeqLens + b)
    n = tl.minimum(tl.maximum(raw, 0), capacity - new)
    pad = n * 0
    if HAS_LEFTPAD:
        pad = tl.minimum(tl.maximum(tl.load(LeftPad + b), 0), n)
    return n, pad, raw


@triton.jit
def _first_bad_page(SeqLens, Table, before, new, num_blocks, page_size, max_blocks, stride_table,
                    BLOCK_E: tl.constexpr, PADDING: tl.constexpr):
    """The first bad block_table entry (an index outside [0, num_blocks)) among the pages
    sequences 0 .. before - 1 address after the append, as a flat index b * max_blocks + j
    (1 << 30: none). The table is read as one flat array, BLOCK_E entries a step, each
    entry's load independent of its sequence's length (a row's entries past its pages are
    read and ignored), and each lane keeps its own minimum (one reduction, after the loop),
    so a step waits on one load latency and no barrier: the per-sequence loop before this
    one waited on a load and a CTA-wide reduction per 16 pages (2048 pages of 16 at 32k
    tokens: 128 steps)."""
    NONE: tl.constexpr = 1 << 30
    end = before * max_blocks
    first = tl.full([BLOCK_E], NONE, tl.int32)  # per lane: no reduction (no CTA barrier) inside the loop
    for e0 in range(0, end, BLOCK_E):
        e = e0 + tl.arange(0, BLOCK_E)
        live = e < end
        b = e // max_blocks
        j = e - b * max_blocks
        n = tl.load(SeqLens + b, mask=live, other=0)
        blk = tl.load(Table + b.to(tl.int64) * stride_table + j, mask=live, other=0)
        if PADDING:
            live = live & (n >= 0)
        want = live & (j < (n + new + page_size - 1) // page_size)
        bad = want & ((blk < 0) | (blk >= num_blocks))
        first = tl.minimum(first, tl.where(bad, e, NONE))
    return tl.min(first, 0)


@triton.jit
def _value_errors(SeqLens, LeftPad, BatchIdx, b, ok, new, queries, capacity, batch_cache, rotary_len,
                  HAS_LEFTPAD: tl.constexpr, HAS_BATCH_IDX: tl.constexpr, ROTARY: tl.constexpr,
                  ROTARY_LOCAL: tl.constexpr, PADDING: tl.constexpr):
    """(code, value) of sequences ``b`` (where ``ok``; a scalar or a vector): the first of the
    checks seqlen, leftpad, batch_idx, rotary length that fails (0: none; a padding sequence,
    PADDING and a negative cache_seqlens, has nothing to check) and the value it found."""
    n = tl.load(SeqLens + b, mask=ok, other=0)
    if PADDING:
        ok = ok & (n >= 0)
    err = tl.where(ok & ((n < 0) | (n + new > capacity)), _C_SEQLEN, 0)
    val = n
    if HAS_LEFTPAD:
        pad = tl.load(LeftPad + b, mask=ok, other=0)
        bad = ok & (err == 0) & ((pad < 0) | (pad > n))
        err = tl.where(bad, _C_LEFTPAD, err)
        val = tl.where(bad, pad, val)
    if HAS_BATCH_IDX:
        row = tl.load(BatchIdx + b, mask=ok, other=0)
        bad = ok & (err == 0) & ((row < 0) | (row >= batch_cache))
        err = tl.where(bad, _C_BATCH_IDX, err)
        val = tl.where(bad, row, val)
    if ROTARY:
        if ROTARY_LOCAL:
            need = n + tl.maximum(new, queries)
        else:
            need = n + tl.maximum(new, 1)
        bad = ok & (err == 0) & (need > rotary_len)
        err = tl.where(bad, _C_ROTARY, err)
        val = tl.where(bad, need, val)
    return err, val


@triton.jit
def _check_split(Slots, slots, SeqLens, LeftPad, BatchIdx, Table, b, split, split_size, num_splits, new, queries,
                 capacity, batch_cache, num_blocks, page_size, max_blocks, stride_table, rotary_len,
                 HAS_LEFTPAD: tl.constexpr, HAS_BATCH_IDX: tl.constexpr, PAGED: tl.constexpr,
                 ROTARY: tl.constexpr, ROTARY_LOCAL: tl.constexpr, PADDING: tl.constexpr, BLOCK_E: tl.constexpr):
    """The spread check's part of one decode program (``decode_kernel``, SPREAD): slot
    b * num_splits + split of Slots (int32 (3, slots): codes, block indices, values;
    ``scratch``) = (code, block index, value) of sequence b's first error where this split
    can see it: its values (``_value_errors``; every split checks them), else the first bad
    block_table entry among the pages that start inside the split's keys and that the
    sequence holds after the append (0, 0, 0: none). Taken in the order (sequence, split),
    the first slot with an error is ``check_kernel``'s status."""
    NONE: tl.constexpr = 1 << 30
    err, val = _value_errors(SeqLens, LeftPad, BatchIdx, b, b >= 0, new, queries, capacity, batch_cache,
                             rotary_len, HAS_LEFTPAD, HAS_BATCH_IDX, ROTARY, ROTARY_LOCAL, PADDING)
    where_j = 0
    if PAGED:
        raw = tl.load(SeqLens + b)
        # the sequence's pages after the append (none where a value is bad: that error is reported)
        held = tl.where((err == 0) & (raw >= 0), tl.minimum((raw + new + page_size - 1) // page_size, max_blocks), 0)
        j_hi = tl.minimum(((split + 1) * split_size + page_size - 1) // page_size, held)
        first = tl.full([BLOCK_E], NONE, tl.int32)
        for e0 in range((split * split_size + page_size - 1) // page_size, j_hi, BLOCK_E):
            e = e0 + tl.arange(0, BLOCK_E)
            live = e < j_hi
            blk = tl.load(Table + b.to(tl.int64) * stride_table + e, mask=live, other=0)
            first = tl.minimum(first, tl.where(live & ((blk < 0) | (blk >= num_blocks)), e, NONE))
        first = tl.min(first, 0)
        hit = first < NONE
        where_j = tl.where(hit, first, 0)
        blk = tl.load(Table + b.to(tl.int64) * stride_table + where_j, mask=hit, other=0)
        err = tl.where(hit, _C_BLOCK, err)
        val = tl.where(hit, blk, val)
    slot = Slots + b * num_splits + split
    tl.store(slot, err)
    tl.store(slot + slots, where_j)
    tl.store(slot + 2 * slots, tl.where(err != 0, val, 0))


@triton.jit
def _softmax_step(s, l_i, m_i):
    """One key tile of the online softmax (base 2): s (rows, keys) -> (p, alpha, l_i, m_new):
    the tile's weights, the rescale of the running sums and the new running sum and max."""
    m_new = tl.maximum(m_i, tl.max(s, 1))
    m_use = tl.where(m_new == float("-inf"), 0.0, m_new)
    p = tl.exp2(s - m_use[:, None])
    alpha = tl.exp2(m_i - m_use)
    return p, alpha, l_i * alpha + tl.sum(p, 1), m_new


@triton.jit
def _load_new(KNew, VNew, Cos, Sin, b64, hk64, j, j_ok, base, n, offs_d, d_ok, offs_dv, dv_ok,
              stride_nkb, stride_nks, stride_nkh, stride_nvb, stride_nvs, stride_nvh, stride_cos, rotary_dim,
              rotary_max, ROTARY: tl.constexpr, INTERLEAVED: tl.constexpr):
    """The spread check's new keys and values at key indices ``j`` (new token j - base, cache
    position n + j - base): k (keys, D) rotated there in KNew's dtype, v (keys, Dv)."""
    tn64 = (j - base).to(tl.int64)
    k = _rotary_tile(KNew + b64 * stride_nkb + hk64 * stride_nkh, tn64 * stride_nks, j_ok, offs_d, d_ok,
                     tl.minimum(n + j - base, rotary_max), Cos, Sin, stride_cos, rotary_dim, ROTARY, INTERLEAVED)
    v = tl.load(VNew + b64 * stride_nvb + hk64 * stride_nvh + tn64[:, None] * stride_nvs + offs_dv[None, :],
                mask=j_ok[:, None] & dv_ok[None, :], other=0.0)
    return k, v


@triton.jit
def _attend_new(q, k, v, t, j, j_ok, row_ok, acc, l_i, m_i, Mask, qk_scale, softcap_in, softcap_out, slope, diag,
                window_left, window_right, chunk, WINDOW_LEFT: tl.constexpr, WINDOW_RIGHT: tl.constexpr,
                SOFTCAP: tl.constexpr, HAS_ALIBI: tl.constexpr, CHUNK: tl.constexpr, IEEE_DOT: tl.constexpr):
    """One tile of new keys (``_load_new``'s k (keys, D), v) into the running (acc, l_i, m_i)
    of ``decode_kernel``'s loop."""
    if IEEE_DOT:
        s = tl.dot(q, tl.trans(k), input_precision="ieee")
    else:
        s = tl.dot(q, tl.trans(k))
    s, _ = scores(s, t[:, None], j[None, :], j_ok[None, :] & row_ok[:, None], Mask, None, 0, 0, 0,
                  qk_scale, qk_scale, softcap_in, softcap_out, slope[:, None], diag, window_left, window_right,
                  chunk, True, WINDOW_LEFT, WINDOW_RIGHT, SOFTCAP, HAS_ALIBI, 0, CHUNK)
    p, alpha, l_i, m_new = _softmax_step(s, l_i, m_i)
    if IEEE_DOT:
        acc = tl.dot(p.to(v.dtype), v, acc * alpha[:, None], input_precision="ieee")
    else:
        acc = tl.dot(p.to(v.dtype), v, acc * alpha[:, None])
    return acc, l_i, m_new


@triton.jit
def check_kernel(Status, SeqLens, LeftPad, BatchIdx, Table, batch, new, queries, capacity, batch_cache,
                 num_blocks, page_size, max_blocks, stride_table, rotary_len,
                 HAS_LEFTPAD: tl.constexpr, HAS_BATCH_IDX: tl.constexpr, PAGED: tl.constexpr,
                 ROTARY: tl.constexpr, ROTARY_LOCAL: tl.constexpr, BLOCK: tl.constexpr, BLOCK_E: tl.constexpr,
                 PADDING: tl.constexpr):
    """The metadata checks of ``problem.validate.cache_values`` in one program (launched
    alone, or called by the decode kernel's checker program: FUSED_CHECK): Status =
    (code, sequence, index, value) of the first sequence with an error, each sequence checked in
    the order seqlen, leftpad, batch_idx, rotary, block_table (code 0: none). PADDING: a
    negative cache_seqlens marks a padding sequence, which has nothing to check. First the
    per-sequence values, BLOCK sequences a step; then the table entries of the sequences
    before the first one with a bad value (``_first_bad_page``)."""
    NONE: tl.constexpr = 1 << 30
    code = 0
    where_b = NONE
    value = 0
    for c0 in range(0, batch, BLOCK):
        b = c0 + tl.arange(0, BLOCK)
        err, val = _value_errors(SeqLens, LeftPad, BatchIdx, b, b < batch, new, queries, capacity, batch_cache,
                                 rotary_len, HAS_LEFTPAD, HAS_BATCH_IDX, ROTARY, ROTARY_LOCAL, PADDING)
        bb = tl.min(tl.where(err != 0, b, NONE), 0)
        pick = b == bb
        take = (code == 0) & (bb < NONE)
        where_b = tl.where(take, bb, where_b)
        value = tl.where(take, tl.sum(tl.where(pick, val, 0), 0), value)
        code = tl.where(take, tl.sum(tl.where(pick, err, 0), 0), code)
    where_j = 0
    if PAGED:
        first = _first_bad_page(SeqLens, Table, tl.minimum(where_b, batch), new, num_blocks, page_size, max_blocks,
                                stride_table, BLOCK_E, PADDING)
        hit = first < NONE  # before where_b, so it comes first
        fb = tl.where(hit, first // tl.maximum(max_blocks, 1), 0)
        fj = tl.where(hit, first - fb * max_blocks, 0)
        blk = tl.load(Table + fb.to(tl.int64) * stride_table + fj, mask=hit, other=0)
        code = tl.where(hit, _C_BLOCK, code)
        where_b = tl.where(hit, fb, where_b)
        where_j = fj
        value = tl.where(hit, blk, value)
    where_b = tl.where(code == 0, 0, where_b)
    tl.store(Status, code)
    tl.store(Status + 1, where_b)
    tl.store(Status + 2, where_j)
    tl.store(Status + 3, value)


@triton.jit
def _verdict(Sync, Status):
    """The fused check's verdict (``decode_kernel``, FUSED_CHECK): wait until the checking
    program has published the status (Sync[1] != 0), then whether it found an error. One
    thread polls with relaxed loads (an acquire per poll would invalidate the SM's L1 each
    time: sm_90a's CCTL.IVALL), then one acquire, then a CTA barrier, then every thread's
    load of the status from L2."""
    go = tl.atomic_add(Sync + 1, 0, sem="relaxed", scope="gpu") == 0
    while go:
        go = tl.atomic_add(Sync + 1, 0, sem="relaxed", scope="gpu") == 0
    tl.atomic_add(Sync + 1, 0, sem="acquire", scope="gpu")
    tl.debug_barrier()
    return tl.load(Status, cache_modifier=".cg") != 0


@triton.jit
def _append_tile(K, V, KCache, VCache, BatchIdx, Table, Cos, Sin, b64, hk64, t, t_ok, n,
                 offs_d, d_ok, offs_dv, dv_ok,
                 stride_kb, stride_ks, stride_kh, stride_vb, stride_vs, stride_vh,
                 stride_cb, stride_cs, stride_ch, stride_db, stride_ds, stride_dh,
                 stride_table, stride_cos, page_size, num_blocks, batch_cache, rotary_dim, rotary_max,
                 SAME_DV: tl.constexpr, PAGED: tl.constexpr, HAS_BATCH_IDX: tl.constexpr,
                 ROTARY: tl.constexpr, INTERLEAVED: tl.constexpr):
    """New tokens ``t`` (where ``t_ok``) of sequence b, kv head hk: k (rotated at its cache
    position n + t) and v into the caches there."""
    pos = n + t
    t64 = t.to(tl.int64)
    k = _rotary_tile(K + b64 * stride_kb + hk64 * stride_kh, t64 * stride_ks, t_ok, offs_d, d_ok,
                     tl.minimum(pos, rotary_max), Cos, Sin, stride_cos, rotary_dim, ROTARY, INTERLEAVED)
    v = tl.load(V + b64 * stride_vb + hk64 * stride_vh + t64[:, None] * stride_vs + offs_dv[None, :],
                mask=t_ok[:, None] & dv_ok[None, :], other=0.0)
    if PAGED:
        blk = tl.load(Table + b64 * stride_table + pos // page_size, mask=t_ok, other=0)
        blk = tl.minimum(tl.maximum(blk, 0), num_blocks - 1).to(tl.int64)
        row_k = blk * stride_cb + (pos % page_size).to(tl.int64) * stride_cs
        row_v = blk * stride_db + (pos % page_size).to(tl.int64) * stride_ds
    else:
        row = b64
        if HAS_BATCH_IDX:
            row = tl.minimum(tl.maximum(tl.load(BatchIdx + b64), 0), batch_cache - 1).to(tl.int64)
        row_k = row * stride_cb + pos.to(tl.int64) * stride_cs
        row_v = row * stride_db + pos.to(tl.int64) * stride_ds
    # Where v_cache is a view of k_cache's first columns (MLA's latent cache), both stores
    # write those columns, from different threads in no fixed order: validate.kvcache_call
    # requires v to be k's same view (v = k[..., :Dv]), so they write the same values.
    ok = t_ok[:, None] & d_ok[None, :]
    tl.store(KCache + hk64 * stride_ch + row_k[:, None] + offs_d[None, :], k, mask=ok)
    if SAME_DV:
        ok_v = ok
    else:
        ok_v = t_ok[:, None] & dv_ok[None, :]
    tl.store(VCache + hk64 * stride_dh + row_v[:, None] + offs_dv[None, :], v, mask=ok_v)


@triton.jit
def append_kernel(
    K, V, KCache, VCache, SeqLens, BatchIdx, Table, Cos, Sin, Status,
    stride_kb, stride_ks, stride_kh, stride_vb, stride_vs, stride_vh,
    stride_cb, stride_cs, stride_ch, stride_db, stride_ds, stride_dh,
    stride_table, stride_cos,
    nheads_k, new, capacity, page_size, num_blocks, batch_cache, head_dim, head_dim_v, rotary_dim, rotary_max,
    BLOCK_T: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_DV: tl.constexpr, SAME_DV: tl.constexpr,
    PAGED: tl.constexpr, HAS_BATCH_IDX: tl.constexpr,
    ROTARY: tl.constexpr, INTERLEAVED: tl.constexpr, CHECKED: tl.constexpr, PADDING: tl.constexpr,
):
    """Program (b * nheads_k + hk, token block): k, v rows t of sequence b, head hk, into
    the cache at position cache_seqlens[b] + t (k rotated there first). The separate append
    (``FLASHTILE_DECODE_APPEND=separate``); by default the decode kernel appends."""
    pid = tl.program_id(0)
    b = pid // nheads_k
    hk = pid % nheads_k
    t = tl.program_id(1) * BLOCK_T + tl.arange(0, BLOCK_T)
    t_ok = t < new
    if CHECKED:
        t_ok = t_ok & (tl.load(Status) == 0)  # a failed check: write nothing
    if PADDING:
        t_ok = t_ok & (tl.load(SeqLens + b) >= 0)  # a padding sequence: nothing
    offs_d = tl.arange(0, BLOCK_D)
    d_ok = offs_d < head_dim
    if SAME_DV:  # v's head dim is k's: the same masks (and the machine code of before)
        offs_dv = offs_d
        dv_ok = d_ok
    else:
        offs_dv = tl.arange(0, BLOCK_DV)
        dv_ok = offs_dv < head_dim_v
    n = tl.minimum(tl.maximum(tl.load(SeqLens + b), 0), capacity - new)
    _append_tile(K, V, KCache, VCache, BatchIdx, Table, Cos, Sin, b.to(tl.int64), hk.to(tl.int64), t, t_ok, n,
                 offs_d, d_ok, offs_dv, dv_ok,
                 stride_kb, stride_ks, stride_kh, stride_vb, stride_vs, stride_vh,
                 stride_cb, stride_cs, stride_ch, stride_db, stride_ds, stride_dh,
                 stride_table, stride_cos, page_size, num_blocks, batch_cache, rotary_dim, rotary_max,
                 SAME_DV, PAGED, HAS_BATCH_IDX, ROTARY, INTERLEAVED)


@triton.jit
def _last_split_combines(Counters, group, num_splits, OutPart, LsePart, Out, Lse, Sink, b64, t, t64, h64, row_ok,
                         offs_dv, dv_ok, stride_pp, stride_pb, stride_ps, stride_ph, stride_lp, stride_lpb, stride_lph,
                         stride_ob, stride_os, stride_oh, stride_lb, stride_lh,
                         BLOCK_M: tl.constexpr, BLOCK_DV: tl.constexpr, HAS_SINK: tl.constexpr,
                         CHUNK: tl.constexpr):
    """The fused combine: after its partial results, a program arrives at its group's counter
    (Counters[group], one per (b, kv head, row block)); the last of the group's splits to
    arrive merges every split's partials, as ``combine_kernel`` does, and leaves the counter
    at 0 for the next launch. The arrival is CUTLASS's generic barrier: a CTA barrier (every
    thread's stores issued), then one gpu-scope acq_rel atomic; the winner's loads of the
    other programs' partials bypass L1 (.cg). The merge reads CHUNK splits a step (their
    LSEs as one (CHUNK, rows) tile, their partials as one (CHUNK, rows, Dv) tile): a serial
    loop of one split a step waited on a load per split (H100 run 106: B1 x 4096, 16
    splits, 17.7 us a step against 11.1 with the combine kernel)."""
    tl.debug_barrier()
    ticket = tl.atomic_add(Counters + group, 1, sem="acq_rel", scope="gpu")
    # Every thread's later loads after the one thread's acquire (Triton 3.6's broadcast of
    # the ticket has a barrier of its own; this one does not depend on it).
    tl.debug_barrier()
    if ticket == num_splits - 1:
        tl.atomic_xchg(Counters + group, 0, sem="relaxed", scope="gpu")
        # The loops keep per-split running values in the tiles' own shape, (CHUNK, rows) and
        # (CHUNK, rows, Dv), and reduce over splits once after them: a sum over the split axis
        # inside a loop crossed warps (shared memory and two barriers a step; H100 runs
        # 129-130: B1 x 8192, 32 splits, 35.5 -> 16.8 us a step). A partial's load does not
        # wait for its LSE. (Pipelining the loop's loads, tl.range num_stages=3, gained
        # nothing: run 131.)
        lse_row = LsePart + b64 * stride_lpb + h64 * stride_lph + t
        offs_c = tl.arange(0, CHUNK)
        tops = tl.full([CHUNK, BLOCK_M], float("-inf"), tl.float32)
        nans = tl.zeros([CHUNK, BLOCK_M], tl.int32)
        for s0 in range(0, num_splits, CHUNK):
            sc = s0 + offs_c
            ok = (sc < num_splits)[:, None] & row_ok[None, :]
            part_lse = tl.load(lse_row[None, :] + sc.to(tl.int64)[:, None] * stride_lp, mask=ok,
                               other=float("-inf"), cache_modifier=".cg")
            nans += (part_lse != part_lse).to(tl.int32)
            tops = tl.maximum(tops, part_lse)
        top = tl.max(tops, 0)
        if HAS_SINK:
            sink = tl.load(Sink + h64, mask=row_ok, other=float("-inf"))
            top = tl.maximum(top, sink)
        top = tl.where(top == float("-inf"), 0.0, top)
        totals = tl.zeros([CHUNK, BLOCK_M], tl.float32)
        sums = tl.zeros([CHUNK, BLOCK_M, BLOCK_DV], tl.float32)
        part_row = OutPart + b64 * stride_pb + t64[:, None] * stride_ps + h64[:, None] * stride_ph + offs_dv[None, :]
        for s0 in range(0, num_splits, CHUNK):
            sc = s0 + offs_c
            sc64 = sc.to(tl.int64)
            ok = (sc < num_splits)[:, None] & row_ok[None, :]
            part_lse = tl.load(lse_row[None, :] + sc64[:, None] * stride_lp, mask=ok, other=float("-inf"),
                               cache_modifier=".cg")
            part = tl.load(part_row[None, :, :] + sc64[:, None, None] * stride_pp,
                           mask=ok[:, :, None] & dv_ok[None, None, :], other=0.0, cache_modifier=".cg")
            w = tl.exp(part_lse - top[None, :])
            totals += w
            # a row that sees no key of a split its block's other rows see: weight 0, and its
            # partial is not read into the sum (0 * inf from a value row would be NaN), as in
            # ``combine_kernel``; selected after the load, which does not wait for the LSE
            sums += tl.where((part_lse != float("-inf"))[:, :, None], w[:, :, None] * part, 0.0)
        total = tl.sum(totals, 0)
        merged = tl.sum(sums, 0)
        nans = tl.sum(nans, 0)
        if HAS_SINK:
            total += tl.exp(sink - top)
        out = merged / tl.where(total == 0.0, 1.0, total)[:, None]
        lse = tl.where(total == 0.0, float("-inf"), top + tl.log(tl.where(total == 0.0, 1.0, total)))
        bad = nans > 0  # a NaN partial (a failed device check) stays NaN
        out = tl.where(bad[:, None], float("nan"), out)
        lse = tl.where(bad, float("nan"), lse)
        tl.store(Out + b64 * stride_ob + t64[:, None] * stride_os + h64[:, None] * stride_oh + offs_dv[None, :],
                 out.to(Out.dtype.element_ty), mask=row_ok[:, None] & dv_ok[None, :])
        tl.store(Lse + b64 * stride_lb + h64 * stride_lh + t, lse, mask=row_ok)


@triton.jit
def decode_kernel(
    Q, K, V, Out, Lse, OutPart, LsePart, Status, SeqLens, LeftPad, BatchIdx, Table, Alibi, Cos, Sin, Sink,
    KNew, VNew, Counters,
    stride_qb, stride_qs, stride_qh,
    stride_kb, stride_ks, stride_kh,
    stride_vb, stride_vs, stride_vh,
    stride_ob, stride_os, stride_oh,
    stride_pp, stride_pb, stride_ps, stride_ph,
    stride_lp, stride_lpb, stride_lph,
    stride_lb, stride_lh,
    stride_table, stride_ab, stride_ah, stride_cos,
    stride_nkb, stride_nks, stride_nkh, stride_nvb, stride_nvs, stride_nvh,
    nheads_k, group, seqlen_q, head_dim, new, capacity, page_size, num_blocks, batch_cache,
    num_splits, split_size, num_m_blocks, rotary_dim, rotary_max,
    qk_scale, softcap_in, softcap_out, window_left, window_right, chunk, head_dim_v,
    batch, max_blocks, rotary_len,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_DV: tl.constexpr,
    SAME_DV: tl.constexpr, PAGED: tl.constexpr, PAGE_TILE: tl.constexpr, PAGE_SLICE: tl.constexpr, HAS_BATCH_IDX: tl.constexpr,
    HAS_LEFTPAD: tl.constexpr,
    WINDOW_LEFT: tl.constexpr, WINDOW_RIGHT: tl.constexpr, SOFTCAP: tl.constexpr, HAS_ALIBI: tl.constexpr,
    ROTARY: tl.constexpr, INTERLEAVED: tl.constexpr, ROTARY_LOCAL: tl.constexpr,
    SPLIT: tl.constexpr, CHECKED: tl.constexpr, IEEE_DOT: tl.constexpr, HAS_SINK: tl.constexpr,
    CHUNK: tl.constexpr, APPEND: tl.constexpr, APPEND_T: tl.constexpr, FUSED_COMBINE: tl.constexpr,
    PADDING: tl.constexpr, FUSED_CHECK: tl.constexpr = False, CHECK_ROTARY: tl.constexpr = False,
    CHECK_BLOCK: tl.constexpr = 16, CHECK_BLOCK_E: tl.constexpr = 1024, COMBINE_CHUNK: tl.constexpr = 1,
    MERGE_M: tl.constexpr = 16, PDL: tl.constexpr = False, SPREAD: tl.constexpr = False,
    BLOCK_NEW: tl.constexpr = 16,
):
    """Program (b, hk, block of rows, split): rows r = t * group + g of KV head hk against
    keys [split * split_size, (split + 1) * split_size) of sequence b (module docstring).
    A sink enters once per row: here with one split, else in ``combine_kernel``.
    APPEND: the new keys and values (KNew, VNew: ``new`` tokens) that fall in this split
    are written into the cache first (what ``append_kernel`` does, one launch less), then
    read back from it: a program reads only its own split's keys, and every program of a
    split writes the same values, so no program waits on another.
    FUSED_COMBINE (with SPLIT): the last split of each group to finish merges the partials
    (``_last_split_combines``) instead of ``combine_kernel``.
    FUSED_CHECK (with CHECKED): ``check_kernel``'s work, one launch less. Each program takes
    a ticket (Counters[0]); the first to arrive checks the metadata (``check_kernel``: the
    same status) and publishes it (Counters[1], release), and takes no work item (the grid
    has one program more; the others take item ticket - 1: in H100 run 113 the checker also
    ran a split of its own, which then ended last); a program waits for that verdict
    (``_verdict``) before its first write: before appending where it has new tokens, else
    before its results. The checker waits on no one and holds a ticket, so it is running:
    no program can wait forever (the ticket order, not the program id, names it: CUDA does
    not promise that program 0 starts first). The last program to finish (Counters[2])
    leaves the three counters at 0; the fused combine's counters follow them (Counters + 4).
    SPREAD (with SPLIT, without APPEND and CHECKED): the spread check (module docstring). The
    programs of KV head 0 and the first row block check what their split reads
    (``_check_split``: a verdict slot each, in Status), no program waits on another or writes
    the cache, the new tokens are read from KNew and VNew (rotated as the append would;
    BLOCK_NEW of them a key tile: a decode step's one token in a tile of 16), and
    ``finish_kernel`` merges, appends and reports after the verdict.
    PDL (launched with Programmatic Dependent Launch, ``use_pdl``): the program waits for the
    kernels before it in the stream before it touches memory, then lets the next kernel (the
    combine) launch; that one waits for this kernel's end the same way."""
    if PDL:
        gdc_wait()
        gdc_launch_dependents()
    pid = tl.program_id(0)
    sync = Counters
    joins = True  # the program has a work item (the fused check's checker has none)
    if FUSED_CHECK:
        Counters = Counters + 4  # the fused combine's counters follow the check's three
        # the first program to arrive checks and takes no work item (the grid has one more
        # program): the check stays off every split's path; the others take theirs in order.
        # Modulo the grid: a ticket counter left non-zero (a launch that never finished)
        # still names exactly one checker and gives every item once: no wait forever.
        ticket = tl.atomic_add(sync, 1, sem="relaxed", scope="gpu") % tl.num_programs(0)
        pid = tl.maximum(ticket - 1, 0)
        joins = ticket != 0
    split = pid % num_splits
    rest = pid // num_splits
    m_block = rest % num_m_blocks
    bhk = rest // num_m_blocks
    b = bhk // nheads_k
    hk = bhk % nheads_k
    b64 = b.to(tl.int64)
    hk64 = hk.to(tl.int64)

    r = m_block * BLOCK_M + tl.arange(0, BLOCK_M)
    t = r // group
    h = hk * group + r % group
    row_ok = t < seqlen_q
    if FUSED_CHECK:
        row_ok = row_ok & (ticket != 0)
    offs_n0 = tl.arange(0, BLOCK_N)
    offs_d = tl.arange(0, BLOCK_D)
    d_ok = offs_d < head_dim
    if SAME_DV:
        offs_dv = offs_d
        dv_ok = d_ok
    else:
        offs_dv = tl.arange(0, BLOCK_DV)
        dv_ok = offs_dv < head_dim_v

    n, pad, raw_n = _seq_bounds(SeqLens, LeftPad, b, new, capacity, HAS_LEFTPAD)
    len_k = n + new - pad
    diag = len_k - seqlen_q
    if FUSED_CHECK:
        if ticket == 0:
            check_kernel(Status, SeqLens, LeftPad, BatchIdx, Table, batch, new, seqlen_q, capacity, batch_cache,
                         num_blocks, page_size, max_blocks, stride_table, rotary_len, HAS_LEFTPAD, HAS_BATCH_IDX,
                         PAGED, CHECK_ROTARY, ROTARY_LOCAL, CHECK_BLOCK, CHECK_BLOCK_E, PADDING)
            tl.debug_barrier()  # every thread's stores before the one thread's release
            tl.atomic_xchg(sync + 1, 1, sem="release", scope="gpu")
    elif CHECKED:
        bad = tl.load(Status) != 0
    if SPREAD:
        if (hk == 0) & (m_block == 0):
            _check_split(Status, batch * num_splits, SeqLens, LeftPad, BatchIdx, Table, b, split, split_size,
                         num_splits, new, seqlen_q,
                         capacity, batch_cache, num_blocks, page_size, max_blocks, stride_table, rotary_len,
                         HAS_LEFTPAD, HAS_BATCH_IDX, PAGED, CHECK_ROTARY, ROTARY_LOCAL, PADDING, CHECK_BLOCK_E)

    # query rows, rotated at their positions (cache indices) while loading
    q_pos = n + t * 0
    if ROTARY_LOCAL:
        q_pos = n + t
    q = _rotary_tile(Q + b64 * stride_qb, t.to(tl.int64) * stride_qs + h.to(tl.int64) * stride_qh, row_ok,
                     offs_d, d_ok, tl.minimum(q_pos, rotary_max), Cos, Sin, stride_cos, rotary_dim,
                     ROTARY, INTERLEAVED)

    # the keys this block of rows may see, cut to this split
    t_first = (m_block * BLOCK_M) // group
    t_last = tl.minimum((m_block * BLOCK_M + BLOCK_M - 1) // group, seqlen_q - 1)
    lo = 0
    hi = len_k
    if WINDOW_LEFT:
        lo = tl.maximum(t_first + diag - window_left, 0)
    if WINDOW_RIGHT:
        hi = tl.minimum(t_last + diag + window_right + 1, len_k)
    if CHUNK:
        lo = tl.maximum(lo, chunk_start(t_first + diag, chunk))
        hi = tl.minimum(hi, chunk_start(t_last + diag, chunk) + chunk)
    lo = tl.maximum(lo, split * split_size)
    hi = tl.minimum(hi, split * split_size + split_size)
    if CHECKED and not FUSED_CHECK:
        hi = tl.where(bad, lo, hi)
    if FUSED_CHECK:
        hi = tl.where(ticket == 0, lo, hi)  # the checker reads no key
    if PADDING:
        padding_seq = raw_n < 0  # a padding sequence: no key read, nothing appended
        hi = tl.where(padding_seq, lo, hi)
    start = (lo // BLOCK_N) * BLOCK_N
    hi_cache = hi  # the keys read from the cache
    if SPREAD:
        hi_cache = tl.minimum(hi, n - pad)  # the new tokens come from KNew, VNew (after the loop)

    if APPEND:
        # the new tokens at key indices (n - pad) + t inside this split, whatever the rows see
        t_lo = tl.maximum(split * split_size - (n - pad), 0)
        t_hi = tl.minimum(split * split_size + split_size - (n - pad), new)
        if FUSED_CHECK:
            t_hi = tl.where(ticket == 0, t_lo, t_hi)
            if t_hi > t_lo:  # only a program that appends waits here
                t_hi = tl.where(_verdict(sync, Status), t_lo, t_hi)  # a failed check: write nothing
        elif CHECKED:
            t_hi = tl.where(bad, t_lo, t_hi)  # a failed check: write nothing
        if PADDING:
            t_hi = tl.where(padding_seq, t_lo, t_hi)
        for t0 in range(t_lo, t_hi, APPEND_T):  # APPEND_T tokens a step: 1 for a decode step
            tn = t0 + tl.arange(0, APPEND_T)
            _append_tile(KNew, VNew, K, V, BatchIdx, Table, Cos, Sin, b64, hk64, tn, tn < t_hi, n,
                         offs_d, d_ok, offs_dv, dv_ok,
                         stride_nkb, stride_nks, stride_nkh, stride_nvb, stride_nvs, stride_nvh,
                         stride_kb, stride_ks, stride_kh, stride_vb, stride_vs, stride_vh,
                         stride_table, stride_cos, page_size, num_blocks, batch_cache, rotary_dim, rotary_max,
                         SAME_DV, PAGED, HAS_BATCH_IDX, ROTARY, INTERLEAVED)
        tl.debug_barrier()  # every thread's stores before any thread's loads of those keys

    if PAGED:
        k_base = K + hk64 * stride_kh
        v_base = V + hk64 * stride_vh
        table_row = Table + b64 * stride_table
        if PAGE_SLICE > 0:
            # the table entries of this split's pages, read once: inside the loop a key's
            # page comes from registers (tl.gather), so no K/V address waits on a load there
            first_page = start // page_size
            pg = first_page + tl.arange(0, PAGE_SLICE)
            slice_ = tl.load(table_row + pg, mask=pg * page_size < hi_cache, other=0)
            slice_ = tl.minimum(tl.maximum(slice_, 0), num_blocks - 1)
    else:
        row = b64
        if HAS_BATCH_IDX:
            row = tl.minimum(tl.maximum(tl.load(BatchIdx + b), 0), batch_cache - 1).to(tl.int64)
        k_base = K + row * stride_kb + hk64 * stride_kh + pad.to(tl.int64) * stride_ks
        v_base = V + row * stride_vb + hk64 * stride_vh + pad.to(tl.int64) * stride_vs

    slope = tl.zeros([BLOCK_M], dtype=tl.float32)
    if HAS_ALIBI:
        slope = tl.load(Alibi + b64 * stride_ab + h.to(tl.int64) * stride_ah, mask=row_ok, other=0.0) * C_LOG2E

    acc = tl.zeros([BLOCK_M, BLOCK_DV], dtype=tl.float32)
    l_i = tl.zeros([BLOCK_M], dtype=tl.float32)
    m_i = tl.full([BLOCK_M], float("-inf"), dtype=tl.float32)
    for n0 in range(start, hi_cache, BLOCK_N):
        j = n0 + offs_n0
        j_ok = (j >= lo) & (j < hi_cache)
        if PAGED:
            if PAGE_TILE:
                blk = tl.load(table_row + n0 // page_size)
                blk = tl.minimum(tl.maximum(blk, 0), num_blocks - 1).to(tl.int64)
                off = (n0 % page_size).to(tl.int64)
                k_rows = blk * stride_kb + (off + offs_n0) * stride_ks
                v_rows = blk * stride_vb + (off + offs_n0) * stride_vs
            elif PAGE_SLICE > 0:
                at = tl.minimum(tl.maximum(j // page_size - first_page, 0), PAGE_SLICE - 1)
                blk = tl.gather(slice_, at, 0).to(tl.int64)
                k_rows = blk * stride_kb + (j % page_size).to(tl.int64) * stride_ks
                v_rows = blk * stride_vb + (j % page_size).to(tl.int64) * stride_vs
            else:
                blk = tl.load(table_row + j // page_size, mask=j_ok, other=0)
                blk = tl.minimum(tl.maximum(blk, 0), num_blocks - 1).to(tl.int64)
                k_rows = blk * stride_kb + (j % page_size).to(tl.int64) * stride_ks
                v_rows = blk * stride_vb + (j % page_size).to(tl.int64) * stride_vs
        else:
            k_rows = j.to(tl.int64) * stride_ks
            v_rows = j.to(tl.int64) * stride_vs
        kt = tl.load(k_base + k_rows[None, :] + offs_d[:, None], mask=j_ok[None, :] & d_ok[:, None], other=0.0)
        if IEEE_DOT:
            s = tl.dot(q, kt, input_precision="ieee")
        else:
            s = tl.dot(q, kt)
        s, _ = scores(s, t[:, None], j[None, :], j_ok[None, :] & row_ok[:, None], K, None, 0, 0, 0,
                      qk_scale, qk_scale, softcap_in, softcap_out, slope[:, None], diag, window_left, window_right,
                      chunk, True, WINDOW_LEFT, WINDOW_RIGHT, SOFTCAP, HAS_ALIBI, 0, CHUNK)  # no explicit mask
        p, alpha, l_i, m_new = _softmax_step(s, l_i, m_i)
        v = tl.load(v_base + v_rows[:, None] + offs_dv[None, :], mask=j_ok[:, None] & dv_ok[None, :], other=0.0)
        if IEEE_DOT:
            acc = tl.dot(p.to(v.dtype), v, acc * alpha[:, None], input_precision="ieee")
        else:
            acc = tl.dot(p.to(v.dtype), v, acc * alpha[:, None])
        m_i = m_new
    if SPREAD:
        # the new tokens, at key indices n - pad + tn: k rotated at cache position n + tn and
        # rounded to the cache's dtype, as the append will store it (``finish_kernel``).
        # (Loading the first tile before the loop gained nothing: H100 run 168.)
        base = n - pad
        for n0 in range(tl.maximum(lo, base), hi, BLOCK_NEW):
            j = n0 + tl.arange(0, BLOCK_NEW)
            k, v = _load_new(KNew, VNew, Cos, Sin, b64, hk64, j, j < hi, base, n, offs_d, d_ok, offs_dv, dv_ok,
                             stride_nkb, stride_nks, stride_nkh, stride_nvb, stride_nvs, stride_nvh, stride_cos,
                             rotary_dim, rotary_max, ROTARY, INTERLEAVED)
            acc, l_i, m_i = _attend_new(q, k, v, t, j, j < hi, row_ok, acc, l_i, m_i, K, qk_scale, softcap_in,
                                        softcap_out, slope, diag, window_left, window_right, chunk,
                                        WINDOW_LEFT, WINDOW_RIGHT, SOFTCAP, HAS_ALIBI, CHUNK, IEEE_DOT)

    if HAS_SINK and not SPLIT:
        sink2 = tl.load(Sink + h, mask=row_ok, other=0.0) * C_LOG2E
        acc, l_i, m_i = add_sink(acc, l_i, m_i, sink2)
    seen = l_i != 0.0
    out = acc / tl.where(seen, l_i, 1.0)[:, None]
    lse = tl.where(seen, (m_i + tl.log2(tl.where(seen, l_i, 1.0))) * C_LN2, float("-inf"))
    if FUSED_CHECK:
        bad = _verdict(sync, Status)
        done = tl.atomic_add(sync + 2, 1, sem="acq_rel", scope="gpu")
        if done == tl.num_programs(0) - 1:  # every program has its ticket and its verdict
            tl.atomic_xchg(sync, 0, sem="relaxed", scope="gpu")
            tl.atomic_xchg(sync + 1, 0, sem="relaxed", scope="gpu")
            tl.atomic_xchg(sync + 2, 0, sem="relaxed", scope="gpu")
    if CHECKED:
        out = tl.where(bad, float("nan"), out)
        lse = tl.where(bad, float("nan"), lse)
    ok = row_ok[:, None] & dv_ok[None, :]
    t64 = t.to(tl.int64)
    h64 = h.to(tl.int64)
    if SPLIT:
        s64 = split.to(tl.int64)
        tl.store(OutPart + s64 * stride_pp + b64 * stride_pb + t64[:, None] * stride_ps + h64[:, None] * stride_ph
                 + offs_dv[None, :], out, mask=ok)
        tl.store(LsePart + s64 * stride_lp + b64 * stride_lpb + h64 * stride_lph + t, lse, mask=row_ok)
        if FUSED_COMBINE:
            # the merge's rows: the block's real ones only (MERGE_M, the rows rounded up to a
            # power of 2, not the 16 a tl.dot needs: GQA 4 x 1 query merges 4 rows, not 16)
            rm = m_block * BLOCK_M + tl.arange(0, MERGE_M)
            tm = rm // group
            tm64 = tm.to(tl.int64)
            hm64 = (hk * group + rm % group).to(tl.int64)
            ok_m = tm < seqlen_q
            if joins:  # the checker belongs to no group
                _last_split_combines(Counters, rest, num_splits, OutPart, LsePart, Out, Lse, Sink, b64, tm, tm64,
                                     hm64, ok_m, offs_dv, dv_ok, stride_pp, stride_pb, stride_ps, stride_ph, stride_lp,
                                     stride_lpb, stride_lph, stride_ob, stride_os, stride_oh, stride_lb, stride_lh,
                                     MERGE_M, BLOCK_DV, HAS_SINK, COMBINE_CHUNK)
    else:
        tl.store(Out + b64 * stride_ob + t64[:, None] * stride_os + h64[:, None] * stride_oh + offs_dv[None, :],
                 out.to(Out.dtype.element_ty), mask=ok)
        tl.store(Lse + b64 * stride_lb + h64 * stride_lh + t, lse, mask=row_ok)


@triton.jit
def _merge_row(OutPart, LsePart, Sink, b, t, h, stride_pp, stride_pb, stride_ps, stride_ph, stride_lp, stride_lpb,
               stride_lph, num_splits, offs_d, d_ok, BLOCK_S: tl.constexpr, HAS_SINK: tl.constexpr):
    """(out (BLOCK_D,) float32, lse) of row (b, t, h) from its splits' partials: out = sum_s
    w_s out_s / sum_s w_s, w_s = exp(lse_s - max_s lse_s); lse = max + log(sum w). A row no
    split saw (every lse -inf): 0 and -inf. A sink (HAS_SINK) is one more part with lse
    sink[h] and out 0. A NaN partial LSE (a failed check) makes both NaN."""
    s = tl.arange(0, BLOCK_S)
    s_ok = s < num_splits
    lse_s = tl.load(LsePart + s.to(tl.int64) * stride_lp + b * stride_lpb + h * stride_lph + t, mask=s_ok,
                    other=float("-inf"))
    top = tl.max(lse_s, 0)
    if HAS_SINK:
        sink = tl.load(Sink + h)
        top = tl.maximum(top, sink)
    top = tl.where(top == float("-inf"), 0.0, top)
    w = tl.exp(lse_s - top)
    total = tl.sum(w, 0)
    if HAS_SINK:
        total += tl.exp(sink - top)
    live = s_ok & (lse_s != float("-inf"))
    parts = tl.load(OutPart + s.to(tl.int64)[:, None] * stride_pp + b * stride_pb + t * stride_ps + h * stride_ph
                    + offs_d[None, :], mask=live[:, None] & d_ok[None, :], other=0.0)
    out = tl.sum(w[:, None] * parts.to(tl.float32), 0) / tl.where(total == 0.0, 1.0, total)
    lse = tl.where(total == 0.0, float("-inf"), top + tl.log(tl.where(total == 0.0, 1.0, total)))
    nan = tl.sum((s_ok & (lse_s != lse_s)).to(tl.int32), 0) > 0  # a NaN LSE (a failed check) stays NaN
    return tl.where(nan, float("nan"), out), tl.where(nan, float("nan"), lse)


@triton.jit
def combine_kernel(
    OutPart, LsePart, Out, Lse, Sink,
    stride_pp, stride_pb, stride_ps, stride_ph,
    stride_lp, stride_lpb, stride_lph,
    stride_ob, stride_os, stride_oh, stride_lb, stride_lh,
    seqlen, nheads, num_splits, head_dim,
    BLOCK_S: tl.constexpr, BLOCK_D: tl.constexpr, HAS_SINK: tl.constexpr, PDL: tl.constexpr = False,
):
    """Program (b, t, h): row (b, t, h) merged from its splits' partials (``_merge_row``).
    PDL: as the decode kernel's, waits first."""
    if PDL:
        gdc_wait()
    pid = tl.program_id(0)
    h = pid % nheads
    bt = pid // nheads
    t = (bt % seqlen).to(tl.int64)
    h = h.to(tl.int64)
    b = (bt // seqlen).to(tl.int64)
    offs_d = tl.arange(0, BLOCK_D)
    d_ok = offs_d < head_dim
    out, lse = _merge_row(OutPart, LsePart, Sink, b, t, h, stride_pp, stride_pb, stride_ps, stride_ph, stride_lp,
                          stride_lpb, stride_lph, num_splits, offs_d, d_ok, BLOCK_S, HAS_SINK)
    tl.store(Out + b * stride_ob + t * stride_os + h * stride_oh + offs_d, out.to(Out.dtype.element_ty), mask=d_ok)
    tl.store(Lse + b * stride_lb + h * stride_lh + t, lse)


@triton.jit
def _append_tokens(KNew, VNew, KCache, VCache, SeqLens, BatchIdx, Table, Cos, Sin, b, hk, t_first, t_step, go,
                   stride_kb, stride_ks, stride_kh, stride_vb, stride_vs, stride_vh,
                   stride_cb, stride_cs, stride_ch, stride_db, stride_ds, stride_dh,
                   stride_table, stride_cos, head_dim, head_dim_v, new, capacity, page_size, num_blocks, batch_cache,
                   rotary_dim, rotary_max, BLOCK_D: tl.constexpr, BLOCK_DV: tl.constexpr, APPEND_T: tl.constexpr,
                   SAME_DV: tl.constexpr, PAGED: tl.constexpr, HAS_BATCH_IDX: tl.constexpr, ROTARY: tl.constexpr,
                   INTERLEAVED: tl.constexpr, PADDING: tl.constexpr):
    """``finish_kernel``'s append, where ``go`` (the verdict): new tokens t_first, t_first +
    t_step, ... of sequence b, KV head hk into the caches (``_append_tile``), APPEND_T a step;
    none for a padding sequence."""
    raw = tl.load(SeqLens + b)
    if PADDING:
        go = go & (raw >= 0)
    if go:
        n = tl.minimum(tl.maximum(raw, 0), capacity - new)
        offs_d = tl.arange(0, BLOCK_D)
        offs_dv = tl.arange(0, BLOCK_DV)
        for t0 in range(0, new, t_step * APPEND_T):
            tn = t_first + t0 + t_step * tl.arange(0, APPEND_T)
            _append_tile(KNew, VNew, KCache, VCache, BatchIdx, Table, Cos, Sin, b.to(tl.int64), hk.to(tl.int64),
                         tn, tn < new, n, offs_d, offs_d < head_dim, offs_dv, offs_dv < head_dim_v,
                         stride_kb, stride_ks, stride_kh, stride_vb, stride_vs, stride_vh,
                         stride_cb, stride_cs, stride_ch, stride_db, stride_ds, stride_dh,
                         stride_table, stride_cos, page_size, num_blocks, batch_cache, rotary_dim, rotary_max,
                         SAME_DV, PAGED, HAS_BATCH_IDX, ROTARY, INTERLEAVED)


@triton.jit
def finish_kernel(
    OutPart, LsePart, Out, Lse, Sink, Slots, Status, KNew, VNew, KCache, VCache, SeqLens, BatchIdx, Table, Cos, Sin,
    stride_pp, stride_pb, stride_ps, stride_ph,
    stride_lp, stride_lpb, stride_lph,
    stride_ob, stride_os, stride_oh, stride_lb, stride_lh,
    stride_kb, stride_ks, stride_kh, stride_vb, stride_vs, stride_vh,
    stride_cb, stride_cs, stride_ch, stride_db, stride_ds, stride_dh,
    stride_table, stride_cos,
    seqlen, nheads, nheads_k, num_splits, head_dim, head_dim_v, new, capacity, page_size, num_blocks, batch_cache,
    rotary_dim, rotary_max, slots, appenders,
    BLOCK_S: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_DV: tl.constexpr, BLOCK_SLOTS: tl.constexpr,
    APPEND_T: tl.constexpr, HAS_SINK: tl.constexpr, SAME_DV: tl.constexpr, PAGED: tl.constexpr,
    HAS_BATCH_IDX: tl.constexpr, ROTARY: tl.constexpr, INTERLEAVED: tl.constexpr, PADDING: tl.constexpr,
    APPEND: tl.constexpr, PDL: tl.constexpr,
):
    """The spread check's last kernel. Every program reads the verdict of every slot the
    decode kernel's programs wrote (``_check_split``; int32 (3, slots)). Programs (b, t, h),
    the first batch x seqlen x nheads: row (b, t, h) merged as ``combine_kernel`` does, NaN
    (and its LSE) where any slot holds an error. Where every slot is clean (APPEND), the new
    tokens go into the caches (``_append_tile``: k rotated there): by ``appenders``
    programs (b, hk) after the merges (``finish_appenders``), each every token of sequence
    b, KV head hk; without them (0), by the merge programs of each KV head's first query
    head, tokens t, t + seqlen, ... after the row's merge. Program 0 writes Status
    (``check_kernel``'s (code, sequence, index, value)): the first slot with an error in the
    order (sequence, split). The decode kernel before it wrote nothing, so a failed check
    leaves the caches untouched."""
    if PDL:
        gdc_wait()
    NONE: tl.constexpr = 1 << 30
    pid = tl.program_id(0)
    merges = tl.num_programs(0) - appenders
    e = tl.arange(0, BLOCK_SLOTS)
    codes = tl.load(Slots + e, mask=e < slots, other=0)
    first = tl.min(tl.where(codes != 0, e, NONE), 0)
    bad = first < NONE
    if pid < merges:
        h = pid % nheads
        bt = pid // nheads
        t = bt % seqlen
        b = bt // seqlen
        b64 = b.to(tl.int64)
        h64 = h.to(tl.int64)
        if pid == 0:
            at = tl.where(bad, first, 0)
            tl.store(Status, tl.load(Slots + at, mask=bad, other=0))
            tl.store(Status + 1, tl.where(bad, at // num_splits, 0))
            tl.store(Status + 2, tl.load(Slots + slots + at, mask=bad, other=0))
            tl.store(Status + 3, tl.load(Slots + 2 * slots + at, mask=bad, other=0))
        offs_dv = tl.arange(0, BLOCK_DV)
        dv_ok = offs_dv < head_dim_v
        out, lse = _merge_row(OutPart, LsePart, Sink, b64, t.to(tl.int64), h64, stride_pp, stride_pb, stride_ps,
                              stride_ph, stride_lp, stride_lpb, stride_lph, num_splits, offs_dv, dv_ok, BLOCK_S,
                              HAS_SINK)
        out = tl.where(bad, float("nan"), out)
        lse = tl.where(bad, float("nan"), lse)
        tl.store(Out + b64 * stride_ob + t.to(tl.int64) * stride_os + h64 * stride_oh + offs_dv,
                 out.to(Out.dtype.element_ty), mask=dv_ok)
        tl.store(Lse + b64 * stride_lb + h64 * stride_lh + t, lse)
        if APPEND:
            if appenders == 0:  # tokens t, t + seqlen, ... by the KV head's first query head
                group = nheads // nheads_k
                _append_tokens(KNew, VNew, KCache, VCache, SeqLens, BatchIdx, Table, Cos, Sin, b, h // group, t,
                               seqlen, (h % group == 0) & (first == NONE),
                               stride_kb, stride_ks, stride_kh, stride_vb, stride_vs, stride_vh,
                               stride_cb, stride_cs, stride_ch, stride_db, stride_ds, stride_dh,
                               stride_table, stride_cos, head_dim, head_dim_v, new, capacity, page_size, num_blocks,
                               batch_cache, rotary_dim, rotary_max, BLOCK_D, BLOCK_DV, APPEND_T, SAME_DV, PAGED,
                               HAS_BATCH_IDX, ROTARY, INTERLEAVED, PADDING)
    elif APPEND:
        # an appender: every new token of sequence b, KV head hk, beside the merges
        a = pid - merges
        _append_tokens(KNew, VNew, KCache, VCache, SeqLens, BatchIdx, Table, Cos, Sin, a // nheads_k,
                       a % nheads_k, 0, 1, first == NONE,
                       stride_kb, stride_ks, stride_kh, stride_vb, stride_vs, stride_vh,
                       stride_cb, stride_cs, stride_ch, stride_db, stride_ds, stride_dh,
                       stride_table, stride_cos, head_dim, head_dim_v, new, capacity, page_size, num_blocks,
                       batch_cache, rotary_dim, rotary_max, BLOCK_D, BLOCK_DV, APPEND_T, SAME_DV, PAGED,
                       HAS_BATCH_IDX, ROTARY, INTERLEAVED, PADDING)


_launch_check = Launcher(check_kernel)
_launch_append = Launcher(append_kernel)
_launch_decode = Launcher(decode_kernel)
_launch_combine = Launcher(combine_kernel)
_launch_finish = Launcher(finish_kernel)


def block_sizes(head_dim: int, rows: int, head_dim_v: int = 0) -> tuple[int, int, int, int]:
    """(BLOCK_M, BLOCK_N, BLOCK_D, BLOCK_DV) of the decode kernel: rows = seqlen_q * group
    packed rows, at least 16 (the smallest tl.dot), at most 64 per program; ``head_dim_v``
    (0: head_dim) sizes the value and output tiles."""
    block_d = max(16, triton.next_power_of_2(head_dim))
    block_dv = max(16, triton.next_power_of_2(head_dim_v or head_dim))
    widest = max(block_d, block_dv)
    # Past 256 columns (MLA's 576 pads to 1024) the query and key tiles fill shared memory:
    # 32 rows, 16 keys (sm_90a compile check: 64 rows do not fit). Unmeasured.
    block_m = min(64 if widest <= 256 else 32, max(16, triton.next_power_of_2(rows)))
    block_n = 64 if widest <= 128 else 32 if widest <= 256 else 16
    return block_m, block_n, block_d, block_dv


def stages(kind: str, block_d: int, block_dv: int) -> int:
    """The decode kernel's pipeline depth: ``STAGES[kind]``, 2 past 256 columns (shared memory)."""
    return STAGES[kind] if max(block_d, block_dv) <= 256 else min(STAGES[kind], 2)


def _sms(device) -> int:
    """The SM count the launch heuristics plan for: the GPU's, 16 under the interpreter."""
    return sm_count(device_index(device)) if device.type == "cuda" else 16


def wave_per_sm(device) -> int:
    """Programs per SM in ``choose_splits``' one wave of long splits: 2 where the GPU's DRAM
    bandwidth per SM is above ``WAVE_GBPS_PER_SM`` (an H200), else 1 (an H100; a MIG slice;
    a CPU device under the interpreter)."""
    if device.type != "cuda":
        return 1
    per_sm = dram_gbps_per_sm(device_index(device))
    return 2 if per_sm is not None and per_sm > WAVE_GBPS_PER_SM else 1


def choose_splits(num_splits: int, programs: int, capacity: int, block_n: int, device, *,
                  page: int = 0) -> int:
    """Splits of the cache length: ``num_splits`` when given (at most one per key tile),
    else from ``programs`` (batch x nheads_k x row blocks) and the SM count. ``page``: the
    page size of a paged cache (0: a row cache); "gather" below is a page size that is not a
    multiple of the key tile (``layout``), whose table reads sit in front of every key load.
    - At most one program per four SMs, with short splits: about 1.5 programs per SM
      (rounded down) while each split then holds at most ``FEW_KEYS_MAX_ROWS`` keys
      (``FEW_KEYS_MAX_GATHER`` for ``gather``), at most one split per 2 key tiles (4 for
      ``gather``). Such programs are latency bound; more of them in flight read faster than
      one per SM. H100, GQA 32/8 generation steps under CUDA graphs, the best count of each
      shape (runs 186-189): a row cache at batch 1 x 4k and 8k keys 24 splits, 12.9 and 18.6
      us against 13.8 and 19.5 at one per SM; batch 2 x 4k 12, 18.3 against 19.1; pages of
      16 at batch 4 x 4k and 8k 6, 33.3 and 55.9 against 38.7 and 61.9 at the many-wave 16
      and 32; batch 2 x 4k and 8k 12, 21.3 and 32.8 against 22.5 and 37.8; batch 1 x 8k and
      32k 24, 21.6 and 55.7 against 22.3 and 60.9.
    - Else a page gather of at most two programs per SM: two per SM rounded down, and at
      least enough splits for each to read its pages through a table slice (``slice_keys``;
      so do the short splits above). H100 run 202, pages of 16, the best of 0-6 splits: batch
      8 x 4k, 8k and 32k 4 splits, 56.3, 99.2 and 356.6 us against 61.8, 106.2 and 364.3 at
      the many-wave 16-25 (3 splits of 32k keys, past the slice: 492); batch 16 x 4k and 8k
      2, 98.6 and 184.5 against 108.5 and 198.8 at 13; batch 32 x 8k 1 or 3, 361.7 and 361.5
      against 373.3 at 7 (2: 417.5: 512 programs are two waves less a few). Run 204, the
      rule's count against 2-16: batch 4 x 16k and 32k 8 splits (98.8 and 184.7 us; 16 splits
      110.5 and 210.7), batch 12 x 8k 2, the best; batch 24 x 8k 1 split 280.0 against 272.3
      at 2 (3%).
    - Else fewer than two programs per SM on rows or whole-tile pages: one wave of programs
      that each stream a long stretch, w = ``wave_per_sm`` per SM (1 on an H100, 2 on an
      H200's faster DRAM: ``WAVE_GBPS_PER_SM``). Up to half of w x sms programs that is
      ``w * sms // programs`` (H100 run 178: one per SM up to 4% less a step than two at batch
      1-8, 4k-131k keys, with half the partials to merge; +0.2% at batch 8 with pages of
      256); above, the nearest count, so 1 from two thirds of w x sms on (H100 run 186: batch
      16, 128 programs, 92.4 us unsplit against 96.1 at 2 splits, 4% less at 8k keys too;
      batch 8, 64 programs, wants its 2: 50.6 against 69.6 unsplit).
    - Else (more programs): enough splits for about 12 programs per SM, so that the last,
      partial wave is short (batch 64 x 8192: 4.38 vs 3.85 TB/s unsplit), at most one split
      per 4 key tiles."""
    tiles = max(1, triton.cdiv(capacity, block_n))
    if num_splits > 0:
        return max(1, min(num_splits, tiles, MAX_SPLITS))
    sms = _sms(device)
    gather = layout(page > 0, page, block_n) == "gather"
    keys = slice_keys(page, block_n) if gather else 0
    most = max(1, min(triton.cdiv(tiles, 4), MAX_SPLITS))
    few = 3 * sms // (2 * programs)
    if 4 * programs <= sms and triton.cdiv(capacity, few) <= (min(FEW_KEYS_MAX_GATHER, keys) if gather
                                                             else FEW_KEYS_MAX_ROWS):
        return max(1, min(few, most if gather else min(triton.cdiv(tiles, 2), MAX_SPLITS)))
    if gather and programs <= 2 * sms:
        least = triton.cdiv(capacity, keys) if keys else 1
        return max(1, min(max(2 * sms // programs, least), most))
    if programs < 2 * sms and not gather:
        wave = wave_per_sm(device) * sms
        return max(1, min(wave // programs if 2 * programs <= wave else round(wave / programs), most))
    return max(1, min(triton.cdiv(12 * sms, programs), most))


def fuse_step(q, k_cache, v_cache, table) -> bool:
    """Whether ``auto`` folds this step's combine and metadata check into the decode kernel
    (``FUSE_BYTES_MAX``): not while a CUDA graph is captured, not past 256 value columns
    (MLA's 512: the fused merge's tile there was never compiled or timed), and only where
    the cache read (every row of the cache or of the block table, keys and values, the
    valid lengths being on the device) is at most ``FUSE_BYTES_MAX``."""
    if v_cache.shape[3] > 256 or capturing(q):
        return False
    rows = table.shape[1] * k_cache.shape[1] if table is not None else k_cache.shape[1]
    width = k_cache.shape[3] + v_cache.shape[3]
    return q.shape[0] * rows * k_cache.shape[2] * width * k_cache.element_size() <= FUSE_BYTES_MAX


def spread_step(q, k_cache, v_cache, table, num_splits: int, new: int) -> bool:
    """Whether the spread check (``FLASHTILE_DECODE_CHECK=spread``, and ``auto`` where the
    check is not fused) can take this step: it splits (``finish_kernel`` merges and appends
    after the decode kernel), its append is short (``FUSED_APPEND_MAX``: the decode kernel
    reads the new tokens in one more key tile or two), its verdict slots (batch x splits)
    fit one tile of ``finish_kernel`` (``SPREAD_SLOTS_MAX``), and its tiles are not past 256
    columns (MLA's 576 / 512 were never compiled this way)."""
    if max(k_cache.shape[3], v_cache.shape[3]) > 256 or new > FUSED_APPEND_MAX:
        return False
    splits, _ = split_plan(q, k_cache, table, num_splits, v_cache.shape[3])
    return 1 < splits and q.shape[0] * splits <= SPREAD_SLOTS_MAX


def use_pdl(q) -> bool:
    """Whether this step's decode and combine kernels are launched with Programmatic
    Dependent Launch (``FLASHTILE_PDL=on``): CUDA tensors on Hopper or later (``griddepcontrol``
    is sm_90's), never under the interpreter (no inline PTX there)."""
    if not settings.pdl() or settings.interpret():
        return False
    capability = capability_of(q)
    return capability is not None and capability >= (9, 0)


def merge_rows(block_m: int, rows: int) -> int:
    """The fused combine's rows per block: the block's real rows rounded up to a power of 2
    (at least 2), not the BLOCK_M a tl.dot needs (GQA 4 x 1 query: 4, not 16)."""
    return min(block_m, max(2, triton.next_power_of_2(rows)))


def combine_chunk(block_m: int, block_dv: int) -> int:
    """Splits the fused combine merges a step: a (chunk, rows, Dv) float32 tile of at most
    2048 elements (16 registers a thread at 4 warps; a power of 2, at least 1): 4096 spilled
    44 B at d64 with 16 rows and every option (sm_90a)."""
    return max(1, 2048 // (block_m * block_dv))


def check_block(batch: int) -> int:
    """Sequences the device check reads a step."""
    return min(128, max(16, triton.next_power_of_2(batch)))


def check_metadata(status, seqlens, leftpad, batch_idx, table, *, new: int, queries: int, capacity: int,
                   batch_cache: int, num_blocks: int, page: int, rotary_len: int, rotary_local: bool,
                   padding: bool = False) -> None:
    """Launch ``check_kernel``: status (int32 (4,)) = (code, sequence, index, value)."""
    batch = seqlens.numel()
    with device_context(status):
        _launch_check(
            (1,),
            (status, seqlens, seqlens if leftpad is None else leftpad, seqlens if batch_idx is None else batch_idx,
             seqlens if table is None else table, batch, new, queries, capacity, batch_cache, num_blocks,
             max(page, 1), table.shape[1] if table is not None else 0, table.stride(0) if table is not None else 0,
             rotary_len),
            dict(HAS_LEFTPAD=leftpad is not None, HAS_BATCH_IDX=batch_idx is not None, PAGED=table is not None,
                 ROTARY=rotary_len >= 0, ROTARY_LOCAL=rotary_local,
                 BLOCK=check_block(batch), BLOCK_E=CHECK_BLOCK_E, PADDING=padding),
            8, 1)


def append(k_cache, v_cache, k, v, seqlens, batch_idx, table, cos, sin, *, interleaved: bool, status=None,
           padding: bool = False) -> None:
    """Write k, v (batch, new, Hk, D) into the caches at cache_seqlens[b] + t, k rotated
    there first when cos/sin are given (``append_kernel``)."""
    batch, new, nheads_k, head_dim = k.shape
    head_dim_v = v.shape[-1]
    paged = table is not None
    capacity = table.shape[1] * k_cache.shape[1] if paged else k_cache.shape[1]
    block_d = max(16, triton.next_power_of_2(head_dim))
    block_dv = max(16, triton.next_power_of_2(head_dim_v))
    block_t = min(64, max(16, triton.next_power_of_2(new)))
    rotary = cos is not None
    with device_context(k):
        _launch_append(
            (batch * nheads_k, triton.cdiv(new, block_t)),
            (k, v, k_cache, v_cache, seqlens, seqlens if batch_idx is None else batch_idx,
             table if paged else seqlens, cos if rotary else k, sin if rotary else k,
             seqlens if status is None else status,
             k.stride(0), k.stride(1), k.stride(2), v.stride(0), v.stride(1), v.stride(2),
             k_cache.stride(0), k_cache.stride(1), k_cache.stride(2),
             v_cache.stride(0), v_cache.stride(1), v_cache.stride(2),
             table.stride(0) if paged else 0, cos.stride(0) if rotary else 0,
             nheads_k, new, capacity, k_cache.shape[1] if paged else 1, k_cache.shape[0], k_cache.shape[0],
             head_dim, head_dim_v, 2 * cos.shape[1] if rotary else 0, cos.shape[0] - 1 if rotary else 0),
            dict(BLOCK_T=block_t, BLOCK_D=block_d, BLOCK_DV=block_dv, SAME_DV=head_dim_v == head_dim, PAGED=paged, HAS_BATCH_IDX=batch_idx is not None,
                 ROTARY=rotary, INTERLEAVED=interleaved, CHECKED=status is not None, PADDING=padding),
            4, 1)


def layout(paged: bool, page: int, block_n: int) -> str:
    """How the decode kernel addresses keys: "rows" (a row cache), "tile" (pages that hold
    whole key tiles: one table read per tile) or "gather" (a table read per key); the
    key of ``STAGES``."""
    return "rows" if not paged else "tile" if page % block_n == 0 else "gather"


def slice_keys(page: int, block_n: int) -> int:
    """The most keys a split of a page gather may hold (a multiple of the key tile) and still
    read its pages through a table slice (``pages_spanned`` at most ``PAGE_SLICE_MAX``); 0
    when not even one key tile can."""
    pages = max(0, PAGE_SLICE_MAX - (0 if block_n % page == 0 else 1))
    return pages * page // block_n * block_n


def pages_spanned(split_size: int, page: int, block_n: int) -> int:
    """The most pages a split of ``split_size`` keys (a multiple of the key tile) reads:
    split_size / page when the page divides the key tile (every split and tile then starts
    on a page), one more otherwise (a split's first tile may start inside a page). Until
    session 35 the extra page was counted always: a split of 4096 keys in pages of 16 took
    a table slice of 512 entries for its 256 pages, and one of 8192 keys (513 pages >
    ``PAGE_SLICE_MAX``) the per-key table read (H100 runs 186 and 189: batch 8 x 32768 at
    4 splits 6% slower than at 6; unmeasured since)."""
    if block_n % page == 0:
        return triton.cdiv(split_size, page)
    return triton.cdiv(split_size, page) + 1


def split_keys(capacity: int, splits: int, block_n: int) -> int:
    """Keys per split of ``capacity`` cut ``splits`` ways: a multiple of the key tile."""
    return triton.cdiv(triton.cdiv(capacity, splits), block_n) * block_n


def split_plan(q, k_cache, table, num_splits: int, head_dim_v: int = 0) -> tuple[int, int]:
    """(splits, split_size) of a decode call: ``choose_splits``, then split_size a multiple
    of the key tile and no split without keys."""
    batch, seqlen_q, nheads, head_dim = q.shape
    nheads_k = k_cache.shape[2]
    paged = table is not None
    page = k_cache.shape[1] if paged else 1
    capacity = table.shape[1] * page if paged else k_cache.shape[1]
    block_m, block_n, _, _ = block_sizes(head_dim, seqlen_q * (nheads // nheads_k), head_dim_v)
    programs = batch * nheads_k * triton.cdiv(seqlen_q * (nheads // nheads_k), block_m)
    splits = choose_splits(num_splits, programs, capacity, block_n, q.device, page=page if paged else 0)
    split_size = split_keys(capacity, splits, block_n)
    return triton.cdiv(capacity, split_size), split_size


def scratch(q, k_cache, table, num_splits: int, checked: bool, head_dim_v: int = 0, spread: bool = False):
    """(status, parts, slots) of a decode call in one float32 allocation (a call's host time
    is a few allocations and launches): status int32 (4,) when ``checked`` else None; parts
    (out_part (S, B, Sq, H, Dv), lse_part (S, B, H, Sq)) when it splits, else None; slots
    int32 (3, B * S), the spread check's verdicts (codes, block indices, values), when
    ``spread`` (with ``checked``, and a step that splits: ``spread_step``) else None.
    ``head_dim_v``: v's head dim (0: q's)."""
    import torch

    splits, _ = split_plan(q, k_cache, table, num_splits, head_dim_v)
    batch, seqlen_q, nheads, head_dim = q.shape
    head_dim = head_dim_v or head_dim  # the partial outputs' width
    n_out = splits * batch * seqlen_q * nheads * head_dim if splits > 1 else 0
    n_lse = splits * batch * nheads * seqlen_q if splits > 1 else 0
    head = 4 if checked else 0  # 16 bytes: the partials stay 16-byte aligned
    n_slots = 4 * triton.cdiv(3 * batch * splits, 4) if spread and checked and splits > 1 else 0  # 16-byte steps
    if head + n_out + n_lse == 0:
        return None, None, None
    buf = torch.empty(head + n_slots + n_out + n_lse, dtype=torch.float32, device=q.device)
    status = buf[:4].view(torch.int32) if checked else None
    slots = buf[head:head + 3 * batch * splits].view(torch.int32).view(3, -1) if n_slots else None
    head += n_slots
    parts = None
    if splits > 1:
        parts = (buf[head:head + n_out].view(splits, batch, seqlen_q, nheads, head_dim),
                 buf[head + n_out:].view(splits, batch, nheads, seqlen_q))
    return status, parts, slots


def decode(q, k_cache, v_cache, out, lse, seqlens, leftpad, batch_idx, table, alibi, cos, sin, *,
           new: int, scale: float, softcap: float, window_left: int, window_right: int, interleaved: bool,
           rotary_local: bool, num_splits: int, status=None, parts=None, sink=None, chunk: int = 0,
           k_new=None, v_new=None, fused_combine: bool = False, padding: bool = False, fused_check: bool = False,
           rotary_len: int = -1, slots=None) -> None:
    """Attention of q (batch, seqlen_q, H, D) against the caches (after the append; k_cache
    of head dim D, v_cache of Dv, which may be a view of k_cache's first Dv columns):
    out (batch, seqlen_q, H, Dv), lse (batch, H, seqlen_q) float32 (unit last stride).
    ``num_splits``: 0 chooses (``choose_splits``); with more than one split the partial
    results go to float32 buffers (``parts``: ``scratch``'s, made here when not given) and
    ``combine_kernel`` writes out and lse. ``sink``: None or (H,) float32 contiguous, one
    logit per query head in the softmax's denominator, added once per row. ``chunk``:
    chunked attention (0: off), chunks counted from each sequence's first key (leftpad).
    ``k_new``, ``v_new``: (batch, new, Hk, D) and (..., Dv), appended by the decode kernel
    itself (``append``'s work, rotary included; None: the caches already hold them).
    ``fused_combine``: with more than one split, the decode kernel's last split of each
    group merges the partials (counters from ``runtime.replay.stream_counter``), no
    ``combine_kernel`` launch. ``fused_check`` (with ``status``): the decode kernel checks the
    metadata values itself (``check_metadata``'s status, one launch less; ``rotary_len``: the
    rotary tables' positions, -1 without). ``slots`` (with ``status``, more than one split, no
    fused combine, ``k_new`` not longer than ``FUSED_APPEND_MAX``): the spread check
    (``spread_step``; ``scratch``'s slots): the decode kernel checks what each split reads
    and reads the new tokens from k_new, v_new; ``finish_kernel`` merges, appends and writes
    ``status``."""
    import torch

    batch, seqlen_q, nheads, head_dim = q.shape
    nheads_k = k_cache.shape[2]
    group = nheads // nheads_k
    paged = table is not None
    page = k_cache.shape[1] if paged else 1
    capacity = table.shape[1] * page if paged else k_cache.shape[1]
    # Every sequence has len_k <= capacity: a side that hides none of its keys is unbounded,
    # and a huge one (2**31 - 1) would overflow the kernel's int32 bounds.
    window_left, window_right = effective_window(window_left, window_right, seqlen_q, capacity, capacity - seqlen_q)
    head_dim_v = v_cache.shape[-1]
    block_m, block_n, block_d, block_dv = block_sizes(head_dim, seqlen_q * group, head_dim_v)
    num_m_blocks = triton.cdiv(seqlen_q * group, block_m)
    splits, split_size = split_plan(q, k_cache, table, num_splits, head_dim_v)
    kind = layout(paged, page, block_n)
    rotary = cos is not None
    softcap_on = softcap > 0.0
    page_slice = 0
    if kind == "gather" and PAGE_SLICE_MAX:
        spanned = pages_spanned(split_size, page, block_n)
        if spanned <= PAGE_SLICE_MAX:
            page_slice = max(16, triton.next_power_of_2(spanned))
    if splits > 1:
        out_part, lse_part = (parts if parts is not None
                              else scratch(q, k_cache, table, num_splits, False, head_dim_v)[1])
    else:
        out_part, lse_part = out, lse
    fused_combine = fused_combine and splits > 1
    groups = batch * nheads_k * num_m_blocks
    merge_m = merge_rows(block_m, seqlen_q * group)
    fused_check = fused_check and status is not None
    spread = slots is not None
    if spread and (splits < 2 or fused_combine or fused_check or status is None
                   or (k_new is not None and k_new.shape[1] > FUSED_APPEND_MAX)):
        raise ValueError("the spread check needs a split step with a status, the separate combine and a short "
                         "append (decode.spread_step)")
    pdl = use_pdl(q)
    sync = 4 if fused_check else 0  # the fused check's counters come first
    counters = stream_counter(q.device, sync + groups * fused_combine) if sync or fused_combine else q
    with device_context(q):
        _launch_decode(
            (batch * nheads_k * num_m_blocks * splits + fused_check,),  # the fused check: its checker too
            (q, k_cache, v_cache, out, lse, out_part, lse_part,
             slots if spread else seqlens if status is None else status, seqlens,
             seqlens if leftpad is None else leftpad, seqlens if batch_idx is None else batch_idx,
             table if paged else seqlens, q if alibi is None else alibi, cos if rotary else q, sin if rotary else q,
             lse if sink is None else sink, q if k_new is None else k_new, q if v_new is None else v_new, counters,
             q.stride(0), q.stride(1), q.stride(2),
             k_cache.stride(0), k_cache.stride(1), k_cache.stride(2),
             v_cache.stride(0), v_cache.stride(1), v_cache.stride(2),
             out.stride(0), out.stride(1), out.stride(2),
             out_part.stride(0), out_part.stride(1), out_part.stride(2), out_part.stride(3) if splits > 1 else 0,
             lse_part.stride(0), lse_part.stride(1), lse_part.stride(2) if splits > 1 else 0,
             lse.stride(0), lse.stride(1),
             table.stride(0) if paged else 0, *(alibi.stride() if alibi is not None else (0, 0)),
             cos.stride(0) if rotary else 0,
             *(k_new.stride()[:3] if k_new is not None else (0, 0, 0)),
             *(v_new.stride()[:3] if v_new is not None else (0, 0, 0)),
             nheads_k, group, seqlen_q, head_dim, new, capacity, page, k_cache.shape[0], k_cache.shape[0],
             splits, split_size, num_m_blocks, 2 * cos.shape[1] if rotary else 0, cos.shape[0] - 1 if rotary else 0,
             scale * LOG2E, scale / softcap if softcap_on else 0.0, softcap * LOG2E if softcap_on else 0.0,
             window_left, window_right, chunk, head_dim_v, batch, table.shape[1] if paged else 0, rotary_len),
            dict(BLOCK_M=block_m, BLOCK_N=block_n, BLOCK_D=block_d, BLOCK_DV=block_dv, SAME_DV=head_dim_v == head_dim,
                 PAGED=paged,
                 PAGE_TILE=kind == "tile", PAGE_SLICE=page_slice, HAS_BATCH_IDX=batch_idx is not None,
                 HAS_LEFTPAD=leftpad is not None, WINDOW_LEFT=window_left >= 0, WINDOW_RIGHT=window_right >= 0,
                 SOFTCAP=softcap_on, HAS_ALIBI=alibi is not None, ROTARY=rotary, INTERLEAVED=interleaved,
                 ROTARY_LOCAL=rotary_local, SPLIT=splits > 1, CHECKED=status is not None and not spread,
                 IEEE_DOT=q.dtype == torch.float32, HAS_SINK=sink is not None, CHUNK=chunk > 0,
                 APPEND=k_new is not None and not spread,
                 APPEND_T=min(APPEND_T_MAX if max(block_d, block_dv) <= 256 else 8,
                              triton.next_power_of_2(max(new, 1))),
                 FUSED_COMBINE=fused_combine, PADDING=padding, FUSED_CHECK=fused_check,
                 CHECK_ROTARY=(fused_check or spread) and rotary_len >= 0, CHECK_BLOCK=check_block(batch),
                 CHECK_BLOCK_E=SPREAD_BLOCK_E if spread else FUSED_CHECK_BLOCK_E, MERGE_M=merge_m,
                 COMBINE_CHUNK=combine_chunk(merge_m, block_dv) if fused_combine else 1,
                 SPREAD=spread, BLOCK_NEW=min(block_n, max(16, triton.next_power_of_2(new))),
                 **_pdl_options(pdl)),
            4, stages(kind, block_d, block_dv))
        if spread:
            _finish(out_part, lse_part, out, lse, sink, slots, status, k_new, v_new, k_cache, v_cache, seqlens,
                    batch_idx, table, cos, sin, nheads_k=nheads_k, capacity=capacity, interleaved=interleaved,
                    padding=padding, pdl=pdl)
        elif splits > 1 and not fused_combine:
            combine(out_part, lse_part, out, lse, sink, pdl=pdl)


def _pdl_options(pdl: bool) -> dict:
    """The constexpr and the launch option of a kernel launched with PDL (``use_pdl``); the
    constexpr is passed either way (a launch plan records every parameter's value, and the
    interpreter's kernels do not say their defaults)."""
    return dict(PDL=True, launch_pdl=True) if pdl else dict(PDL=False)


def _finish(out_part, lse_part, out, lse, sink, slots, status, k_new, v_new, k_cache, v_cache, seqlens, batch_idx,
            table, cos, sin, *, nheads_k: int, capacity: int, interleaved: bool, padding: bool, pdl: bool) -> None:
    """``finish_kernel`` (the spread check's last kernel, inside ``decode``'s device context):
    the merge of ``combine``, the verdict of ``slots``, the append of k_new, v_new (None:
    nothing to append) and ``status``."""
    splits, batch, seqlen, nheads, head_dim_v = out_part.shape
    head_dim = k_cache.shape[3]
    paged = table is not None
    rotary = cos is not None
    new = 0 if k_new is None else k_new.shape[1]
    knew = k_new if new else out_part
    vnew = v_new if new else out_part
    appenders = finish_appenders(batch, seqlen, nheads, nheads_k, new, out.device)
    _launch_finish(
        (batch * seqlen * nheads + appenders,),
        (out_part, lse_part, out, lse, lse if sink is None else sink, slots, status, knew, vnew, k_cache, v_cache,
         seqlens, seqlens if batch_idx is None else batch_idx, table if paged else seqlens,
         cos if rotary else out_part, sin if rotary else out_part,
         out_part.stride(0), out_part.stride(1), out_part.stride(2), out_part.stride(3),
         lse_part.stride(0), lse_part.stride(1), lse_part.stride(2),
         out.stride(0), out.stride(1), out.stride(2), lse.stride(0), lse.stride(1),
         *(k_new.stride()[:3] if new else (0, 0, 0)), *(v_new.stride()[:3] if new else (0, 0, 0)),
         k_cache.stride(0), k_cache.stride(1), k_cache.stride(2), v_cache.stride(0), v_cache.stride(1),
         v_cache.stride(2), table.stride(0) if paged else 0, cos.stride(0) if rotary else 0,
         seqlen, nheads, nheads_k, splits, head_dim, head_dim_v, new, capacity, k_cache.shape[1] if paged else 1,
         k_cache.shape[0], k_cache.shape[0], 2 * cos.shape[1] if rotary else 0, cos.shape[0] - 1 if rotary else 0,
         slots.shape[1], appenders),
        dict(BLOCK_S=max(2, triton.next_power_of_2(splits)), BLOCK_D=max(16, triton.next_power_of_2(head_dim)),
             BLOCK_DV=max(16, triton.next_power_of_2(head_dim_v)),
             BLOCK_SLOTS=max(16, triton.next_power_of_2(slots.shape[1])),
             APPEND_T=min(APPEND_T_MAX, triton.next_power_of_2(max(triton.cdiv(new, 1 if appenders else seqlen),
                                                                   1))),
             HAS_SINK=sink is not None, SAME_DV=head_dim_v == head_dim, PAGED=paged,
             HAS_BATCH_IDX=batch_idx is not None, ROTARY=rotary, INTERLEAVED=interleaved, PADDING=padding,
             APPEND=new > 0, **_pdl_options(pdl)),
        4, 1)


def finish_appenders(batch: int, seqlen: int, nheads: int, nheads_k: int, new: int, device) -> int:
    """Programs of ``finish_kernel`` that only append (batch x nheads_k), where the merges
    and they fit one program per SM; else 0, and the merge programs append after their
    merge. On an H100 under graphs (run 170, GQA 32/8) the appenders saved 0.1-0.6 us a step
    at batch 1-2 (160 programs, batch 4: 0.3 us more on a row cache, 0.3 less with pages of
    16)."""
    if not new:
        return 0
    extra = batch * nheads_k
    return extra if batch * seqlen * nheads + extra <= _sms(device) else 0


def combine(out_part, lse_part, out, lse, sink=None, *, pdl: bool = False) -> None:
    """``combine_kernel``: out_part (S, B, Sq, H, D), lse_part (S, B, H, Sq) float32 ->
    out (B, Sq, H, D), lse (B, H, Sq) (unit last strides); ``sink``: None or (H,) float32,
    joined once per row; ``pdl``: launched with PDL after the decode kernel (``use_pdl``)."""
    splits, batch, seqlen, nheads, head_dim = out_part.shape
    if batch * seqlen * nheads == 0:
        return
    with device_context(out):
        _launch_combine(
            (batch * seqlen * nheads,),
            (out_part, lse_part, out, lse, lse if sink is None else sink,
             out_part.stride(0), out_part.stride(1), out_part.stride(2), out_part.stride(3),
             lse_part.stride(0), lse_part.stride(1), lse_part.stride(2),
             out.stride(0), out.stride(1), out.stride(2), lse.stride(0), lse.stride(1),
             seqlen, nheads, splits, head_dim),
            dict(BLOCK_S=max(2, triton.next_power_of_2(splits)), BLOCK_D=max(16, triton.next_power_of_2(head_dim)),
                 HAS_SINK=sink is not None, **_pdl_options(pdl)),
            4, 1)

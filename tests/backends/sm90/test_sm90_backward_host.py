"""Host-side pieces of the Gluon backward (CPU): argument checks, the one-pass grid order and
postprocess. Which calls take these kernels is the registry's (tests/backends/
test_registry.py); the kernels are GPU-only (test_sm90_backward_gpu.py) and
compile-checked for sm_90a in test_sm90_compile.py."""

from __future__ import annotations

import pytest

torch = pytest.importorskip("torch")
pytest.importorskip("triton")


@pytest.fixture(autouse=True)
def _h100_sms(monkeypatch):
    """Causal one-pass launches ask the device for its SMs (``backward_onepass.pair_group``);
    these tests' tensors are on the CPU: an H100's 132."""
    from flashtile.backends.sm90 import backward_onepass as op

    monkeypatch.setattr(op, "sm_count", lambda index: 132)



def test_cpu_tensors_never_reach_the_gluon_backward(monkeypatch, triton_backend):
    """The registry looks at the device first: the interpreter and CPU tensors keep the
    Triton kernels (the Gluon kernels are sm90-only)."""
    from flashtile.backends.sm90 import backward_split as backward_sm90

    def boom(*args, **kwargs):
        raise AssertionError("Gluon backward called for a CPU tensor")

    monkeypatch.setattr(backward_sm90, "attention_backward_ws", boom)
    import flashtile

    q, k, v = (torch.randn(1, 37, 2, 64, dtype=torch.float16, requires_grad=True) for _ in range(3))
    flashtile.flash_attn_func(q, k, v, causal=True).float().sum().backward()
    assert q.grad is not None and torch.isfinite(q.grad.float()).all()


def test_launch_arguments_are_checked_before_any_work():
    from flashtile.backends.sm90.backward_split import attention_backward_ws

    t = torch.zeros(1, 1, 1, 64, dtype=torch.bfloat16)
    lse = torch.zeros(1, 1, 1)
    args = (t, t, t, t, lse, lse, t, t, t)
    with pytest.raises(ValueError, match="kernels"):  # "dk" alone exists at d256 only (its own kernel)
        attention_backward_ws(*args, scale=0.125, diag_offset=0, causal=False, kernels=("dk",))
    t256 = torch.zeros(1, 1, 1, 256, dtype=torch.bfloat16)
    with pytest.raises(ValueError, match="kernels"):
        attention_backward_ws(t256, t256, t256, t256, lse, lse, t256, t256, t256, scale=0.125, diag_offset=0,
                              causal=False, kernels=("dq", "dkv"))
    with pytest.raises(ValueError, match="fixed rings"):  # d256's dV and dK kernels: DV_RING, DK_RING
        attention_backward_ws(t256, t256, t256, t256, lse, lse, t256, t256, t256, scale=0.125, diag_offset=0,
                              causal=False, dkdv_num_buf=4)
    with pytest.raises(ValueError, match="ring slots"):
        attention_backward_ws(*args, scale=0.125, diag_offset=0, causal=False, dkdv_num_buf=1)
    with pytest.raises(ValueError, match="dkdv_block_q"):
        attention_backward_ws(*args, scale=0.125, diag_offset=0, causal=False, dkdv_block_q=96)
    with pytest.raises(ValueError, match="dkdv_block_q"):  # d256's split kernels step by 64 queries
        attention_backward_ws(t256, t256, t256, t256, lse, lse, t256, t256, t256, scale=0.125, diag_offset=0,
                              causal=False, dkdv_block_q=128)
    with pytest.raises(ValueError, match="ring slots"):
        attention_backward_ws(*args, scale=0.125, diag_offset=0, causal=False, dq_num_buf=1)


@pytest.mark.parametrize("causal", [True, False])
@pytest.mark.parametrize("nheads", [4, 2], ids=["gqa", "mha"])
def test_split_grid_order(causal, nheads, monkeypatch):
    """The d256 dV and dK kernels' grid order (``backward_split.PAIR_GROUP``): None (the
    default) the rule for causal GQA (``common.pair_group``: here 132 SMs over 5 blocks of 128
    keys, 10 of 64: 26 and 13 pairs, so every one of the 4 pairs) and pair-major (``KEYS_OUTER``
    off) for causal MHA; 1 pair-major; G that many pairs a group for every causal call; calls
    without causal stay pair-major."""
    from flashtile.backends.sm90 import backward_split as bw

    launches = []
    for name in ("_launch_dv", "_launch_dk"):
        monkeypatch.setattr(bw, name, lambda grid, args, constexprs, *rest, name=name: launches.append(
            (name, grid, args[-1], constexprs["KEYS_OUTER"])))
    monkeypatch.setattr(bw, "sm_count", lambda index: 132)
    q = torch.zeros(2, nheads, 600, 256, dtype=torch.bfloat16)
    kv = torch.zeros(2, 2, 600, 256, dtype=torch.bfloat16)
    lse = torch.zeros(2, nheads, 600)
    for knob, group in ((1, 1), (None, 4 if nheads > 2 else 1), (3, 3), (0, 4)):
        monkeypatch.setattr(bw, "PAIR_GROUP", knob)
        launches.clear()
        bw.attention_backward_ws(q, kv, kv, q, lse, lse, q, kv, kv, scale=0.1, diag_offset=0, causal=causal,
                                 kernels=("dv", "dk"))
        want = group if causal else 1
        assert launches == [("_launch_dv", (5 * 4,), want, want > 1), ("_launch_dk", (10 * 4,), want, want > 1)]


def test_one_pass_postprocess_casts_the_padded_accumulator(triton_backend):
    """``_dq_convert``: rows of the float32 dQ (padded to 64 rows) cast into a strided dq
    view, nothing past seqlen_q written (NaN-filled rows stay NaN)."""
    from flashtile.backends.sm90.backward_onepass import _launch_convert

    B, H, S, D, rows = 2, 3, 70, 64, 128
    acc = torch.randn(B, H, rows, D)
    base = torch.full((B, S + 5, H, D), float("nan"), dtype=torch.float16)
    dq = base[:, :S].transpose(1, 2)  # (B, H, S, D) view of a (B, S, H, D) buffer, rows to spare
    _launch_convert((2, B * H), (acc, dq, H, S, rows, *dq.stride()[:3]),
                    dict(BLOCK_M=64, HEAD_D=D, QROWS=64, NATIVE=False), 4, 1)
    assert torch.equal(dq, acc[:, :, :S].to(torch.float16))
    assert base[:, S:].isnan().all()


def _native_positions(rows: int, cols: int):
    """(row, col) of a native dQ slot's every offset, from ``native_offset_bases`` alone (the
    sum of the bases of the offset's set bits)."""
    from flashtile.backends.sm90.backward_onepass import native_offset_bases

    bases = torch.tensor(native_offset_bases(rows, cols))
    offsets = torch.arange(rows * cols)
    bits = (offsets[:, None] >> torch.arange(len(bases))) & 1
    at = bits @ bases
    return at[:, 0], at[:, 1]


@pytest.mark.parametrize("head_dim, q_rows", [(128, 64), (64, 128), (64, 64)])
def test_native_dq_order_is_put_back(head_dim, q_rows, triton_backend):
    """``dq_swizzle="native"``: each query tile's two halves lie one after the other in the
    float32 dQ, each in ``native_offset_bases``' order (a permutation of the slot: every
    (row, col) once); ``_dq_convert`` (interpreted) puts every element back, into a strided
    dq with seqlen_q inside the last tile (the padding rows are not written)."""
    from flashtile.backends.sm90.backward_onepass import _launch_convert

    half = head_dim // 2
    r_at, c_at = _native_positions(q_rows, half)
    assert sorted(zip(r_at.tolist(), c_at.tolist())) == [(r, c) for r in range(q_rows) for c in range(half)]
    B, H, S = 2, 3, q_rows + 37
    rows = -(-S // q_rows) * q_rows
    want = torch.randn(B, H, rows, head_dim)
    tiles = want.view(B, H, rows // q_rows, q_rows, 2, half).permute(0, 1, 2, 4, 3, 5)  # (.., tile, half, r, c)
    acc = tiles[..., r_at, c_at].contiguous().view(B, H, rows, head_dim)
    assert not torch.equal(acc, want)
    base = torch.full((B, S + 5, H, head_dim), float("nan"), dtype=torch.float16)
    dq = base[:, :S].transpose(1, 2)
    _launch_convert((-(-S // 64), B * H), (acc, dq, H, S, rows, *dq.stride()[:3]),
                    dict(BLOCK_M=64, HEAD_D=head_dim, QROWS=q_rows, NATIVE=True), 4, 1)
    assert torch.equal(dq, want[:, :, :S].to(torch.float16))
    assert base[:, S:].isnan().all()


def test_query_split_dq_order_is_put_back(triton_backend):
    """Under the query split (``Q_SPLIT``) each 64-row half of a 128-query step lies in place in
    the float32 dQ, all D = 64 columns in ``native_offset_bases(64, 64)``'s order (the reducer's
    64 x 64 boxes at rows row + half * 64); ``_dq_convert`` with QROWS = 64 (interpreted: the
    same offsets as two halves of 32 columns) puts every element back, the padding rows
    unwritten."""
    from flashtile.backends.sm90.backward_onepass import _launch_convert

    r_at, c_at = _native_positions(64, 64)
    B, H, S, D = 2, 3, 128 + 37, 64
    rows = 256  # padded to the steps' 128 queries
    want = torch.randn(B, H, rows, D)
    acc = want.view(B, H, rows // 64, 64, D)[..., r_at, c_at].contiguous().view(B, H, rows, D)
    assert not torch.equal(acc, want)
    base = torch.full((B, S + 5, H, D), float("nan"), dtype=torch.float16)
    dq = base[:, :S].transpose(1, 2)
    _launch_convert((-(-S // 64), B * H), (acc, dq, H, S, rows, *dq.stride()[:3]),
                    dict(BLOCK_M=64, HEAD_D=D, QROWS=64, NATIVE=True), 4, 1)
    assert torch.equal(dq, want[:, :, :S].to(torch.float16))
    assert base[:, S:].isnan().all()


def test_one_pass_arguments_are_checked_before_any_work():
    from flashtile.backends.sm90.backward_onepass import attention_backward_onepass

    t = torch.zeros(1, 2, 8, 32, dtype=torch.float16)
    lse = torch.zeros(1, 2, 8)
    with pytest.raises(ValueError, match="head dims"):
        attention_backward_onepass(t, t, t, t, lse, lse, t, t, t, scale=0.1, diag_offset=0, causal=False)
    t = torch.zeros(1, 2, 8, 64, dtype=torch.float16)
    with pytest.raises(ValueError, match="num_buf"):
        attention_backward_onepass(t, t, t, t, lse, lse, t, t, t, scale=0.1, diag_offset=0, causal=False, num_buf=1)
    with pytest.raises(ValueError, match="dq_accum"):  # rows are padded to 128 at d64 (64 would not do either)
        attention_backward_onepass(t, t, t, t, lse, lse, t, t, t, scale=0.1, diag_offset=0, causal=False,
                                   dq_accum=torch.zeros(1, 2, 8, 64))
    with pytest.raises(ValueError, match="dq_accum"):  # to 128 with 128 queries per step
        attention_backward_onepass(t, t, t, t, lse, lse, t, t, t, scale=0.1, diag_offset=0, causal=False,
                                   dq_accum=torch.zeros(1, 2, 64, 64), q_rows=128)
    with pytest.raises(ValueError, match="q_rows"):
        attention_backward_onepass(t, t, t, t, lse, lse, t, t, t, scale=0.1, diag_offset=0, causal=False, q_rows=96)
    t128 = torch.zeros(1, 2, 8, 128, dtype=torch.float16)
    with pytest.raises(ValueError, match="q_rows"):  # no room in shared memory at d128
        attention_backward_onepass(t128, t128, t128, t128, lse, lse, t128, t128, t128, scale=0.1, diag_offset=0,
                                   causal=False, q_rows=128)
    with pytest.raises(ValueError, match="q_rows"):  # packed sequences step by 64
        attention_backward_onepass(t, t, t, t, lse, lse, t, t, t, scale=0.1, diag_offset=0, causal=False, q_rows=128,
                                   varlen=(None, (torch.zeros(64, dtype=torch.int32), 1)))


def test_one_pass_128_query_steps_launch(monkeypatch):
    """q_rows=128: Q and dO boxes of 128 rows, 2 ring slots by default (the shared memory of
    4 slots of 64 rows), the float32 dQ padded to 128 rows (its boxes 128 rows too)."""
    from flashtile.backends.sm90 import backward_onepass as op

    launches = []
    monkeypatch.setattr(op, "_launch", lambda grid, args, constexprs, *rest: launches.append((grid, args, constexprs)))
    monkeypatch.setattr(op, "_launch_convert", lambda grid, args, *rest: launches.append((grid, args)))
    q = torch.zeros(1, 4, 300, 64, dtype=torch.float16)
    lse = torch.zeros(1, 4, 300)
    op.attention_backward_onepass(q, q, q, q, lse, lse, q, q, q, scale=0.1, diag_offset=0, causal=True, q_rows=128)
    (grid, args, constexprs), (convert_grid, convert_args) = launches
    assert constexprs["NUM_BUF"] == 2 and args[0].block_shape == [1, 1, 128, 64] and args[3].block_shape[2] == 128
    assert args[4].block_shape == [1, 1, 64, 64]  # dK's stores stay 64 keys per warpgroup
    dq_desc = args[17]  # the accumulator's own order (the default): a tile's halves one after the other
    assert dq_desc.block_shape == [128, 32] and dq_desc.shape == [2 * 4 * 384, 32] and args[18] == 384
    assert convert_args[4] == 384


@pytest.mark.parametrize("head_dim", [64, 128])
def test_one_pass_native_dq_launch(head_dim, monkeypatch):
    """dq_swizzle="native" (the default): the kernel's constexpr, the float32 dQ seen by its
    TMA boxes as (2 x B x H x padded rows, D / 2) without swizzle (a query tile's halves one
    after the other), and the postprocess told so; a swizzled call keeps the (B x H x rows,
    D) view."""
    from flashtile.backends.sm90 import backward_onepass as op

    launches = []
    monkeypatch.setattr(op, "_launch", lambda grid, args, constexprs, *rest: launches.append((args, constexprs)))
    monkeypatch.setattr(op, "_launch_convert", lambda grid, args, constexprs, *rest: launches.append(constexprs))
    q = torch.zeros(1, 4, 300, head_dim, dtype=torch.float16)
    lse = torch.zeros(1, 4, 300)
    q_rows = op.Q_ROWS[head_dim]
    rows = -(-300 // q_rows) * q_rows
    for swizzle in (None, op.DQ_SWIZZLE_PACKED[head_dim]):
        op.attention_backward_onepass(q, q, q, q, lse, lse, q, q, q, scale=0.1, diag_offset=0, causal=True,
                                      dq_swizzle=swizzle)
    (args, constexprs), convert, (plain_args, plain_constexprs), plain_convert = launches
    assert constexprs["DQ_NATIVE"] is True and convert["NATIVE"] is True and convert["QROWS"] == q_rows
    dq_desc = args[17]
    assert dq_desc.shape == [2 * 4 * rows, head_dim // 2] and dq_desc.block_shape == [q_rows, head_dim // 2]
    assert dq_desc.layout.swizzle_byte_width == 0
    assert plain_constexprs["DQ_NATIVE"] is False and plain_convert["NATIVE"] is False
    assert plain_args[17].shape == [4 * rows, head_dim] and plain_args[17].layout.swizzle_byte_width != 0


@pytest.mark.parametrize("causal, nheads_k", [(True, 2), (True, 1), (True, 4), (False, 2), (False, 4)])
def test_one_pass_grid_order(causal, nheads_k, monkeypatch):
    """Causal GQA calls launch block-major within groups of ``sms // num_n_blocks`` (batch, kv
    head) pairs (the grouped order: ``KEYS_OUTER`` and the runtime ``pair_group``), pair-major
    (``KEYS_OUTER`` off, the kernel's plain order) where that is one pair; causal MHA calls
    (unless ``GROUP_MHA``) and calls without causal pair-major. ``PAIR_GROUP`` (the
    experiments' knob) overrides the rule for every causal call."""
    from flashtile.backends.sm90 import backward_onepass as op

    launches = []
    monkeypatch.setattr(op, "_launch", lambda grid, args, constexprs, *rest: launches.append((grid, args, constexprs)))
    monkeypatch.setattr(op, "_launch_convert", lambda *a: None)
    sms = []
    monkeypatch.setattr(op, "sm_count", lambda index: sms[-1])
    q = torch.zeros(2, 4, 300, 64, dtype=torch.float16)
    kv = torch.zeros(2, nheads_k, 300, 64, dtype=torch.float16)
    lse = torch.zeros(2, 4, 300)
    pairs = 2 * nheads_k  # 3 key blocks of 128 each
    for group_mha in (False, True):
        monkeypatch.setattr(op, "GROUP_MHA", group_mha)
        for count, group in ((132, pairs), (6, 2), (5, 1), (2, 1)):  # one pair a group below 2 x 3 SMs
            sms.append(count)
            op.attention_backward_onepass(q, kv, kv, q, lse, lse, q, kv, kv, scale=0.1, diag_offset=0,
                                          causal=causal)
            grid, args, constexprs = launches[-1]
            want = min(group, pairs) if causal and (nheads_k < 4 or group_mha) else 1
            assert grid == (3 * pairs,) and args[20] == want and constexprs["KEYS_OUTER"] is (want > 1), (
                count, args[20])
    monkeypatch.setattr(op, "GROUP_MHA", False)
    for knob, group in ((0, pairs), (3, min(3, pairs)), (1, 1)):
        monkeypatch.setattr(op, "PAIR_GROUP", knob)  # the order experiment's knob reaches the launch, MHA too
        op.attention_backward_onepass(q, kv, kv, q, lse, lse, q, kv, kv, scale=0.1, diag_offset=0, causal=causal)
        assert launches[-1][1][20] == (group if causal else 1)


@pytest.mark.parametrize("pairs, blocks", [(1, 1), (6, 5), (7, 3), (16, 16), (5, 33)])
def test_grouped_coords_cover_the_grid_in_order(pairs, blocks):
    """The kernels' grouped order (``common.grouped_coords``, run as Python): every (key block,
    pair) once; the groups one after another, block-major within each (a group's block 0
    first), the last group short where pair_group does not divide the pairs; a group of one
    pair is pair-major and one of every pair block-major over the grid."""
    from flashtile.backends.sm90.common import grouped_coords

    for group in range(1, pairs + 1):
        coords = [grouped_coords.fn(pid, pairs, blocks, group) for pid in range(pairs * blocks)]
        assert sorted(coords) == [(nb, bk) for nb in range(blocks) for bk in range(pairs)], group
        want = []
        for first in range(0, pairs, group):
            members = range(first, min(first + group, pairs))
            want += [(nb, bk) for nb in range(blocks) for bk in members]
        assert coords == want, group
    assert [grouped_coords.fn(pid, pairs, blocks, 1) for pid in range(pairs * blocks)] == [
        (pid % blocks, pid // blocks) for pid in range(pairs * blocks)]
    assert [grouped_coords.fn(pid, pairs, blocks, pairs) for pid in range(pairs * blocks)] == [
        (pid // pairs, pid % pairs) for pid in range(pairs * blocks)]


@pytest.mark.parametrize("causal, blocks, pairs, sms, want", [
    (True, 16, 64, 132, 8), (True, 32, 64, 132, 4), (True, 64, 64, 132, 2), (True, 128, 64, 132, 1),
    (True, 256, 64, 132, 1), (True, 16, 4, 132, 4), (False, 16, 64, 132, 1)])
def test_pair_group_rule(causal, blocks, pairs, sms, want):
    """About one wave of programs a group: H100 runs 248-249's best group sizes at S2048-8192
    (16-64 key blocks of 128 on 132 SMs: 8, 4, 2), pair-major from S16384 on; the one-pass
    kernel's causal MHA calls pair-major (``GROUP_MHA`` off)."""
    from flashtile.backends.sm90 import backward_onepass as op
    from flashtile.backends.sm90.common import pair_group

    assert pair_group(None, causal, blocks, pairs, sms, gqa=True) == want
    assert op.pair_group(causal, blocks, pairs, sms, gqa=True) == want
    assert op.pair_group(causal, blocks, pairs, sms, gqa=False) == 1


@pytest.mark.parametrize("head_dim", [64, 128])
def test_one_pass_deterministic_launch(head_dim, monkeypatch):
    """deterministic=True: the kernel gets an int32 turn counter per (batch, query head,
    query tile), zeroed (Sem, after Delta; its dtype selects the ordered reducer), and two
    dQ slots (``DQ_BUF_DETERMINISTIC``); a plain call passes the float32 LSE there, unread,
    with ``DQ_BUF``'s slots. Packed sequences are refused by name."""
    from flashtile.backends.sm90 import backward_onepass as op

    launches = []
    monkeypatch.setattr(op, "_launch", lambda grid, args, constexprs, *rest: launches.append((args, constexprs)))
    monkeypatch.setattr(op, "_launch_convert", lambda *a: None)
    q = torch.zeros(2, 4, 300, head_dim, dtype=torch.float16)
    kv = torch.zeros(2, 2, 300, head_dim, dtype=torch.float16)
    lse = torch.zeros(2, 4, 300)
    for det in (True, False):
        op.attention_backward_onepass(q, kv, kv, q, lse, lse, q, kv, kv, scale=0.1, diag_offset=0, causal=True,
                                      deterministic=det)
    (det_args, det_constexprs), (plain_args, plain_constexprs) = launches
    tiles = -(-300 // op.Q_ROWS[head_dim])
    sem = det_args[8]
    assert sem.dtype == torch.int32 and sem.shape == (2 * 4 * tiles,) and not sem.any()
    assert plain_args[8] is lse
    assert det_constexprs["DQ_BUF"] == op.DQ_BUF_DETERMINISTIC[head_dim] == 2
    assert plain_constexprs["DQ_BUF"] == op.DQ_BUF[head_dim]
    with pytest.raises(ValueError, match="deterministic=True.*fixed-length"):
        op.attention_backward_onepass(q[:1], kv[:1], kv[:1], q[:1], lse[:1], lse[:1], q[:1], kv[:1], kv[:1],
                                      scale=0.1, diag_offset=0, causal=False, deterministic=True,
                                      varlen=(None, (torch.zeros(64, dtype=torch.int32), 1)))
    assert len(launches) == 2


def test_one_pass_deterministic_rotation(monkeypatch):
    """A deterministic call without causal starts each key block at a query tile of its own
    (``DET_ROTATE``) when a (batch, kv head)'s blocks fit on half the SMs (``det_rotate``):
    3 and 66 blocks of 128 keys on 132 SMs do, 67 do not; causal calls never rotate, nor do
    plain ones (``DET_ROTATE`` False). ``rotate=False`` keeps every block from the first
    tile; ``rotate=True`` where the rule says no (too many blocks, causal) is refused, since
    a block could wait for one that cannot start, and so is ``rotate`` without
    ``deterministic``. ``DET_ROTATE_DEFAULT`` is on (H100 run 237); with it off only
    ``rotate=True`` rotates."""
    from flashtile.backends.sm90 import backward_onepass as op

    launches = []
    assert op.DET_ROTATE_DEFAULT
    monkeypatch.setattr(op, "_launch", lambda grid, args, constexprs, *rest: launches.append(constexprs["DET_ROTATE"]))
    monkeypatch.setattr(op, "_launch_convert", lambda *a: None)
    monkeypatch.setattr(op, "sm_count", lambda index: 132)

    def call(seqlen, **kw):
        q = torch.zeros(1, 2, seqlen, 64, dtype=torch.float16)
        lse = torch.zeros(1, 2, seqlen)
        op.attention_backward_onepass(q, q, q, q, lse, lse, q, q, q, scale=0.1, diag_offset=0,
                                      **dict(dict(causal=False, deterministic=True), **kw))

    for seqlen in (300, 66 * 128, 66 * 128 + 1):
        call(seqlen)
    call(300, causal=True)
    call(300, deterministic=False)
    call(300, rotate=False)
    call(300, rotate=True)
    assert launches == [True, True, False, False, False, False, True]
    for kw in (dict(seqlen=66 * 128 + 1, rotate=True), dict(seqlen=300, causal=True, rotate=True)):
        with pytest.raises(ValueError, match="rotate=True needs no causal mask"):
            call(**kw)
    with pytest.raises(ValueError, match="pass deterministic=True"):
        call(300, deterministic=False, rotate=False)
    monkeypatch.setattr(op, "DET_ROTATE_DEFAULT", False)
    call(300)
    call(300, rotate=True)
    assert launches[7:] == [False, True]


@pytest.mark.parametrize("num_n_blocks, nq", [(1, 1), (16, 16), (16, 32), (13, 25), (7, 3), (66, 132), (40, 40)])
def test_rotated_turns_follow_the_arrival_order(num_n_blocks, nq):
    """``_rotated_turn`` (run as Python) against the order in which the blocks reach each
    query tile when block j starts at tile (j * nq) // num_n_blocks (the kernel's q_rot)
    and wraps around: at every tile the turns are 0 .. num_n_blocks - 1 once each, a block
    never goes before one that reached the tile at an earlier step, and of two that reach
    it at the same step the higher goes first (so a block waits only for blocks a step
    ahead of it or above it, never for a lower one that is behind)."""
    from flashtile.backends.sm90.backward_onepass import _rotated_turn

    for r in range(nq):
        step = [(r - (j * nq) // num_n_blocks) % nq for j in range(num_n_blocks)]
        by_turn = sorted(range(num_n_blocks), key=lambda j: _rotated_turn.fn(j, num_n_blocks, r, nq))
        assert sorted(_rotated_turn.fn(j, num_n_blocks, r, nq) for j in range(num_n_blocks)) == list(
            range(num_n_blocks))
        assert by_turn == sorted(range(num_n_blocks), key=lambda j: (step[j], -j))


def _schedule_finishes(visits, resident):
    """Deterministic reducers as a schedule: ``visits`` lists the blocks in launch order, each
    as its (counter, turn) per step. Blocks launch in order, at most ``resident`` at once; a
    block adds at its step once that counter reads the step's turn, then counts it up; a block
    past its last step ends and frees its place. True if every block ends, False if the
    resident blocks all wait (a hang on the GPU)."""
    counter, steps, running, launched = {}, [0] * len(visits), [], 0
    while True:
        while launched < len(visits) and len(running) < resident:
            running.append(launched)
            launched += 1
        if not running:
            return True
        moved = False
        for b in list(running):
            at, turn = visits[b][steps[b]]
            if counter.get(at, 0) == turn:
                counter[at] = turn + 1
                steps[b] += 1
                moved = True
                if steps[b] == len(visits[b]):
                    running.remove(b)
        if not moved:
            return False


def _simulate_turns(num_n_blocks, nq, resident, start, turn, group_size=1, pairs=1):
    """``_schedule_finishes`` for ``pairs`` (batch, kv head) pairs' blocks, pair-major (as the
    grid): block j of a pair, at its step s, adds into query head s // nq's tile
    (start(j) + s) % nq in turn turn(j, tile), over every tile of its group_size heads."""
    visits = [[((pair, s // nq, (start(j) + s) % nq), turn(j, (start(j) + s) % nq)) for s in range(group_size * nq)]
              for pair in range(pairs) for j in range(num_n_blocks)]
    return _schedule_finishes(visits, resident)


@pytest.mark.parametrize("num_n_blocks, nq", [(16, 16), (16, 32), (13, 25), (7, 3), (66, 132), (64, 64)])
def test_deterministic_orders_never_hang_where_allowed(num_n_blocks, nq):
    """Every block's reductions complete in the rotated order (``_rotated_turn``) whenever
    ``det_rotate`` allows it (here three pairs on as few SMs as the rule allows; one pair's
    worth of places, the least one launch needs, with two pairs of three query heads a kv
    head), and in the ascending order (every block from the first tile, session 42's) with a
    single block resident.
    With fewer places than blocks the rotated order hangs (a block waits for a higher one
    that cannot start): the reason for the rule."""
    from flashtile.backends.sm90.backward_onepass import _rotated_turn, det_rotate

    sms = 2 * num_n_blocks
    assert det_rotate(False, num_n_blocks, sms) and not det_rotate(False, num_n_blocks, sms - 1)

    def rot(j):
        return (j * nq) // num_n_blocks

    def rotated(j, tile):
        return _rotated_turn.fn(j, num_n_blocks, tile, nq)

    assert _simulate_turns(num_n_blocks, nq, sms, rot, rotated, pairs=3)
    # a pair's worth of places is enough for one launch (in-order, pair-major); GQA: heads in turn
    assert _simulate_turns(num_n_blocks, nq, num_n_blocks, rot, rotated, group_size=3, pairs=2)
    assert _simulate_turns(num_n_blocks, nq, 1, lambda j: 0, lambda j, tile: j)
    if num_n_blocks > 2 and nq > 2:
        assert not _simulate_turns(num_n_blocks, nq, num_n_blocks // 2, rot, rotated)


@pytest.mark.parametrize("pairs, num_n_blocks, heads", [(6, 5, 1), (4, 8, 3), (7, 3, 2)])
def test_deterministic_causal_grouped_orders_never_hang(pairs, num_n_blocks, heads):
    """Deterministic causal calls in every grouped grid order (``common.grouped_coords``, a
    pair's blocks reversed as ``onepass_kernel`` reverses them): query tile t (as tall as a
    key block) is seen by key blocks 0 .. t, which add into it in turns t - j (``_det_turn``:
    the highest first); block j walks tiles j .. end of each of its pair's query heads.
    Blocks launch in grid order, at most ``resident`` at once, and a block that has added
    into all its tiles frees its place. Every order finishes with one place or many, since
    a block waits only for higher blocks of its pair, which launch before it; launched
    lowest first (the reversal dropped), one place hangs."""
    from flashtile.backends.sm90.common import grouped_coords

    def finishes(order, resident):  # block j walks tiles j .. end of each head, tile t in turn t - j
        return _schedule_finishes([[((pair, head, t), t - j) for head in range(heads) for t in range(j, num_n_blocks)]
                                   for pair, j in order], resident)

    grid = range(pairs * num_n_blocks)
    for group in range(1, pairs + 1):
        order = [(bk, num_n_blocks - 1 - nb) for nb, bk in (grouped_coords.fn(pid, pairs, num_n_blocks, group)
                                                          for pid in grid)]
        for resident in (1, 2, num_n_blocks, pairs * num_n_blocks):
            assert finishes(order, resident), (group, resident)
        ascending = [(bk, nb) for nb, bk in (grouped_coords.fn(pid, pairs, num_n_blocks, group) for pid in grid)]
        assert not finishes(ascending, 1)


def test_one_pass_packed_launch(monkeypatch):
    """Packed sequences (B = 1): one program per (kv head, item of the key work list), the
    list's capacity wide (the kernel returns past the count); the work list's order, never
    block-major; dK and dV with their head and row strides for the masked last tiles. A
    batch of two is refused before any launch."""
    from flashtile.backends.sm90 import backward_onepass as op

    launches = []
    monkeypatch.setattr(op, "_launch", lambda grid, args, constexprs, *rest: launches.append((grid, args, constexprs)))
    monkeypatch.setattr(op, "_launch_convert", lambda *a: launches.append(("convert", a)))
    q = torch.zeros(1, 6, 300, 64, dtype=torch.float16)
    kv = torch.zeros(1, 300, 2, 64, dtype=torch.float16).transpose(1, 2)  # (B, Hk, S, D) view
    lse = torch.zeros(1, 6, 300)
    table = torch.zeros(64, dtype=torch.int32)
    op.attention_backward_onepass(q, kv, kv, q, lse, lse, q, kv, kv, scale=0.1, diag_offset=0, causal=True,
                                  varlen=(None, (table, 5), "a query table, unread"))
    (grid, args, constexprs), (_, (convert_grid, convert_args, *_)) = launches
    assert grid == (5 * 2,) and constexprs["KEYS_OUTER"] is False and args[20] == 1  # heads outer
    assert constexprs["DQ_BUF"] == op.DQ_BUF_PACKED[64] == 2  # fixed lengths take one at d64
    assert args[-8:] == (table, 5, kv, 64, 2 * 64, kv, 64, 2 * 64)  # head stride 64, row stride 128
    assert convert_grid == (5, 6) and convert_args[4] == 320  # every packed row cast, the accumulator padded
    with pytest.raises(ValueError, match="one batch row"):
        op.attention_backward_onepass(q.expand(2, -1, -1, -1), kv, kv, q, lse, lse, q, kv, kv, scale=0.1,
                                      diag_offset=0, causal=True, varlen=(None, (table, 5)))
    assert len(launches) == 2


def test_dq_slot_layout_and_its_swizzle():
    """The one-pass kernel's float32 dQ slots: by default in the accumulator's own order at
    both head dims (``DQ_NATIVE``: TMA boxes without swizzle; H100 runs 218-221) for
    fixed-length calls; packed sequences (whose query tiles start at any row) keep the
    earlier defaults, 32-byte swizzled at d64 (no bank conflicts) and Triton's own layout for
    the tile at d128 (128 bytes), and refuse ``DQ_NATIVE`` asked for; a swizzle is one TMA
    supports, else refused before any launch."""
    import triton.experimental.gluon.language as gl

    from flashtile.backends.sm90 import backward_onepass as op

    for d in op.HEAD_DIMS:
        assert op.dq_slot_swizzle(d, None, packed=False) == op.DQ_NATIVE
        assert op.dq_accumulator_layout(d).swizzle_byte_width == 0
        assert op.dq_accumulator_layout(d, 32).swizzle_byte_width == 32
        assert op.dq_accumulator_layout(d, 128) == gl.NVMMASharedLayout.get_default_for([op.BLOCK, d // 2],
                                                                                       gl.float32)
    assert op.dq_slot_swizzle(64, None, packed=True) == 32
    assert op.dq_slot_swizzle(128, None, packed=True) == 128
    assert op.dq_slot_swizzle(64, 128, packed=True) == 128
    with pytest.raises(ValueError, match="fixed-length"):
        op.dq_slot_swizzle(128, op.DQ_NATIVE, packed=True)
    with pytest.raises(ValueError, match="swizzle"):
        op.dq_accumulator_layout(128, 16)
    with pytest.raises(ValueError, match="swizzle"):
        op.dq_accumulator_layout(128, "natural")


def test_query_split_plan_and_its_box():
    """The d64 query split (``backward_onepass.split_plan``, session 51): off by default
    (``Q_SPLIT``), taken when asked at d64 with 128 queries per step, the native dQ slots and
    fixed lengths, and refused, naming q_split, anywhere else; its dQ slots are boxes of 64
    rows x D (one row half per warpgroup) instead of 128 x D / 2."""
    from flashtile.backends.sm90 import backward_onepass as op

    assert op.Q_SPLIT is False
    assert op.split_plan(64, 128, True, False, None) is False
    assert op.split_plan(64, 128, True, False, True) is True
    assert op.split_plan(128, 64, True, False, None) is False
    for args in ((128, 64, True, False), (64, 64, True, False), (64, 128, False, False), (64, 128, True, True)):
        with pytest.raises(ValueError, match="q_split=True"):
            op.split_plan(*args, True)
        assert op.split_plan(*args, None) is False
    assert op.dq_box(64, 128, True) == [64, 64] and op.dq_box(64, 128, False) == [128, 32]
    assert op.dq_box(128, 64, False) == [64, 64]


@pytest.mark.parametrize("q_split", [False, True])
def test_query_split_launch(q_split, monkeypatch):
    """A fixed-length d64 call under ``Q_SPLIT``: the dQ descriptor views the float32
    accumulator as (B * H * rows, 64) in boxes of 64 x 64 (a warpgroup's row half, in place)
    instead of (2 * B * H * rows, 32) in boxes of 128 x 32, and the cast reads 64-row tiles;
    without it, the launch is today's. q_split=True at d128 is refused before any launch."""
    from flashtile.backends.sm90 import backward_onepass as op

    launches = []
    monkeypatch.setattr(op, "Q_SPLIT", q_split)
    monkeypatch.setattr(op, "_launch", lambda grid, args, constexprs, *rest: launches.append((grid, args, constexprs)))
    monkeypatch.setattr(op, "_launch_convert", lambda grid, args, constexprs, *rest: launches.append(constexprs))
    monkeypatch.setattr(op, "sm_count", lambda index: 132)
    q = torch.zeros(2, 4, 300, 64, dtype=torch.float16)
    kv = torch.zeros(2, 2, 300, 64, dtype=torch.float16)
    lse = torch.zeros(2, 4, 300)
    op.attention_backward_onepass(q, kv, kv, q, lse, lse, q, kv, kv, scale=0.1, diag_offset=0, causal=False)
    (grid, args, constexprs), convert = launches
    dq_desc = args[17]
    rows = 2 * 4 * 384  # 300 queries padded to 3 steps of 128
    assert list(dq_desc.block_shape) == ([64, 64] if q_split else [128, 32])
    assert list(dq_desc.shape) == ([rows, 64] if q_split else [2 * rows, 32])
    assert constexprs["DQ_NATIVE"] is True and convert["QROWS"] == (64 if q_split else 128)
    q, kv = torch.zeros(2, 4, 300, 128, dtype=torch.float16), torch.zeros(2, 2, 300, 128, dtype=torch.float16)
    with pytest.raises(ValueError, match="q_split=True"):
        op.attention_backward_onepass(q, kv, kv, q, lse, lse, q, kv, kv, scale=0.1, diag_offset=0, causal=False,
                                      q_split=True)
    assert len(launches) == 2


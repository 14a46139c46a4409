"""The HBM-traffic / FLOP model (flashtile.traffic): exact numbers, CPU only."""

from __future__ import annotations

import dataclasses
import io
import math
import subprocess
import sys

import numpy as np
import pytest

from flashtile import traffic as tr
from flashtile.traffic import (H200, H200_MEASURED, attention_flops, attention_roofline, memory_work, min_hbm_bytes,
                               print_traffic_table, roofline_time)


def _brute_tiles(n: int, m: int, br: int, bc: int, causal: bool):
    """Visible mask and visited tile pairs from an explicit N x M mask (small sizes only)."""
    rows, cols = np.arange(n)[:, None], np.arange(m)[None, :]
    mask = cols <= rows + (m - n) if causal else np.ones((n, m), dtype=bool)
    visits = {(i, j) for i in range(-(-n // br)) for j in range(-(-m // bc))
              if mask[i * br:(i + 1) * br, j * bc:(j + 1) * bc].any()}
    return mask, visits


# ---------------------------------------------------------------- convention FLOPs / bytes


class TestConventions:
    def test_attention_flops_benchmarks_convention(self):
        fwd = 4 * 4 * 16 * 4096 * 4096 * 128
        assert attention_flops(4, 16, 4096, 4096, 128) == fwd
        assert attention_flops(4, 16, 4096, 4096, 128, causal=True) == fwd / 2
        assert attention_flops(4, 16, 4096, 4096, 128, pass_="bwd") == 2.5 * fwd
        assert attention_flops(4, 16, 4096, 4096, 128, pass_="fwd_bwd") == 3.5 * fwd
        assert attention_flops(1, 1, 239, 1, 59, causal=True) == 4 * 239 * 59 / 2

    def test_min_hbm_bytes_gqa_decode(self):
        # BENCHMARKS.md decode row: batch 8, 32 query / 8 KV heads, KV length 4096, bf16.
        q = 8 * 32 * 1 * 128 * 2
        kv = 8 * 8 * 4096 * 128 * 2
        lse = 8 * 32 * 1 * 4
        assert min_hbm_bytes(8, 32, 8, 1, 4096, 128) == 2 * q + 2 * kv + lse
        assert min_hbm_bytes(8, 32, 8, 1, 4096, 128, pass_="bwd") == 4 * q + 4 * kv + lse
        assert min_hbm_bytes(8, 32, 8, 1, 4096, 128, pass_="fwd_bwd") == 6 * q + 6 * kv + 2 * lse

    def test_min_hbm_bytes_linear_in_seqlen(self):
        one = min_hbm_bytes(2, 6, 2, 1000, 1000, 64, dtype_bytes=2)
        assert min_hbm_bytes(2, 6, 2, 2000, 2000, 64, dtype_bytes=2) == 2 * one

    def test_min_hbm_bytes_rejects_indivisible_heads(self):
        with pytest.raises(ValueError, match=r"nheads_k.*nheads_k=4"):
            min_hbm_bytes(1, 6, 4, 16, 16, 64)


# ---------------------------------------------------------------- naive vs flash ledger


class TestNaive:
    def test_nxn_touches_and_quadratic_growth(self):
        small, big = memory_work(512, 64), memory_work(1024, 64)
        # element touches, as the lesson counts them: quadratic for naive, zero for flash
        assert small.naive.nxn_touches == 4 * 512 * 512 and small.flash.nxn_touches == 0
        assert big.naive.nxn_touches == 4 * small.naive.nxn_touches
        assert small.naive.nxn_arrays == 4 and small.flash.nxn_arrays == 0
        assert memory_work(512, 64, backward=True).naive.nxn_arrays == 7
        assert memory_work(512, 64, backward=True).naive.nxn_touches == 7 * 512 * 512
        s_bytes = sum(line.total_bytes for line in small.naive.ledger if line.tensor in ("S", "P"))
        b_bytes = sum(line.total_bytes for line in big.naive.ledger if line.tensor in ("S", "P"))
        assert b_bytes == 4 * s_bytes == 4 * 4 * 512 * 512 * 4

    @pytest.mark.parametrize("causal", [False, True])
    def test_forward_bytes_exact(self, causal):
        n, m, d, b = 300, 217, 40, 2
        w = memory_work(n, d, dtype_bytes=b, seqlen_k=m, causal=causal)
        # write S, read S, write P, read P; read Q, K, V; write O. Causal masks, moves the same.
        assert w.naive.hbm_bytes == 4 * n * m * b + 2 * n * d * b + 2 * m * d * b

    def test_backward_bytes_exact(self):
        n, m, d, b = 256, 128, 64, 4
        w = memory_work(n, d, dtype_bytes=b, seqlen_k=m, backward=True)
        # P read twice, dP written+read, dS written+read twice; dO read twice; Q, K, V read;
        # dQ, dK, dV written.
        assert w.naive.hbm_bytes == 7 * n * m * b + (2 + 1 + 1) * n * d * b + 4 * m * d * b
        assert w.naive.line("dS").reads_bytes == 2 * n * m * b


class TestFlash:
    @pytest.mark.parametrize("n", [64, 1000, 4096])
    @pytest.mark.parametrize("br", [48, 64, 128])
    def test_forward_kv_rereads_are_ceil_n_over_br_passes(self, n, br):
        d, b = 64, 4
        w = memory_work(n, d, dtype_bytes=b, Br=br, Bc=64, sram_kv_reuse="hbm").flash
        passes = math.ceil(n / br)
        k, k_re = w.line("K"), w.line(f"K re-reads {tr.REREAD_TAG}")
        assert k.reads_bytes == n * d * b
        assert k_re.reads_bytes == (passes - 1) * n * d * b
        assert w.line(f"V re-reads {tr.REREAD_TAG}").reads_bytes == k_re.reads_bytes
        assert w.hbm_bytes == w.compulsory_bytes + 2 * k_re.reads_bytes

    def test_default_hbm_bytes_grow_linearly_as_the_lesson_says(self):
        """The seed lesson's model: FlashAttention's HBM bytes linear in N (the L2 absorbs
        the K/V re-reads, as the H200's DRAM counters measured); the every-re-read bound
        stays the option sram_kv_reuse="hbm" (quadratic)."""
        d = 64
        small, big = memory_work(1024, d), memory_work(4096, d)
        assert big.flash.hbm_bytes == 4 * small.flash.hbm_bytes
        assert big.flash.hbm_bytes == big.flash.compulsory_bytes
        bound = memory_work(4096, d, sram_kv_reuse="hbm").flash.hbm_bytes
        assert bound > 10 * memory_work(1024, d, sram_kv_reuse="hbm").flash.hbm_bytes / 4
        assert big.naive.hbm_bytes / big.flash.hbm_bytes > 4 * small.naive.hbm_bytes / small.flash.hbm_bytes * 0.9

    def test_compulsory_bytes_exactly_linear(self):
        d, b = 64, 4
        for n in (128, 1000, 4096):
            w = memory_work(n, d, dtype_bytes=b)
            assert w.flash.compulsory_bytes == 4 * n * d * b + 4 * n  # Q, K, V, O + fp32 LSE
            assert w.naive.compulsory_bytes == w.flash.compulsory_bytes
        twice = memory_work(2000, d).flash.compulsory_bytes
        assert twice == 2 * memory_work(1000, d).flash.compulsory_bytes

    def test_causal_rereads_half_of_full_when_tiles_divide(self):
        n, d, b, blk = 4096, 64, 4, 64
        full = memory_work(n, d, dtype_bytes=b, Br=blk, Bc=blk).flash.reread_bytes
        causal = memory_work(n, d, dtype_bytes=b, Br=blk, Bc=blk, causal=True).flash.reread_bytes
        t = n // blk
        # K tile j is visited by Q tiles j..t-1: t(t+1)/2 visits, t of them first visits.
        assert causal == 2 * (t * (t + 1) // 2 - t) * blk * d * b
        assert causal * 2 == full

    def test_causal_rereads_about_half_with_ragged_tiles(self):
        full = memory_work(1000, 64, Br=48, Bc=64).flash.reread_bytes
        causal = memory_work(1000, 64, Br=48, Bc=64, causal=True).flash.reread_bytes
        assert 0.45 < causal / full < 0.55

    @pytest.mark.parametrize("n,m", [(1, 1), (1, 239), (239, 1), (3, 799), (113, 203),
                                     (128, 217), (217, 128), (127, 513)])
    @pytest.mark.parametrize("causal", [False, True])
    def test_tile_counts_match_brute_force_mask(self, n, m, causal):
        br, bc, d, b = 16, 32, 8, 2
        mask, visits = _brute_tiles(n, m, br, bc, causal)
        kw = dict(dtype_bytes=b, Br=br, Bc=bc, seqlen_k=m, causal=causal)
        fwd, bwd = memory_work(n, d, **kw), memory_work(n, d, backward=True, **kw)
        width = lambda j: min(bc, m - j * bc)  # noqa: E731
        height = lambda i: min(br, n - i * br)  # noqa: E731
        computed = sum(height(i) * width(j) for i, j in visits)
        assert fwd.flash.flops == 4 * int(mask.sum()) * d
        assert fwd.flash.executed_flops == 4 * computed * d
        assert bwd.flash.flops == 10 * int(mask.sum()) * d
        assert bwd.flash.executed_flops == 10 * computed * d
        k_loads = sum(width(j) for _, j in visits)
        k_first = sum(width(j) for j in {j for _, j in visits})
        k_re = fwd.flash.line(f"K re-reads {tr.REREAD_TAG}")
        assert k_re.reads_bytes == (k_loads - k_first) * d * b
        q_loads = sum(height(i) for i, _ in visits)
        q_first = sum(height(i) for i in {i for i, _ in visits})
        q_re = bwd.flash.line(f"Q re-reads {tr.REREAD_TAG}")
        assert q_re.reads_bytes == (q_loads - q_first) * d * b
        assert bwd.flash.line(f"dO re-reads {tr.REREAD_TAG}").reads_bytes == q_loads * d * b
        atomics = bwd.flash.line(f"dQ atomics {tr.REREAD_TAG}")
        assert atomics.reads_bytes == atomics.writes_bytes == q_loads * d * tr.DQ_ACCUM_BYTES

    def test_backward_fa2_order_exact(self):
        n, d, b, bc = 1000, 64, 2, 64
        w = memory_work(n, d, dtype_bytes=b, Bc=bc, backward=True).flash
        tc = math.ceil(n / bc)
        assert w.line(f"Q re-reads {tr.REREAD_TAG}").reads_bytes == (tc - 1) * n * d * b
        assert w.line(f"LSE re-reads {tr.REREAD_TAG}").reads_bytes == (tc - 1) * n * 4
        assert w.line("D").writes_bytes == n * 4
        assert w.compulsory_bytes == 8 * n * d * b + 4 * n  # read q k v o do lse, write dq dk dv
        assert w.nxn_touches == 0

    def test_l2_mode_drops_exactly_the_reread_lines(self):
        n, d, b = 1000, 128, 2
        fwd = memory_work(n, d, dtype_bytes=b, sram_kv_reuse="l2")
        assert fwd.flash.hbm_bytes == fwd.flash.compulsory_bytes
        bwd = memory_work(n, d, dtype_bytes=b, backward=True, sram_kv_reuse="l2")
        # What is left above the floor: D (fp32 write + first read), fp32 dQ zero-fill + convert.
        assert bwd.flash.hbm_bytes == bwd.flash.compulsory_bytes + 2 * n * 4 + 2 * n * d * 4
        hbm = memory_work(n, d, dtype_bytes=b, backward=True, sram_kv_reuse="hbm")
        assert hbm.flash.hbm_bytes == sum(x.total_bytes for x in hbm.flash.ledger)
        assert hbm.flash.hbm_bytes - bwd.flash.hbm_bytes == hbm.flash.reread_bytes > 0

    def test_flops_exact(self):
        n, d = 1000, 64
        assert memory_work(n, d).flash.flops == 4 * n * n * d
        assert memory_work(n, d, causal=True).flash.flops == 4 * (n * (n + 1) // 2) * d
        causal_bwd = memory_work(n, d, causal=True, backward=True)
        assert causal_bwd.naive.flops == 10 * (n * (n + 1) // 2) * d
        # Naive computes the whole square; its backward is 4 matmuls, no recomputation.
        assert memory_work(n, d, causal=True).naive.executed_flops == 4 * n * n * d
        assert causal_bwd.naive.executed_flops == 8 * n * n * d

    def test_dict_and_attribute_access_agree(self):
        w = memory_work(256, 32, causal=True, backward=True)
        assert w["naive"] is w.naive and w["flash"] is w.flash
        for algo in (w.naive, w.flash):
            for key in ("nxn_touches", "hbm_bytes", "compulsory_bytes", "flops", "ledger"):
                assert algo[key] == getattr(algo, key)
        with pytest.raises(KeyError):
            w["fast"]
        with pytest.raises(dataclasses.FrozenInstanceError):
            w.flash.hbm_bytes = 0  # type: ignore[misc]
        # Plain ints, so rows serialize to JSON for the CLI and benchmarks.
        assert all(type(x.reads_bytes) is int and type(x.writes_bytes) is int
                   for x in w.flash.ledger + w.naive.ledger)
        assert type(w.flash.hbm_bytes) is int and type(w.flash.executed_flops) is int


# ---------------------------------------------------------------- table, plot, roofline


def test_print_traffic_table_prints_and_returns_rows():
    buf = io.StringIO()
    rows = print_traffic_table((128, 256, 1000), d=64, dtype_bytes=4, file=buf)
    text = buf.getvalue()
    assert [r["N"] for r in rows] == [128, 256, 1000]
    assert "   1000 |" in text and "d=64" in text
    for r in rows:
        w = memory_work(r["N"], 64, sram_kv_reuse="hbm")  # the table's flash+reread column
        assert r["naive_nxn_elements"] == 4 * r["N"] ** 2
        assert r["naive_hbm_bytes"] == w.naive.hbm_bytes
        assert r["flash_compulsory_bytes"] == w.flash.compulsory_bytes
        assert r["flash_hbm_bytes"] == w.flash.hbm_bytes
        assert r["ratio"] == pytest.approx(w.naive.hbm_bytes / w.flash.hbm_bytes)
        assert r["ratio_compulsory"] == pytest.approx(w.naive.hbm_bytes / w.flash.compulsory_bytes)
    # Everything through HBM, flash saves about 2 * Br / d (= 2 here); the floor ~N / d.
    assert rows[0]["ratio"] == pytest.approx(2.0, rel=0.01)
    n, d, b = 1000, 64, 4
    assert rows[2]["ratio_compulsory"] == (4 * n * n * b + 4 * n * d * b) / (4 * n * d * b + 4 * n)
    assert f"{rows[0]['naive_nxn_elements']:,}" in text  # 65,536


def test_plot_traffic_writes_png(tmp_path):
    pytest.importorskip("matplotlib")
    out = tr.plot_traffic([128, 512, 2048], tmp_path / "traffic.png")
    assert out.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_import_does_not_pull_matplotlib():
    code = "import sys, flashtile.traffic; sys.exit('matplotlib' in sys.modules)"
    assert subprocess.run([sys.executable, "-c", code]).returncode == 0


class TestRoofline:
    def test_constants(self):
        assert (H200.hbm_bytes_per_s, H200.matmul_flops_per_s) == (4.8e12, 989e12)
        measured = (H200_MEASURED.hbm_bytes_per_s, H200_MEASURED.matmul_flops_per_s)
        assert measured == (4.24e12, 775e12)

    def test_roofline_time_picks_the_bound(self):
        est = roofline_time(989e12, 1e12)
        assert est.bound == "compute" and est.seconds == est.compute_s == 1.0
        assert est.memory_s == pytest.approx(1e12 / 4.8e12)
        est = roofline_time(1e9, 4.24e12, gpu=H200_MEASURED)
        assert est.bound == "memory" and est.seconds == est.memory_s == 1.0

    def test_attention_prefill_compute_bound_decode_memory_bound(self):
        prefill = attention_roofline(4, 16, 16, 4096, 4096, 128)
        assert prefill.bound == "compute"
        assert prefill.compute_s == 4 * 4 * 16 * 4096 * 4096 * 128 / 989e12
        decode = attention_roofline(8, 32, 8, 1, 32768, 128, gpu=H200_MEASURED)
        assert decode.bound == "memory"
        assert decode.memory_s == min_hbm_bytes(8, 32, 8, 1, 32768, 128) / 4.24e12


# ---------------------------------------------------------------- bad input


@pytest.mark.parametrize(
    "call,exc,words",
    [
        (lambda: memory_work(0, 64), ValueError, ["N", "0"]),
        (lambda: memory_work(-5, 64), ValueError, ["N", "-5"]),
        (lambda: memory_work(128, 0), ValueError, ["d", "0"]),
        (lambda: memory_work(128.0, 64), TypeError, ["N", "128.0"]),
        (lambda: memory_work(True, 64), TypeError, ["N", "True"]),
        (lambda: memory_work(128, 64, dtype_bytes=0), ValueError, ["dtype_bytes", "0"]),
        (lambda: memory_work(128, 64, Br=0), ValueError, ["Br", "0"]),
        (lambda: memory_work(128, 64, Bc=-1), ValueError, ["Bc", "-1"]),
        (lambda: memory_work(128, 64, seqlen_k=0), ValueError, ["seqlen_k", "0"]),
        (lambda: memory_work(128, 64, sram_kv_reuse="smem"), ValueError, ["sram_kv_reuse", "smem"]),
        (lambda: attention_flops(1, 1, 128, 128, 64, pass_="bw"), ValueError, ["pass_", "bw"]),
        (lambda: attention_flops(1, 1, 128, "128", 64), TypeError, ["seqlen_k", "128"]),
        (lambda: min_hbm_bytes(1, 1, 1, 16, 16, 64, dtype_bytes=0), ValueError, ["dtype_bytes"]),
        (lambda: roofline_time(-1.0, 10.0), ValueError, ["flops", "-1.0"]),
        (lambda: roofline_time(1.0, float("nan")), ValueError, ["bytes_", "nan"]),
        (lambda: print_traffic_table((128, 0), file=io.StringIO()), ValueError, ["N", "0"]),
    ],
)
def test_bad_input_names_argument_and_value(call, exc, words):
    with pytest.raises(exc) as info:
        call()
    for word in words:
        assert word in str(info.value)


def test_numpy_integers_accepted():
    assert memory_work(np.int64(256), np.int32(64)) == memory_work(256, 64)

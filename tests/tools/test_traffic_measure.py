"""`flashtile traffic --measure`: ncu's CSV, the cases between markers, the model's numbers,
and the message without a GPU (CPU); the measurement itself on the GPU."""

from __future__ import annotations

import json

import pytest

from flashtile import cli, traffic
from flashtile.tools import traffic_measure as tm

HEADER = ('"ID","Process ID","Process Name","Host Name","Kernel Name","Context","Stream","Block Size",'
          '"Grid Size","Device","CC","Section Name","Metric Name","Metric Unit","Metric Value"')


def _rows(kid, name, read, write, ns):
    base = f'"{kid}","1","python3","127.0.0.1","{name}","1","7","(1, 1, 1)","(1, 1, 1)","0","9.0",'
    return [base + f'"Command line profiler metrics","{m}","{u}","{v}"'
            for m, u, v in (("dram__bytes_read.sum", "byte", read), ("dram__bytes_write.sum", "byte", write),
                            ("gpu__time_duration.sum", "nsecond", ns))]


def _csv(kernels):
    lines = ["==PROF== Connected to process 1 (python3)", HEADER]
    for i, k in enumerate(kernels):
        lines += _rows(i, *k)
    lines.append("==PROF== Disconnected from process 1")
    return "\n".join(lines)


def test_parse_and_split_cases():
    text = _csv([(tm.MARKER, 32, 0, 1000),
                 ("void cutlass::Kernel2<cutlass_80_wmma_tensorop_bf16_s161616gemm_bf16_16x16_128x2_tn_align8>(T1::Params)",
                  "1,000,000", 500, 2000),
                 ("softmax_warp_forward", 300, 200, 3000),
                 (tm.MARKER, 32, 0, 1000),
                 ("_attn_fwd_ws", 7000, 4000, 5000)])
    rows = tm.parse_ncu_csv(text)
    assert [r.id for r in rows] == [0, 1, 2, 3, 4]
    assert rows[1].metrics["dram__bytes_read.sum"] == 1_000_000  # thousands separators tolerated
    cases = tm.split_cases(rows, ["a", "b"])
    assert [r.name for r in cases["a"]][1] == "softmax_warp_forward"
    assert [r.name for r in cases["b"]] == ["_attn_fwd_ws"]
    with pytest.raises(ValueError, match="more .* than cases"):
        tm.split_cases(rows, ["a"])
    with pytest.raises(ValueError, match="no flashtile_measure_marker for the cases"):
        tm.split_cases(rows, ["a", "b", "c"])
    with pytest.raises(ValueError, match="before the first"):
        tm.split_cases(rows[1:], ["a", "b"])
    with pytest.raises(ValueError, match="--page details"):
        tm.parse_ncu_csv('"ID","Kernel Name"\n"1","k"')


def test_summarize_and_the_l2_share():
    case = tm.Case("flashtile", "fwd", 4096, 128, 16)
    model = tm.model_bytes(case)
    assert model["compulsory"] == traffic.min_hbm_bytes(1, 16, 16, 4096, 4096, 128, 2, "fwd")
    assert model["compulsory_read"] == 16 * 3 * 4096 * 128 * 2  # q, k, v
    assert model["compulsory_read"] + model["compulsory_write"] == model["compulsory"]
    assert model["no_cache"] == 16 * traffic.memory_work(4096, 128, dtype_bytes=2, Br=128, Bc=128,
                                                           sram_kv_reuse="hbm").flash.hbm_bytes
    assert model["kernel_floor_read"] == model["compulsory_read"]
    # Reads half-way between the floor and every re-read from HBM: the L2 took half; the
    # writes (short of the output when it stays in the L2) do not enter the share.
    half = (model["kernel_floor_read"] + model["no_cache_read"]) / 2
    row = tm.summarize(case, [tm.KernelRow(1, "_attn_fwd_ws", {"dram__bytes_read.sum": half,
                                                                 "dram__bytes_write.sum": 1000.0,
                                                                 "gpu__time_duration.sum": 2e6})])
    assert row["measured_bytes"] == pytest.approx(half + 1000)
    assert row["l2_absorbed"] == pytest.approx(0.5)
    assert row["ncu_time_us"] == pytest.approx(2000)
    naive = tm.summarize(tm.Case("naive", "bwd", 1024, 64, 2), [])
    assert naive["l2_absorbed"] is None and naive["measured_bytes"] == 0
    assert naive["no_cache_bytes"] == 2 * traffic.memory_work(1024, 64, dtype_bytes=2, backward=True,
                                                              sram_kv_reuse="hbm").naive.hbm_bytes
    # The split backward's floor: both main kernels read Q, K, V, dO (and LSE, D), the
    # preprocess O and dO: twice the compulsory reads and a bit.
    bwd = tm.model_bytes(tm.Case("flashtile", "bwd", 4096, 128, 1))
    assert 2.0 <= bwd["kernel_floor_read"] / bwd["compulsory_read"] <= 2.05


def test_split_backward_model():
    n, d, b = 4096, 128, 2
    read, written = tm.split_backward_bytes(n, d, b)
    assert written == 3 * n * d * b + 4 * n  # dq, dk, dv; D
    # Every re-read counted: Q, dO, LSE, D once per 128-key program, K, V once per 128-query program.
    programs = n // 128
    assert read == programs * n * (2 * d * b + 8) + programs * 2 * n * d * b + 2 * n * d * b + 2 * n * d * b + n * (2 * d * b + 8)
    # One program per kernel: each kernel reads its inputs once. The preprocess reads O and dO;
    # both main kernels read Q, K, V, dO, and LSE and D: 10 N x d tensors and 4 fp32 rows.
    n = 128
    assert tm.split_backward_bytes(n, d, b)[0] == 10 * n * d * b + 16 * n


def test_make_cases_order_and_bad_names():
    cases = tm.make_cases([2048, 1024], [64], 8)
    assert [c.name for c in cases[:4]] == ["naive-fwd-N1024-d64", "naive-bwd-N1024-d64",
                                           "flashtile-fwd-N1024-d64", "flashtile-bwd-N1024-d64"]
    with pytest.raises(ValueError, match="impl"):
        tm.make_cases([1024], [64], 8, impls=["cudnn"])
    with pytest.raises(ValueError, match="pass"):
        tm.make_cases([1024], [64], 8, passes=["both"])


def test_measure_without_a_gpu_says_so_and_exits_0(capsys, monkeypatch, tmp_path):
    torch = pytest.importorskip("torch")
    if torch.cuda.is_available():
        pytest.skip("a GPU is here")
    assert cli.main(["traffic", "--measure", "--out", str(tmp_path)]) == 0
    assert "needs a CUDA GPU" in capsys.readouterr().out
    assert not list(tmp_path.iterdir())


def test_no_ncu_is_named(monkeypatch):
    monkeypatch.setenv("FLASHTILE_NCU", "/nonexistent/ncu")
    monkeypatch.setenv("PATH", "")
    monkeypatch.setattr(tm, "NCU_CANDIDATES", ())
    assert tm.find_ncu() is None
    torch = pytest.importorskip("torch")
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    assert "ncu was not found" in tm.why_not_here(None)


def test_model_flags_still_take_one_head_dim_each(capsys):
    assert cli.main(["traffic", "--seq", "1024", "--d", "64", "128", "--dtype-bytes", "2"]) == 0
    out = capsys.readouterr().out
    assert "d=64," in out and "d=128," in out


def test_from_csv_needs_no_gpu(tmp_path, capsys):
    # A saved CSV of the cases of --seq 1024 --d 64 --heads 2 (4 passes, each behind a marker)
    # gives the table, the rows and the plot on any machine.
    pytest.importorskip("matplotlib")
    kernels = []
    for _ in range(4):
        kernels += [(tm.MARKER, 32, 0, 1000), ("some_kernel", 1_000_000, 500_000, 10_000)]
    path = tmp_path / "ncu-traffic.csv"
    path.write_text(_csv(kernels))
    assert cli.main(["traffic", "--measure", "--from-csv", str(path), "--seq", "1024", "--d", "64", "--heads", "2",
                     "--gpu-name", "NVIDIA H200", "--out", str(tmp_path), "--plot", str(tmp_path / "t.png")]) == 0
    rows = [json.loads(line) for line in (tmp_path / "traffic-measured.jsonl").read_text().splitlines()]
    assert [r["case"] for r in rows] == [c.name for c in tm.make_cases([1024], [64], 2)]
    assert all(r["read_bytes"] == 1_000_000 and r["gpu"] == "NVIDIA H200" for r in rows)
    assert (tmp_path / "t.png").stat().st_size > 0
    assert "flashtile fwd" in capsys.readouterr().out


@pytest.mark.gpu
def test_measured_bytes_on_the_gpu(tmp_path, capsys):
    # ncu's DRAM counters for one small shape: flashtile's forward reads its compulsory bytes
    # (the L2 takes the K/V re-reads of one head), naive attention reads its N x N arrays.
    if tm.find_ncu() is None:
        pytest.skip("no ncu on this machine")
    assert tm.measure([4096], [64], heads=8, out_dir=tmp_path) == 0
    rows = {r["case"]: r for r in map(json.loads, (tmp_path / "traffic-measured.jsonl").read_text().splitlines())}
    flash, naive, bwd = rows["flashtile-fwd-N4096-d64"], rows["naive-fwd-N4096-d64"], rows["flashtile-bwd-N4096-d64"]
    assert 0.95 * flash["compulsory_read_bytes"] <= flash["read_bytes"] <= 0.5 * flash["no_cache_read_bytes"]
    assert naive["read_bytes"] >= 0.9 * naive["no_cache_read_bytes"]  # S and P read back from HBM
    assert naive["write_bytes"] >= 0.8 * 2 * 8 * 4096 * 4096 * 2  # and written there
    assert 0.95 * bwd["kernel_floor_read_bytes"] <= bwd["read_bytes"] <= 0.5 * bwd["no_cache_read_bytes"]

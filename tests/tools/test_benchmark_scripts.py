"""The GPU benchmark scripts at least import and parse their arguments on CPU."""

from __future__ import annotations

import importlib.util
from pathlib import Path

import pytest

pytest.importorskip("triton")
ROOT = Path(__file__).resolve().parents[2] / "benchmarks"


def _script(name: str):
    """benchmarks/<name>.py loaded as a module."""
    spec = importlib.util.spec_from_file_location(f"bench_{name.replace('/', '_')}", ROOT / f"{name}.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_train_block_rotates_rounds_and_pairs_each_with_its_own_baseline(monkeypatch):
    """``train_block.round_order`` puts each impl first in turn; ``attention_by_round`` takes
    each round's step minus that round's no-attention step (not another round's), and
    ``summary`` gives the median over rounds of flashtile's attention / cuDNN's."""
    monkeypatch.syspath_prepend(str(ROOT))
    tb = _script("train_block")
    names = ["flashtile", "sdpa-cudnn", "no-attention"]
    assert [tb.round_order(names, r)[0] for r in range(4)] == ["flashtile", "sdpa-cudnn", "no-attention", "flashtile"]
    assert sorted(tb.round_order(names, 2)) == sorted(names)
    rows = [dict(impl="flashtile", round=0, ms=21.0), dict(impl="sdpa-cudnn", round=0, ms=22.0),
            dict(impl="no-attention", round=0, ms=17.0),
            dict(impl="no-attention", round=1, ms=18.0), dict(impl="flashtile", round=1, ms=21.0),
            dict(impl="sdpa-cudnn", round=1, ms=22.5),
            dict(impl="flashtile", round=2, ms=30.0)]  # a round without its baseline is left out
    att = tb.attention_by_round(rows)
    assert att == {"flashtile": [4.0, 3.0], "sdpa-cudnn": [5.0, 4.5]}
    lines = tb.summary(rows)
    assert "over 3 rounds" in lines[0] and "attention median  3.500 ms" in lines[0]
    assert lines[-1].startswith("attention flashtile / cuDNN: median 0.733 over 2 rounds")  # (0.8 + 0.667) / 2
    with pytest.raises(SystemExit):  # argparse's error, before any GPU work
        tb.main(["--rounds", "0"])


def _transformers_step_rows(tmp_path, monkeypatch, *argv) -> dict:
    """benchmarks/transformers_step.py --tiny with ``argv``: its rows by (impl, workload)."""
    import json

    monkeypatch.delenv("FLASHTILE_BACKEND", raising=False)
    out = tmp_path / "rows.jsonl"
    assert _script("transformers_step").main(["--tiny", "--steps", "2", "--warmup", "0", *argv,
                                              "--out", str(out)]) == 0
    return {(r["impl"], r["workload"]): r for r in map(json.loads, out.read_text().splitlines())}


@pytest.mark.parametrize("name", ["sweep_fwd", "sweep_bwd", "train_block", "host_overhead", "host_profile",
                                  "context_parallel", "varlen_profile", "tma_reduce_rate",
                                  "varlen_same_documents", "experiments/gluon_fwd", "experiments/decode_breakdown",
                                  "experiments/bwd_breakdown", "experiments/dq_collisions", "experiments/layout_ab",
                                  "experiments/smem_model", "features"])
def test_script_imports_and_shows_help(name, capsys, monkeypatch):
    monkeypatch.syspath_prepend(str(ROOT))  # as when run as a script: benchmarks/ holds sweep_common
    module = _script(name)
    with pytest.raises(SystemExit) as exc:
        module.main(["--help"])
    assert exc.value.code == 0
    assert "usage" in capsys.readouterr().out



def test_sweep_decode_reads_paged_shapes(monkeypatch):
    """``sweep_decode.py --shapes``: batch x cached tokens, with ``p<page size>`` for a paged cache."""
    monkeypatch.setenv("FLASHTILE_PLANS", "0")  # the script sets it on import: restored after the test
    parse = _script("sweep_decode").parse_shape
    assert parse("16x4096").label() == "B16 L4096 H32/8 d128 q1"
    assert parse("4x8192p16").label() == "B4 L8192 H32/8 d128 q1 page 16"


def test_sweep_decode_names_the_heuristics_count(monkeypatch):
    """``sweep_decode.heuristic_splits``: ``split_plan``'s count for a shape on a CPU device (16
    SMs). 8 KV heads at batch 1 are 8 programs: one per two SMs on 4096 rows (16 // 8), two per
    SM with pages of 16 (32 // 8; the many-wave count was 16 until run 202); 2 KV heads
    are 2 programs, the small-batch count 24 // 2 = 12, whose 342 keys round up to 384: 11."""
    monkeypatch.setenv("FLASHTILE_PLANS", "0")
    module = _script("sweep_decode")
    from flashtile.tools.bench.decode import DecodeShape

    assert module.heuristic_splits(module.parse_shape("1x4096"), "cpu") == 2
    assert module.heuristic_splits(module.parse_shape("1x4096p16"), "cpu") == 4
    assert module.heuristic_splits(DecodeShape(1, 4096, nheads=8, nheads_k=2), "cpu") == 11


def test_sweep_decode_sets_each_row_stage_count(monkeypatch):
    """``sweep_decode.py --stages-rows 2 4``: one sweep per value, each with the row-cache
    kernel's ``decode.STAGES["rows"]`` at that value (the paged kinds untouched)."""
    monkeypatch.setenv("FLASHTILE_PLANS", "0")
    module = _script("sweep_decode")
    from flashtile.backends.triton import decode

    monkeypatch.setattr(decode, "STAGES", dict(decode.STAGES))
    seen = []
    monkeypatch.setattr(module, "sweep", lambda args: seen.append(dict(decode.STAGES)))
    monkeypatch.setattr("sys.argv", ["sweep_decode.py", "--only", "--stages-rows", "2", "4"])
    module.main()
    assert [s["rows"] for s in seen] == [2, 4]
    assert all(s["tile"] == 5 and s["gather"] == 3 for s in seen)


def test_host_overhead_cpu_stub_times_every_row(capsys, monkeypatch, triton_backend):
    """``host_overhead.py --cpu-stub`` (the host path with stubbed launches, the way this box
    measures host cost): every row is timed, none reports a failure (a launch plan that
    cannot record a kernel's parameters did, for the kv-cache rows, before 83f57c3's fix)."""
    monkeypatch.syspath_prepend(str(ROOT))
    monkeypatch.setenv("FLASHTILE_KVCACHE_CHECK", "device")  # the script sets it only where unset
    _script("host_overhead").cpu_stub(n=20)
    out = capsys.readouterr().out
    assert "failed" not in out, out
    assert sum(" host " in line for line in out.splitlines()) == 18, out


def test_smem_model_bytes_per_step():
    """benchmarks/experiments/smem_model.py (session 51): today's d64 step moves 512 KB of shared
    memory (352 KB of it the products' operand reads) for 10.49 MFLOP, d128's and the d64 query
    split's 416 KB; FLOP time / smem time 0.62, 0.77, 0.77 (run 253's ncu: 0.64 and 0.80). A
    product's instructions: M / 64 x K / 16, each reading A (unless from registers) and B."""
    script = _script("experiments/smem_model")
    d = script.designs()
    assert [d[k].smem_bytes() // 1024 for k in ("d64", "d128", "d64-split")] == [512, 416, 416]
    assert {d[k].flops() for k in d} == {5 * 2 * 128 * 128 * 64}
    assert [round(d[k].bound(), 3) for k in ("d64", "d128", "d64-split")] == [0.625, 0.769, 0.769]
    rs = script.Product("dQ", 64, 64, 128, a_in_registers=True)
    assert rs.instructions() == 8 and rs.smem_bytes() == 8 * 2048
    assert script.Product("S", 128, 64, 64).smem_bytes() == 2 * 4 * (2048 + 2048)
    assert d["d64-split"].wgmma_counts() == {("64x128x16", False): 32, ("64x64x16", True): 32,
                                             ("64x64x16", False): 64}
    sass = ("  HGMMA.64x64x16.F32.BF16 R24, R56, gdesc[UR8].tnspB, RZ ;\n"
            "  HGMMA.64x128x16.F32.BF16 R24, gdesc[UR4], R24 ;\n")
    assert script.sass_counts(sass) == {("64x64x16", True): 1, ("64x128x16", False): 1}


def test_dq_collisions_models():
    """benchmarks/experiments/dq_collisions.py (session 37): in the lockstep model plain calls
    put each program of a head on a dQ tile of its own and causal calls crowd tiles under the
    rotation (more with 128-row steps), not from the diagonal; in the scheduled model (132 SMs,
    random step times) the diagonal start is the crowded one at S16384. The models disagree."""
    script = _script("experiments/dq_collisions")
    assert script.lockstep(16384, 128, causal=False, rotate=True) == (1, 1.0)
    assert script.lockstep(16384, 128, causal=True, rotate=False) == (1, 1.0)
    worst, mean = script.lockstep(16384, 128, causal=True, rotate=True)
    assert worst == 11 and round(mean, 2) == 1.27
    assert script.lockstep(16384, 64, causal=True, rotate=True)[0] == 8
    rotated = script.scheduled(16384, 128, causal=True, rotate=True, heads=32)[1]
    diagonal = script.scheduled(16384, 128, causal=True, rotate=False, heads=32)[1]
    assert round(rotated, 2) == 2.50 and round(diagonal, 2) == 7.29


def test_decode_tma_experiment_matches_the_library_kernel(capsys, triton_backend):
    """benchmarks/experiments/decode_tma.py --cpu: its decode kernel (interpreter), whole tiles
    through TMA and through unmasked pointer loads, against the library's decode kernel,
    caches NaN past each sequence, splits with partial last tiles; it exits 1 on a mismatch."""
    assert _script("experiments/decode_tma").main(["--cpu"]) == 0
    out = capsys.readouterr().out
    assert out.count(" ok") == 6, out
    for how in ("tma", "unmasked"):  # 5 splits of 192 keys and 40
        assert f"check {how} B2 L1000 H8/2 d64 splits 6:" in out, out


def test_varlen_same_documents(tmp_path, capsys, monkeypatch):
    # Each document at the fixed-length rate of its own length, beside the varlen rows.
    monkeypatch.syspath_prepend(str(ROOT))
    import json

    import varlen_same_documents as vsd

    fixed = [dict(impl="flashtile", seqlen_q=n, seqlen_k=n, headdim=64, causal=False, tflops=t, **{"pass": "fwd"})
             for n, t in ((512, 100.0), (2048, 300.0))]
    fixed.append(dict(fixed[0], impl="sdpa-cudnn", tflops=1.0))  # other impls are not the reference
    varlen = [dict(impl=i, dist="mix", headdim=64, causal=False, lengths=[512, 2048], tflops=t, **{"pass": "fwd"})
              for i, t in (("flashtile", 250.0), ("flashtile-fixed", 400.0))]
    for name, rows in (("fixed", fixed), ("varlen", varlen)):
        (tmp_path / f"{name}.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    assert vsd.main(["--fixed", str(tmp_path / "fixed.jsonl"), "--varlen", str(tmp_path / "varlen.jsonl")]) == 0
    same = (512 ** 2 + 2048 ** 2) / (512 ** 2 / 100 + 2048 ** 2 / 300)  # FLOP-weighted harmonic mean: 260.7
    assert f"| mix | fwd | 64 | no | 250 | {same:.0f} | {250 / same:.2f}x | 400 | 0.62x |" in capsys.readouterr().out
    rates = {("fwd", 64, False, 512): 100.0, ("fwd", 64, False, 2048): 300.0}
    assert vsd.rate_at(rates, ("fwd", 64, False), 1024) == pytest.approx(200.0)  # log-linear between lengths
    assert vsd.rate_at(rates, ("fwd", 64, False), 64) == 100.0 and vsd.rate_at(rates, ("fwd", 64, False), 9999) == 300.0


def test_sweep_records_rows_and_the_best_candidate(tmp_path, capsys, monkeypatch):
    monkeypatch.syspath_prepend(str(ROOT))
    import json

    from flashtile.tools.bench.prefill import make_shape
    from sweep_common import Sweep

    shape = make_shape(4096, 128, True, "bf16")
    sweep = Sweep("bwd", str(tmp_path / "rows.jsonl"))
    peers = {"sdpa-cudnn": 2.0}
    sweep.record(shape, "slow", [1], 4.0, peers, variant="split")
    sweep.record(shape, "fast", [2], 1.0, peers, variant="split")
    sweep.record(shape, "atomic", [3], 3.0, peers, variant="atomic")
    rows = [json.loads(line) for line in (tmp_path / "rows.jsonl").read_text().splitlines()]
    assert [r["cfg"] for r in rows] == [[1], [2], [3]]
    assert rows[1]["tflops"] == pytest.approx(shape.flops("bwd") / 1.0 * 1e-9)
    best = {key[-1]: value[0] for key, value in sweep.best.items()}
    assert best == {"split": "fast", "atomic": "atomic"}
    sweep.report()
    assert "xsdpa-cudnn=2.000" in capsys.readouterr().out


def test_launch_key_cost_runs_on_cpu(tmp_path):
    # A subprocess: under TRITON_INTERPRET=1 the kernels are interpreter functions, with
    # no binder to time.
    import os
    import subprocess
    import sys

    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    env["PYTHONPATH"] = str(ROOT.parent / "src") + os.pathsep + env.get("PYTHONPATH", "")
    env["TRITON_CACHE_DIR"] = str(tmp_path)
    proc = subprocess.run([sys.executable, str(ROOT / "launch_key_cost.py")], env=env, capture_output=True,
                          text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "triton_binder" in proc.stdout and "flashtile_key" in proc.stdout


def test_transformers_step_tiny_run(tmp_path, monkeypatch):
    """benchmarks/transformers_step.py --tiny on CPU: every workload gives a row. Packing
    the documents into one row changes no loss with flashtile (no document attends to
    another, and the same next-token targets count)."""
    pytest.importorskip("transformers")
    rows = _transformers_step_rows(tmp_path, monkeypatch, "--impl", "tiled_attention", "sdpa")
    assert len(rows) == 6 and all(r["tokens_per_s"] > 0 for r in rows.values())
    ft = {w: rows[("tiled_attention", w)]["losses"] for w in ("train-padded", "train-packed")}
    assert ft["train-padded"] == pytest.approx(ft["train-packed"], rel=1e-5)
    assert ft["train-padded"] == pytest.approx(rows[("sdpa", "train-padded")]["losses"], rel=1e-4)


def test_transformers_step_provider_and_continuous_batching_rows(tmp_path, monkeypatch):
    """The workloads of issue 37 on CPU: train-full through "sdpa" with PyTorch's flash
    backend forced and with the provider active (on CPU tensors the provider changes
    nothing: the same losses), and continuous batching on flashtile_fa2 and paged sdpa."""
    pytest.importorskip("transformers")
    rows = _transformers_step_rows(tmp_path, monkeypatch, "--impl", "sdpa", "sdpa+flashtile", "flashtile_fa2",
                                   "--workload", "train-full", "cb")
    assert len(rows) == 6 and all(r.get("tokens_per_s", 0) > 0 for r in rows.values()), rows
    assert rows[("sdpa+flashtile", "train-full")]["losses"] == rows[("sdpa", "train-full")]["losses"]
    assert rows[("flashtile_fa2", "cb")]["tokens"] == 6 * 8
    from flashtile.integrations import torch_sdpa
    assert not torch_sdpa.active()


def test_context_parallel_benchmark_runs_on_gloo(tmp_path):
    # The multi-GPU benchmark's whole path (timing, the no-communication and comm-only
    # breakdown, the one-process reference) on 2 CPU ranks: every implementation gives a row
    # whose output matches one-process attention.
    import json
    import os
    import subprocess
    import sys

    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    env["PYTHONPATH"] = str(ROOT.parent / "src") + os.pathsep + env.get("PYTHONPATH", "")
    out = tmp_path / "rows.jsonl"
    proc = subprocess.run([sys.executable, str(ROOT / "context_parallel.py"), "--cpu-smoke", "--out", str(out)],
                          env=env, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    rows = [json.loads(line) for line in out.read_text().splitlines()]
    assert sorted(r["impl"] for r in rows) == ["ring-contiguous", "ring-zigzag", "ulysses"]
    for r in rows:
        assert r["world"] == 2 and r["step_s"] > 0 and r["single_s"] > 0
        assert r["err"] < 1e-5, r
    assert all(0.0 <= r["comm_hidden"] <= 1.0 for r in rows if r["impl"] != "ulysses")


def test_train_block_names_attentions_kernels(monkeypatch):
    """``train_block.attention_kernels``: the kernels a step launches beyond the no-attention
    step's (a GEMM both launch is not attention's, even when it takes longer), and the GPU time
    the step adds."""
    monkeypatch.syspath_prepend(str(ROOT))  # train_block imports sweep_common
    split = _script("train_block").attention_kernels
    base = {"gemm": 100.0, "rmsnorm": 10.0}
    own, extra = split({"gemm": 104.0, "rmsnorm": 10.0, "fwd": 30.0, "bwd": 70.0}, base)
    assert own == {"fwd": 30.0, "bwd": 70.0}
    assert extra == 104.0


def test_train_block_finds_the_gpus_idle_gaps(monkeypatch):
    """``train_block.kernel_gaps``: overlapping kernels count once, a gap between them is idle
    time named by the kernel that ended last before it and the one after it."""
    monkeypatch.syspath_prepend(str(ROOT))
    gaps = _script("train_block").kernel_gaps
    spans = [(0.0, 10.0, "a"), (5.0, 20.0, "b"), (8.0, 12.0, "c"), (50.0, 60.0, "d"), (61.0, 70.0, "e")]
    busy, idle, top = gaps(spans, least_us=2.0)
    assert (busy, idle) == (39.0, 31.0)  # 0-20, 50-60, 61-70 busy; 20-50 and 60-61 idle
    assert top == [(30.0, "b", "d")]  # the 1 us gap is under least_us
    assert gaps([]) == (0.0, 0.0, [])  # a profile without device events (no GPU)

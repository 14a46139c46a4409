"""The benchmark driver on CPU: shapes, dry-run rows, summary, plots, argument errors.

Nothing here touches CUDA: `--dry-run` writes fake timings through the same row,
summary and plot code that a GPU run uses.
"""
from __future__ import annotations

import json
from pathlib import Path

import pytest

pytest.importorskip("torch")  # bench stamps rows with torch's version, even in a dry run
from flashtile.tools.bench import main as bench_main  # noqa: E402
from flashtile.tools.bench import prefill as bench  # noqa: E402
from flashtile.traffic import attention_flops  # noqa: E402

REQUIRED = {"impl", "pass", "dtype", "batch", "nheads", "nheads_k", "seqlen_q", "seqlen_k",
            "headdim", "causal", "ms", "tflops", "gpu", "torch", "triton", "commit", "max_abs_diff"}


def _dry_run(tmp_path: Path, *extra: str) -> list[dict]:
    argv = ["--dry-run", "--out", str(tmp_path), "--tag", "t", *extra]
    assert bench.main(argv) == 0
    return [json.loads(line) for line in (tmp_path / "t.jsonl").read_text().splitlines()]


# ---------------------------------------------------------------- shapes
@pytest.mark.parametrize("seqlen, headdim, batch, nheads", [
    (4096, 128, 4, 16), (8192, 256, 2, 8), (1024, 64, 16, 32), (16384, 128, 1, 16), (32768, 64, 1, 32),
])
def test_shape_formula(seqlen: int, headdim: int, batch: int, nheads: int) -> None:
    shape = bench.make_shape(seqlen, headdim, causal=False, dtype="fp16")
    assert (shape.batch, shape.nheads, shape.nheads_k, shape.seqlen) == (batch, nheads, nheads, seqlen)


def test_gpu_slug() -> None:
    assert bench.gpu_slug("NVIDIA H200") == "h200"
    assert bench.gpu_slug("NVIDIA H100 80GB HBM3") == "h100-80gb-hbm3"


def test_src_tree_names_the_files_on_disk_and_writes_nothing(tmp_path: Path) -> None:
    """``common.src_tree``: the id ``git rev-parse --short C:src`` gives for a commit C with
    the files src/ holds on disk (an edit, an untracked file; not an ignored one), so that a
    copy whose git metadata is older than its files still names what ran; the repository's
    objects are untouched."""
    import shutil
    import subprocess

    from flashtile.tools.bench.common import src_tree

    if shutil.which("git") is None:
        pytest.skip("no git")

    def git(*args: str) -> str:
        return subprocess.run(["git", "-C", str(tmp_path), "-c", "user.name=t", "-c", "user.email=t@t", *args],
                              capture_output=True, text=True, check=True).stdout.strip()

    git("init", "-q")
    (tmp_path / "src" / "pkg").mkdir(parents=True)
    (tmp_path / "src" / "pkg" / "a.py").write_text("a = 1\n")
    (tmp_path / ".gitignore").write_text("*.log\n")
    (tmp_path / "README").write_text("outside src\n")
    git("add", "-A")
    git("commit", "-qm", "one")
    first = git("rev-parse", "--short", "HEAD:src")
    assert src_tree(tmp_path / "src" / "pkg") == first
    (tmp_path / "src" / "pkg" / "run.log").write_text("ignored\n")
    (tmp_path / "README").write_text("changed, but outside src\n")
    assert src_tree(tmp_path) == first
    objects = git("count-objects", "-v")
    (tmp_path / "src" / "pkg" / "a.py").write_text("a = 2\n")
    (tmp_path / "src" / "pkg" / "b.py").write_text("b = 1\n")
    edited = src_tree(tmp_path)
    assert edited not in (None, first)
    assert git("count-objects", "-v") == objects and git("status", "--porcelain", "--", "src") != ""
    git("add", "-A")
    git("commit", "-qm", "two")
    assert git("rev-parse", "--short", "HEAD:src") == edited


# ---------------------------------------------------------------- rows
def test_dry_run_rows_have_exactly_the_required_keys(tmp_path: Path) -> None:
    rows = _dry_run(tmp_path, "--no-plot", "--headdim", "64", "--seqlen", "1024", "32768",
                    "--pass", "fwd", "bwd", "fwd_bwd", "--memory")
    by_pass = {p: [r for r in rows if r["pass"] == p]
               for p in ("fwd", "bwd", "fwd_bwd", "first_call", "fwd_mem", "fwd_bwd_mem")}
    # 2 seqlens x 2 causal x 2 dtypes x 6 impls per timed pass; 2 seqlens x 2 dtypes x 6 impls per memory pass
    assert all(len(by_pass[p]) == 48 for p in ("fwd", "bwd", "fwd_bwd"))
    assert len(by_pass["fwd_mem"]) == len(by_pass["fwd_bwd_mem"]) == 24
    for row in rows:
        if "skipped" in row:
            assert set(row) == REQUIRED | {"skipped"} and row["ms"] is None and row["tflops"] is None
        elif row["pass"] == "first_call":
            assert set(row) == REQUIRED | {"first_call_s"}
        elif row["pass"] == "fwd_mem":
            assert set(row) == REQUIRED | {"extra_mib", "output_lse_mib"} and row["batch"] == 1
        elif row["pass"] == "fwd_bwd_mem":
            assert set(row) == REQUIRED | {"extra_mib", "out_lse_grads_mib"} and row["batch"] == 1
        else:
            assert set(row) == REQUIRED and row["ms"] > 0
            flops = attention_flops(row["batch"], row["nheads"], row["seqlen_q"], row["seqlen_k"],
                                    row["headdim"], causal=row["causal"], pass_=row["pass"])
            assert row["tflops"] == pytest.approx(flops / (row["ms"] * 1e-3) / 1e12)
        assert isinstance(row["causal"], bool) and row["dtype"] in ("fp16", "bf16")
    # naive at seqlen 32768 would need 128 GiB of fp32 scores: skipped, with a reason
    skipped = [r for r in rows if "skipped" in r]
    assert skipped and all(r["impl"] == "naive" and r["seqlen_q"] == 32768 for r in skipped)


def test_impl_and_pass_selection(tmp_path: Path) -> None:
    rows = _dry_run(tmp_path, "--no-plot", "--quick", "--impl", "flashtile", "sdpa-cudnn",
                    "--causal", "yes", "--dtype", "bf16")
    timed = [r for r in rows if r["pass"] != "first_call"]
    assert {r["impl"] for r in rows} == {"flashtile", "sdpa-cudnn"}
    assert {r["pass"] for r in timed} == {"fwd"} and all(r["causal"] for r in rows)
    assert {(r["headdim"], r["seqlen_q"]) for r in timed} == {(d, s) for d in (64, 128) for s in (1024, 4096, 16384)}


# ---------------------------------------------------------------- summary and plots
def test_summary_has_ratios(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    _dry_run(tmp_path, "--no-plot", "--headdim", "128", "--seqlen", "4096", "--dtype", "fp16")
    summary = (tmp_path / "t-summary.md").read_text()
    assert "flashtile/sdpa-flash" in summary and "flashtile/sdpa-cudnn" in summary
    line = next(ln for ln in summary.splitlines() if ln.startswith("| 128 | 4096 | 4 | no | fp16 | fwd"))
    assert line.count("x |") == 2  # both ratios filled in
    assert summary.strip().splitlines()[-1] in capsys.readouterr().out  # the table ends the output


def test_provider_rows_on_request_with_their_ratio(tmp_path: Path) -> None:
    """sdpa-flashtile (SDPA's flash backend through flashtile's provider) is not a default
    impl; asked for, the summary gives its speed as a share of flashtile's direct call."""
    _dry_run(tmp_path, "--no-plot", "--headdim", "128", "--seqlen", "4096", "--dtype", "fp16")
    assert "sdpa-flashtile" not in (tmp_path / "t-summary.md").read_text()
    asked = tmp_path / "asked"
    _dry_run(asked, "--no-plot", "--headdim", "128", "--seqlen", "4096", "--dtype", "fp16",
             "--impl", "flashtile", "sdpa-flash", "sdpa-flashtile")
    summary = (asked / "t-summary.md").read_text()
    line = next(ln for ln in summary.splitlines() if ln.startswith("| 128 | 4096 | 4 | no | fp16 | fwd"))
    assert "sdpa-flashtile/flashtile" in summary and line.count("x |") == 2, line


def test_deterministic_rows_on_request_with_their_ratio(tmp_path: Path) -> None:
    """flashtile-det (deterministic=True) is not a default impl; asked for, the summary gives
    its speed as a share of the default call's (issue 38's target: at least 0.9x)."""
    _dry_run(tmp_path, "--no-plot", "--headdim", "64", "--seqlen", "4096", "--dtype", "bf16", "--pass", "bwd",
             "--impl", "flashtile", "flashtile-det", "sdpa-cudnn")
    summary = (tmp_path / "t-summary.md").read_text()
    line = next(ln for ln in summary.splitlines() if ln.startswith("| 64 | 4096 | 4 | no | bf16 | bwd"))
    assert "flashtile-det/flashtile" in summary and "sdpa-flashtile" not in summary
    assert line.count("x |") == 2 and "0.93x" in line, line  # the dry run's 420 / 450 TF/s


def test_plots_written_and_plot_only(tmp_path: Path) -> None:
    pytest.importorskip("matplotlib")
    _dry_run(tmp_path, "--headdim", "64", "--seqlen", "1024", "4096", "--dtype", "fp16", "--pass", "fwd", "bwd")
    pngs = sorted(p.name for p in tmp_path.glob("*.png"))
    assert pngs == [f"t-d64-{c}-fp16-{p}.png" for c in ("causal", "full") for p in ("bwd", "fwd")]
    again = tmp_path / "again"
    assert bench.main(["--plot-only", str(tmp_path / "t.jsonl"), "--out", str(again)]) == 0
    assert len(list(again.glob("*.png"))) == 4


# ---------------------------------------------------------------- bad input
@pytest.mark.parametrize("argv", [
    ["--impl", "bogus"], ["--pass", "sideways"], ["--dtype", "fp8"], ["--causal", "maybe"],
    ["--seqlen", "0"], ["--headdim", "100"], ["--rep", "0"], ["--seqlen", "many"],
])
def test_bad_args_exit_nonzero(argv: list[str], tmp_path: Path) -> None:
    with pytest.raises(SystemExit) as exc:
        bench.main(["--dry-run", "--no-plot", "--out", str(tmp_path), *argv])
    assert exc.value.code != 0
    assert not list(tmp_path.glob("*.jsonl"))  # argument errors come before any row


def test_varlen_bench_plan_summary_and_plots(tmp_path, capsys):
    from flashtile.tools.bench import varlen as bv

    for dist in bv.DISTS:
        lengths = bv.lengths_for(dist)
        assert sum(lengths) == bv.TOKENS and min(lengths) >= 1
    assert bv.lengths_for("uniform") == bv.lengths_for("uniform")  # seeded
    assert bv.visible_pairs([3, 1], causal=True) == 6 + 1 and bv.visible_pairs([3], causal=False) == 9
    assert bv.flops([4], 2, 8, False, "bwd") == 2.5 * 4 * 2 * 8 * 16
    assert bench_main(["--varlen", "--dry-run"]) == 0
    assert "longtail" in capsys.readouterr().out
    rows = []
    for impl, tf in (("flashtile", 300.0), ("flashtile-fixed", 400.0), ("flex", 200.0), ("sdpa-cudnn", 150.0)):
        for pass_ in ("fwd", "bwd"):
            rows.append(dict(impl=impl, pass_=pass_, dist="equal", docs=8, headdim=64, causal=True, tflops=tf,
                             gpu="g", torch="t", triton="tr", commit="c"))
    for r in rows:
        r["pass"] = r.pop("pass_")
    table = bv.summary_markdown(rows)
    assert "| equal | 8 | 64 | yes | fwd | 300 | 400 | 200 | 150 | 0.75x |  | 1.50x | 2.00x |" in table
    rows += [dict(r, impl="flashtile-docs", tflops=250.0) for r in rows if r["impl"] == "flashtile"]
    assert "| 300 | 400 | 250 | 200 | 150 | 0.75x | 1.20x | 1.50x | 2.00x |" in bv.summary_markdown(rows)
    # the fixed-length reference at each document's own length: FLOP-weighted harmonic mean
    assert bv.same_documents_rate([1, 2], False, lambda n: 100.0 * n) == pytest.approx(5 / (1 / 100 + 4 / 200))
    assert bv.same_documents_rate([7, 7, 7], True, lambda n: 123.0) == pytest.approx(123.0)
    paths = bv.plot(rows, tmp_path, "t")
    assert [p.name for p in paths] == ["t-fwd.png", "t-bwd.png"] and all(p.stat().st_size > 0 for p in paths)


def test_decode_bench_plan_and_summary(capsys):
    from flashtile.tools.bench import decode as bd

    assert bench_main(["--decode", "--dry-run"]) == 0
    text = capsys.readouterr().out
    assert "B8 L32768 H32/8 d128 q1 page 16" in text and "1024.1 MiB to read, 1 graph copies" in text
    assert "B1 L4096 H32/8 d128 q1: 16.0 MiB to read, 16 graph copies" in text
    for batch in (1, 2, 4):  # issue 38's small batches, 4k-32k cached tokens
        assert all(f"B{batch} L{n} H32/8 d128 q1:" in text for n in (4096, 8192, 16384, 32768))
    assert "B4 L8192 H32/8 d128 q1 page 16" in text
    assert bench_main(["--decode", "--dry-run", "--append", "--only", "0"]) == 0  # generation steps: parsed
    assert bench_main(["--decode", "--dry-run", "--warm-l2", "--only", "0"]) == 0  # graph rows on one copy: parsed
    s = bd.DecodeShape(8, 4096)
    assert s.bytes() == 2 * (2 * 8 * 4096 * 8 * 128 + 2 * 8 * 32 * 128)
    rows = [{"label": s.label(), "mode": "eager", "impl": i, "tb_per_s": tb}
            for i, tb in (("flashtile", 3.0), ("sdpa-cudnn", 2.5), ("sdpa-flash", None))]
    table = bd.summary_markdown(rows, 4.0)
    assert "| B8 L4096 H32/8 d128 q1 | eager | 3.00 | 75% | 2.50 | - | 1.20 | - |" in table


def test_decode_graph_rows_read_cold_inputs(monkeypatch):
    """Graph rows cycle through copies of their inputs (a replayed graph flushes no L2, and a
    cache under 50 MB would be read partly from it): at least COLD_BYTES a cycle, each call
    the next copy; eager rows (do_bench flushes L2) and --warm-l2 take one."""
    import torch
    import triton.testing

    from flashtile.tools.bench import decode as bd

    small, big = bd.DecodeShape(1, 4096), bd.DecodeShape(8, 32768)
    assert bd.cold_copies(small) == 16 and bd.cold_copies(big) == 1  # 16 MiB, 1 GiB
    assert all(bd.cold_copies(s) * s.bytes() >= bd.COLD_BYTES for s in bd.shapes())
    made = []

    def one(impl, shape, num_splits, append):
        made.append(len(made))
        return lambda i=made[-1]: i

    monkeypatch.setattr(bd, "_build_one", one)
    call = bd.build("flashtile", small, copies=3)
    assert made == [0, 1, 2] and [call() for _ in range(7)] == [0, 1, 2, 0, 1, 2, 0]
    assert bd.build("flashtile", small)() == 3
    seen = []
    monkeypatch.setattr(bd, "build", lambda impl, shape, num_splits, append, copies: seen.append(copies) or call)
    monkeypatch.setattr(torch.cuda, "synchronize", lambda: None)
    monkeypatch.setattr(triton.testing, "do_bench_cudagraph", lambda fn, rep, return_mode: 1.0)
    monkeypatch.setattr(triton.testing, "do_bench", lambda fn, warmup, rep, return_mode: 2.0)
    assert bd.measure("flashtile", small, "cuda_graph", 1, 1) == 1.0
    assert bd.measure("flashtile", small, "eager", 1, 1) == 2.0
    bd.measure("flashtile", small, "cuda_graph", 1, 1, warm_l2=True)
    assert seen == [16, 1, 1]
    # wall rows: cold copies too, warmup calls, then wall_ms's back-to-back blocks
    calls = []
    monkeypatch.setattr(bd, "build", lambda impl, shape, num_splits, append, copies: seen.append(copies) or
                        (lambda: calls.append(1)))
    monkeypatch.setattr(bd, "wall_ms", lambda call: call() or 3.0)
    assert bd.measure("flashtile", small, "eager_wall", 4, 1) == 3.0 and len(calls) == 1 + 4 + 1
    assert seen[-1] == 16


def test_decode_wall_rows_time_calls_back_to_back(monkeypatch):
    """``wall_ms``: the median block's wall ms per call, one sync per block (not per call), so
    a call's host time counts where it exceeds the GPU's."""
    import torch

    from flashtile.tools.bench import decode as bd

    log = []
    clock = iter(range(0, 1000, 1))
    monkeypatch.setattr(torch.cuda, "synchronize", lambda: log.append("sync"))
    monkeypatch.setattr(bd.time, "perf_counter", lambda: next(clock) * 0.01)  # 10 ms a reading
    assert bd.wall_ms(lambda: log.append("call"), calls=5, blocks=3) == pytest.approx(10 / 5)
    assert log == (["sync"] + ["call"] * 5 + ["sync"]) * 3


# ---------------------------------------------------------------- GQA
def test_gqa_shapes_rows_and_bad_group(tmp_path: Path) -> None:
    shape = bench.make_shape(4096, 128, causal=True, dtype="bf16", gqa=4)
    assert (shape.nheads, shape.nheads_k) == (16, 4) and "H16/4" in shape.label()
    with pytest.raises(ValueError, match="gqa"):
        bench.make_shape(4096, 128, causal=True, dtype="bf16", gqa=3)
    rows = _dry_run(tmp_path, "--no-plot", "--headdim", "128", "--seqlen", "1024", "--gqa", "4", "--memory")
    assert rows and all((r["nheads"], r["nheads_k"]) == (16, 4) for r in rows)
    grads = next(r for r in rows if r["pass"] == "fwd_bwd_mem")["out_lse_grads_mib"]
    mha = bench.make_shape(1024, 128, causal=False, dtype="fp16", batch=1)
    assert grads == pytest.approx(bench.output_lse_mib(mha) + 1.5 * bench._tensor_mib(mha))  # dq + 2 x dq / 4
    with pytest.raises(SystemExit):
        bench.main(["--dry-run", "--headdim", "64", "128", "--gqa", "3"])


@pytest.mark.parametrize("impl", ["naive", "sdpa-flash", "flashtile"])
def test_gqa_forward_matches_the_reference_slice(impl: str) -> None:
    # Every impl's forward on a GQA shape (CPU: the torch twin for flashtile, SDPA's CPU math
    # for sdpa-*): its last head (of the last kv head's group) against the fp32 slice.
    torch = pytest.importorskip("torch")
    shape = bench.Shape(batch=1, nheads=4, nheads_k=2, seqlen=64, headdim=32, causal=True, dtype="bf16")
    torch.manual_seed(0)
    bshd = [torch.randn(1, 64, h, 32) for h in (4, 2, 2)]
    inputs = bshd if impl == "flashtile" else [t.transpose(1, 2).contiguous() for t in bshd]
    out = bench._first(bench.build_forward(impl, shape, *inputs)())
    got = out[-1, :, -1, :] if impl == "flashtile" else out[-1, -1]
    torch.testing.assert_close(got, bench._reference_slice(shape, *bshd), atol=1e-5, rtol=1e-5)


def test_flex_bench_options(capsys):
    """`flashtile bench --flex` is routed to the flex module, lists its patterns and peers, and
    refuses an unknown pattern (it needs CUDA to run)."""
    with pytest.raises(SystemExit) as ok:
        bench_main(["--flex", "-h"])
    assert ok.value.code == 0
    text = capsys.readouterr().out
    assert "relbias" in text and "torch-flex" in text and "flashtile-flex-ready" in text
    with pytest.raises(SystemExit) as bad:
        bench_main(["--flex", "--pattern", "nonsense"])
    assert bad.value.code == 2

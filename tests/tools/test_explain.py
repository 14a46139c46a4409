"""flashtile explain: the kernels of calls whose path is known (the sm90 table, the Gluon
scope, varlen routing), and its command line."""

from __future__ import annotations

import pytest

pytest.importorskip("torch")
pytest.importorskip("triton")

from flashtile.cli import main  # noqa: E402
from flashtile.tools.explain import explain  # noqa: E402


@pytest.mark.parametrize("kwargs, forward, backward, reason", [
    (dict(seqlen_q=4096, head_dim=128), "Gluon", "Gluon one-pass", None),
    (dict(seqlen_q=4096, head_dim=128, deterministic=True), "Gluon", "Gluon one-pass", None),  # its ordered sums
    (dict(seqlen_q=1536, head_dim=128, causal=True, deterministic=True), "Gluon", "Gluon dK/dV",
     "deterministic and causal with seqlen_q < 2048"),
    (dict(seqlen_q=1024, head_dim=64, causal=True), "Triton", "Gluon one-pass", "short causal d64"),
    (dict(seqlen_q=1024, head_dim=64, causal=True, deterministic=True), "Triton", "Gluon dK/dV", "short causal d64"),
    (dict(seqlen_q=4096, head_dim=64, varlen=True), "Gluon", "Gluon one-pass", None),
    (dict(seqlen_q=4096, head_dim=64, varlen=True, causal=True), "Gluon", "Gluon one-pass", None),
    (dict(seqlen_q=4096, head_dim=256, causal=True), "Gluon", "Gluon dV, dK and dQ", "d256 takes the split"),
    (dict(seqlen_q=4096, head_dim=128, softcap=5.0), "Triton", "Triton", "plain or causal attention only, not softcap"),
    (dict(seqlen_q=4096, head_dim=96), "Triton", "Triton", "head dims (64, 128, 256), not 96"),
    (dict(seqlen_q=4096, head_dim=128, dtype="fp32"), "Triton", "Triton", "fp16/bf16, not float32"),
    (dict(seqlen_q=4096, head_dim=128, capability=(8, 0)), "Triton", "Triton", "need Hopper"),
    (dict(seqlen_q=4096, head_dim=128, varlen=True, causal=True), "Gluon",
     "Gluon dK/dV + dQ kernels (backends/sm90/backward_split.py), work", "causal packed calls"),
    (dict(seqlen_q=4096, head_dim=128, varlen=True, seqused=True), "Triton", "Triton", "seqused"),
    (dict(seqlen_q=4096, head_dim=256, varlen=True), "Gluon", "Triton", "no packed-call Gluon backward"),
    (dict(seqlen_q=1, seqlen_k=500, head_dim=128, causal=True), "Gluon", "Gluon", "run as non-causal"),
    (dict(seqlen_q=4096, device="cpu"), "chunked torch twin", "torch autograd", "torch twin"),
    (dict(seqlen_q=4096, ws_env=False), "Triton", "Triton", "FLASHTILE_WS=0"),
    (dict(seqlen_q=4096, head_dim=128, causal=True, sink=True), "Gluon", "Gluon", None),
    (dict(seqlen_q=8192, head_dim=128, causal=True, chunk=1024), "Triton", "Triton", "not chunked attention"),
    (dict(seqlen_q=4096, head_dim=128, causal=True, chunk=4096), "Gluon", "Gluon", None),  # one chunk: off
])
def test_known_paths(kwargs, forward, backward, reason):
    """The registry's answers, as explain prints them."""
    plan = explain(**kwargs)
    assert plan.forward.startswith(forward), plan
    assert plan.backward.startswith(backward), plan
    if reason is None:
        assert not plan.reasons, plan
    else:
        assert any(reason in r for r in plan.reasons), plan


def test_bwd_dq_split_keeps_the_split_kernels(monkeypatch):
    monkeypatch.setenv("FLASHTILE_BWD_DQ", "split")
    assert explain(4096, head_dim=64).backward.startswith("Gluon dK/dV")
    monkeypatch.setenv("FLASHTILE_BWD_DQ", "auto")
    assert explain(4096, head_dim=64).backward.startswith("Gluon one-pass")


def test_command_line(capsys):
    assert main(["explain", "--head-dim", "64", "--causal", "--seqlen-q", "1024"]) == 0
    out = capsys.readouterr().out
    assert out.startswith("forward:  Triton forward") and "short causal d64" in out


def test_command_line_deterministic(capsys, monkeypatch):
    monkeypatch.delenv("FLASHTILE_BWD_DQ", raising=False)
    assert main(["explain", "--head-dim", "64"]) == 0
    assert "Gluon one-pass" in capsys.readouterr().out
    assert main(["explain", "--head-dim", "64", "--deterministic"]) == 0  # its dQ sums in a fixed order
    assert "Gluon one-pass" in capsys.readouterr().out
    assert main(["explain", "--head-dim", "64", "--causal", "--seqlen-q", "1536", "--deterministic"]) == 0
    out = capsys.readouterr().out
    assert "Gluon one-pass" not in out and "Gluon dK/dV" in out



def test_flex_shows_the_kernels_and_the_generated_source(capsys):
    pytest.importorskip("triton")
    assert main(["explain", "--flex-score", "relative_bias", "--flex-mask", "document"]) == 0
    text = capsys.readouterr().out
    assert "Triton flex kernels" in text and "the Gluon kernels take no score_mod/mask_mod" in text
    assert "def score_mod_relative_bias_score(score, b, h, q_idx, kv_idx, ARGS):" in text
    assert "def mask_mod_document_mask(b, h, q_idx, kv_idx, ARGS):" in text
    assert "built-in kernels instead" not in text  # relative_bias has no built-in equivalent


def test_flex_ready_made_mods_say_they_take_the_builtin_kernels(capsys):
    pytest.importorskip("triton")
    assert main(["explain", "--flex-score", "alibi", "--flex-mask", "causal"]) == 0
    assert "the call runs the built-in kernels instead" in capsys.readouterr().out


def test_flex_refused_mod_is_explained():
    pytest.importorskip("triton")
    import torch

    from flashtile.tools.explain import explain_flex

    text = explain_flex(lambda score, b, h, q_idx, kv_idx: torch.erf(score))
    assert "score_mod: refused by the kernels" in text and "erf" in text

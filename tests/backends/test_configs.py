"""Launch-config tables and the optional autotuning cache (no GPU needed)."""

from __future__ import annotations

import json

import pytest

from flashtile.backends import configs
from flashtile.backends.configs import FwdConfig


def test_table_covers_every_head_dim_and_arch():
    for head_dim in range(1, 513):
        for capability in ((9, 0), (8, 0), (8, 9)):
            for causal in (False, True):
                for seqlen in (1, 1024, 4096):
                    for mask in (False, True):
                        cfg = configs.default_fwd_config(capability, head_dim, "bfloat16", causal, seqlen, mask)
                        assert cfg.block_m >= 16 and cfg.block_n >= 16
                        if mask:
                            assert cfg.block_n <= 64 and cfg.num_stages <= 2
            bwd = configs.default_bwd_config(capability, head_dim, "float16")
            assert bwd.block_m_kv >= 16 and not bwd.fused_dq


def test_fp32_gets_small_tiles_without_tma():
    cfg = configs.default_fwd_config((9, 0), 128, "float32", False, 8192)
    assert cfg.block_m <= 64 and cfg.block_n <= 32 and not cfg.use_tma


def test_autotune_picks_fastest_skips_failures_and_caches(tmp_path, monkeypatch):
    monkeypatch.setenv("FLASHTILE_CACHE_DIR", str(tmp_path))
    monkeypatch.setattr(configs, "_memory_cache", {})
    a, b, c = FwdConfig(128, 64, 8, 3), FwdConfig(64, 64, 4, 3), FwdConfig(128, 128, 8, 3, True)
    timings = {a: 2.0, b: 1.0}
    calls = []

    def time_ms(cfg):
        calls.append(cfg)
        if cfg not in timings:
            raise RuntimeError("out of shared memory")
        return timings[cfg]

    assert configs.autotuned_fwd_config("key1", [a, b, c], time_ms) == b
    assert len(calls) == 3
    stored = json.loads((tmp_path / "autotune-fwd.json").read_text())
    assert stored["key1"]["block_m"] == 64
    # A new process (empty memory cache) reads the disk cache instead of timing again.
    monkeypatch.setattr(configs, "_memory_cache", {})
    assert configs.autotuned_fwd_config("key1", [a, b, c], time_ms) == b
    assert len(calls) == 3
    with pytest.raises(RuntimeError, match="no runnable forward config"):
        configs.autotuned_fwd_config("key2", [c], time_ms)


def test_autotune_switch(monkeypatch):
    from flashtile.runtime import settings

    monkeypatch.delenv("FLASHTILE_AUTOTUNE", raising=False)
    assert not settings.autotune()
    for value in ("1", "true", "YES"):
        monkeypatch.setenv("FLASHTILE_AUTOTUNE", value)
        assert settings.autotune()
    monkeypatch.setenv("FLASHTILE_AUTOTUNE", "0")
    assert not settings.autotune()


def test_bwd_dq_mode_override():
    split = configs.default_bwd_config((9, 0), 256, "bfloat16", dq_mode="split")
    atomic = configs.default_bwd_config((9, 0), 256, "bfloat16", dq_mode="atomic")
    assert not split.fused_dq and atomic.fused_dq
    assert atomic.num_stages == 1  # d256 fused: a second stage overflows shared memory (H200 run 8)
    with pytest.raises(ValueError, match="dq_mode"):
        configs.default_bwd_config((9, 0), 128, "bfloat16", dq_mode="fast")


def test_bwd_one_loop_only_without_tile_masks():
    """The single-loop dk/dv variant is picked where the H200 sweep measured it ahead."""
    for d in (40, 64, 256):
        assert not configs.default_bwd_config((9, 0), d, "bfloat16", tile_masks=False).split_phases
        assert configs.default_bwd_config((9, 0), d, "bfloat16", tile_masks=True).split_phases
    assert configs.default_bwd_config((9, 0), 128, "bfloat16", tile_masks=False).split_phases
    assert configs.default_bwd_config((8, 0), 64, "bfloat16", tile_masks=False).split_phases
    atomic = configs.default_bwd_config((9, 0), 64, "bfloat16", dq_mode="atomic", tile_masks=False)
    assert atomic.fused_dq and atomic.split_phases

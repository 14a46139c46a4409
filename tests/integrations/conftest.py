"""Fixtures of the integration tests (transformers is imported inside them only)."""

from __future__ import annotations

import functools

import pytest


@pytest.fixture
def flash_calls(monkeypatch):
    """Counts the calls of the flashtile functions that transformers receives for the
    flash-attention name (``FLASH_NAME``); transformers' lazy import is reset so that it
    asks for them again."""
    from transformers import modeling_flash_attention_utils as mfa

    from flashtile.integrations import transformers as ft

    counts = {"flash_attn_varlen_func": 0, "flash_attn_with_kvcache": 0}
    real = ft._flash_functions

    def counting(fn):
        @functools.wraps(fn)
        def wrapper(*args, **kwargs):
            counts[fn.__name__] += 1
            return fn(*args, **kwargs)
        return wrapper

    def counted():
        return tuple(counting(fn) if getattr(fn, "__name__", None) in counts else fn for fn in real())

    monkeypatch.setattr(ft, "_flash_functions", counted)
    monkeypatch.setattr(mfa, "_loaded_implementation", None)
    return counts

"""The public functions: flash-attn's and SDPA's signatures and semantics on flashtile.

Each function documents its shapes and masks, has its arguments checked and reduced to
the canonical problem (``flashtile.problem``: one validation module for every entry
point; errors are ValueError or TypeError naming the argument, raised before anything
runs) and runs it (``flashtile.dispatch``: the torch twin for CPU tensors, the kernels for
CUDA tensors; ``FLASHTILE_BACKEND=triton|torch|auto`` forces one, e.g. the Triton kernels
on CPU tensors under ``TRITON_INTERPRET=1``).

    flash.py      flash_attn_func, flash_attn_qkvpacked_func, flash_attn_kvpacked_func
    varlen.py     flash_attn_varlen_func and its packed variants (paged keys too)
    kvcache.py    flash_attn_with_kvcache (decoding: in-place append, rotary, paged) and
                  flash_attn_combine
    sdpa.py       scaled_dot_product_attention
    padding.py    unpad_input / pad_input
    flex.py       flex_attention, create_block_mask (torch's FlexAttention API)
    mods.py       ready-made score and mask functions for flex_attention
"""

from __future__ import annotations

from flashtile.problem.validate import MAX_HEAD_DIM
from flashtile.api.flash import flash_attn_func, flash_attn_kvpacked_func, flash_attn_qkvpacked_func
from flashtile.api.kvcache import flash_attn_combine, flash_attn_with_kvcache
from flashtile.api import mods
from flashtile.api.flex import create_block_mask, flex_attention
from flashtile.api.padding import pad_input, unpad_input
from flashtile.api.sdpa import scaled_dot_product_attention
from flashtile.api.varlen import (flash_attn_varlen_func, flash_attn_varlen_kvpacked_func,
                                  flash_attn_varlen_qkvpacked_func)

from flashtile.public import API_NAMES  # the public names, listed once

__all__ = ["MAX_HEAD_DIM", *API_NAMES]

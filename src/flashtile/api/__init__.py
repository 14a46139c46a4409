"""flash-attn- and SDPA-compatible attention: validation, dispatch, the public functions.

Every API reduces to one canonical problem (see ``flashtile.backends.triton.forward``): q (B, H, Sq, D),
k/v (B, Hk, Sk, D) as strided views, a diagonal offset (Sk - Sq for flash-attn's
bottom-right causal alignment, 0 for SDPA's top-left), an inclusive window (left, right)
around that diagonal (-1 = unbounded; causal = right 0), softcap, ALiBi slopes and an
explicit mask; a varlen call is that problem with B = 1 over the packed token axis and a
work list of its sequences. Every check runs before any kernel launch and raises
``ValueError`` or ``TypeError`` naming the argument and the value received.

Where things are:
    _validate.py  the one validation layer (shapes, dtypes, scalars, varlen metadata)
    _dispatch.py  backend choice and the call into the kernels (``flashtile.autograd``)
                  or the chunked torch twin
    flash.py      flash_attn_func, flash_attn_qkvpacked_func, flash_attn_kvpacked_func
    varlen.py     flash_attn_varlen_func and its packed variants
    kvcache.py    flash_attn_with_kvcache (decoding: in-place append, rotary, paged) and
                  flash_attn_combine
    sdpa.py       scaled_dot_product_attention
    padding.py    unpad_input / pad_input
    _probs.py     S_dmask (return_attn_probs with dropout; debugging only)

Backends: CUDA tensors run the Triton kernels; CPU tensors run the chunked torch twin
(same semantics, O(N) memory). ``FLASHTILE_BACKEND=triton|torch|auto`` forces one, e.g.
to run the Triton kernels on CPU tensors under ``TRITON_INTERPRET=1``.
"""

from __future__ import annotations

from flashtile.problem.validate import MAX_HEAD_DIM
from flashtile.api.flash import flash_attn_func, flash_attn_kvpacked_func, flash_attn_qkvpacked_func
from flashtile.api.kvcache import flash_attn_combine, flash_attn_with_kvcache
from flashtile.api.padding import pad_input, unpad_input
from flashtile.api.sdpa import scaled_dot_product_attention
from flashtile.api.varlen import (flash_attn_varlen_func, flash_attn_varlen_kvpacked_func,
                                  flash_attn_varlen_qkvpacked_func)

from flashtile import _API_NAMES  # the public names, listed once (flashtile/__init__.py)

__all__ = ["MAX_HEAD_DIM", *_API_NAMES]

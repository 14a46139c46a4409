"""The kernels' dropout mask in plain torch: Philox 4x32-10, bit for bit as Triton draws it.

Every flashtile kernel keeps attention weight (bh, i, j) (bh = b * nheads + h; i, j the
query and key index within the sequence) iff the uniform float of
``tl.philox(seed, j, i, bh, 0)``'s first word is >= dropout_p (``triton.scores.dropout_keep``).
The torch twin draws the same bits here, so a CPU call and a GPU call with one seed drop
the same weights, and the twin can report the mask it used (S_dmask).

Philox's 32 x 32 -> 64-bit products are formed from 16-bit halves: torch has no unsigned
64-bit multiply, and int64 products of two 32-bit words would overflow.
"""

from __future__ import annotations

import torch

_ROUND_A, _ROUND_B = 0xD2511F53, 0xCD9E8D57
_KEY_A, _KEY_B = 0x9E3779B9, 0xBB67AE85
_MASK32 = 0xFFFFFFFF
# Triton's uint_to_uniform_float for 32-bit words: (2**23 - 1) / 2**23 * 2**-31, float32.
_SCALE = torch.tensor(4.6566127342e-10, dtype=torch.float32)


def _mul_hi_lo(a: int, b: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(high, low) 32-bit words of the constant ``a`` times the 32-bit words ``b`` (int64)."""
    p_hi = a * (b >> 16)  # < 2**48
    p_lo = a * (b & 0xFFFF)  # < 2**48
    high = (p_hi + (p_lo >> 16)) >> 16
    low = (((p_hi & 0xFFFF) << 16) + p_lo) & _MASK32
    return high, low


def philox_first_word(seed: int, c0: torch.Tensor, c1: torch.Tensor, c2: torch.Tensor) -> torch.Tensor:
    """The first output word of Philox 4x32 with 10 rounds for counters (c0, c1, c2, 0)
    (int64 tensors of 32-bit values, broadcast together) and the 64-bit key ``seed``."""
    k0, k1 = seed & _MASK32, (seed >> 32) & _MASK32
    c0, c1, c2 = torch.broadcast_tensors(c0.to(torch.int64), c1.to(torch.int64), c2.to(torch.int64))
    c3 = torch.zeros_like(c0)
    for _ in range(10):
        hi_b, lo_b = _mul_hi_lo(_ROUND_B, c2)
        hi_a, lo_a = _mul_hi_lo(_ROUND_A, c0)
        c0, c1, c2, c3 = hi_b ^ c1 ^ k0, lo_b, hi_a ^ c3 ^ k1, lo_a
        k0, k1 = (k0 + _KEY_A) & _MASK32, (k1 + _KEY_B) & _MASK32
    return c0


def keep_mask(seed: int, bh: torch.Tensor, i: torch.Tensor, j: torch.Tensor, dropout_p: float) -> torch.Tensor:
    """Bool keep mask of the elements (bh, i, j) (int tensors, broadcast together): what
    the kernels keep for the Philox key ``seed`` at dropout probability ``dropout_p``."""
    r = philox_first_word(seed, j, i, bh)
    x = torch.where(r >= 2**31, r - 2**32, r)  # the word as int32
    x = torch.where(x < 0, -x - 1, x)
    uniform = x.to(torch.float32) * _SCALE.to(x.device)
    return uniform >= torch.tensor(dropout_p, dtype=torch.float32)

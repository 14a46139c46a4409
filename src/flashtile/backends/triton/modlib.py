"""Triton helpers the translated score and mask functions call (``modgen.py``): torch's
integer semantics where Triton's differ, and math without libdevice (so the same code runs
under TRITON_INTERPRET=1). tanh is the score pipeline's (``scores.tanh``)."""

from __future__ import annotations

import triton
import triton.language as tl


@triton.jit
def floordiv(a, b):
    """torch's floor division of integers (Triton's ``//`` truncates toward zero)."""
    q = a // b
    return q - ((q * b != a) & ((a < 0) != (b < 0))).to(q.dtype)


@triton.jit
def floordiv_float(a, b):
    """torch's floor division of floats: the quotient of a - fmod(a, b), not floor(a / b)
    (1.0 // 0.1 is 9.0)."""
    mod = a % b  # fmod: the sign of a
    div = (a - mod) / b
    div = tl.where((mod != 0) & ((b < 0) != (mod < 0)), div - 1.0, div)
    floored = tl.floor(div)
    floored = tl.where(div - floored > 0.5, floored + 1.0, floored)
    return tl.where(b == 0, a / b, floored)


@triton.jit
def remainder(a, b):
    """torch's ``%`` (the sign of the divisor) for integers and floats."""
    r = a % b
    return tl.where((r != 0) & ((r < 0) != (b < 0)), r + b, r)


@triton.jit
def sigmoid(x):
    return 1.0 / (1.0 + tl.exp(-x))


@triton.jit
def sign(x):
    return (x > 0).to(x.dtype) - (x < 0).to(x.dtype)


@triton.jit
def gather(ptr, offset, ok):
    """One element per lane of a captured tensor, 0 where the index is out of its bounds
    (a padded row or column past the sequence: its score is never used)."""
    return tl.load(ptr + offset, mask=ok, other=0)

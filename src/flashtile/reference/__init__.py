"""NumPy reference: the textbook formulas and FlashAttention-2's tile algebra.

Exact in float64 (agrees with the naive formula to ~1e-12), runs anywhere numpy does.
"""

from flashtile.reference.naive import causal_visible, naive_attention, naive_attention_backward, unstable_attention
from flashtile.reference.tiled import flash_attention_backward, flash_attention_forward

__all__ = [
    "causal_visible",
    "flash_attention_backward",
    "flash_attention_forward",
    "naive_attention",
    "naive_attention_backward",
    "unstable_attention",
]

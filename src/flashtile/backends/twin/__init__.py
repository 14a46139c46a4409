"""The torch twin: flashtile's semantics in plain torch ops, for CPU tensors.

    attention.py  the chunked forward (differentiable by torch autograd), fixed and packed
    kvcache.py    flash_attn_with_kvcache: rotary, the in-place append, attention; combine
    philox.py     the kernels' dropout mask, bit for bit

Every CPU test of the API runs here and on the Triton kernels under the interpreter.
"""

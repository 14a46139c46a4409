"""The portable Triton kernels (any CUDA GPU Triton supports; the interpreter on CPU).

    scores.py    the one score pipeline every kernel runs on a tile (scale, softcap,
                 ALiBi, masks, window), the constants of base-2 softmax, Philox dropout
    forward.py   the forward kernel and its launcher
    backward.py  Delta, the dK/dV and dQ kernels and their launcher
    decode.py    the kv-cache kernels: metadata check, append, split-KV decode, combine
"""

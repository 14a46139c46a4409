"""Attention kernels (Triton on GPU) and their torch twins for CPU tensors."""

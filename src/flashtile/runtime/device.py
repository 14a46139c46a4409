"""Facts about the device a call runs on, asked of the driver once per device."""

from __future__ import annotations

import functools
from typing import Optional


def device_index(device) -> int:
    """The index of a CUDA ``torch.device`` (a bare "cuda" means the current device)."""
    if device.index is not None:
        return device.index
    import torch

    return torch.cuda.current_device()


@functools.lru_cache(maxsize=None)
def cuda_capability(device_index: int) -> tuple[int, int]:
    """(major, minor) of a CUDA device."""
    import torch

    return torch.cuda.get_device_capability(device_index)


@functools.lru_cache(maxsize=None)
def sm_count(device_index: int) -> int:
    """Streaming multiprocessors of a CUDA device."""
    import torch

    return torch.cuda.get_device_properties(device_index).multi_processor_count


@functools.lru_cache(maxsize=None)
def dram_gbps(device_index: int) -> float:
    """Peak DRAM bandwidth of a CUDA device in GB/s: the driver's memory clock and bus width
    (``triton.testing.get_dram_gbps``, which asks ``cuDeviceGetAttribute``; CUDA 13 dropped
    the clock from ``cudaDeviceProp``). An H100 SXM reports about 3350, an H200 about 4800."""
    from triton.testing import get_dram_gbps

    return float(get_dram_gbps(device_index))


@functools.lru_cache(maxsize=None)
def dram_gbps_per_sm(device_index: int) -> Optional[float]:
    """``dram_gbps`` over the SM count; None for a MIG slice, which reports its own SMs but
    the whole card's memory clock and bus width (its share of the bandwidth is unknown)."""
    import torch

    if "MIG" in torch.cuda.get_device_name(device_index):
        return None
    return dram_gbps(device_index) / sm_count(device_index)


def capability_of(t) -> Optional[tuple[int, int]]:
    """(major, minor) of the CUDA device holding tensor ``t``; None for a CPU tensor (the
    Triton interpreter)."""
    if t.device.type != "cuda":
        return None
    return cuda_capability(device_index(t.device))


def device_context(t):
    """``torch.cuda.device(t.device)`` for a CUDA tensor (launches go to its device), else a
    no-op context."""
    import contextlib

    import torch

    return torch.cuda.device(t.device) if t.is_cuda else contextlib.nullcontext()

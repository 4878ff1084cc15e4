"""Process-level set-up shared by the entry points: allocator tuning and peak FLOP/s."""

from __future__ import annotations

import ctypes
import functools
import time

import torch

# Peak dense bf16 tensor-core FLOP/s of common accelerators (vendor figures, no sparsity).
GPU_PEAK_FLOPS = {"H200": 989e12, "H100": 989e12, "A100": 312e12, "L40S": 362e12,
                  "A10G": 125e12, "L4": 121e12, "V100": 125e12, "RTX 4090": 165e12}


def tune_cpu_allocator() -> bool:
    """Stop glibc from returning large buffers to the OS after every free.

    Training allocates and frees the same large activation buffers every step; glibc
    serves them with mmap/munmap and page-faults them in again each time. Disabling
    mmap for large blocks and raising the trim threshold (the runtime equivalent of
    MALLOC_MMAP_MAX_=0 MALLOC_TRIM_THRESHOLD_=...) made a CPU training step faster
    (docs/results/training-throughput.md). Returns False (and changes nothing) where glibc's mallopt is not available.
    """
    try:
        libc = ctypes.CDLL("libc.so.6")
    except OSError:
        return False
    M_TRIM_THRESHOLD, M_MMAP_MAX = -1, -4
    return bool(libc.mallopt(M_MMAP_MAX, 0)) and bool(libc.mallopt(M_TRIM_THRESHOLD, 2**30))


@functools.cache
def has_cpp_compiler() -> bool:
    """Whether torch.compile's CPU backend (inductor) finds a C++ compiler on this machine
    (`eval.latency_backend=auto`: compile the latency passes only where they can be)."""
    try:  # torch's own search (CXX, g++, clang++)
        from torch._inductor.cpp_builder import get_cpp_compiler

        get_cpp_compiler()
    except Exception:  # no compiler found (InvalidCxxCompiler), or a torch without this module
        return False
    return True


@functools.cache
def measured_cpu_peak_flops(n: int = 1024, seconds: float = 0.5) -> float:
    """The best fp32 matmul FLOP/s this process reaches on a square GEMM: the honest
    denominator of MFU on a CPU whose vendor peak is unknown."""
    g = torch.Generator().manual_seed(0)  # never touch the global RNG: training draws noise from it
    a, b = torch.randn(n, n, generator=g), torch.randn(n, n, generator=g)
    best, t_end = 0.0, time.perf_counter() + seconds
    while time.perf_counter() < t_end:
        t = time.perf_counter()
        a @ b
        best = max(best, 2 * n**3 / (time.perf_counter() - t))
    return best


def peak_flops(device: torch.device | str, configured: float | None = None) -> float:
    """Peak FLOP/s for MFU: `configured` if given, else a table entry for a known GPU,
    else the measured matmul peak of this CPU."""
    if configured:
        return float(configured)
    device = torch.device(device)
    if device.type == "cuda":
        name = torch.cuda.get_device_name(device)
        for key, value in GPU_PEAK_FLOPS.items():
            if key in name:
                return value
        return 312e12
    return measured_cpu_peak_flops()

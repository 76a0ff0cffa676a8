"""Host-side helpers of the Triton launch wrappers (the router's, the dispatchers' and the
runners'): whether kernels run in the CPU interpreter or may chain as programmatic dependent
launches, and the integer sizes of grids and tiles. Plain Python, not
triton.cdiv / triton.next_power_of_2, which Triton 3.9 makes constexpr functions: about 2 us a
host call."""

from __future__ import annotations

import functools
import os

import torch


def interpret_mode() -> bool:
    """True when Triton kernels run in the CPU interpreter (TRITON_INTERPRET=1)."""
    return os.environ.get("TRITON_INTERPRET", "0") == "1"


@functools.cache
def _capability(device: torch.device) -> tuple[int, int]:
    return torch.cuda.get_device_capability(device)


def pdl_capable(device: torch.device) -> bool:
    """Whether kernels on `device` may be programmatic dependent launches (CUDA, compute
    capability 9.0+, not the interpreter): a kernel launched so may be placed while the kernel
    before it runs, once that one lets it (`gdc_launch_dependents`), and must wait on the GPU
    (`gdc_wait`) before it touches memory the one before writes."""
    return device.type == "cuda" and not interpret_mode() and _capability(device) >= (9, 0)


def next_pow2(n: int) -> int:
    """The smallest power of two >= n (1 for n <= 1)."""
    return 1 if n <= 1 else 1 << (n - 1).bit_length()


def cdiv(a: int, b: int) -> int:
    """ceil(a / b) for ints, b > 0."""
    return -(-a // b)

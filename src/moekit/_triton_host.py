"""Host-side helpers of the Triton launch wrappers (the router's and the runners'): whether
kernels run in the CPU interpreter, and the integer sizes of grids and tiles. Plain Python, not
triton.cdiv / triton.next_power_of_2, which Triton 3.9 makes constexpr functions: about 2 us a
host call."""

from __future__ import annotations

import os


def interpret_mode() -> bool:
    """True when Triton kernels run in the CPU interpreter (TRITON_INTERPRET=1)."""
    return os.environ.get("TRITON_INTERPRET", "0") == "1"


def next_pow2(n: int) -> int:
    """The smallest power of two >= n (1 for n <= 1)."""
    return 1 if n <= 1 else 1 << (n - 1).bit_length()


def cdiv(a: int, b: int) -> int:
    """ceil(a / b) for ints, b > 0."""
    return -(-a // b)

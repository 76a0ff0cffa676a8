"""Imports every built-in runner module so that each registers itself."""

from moekit.runners import (
    cutlass,  # noqa: F401
    deep_gemm,  # noqa: F401
    flashinfer,  # noqa: F401
    torch,  # noqa: F401
    triton,  # noqa: F401
    triton_kernel,  # noqa: F401
    w4a16,  # noqa: F401
)

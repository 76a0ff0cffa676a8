"""Imports every built-in runner module so that each registers itself."""

from moekit.runners import torch  # noqa: F401
from moekit.runners import cutlass  # noqa: F401
from moekit.runners import triton  # noqa: F401
from moekit.runners import flashinfer  # noqa: F401
from moekit.runners import deep_gemm  # noqa: F401
from moekit.runners import triton_kernel  # noqa: F401
from moekit.runners import w4a16  # noqa: F401

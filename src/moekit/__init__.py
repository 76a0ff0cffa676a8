"""moekit: Mixture-of-Experts layers for LLM inference."""

import os

if os.environ.get("TRITON_INTERPRET", "0") == "1":  # CPU runs: see _triton_interpreter
    from moekit import _triton_interpreter

    _triton_interpreter.fix()

from moekit.config import MoEConfig, ParallelConfig, RunnerConfig
from moekit.layer import MoE, fused_moe

__version__ = "0.1.0"

__all__ = ["MoE", "MoEConfig", "ParallelConfig", "RunnerConfig", "__version__", "fused_moe"]

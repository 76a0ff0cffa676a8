"""moekit: Mixture-of-Experts layers for LLM inference."""

from moekit.config import MoEConfig, ParallelConfig, RunnerConfig
from moekit.layer import MoE, fused_moe

__version__ = "0.1.0"

__all__ = ["MoE", "MoEConfig", "ParallelConfig", "RunnerConfig", "fused_moe", "__version__"]

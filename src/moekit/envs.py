"""Every MOEKIT_* environment variable, declared once: name, default and what it does."""

from __future__ import annotations

import os
from dataclasses import dataclass


@dataclass(frozen=True)
class EnvVar:
    name: str
    default: str
    help: str

    def get(self) -> str:
        return os.environ.get(self.name, self.default)

    def get_bool(self) -> bool:
        return self.get().strip().lower() in ("1", "true", "yes", "on")


MOEKIT_LOG_LEVEL = EnvVar("MOEKIT_LOG_LEVEL", "INFO", "log level of the 'moekit' logger")
MOEKIT_CONFIG_DIR = EnvVar(
    "MOEKIT_CONFIG_DIR",
    os.path.join(os.path.expanduser("~"), ".cache", "moekit", "configs"),
    "user directory for tuned kernel configs and selection tables; overrides the shipped ones",
)
MOEKIT_DISABLE_TRITON = EnvVar(
    "MOEKIT_DISABLE_TRITON",
    "0",
    "1: report Triton as unavailable: its runners and the fused routing (debugging)",
)
MOEKIT_TRITON_KERNEL_ENGINE = EnvVar(
    "MOEKIT_TRITON_KERNEL_ENGINE",
    "auto",
    "the triton_kernel runner's GEMMs: auto (Gluon warp-specialized kernels on sm_90 with Triton "
    ">= 3.9 at large batches, else Triton's), triton, or gluon (an error where it cannot run)",
)
MOEKIT_FUSED_ROUTER = EnvVar(
    "MOEKIT_FUSED_ROUTER",
    "auto",
    "how layers built from now on route: auto (one Triton kernel, "
    "moekit.router.select_experts_fused, for CUDA logits where it can run: no custom routing "
    "function, at most 1024 experts; compiled as the op moekit::route), 1 (also under the CPU "
    "interpreter) or 0 (PyTorch ops, moekit.router.select_experts)",
)
MOEKIT_GIT_COMMIT = EnvVar(
    "MOEKIT_GIT_COMMIT",
    "",
    "git commit that results record instead of asking git (a copy of the tree on a GPU box, with or "
    "without .git)",
)

ALL: tuple[EnvVar, ...] = (
    MOEKIT_LOG_LEVEL,
    MOEKIT_CONFIG_DIR,
    MOEKIT_DISABLE_TRITON,
    MOEKIT_TRITON_KERNEL_ENGINE,
    MOEKIT_FUSED_ROUTER,
    MOEKIT_GIT_COMMIT,
)

"""What this process runs on: device, compute capability and optional libraries.

Runners and dispatchers decide their availability from a `Platform`; tests inject fake ones.
"""

from __future__ import annotations

import functools
import importlib
import importlib.metadata
from dataclasses import dataclass, field

import torch

from moekit import envs

# distribution name -> import name, for every library a backend or an integration may need
# (safetensors: MoE.from_pretrained's checkpoint directories)
OPTIONAL_LIBRARIES = {
    "triton": "triton",
    "sgl-deep-gemm": "deep_gemm",
    "flashinfer-python": "flashinfer",
    "deep-ep": "deep_ep",
    "mooncake-transfer-engine": "mooncake",
    "transformers": "transformers",
    "safetensors": "safetensors",
    "prometheus-client": "prometheus_client",
}


@functools.lru_cache(maxsize=None)
def _sm_count(index: int) -> int:
    return torch.cuda.get_device_properties(index).multi_processor_count


def sm_count(device: torch.device) -> int:
    """Streaming multiprocessors of CUDA `device` (index None: the current one); cached."""
    return _sm_count(device.index if device.index is not None else torch.cuda.current_device())


@dataclass(frozen=True)
class Availability:
    """Whether a backend can run here; `reason` says why not (missing library, needs SM100...)."""

    ok: bool
    reason: str = ""

    def __bool__(self) -> bool:
        return self.ok


@dataclass(frozen=True)
class Platform:
    """device: 'cuda' or 'cpu'; capability: (major, minor) for CUDA; libraries: name -> version
    (None where not importable)."""

    device: str
    device_name: str
    capability: tuple[int, int] | None = None
    num_gpus: int = 0
    libraries: dict[str, str | None] = field(default_factory=dict)

    @property
    def is_cuda(self) -> bool:
        return self.device == "cuda"

    def has(self, library: str) -> bool:
        return self.libraries.get(library) is not None

    def sm(self) -> int:
        """Compute capability as one number (90 for Hopper), 0 on CPU."""
        return 0 if self.capability is None else self.capability[0] * 10 + self.capability[1]


def _library_version(dist: str, module: str) -> str | None:
    if dist == "triton" and envs.MOEKIT_DISABLE_TRITON.get_bool():
        return None
    try:
        importlib.import_module(module)
    except Exception:  # noqa: BLE001 - any import failure means "not usable here"
        return None
    try:
        return importlib.metadata.version(dist)
    except importlib.metadata.PackageNotFoundError:
        return "unknown"



@functools.lru_cache(maxsize=None)
def detect() -> Platform:
    """The platform of this process (cached)."""
    libs = {dist: _library_version(dist, mod) for dist, mod in OPTIONAL_LIBRARIES.items()}
    libs["torch"] = torch.__version__
    if torch.cuda.is_available():
        return Platform(
            device="cuda",
            device_name=torch.cuda.get_device_name(),
            capability=torch.cuda.get_device_capability(),
            num_gpus=torch.cuda.device_count(),
            libraries=libs,
        )
    return Platform(device="cpu", device_name="cpu", libraries=libs)

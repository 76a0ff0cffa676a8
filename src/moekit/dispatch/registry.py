"""The a2a backend registry: name -> Dispatcher class, and why a backend is unavailable here."""

from __future__ import annotations

from moekit.config import A2A_BACKENDS, ParallelConfig
from moekit.dispatch.base import Dispatcher
from moekit.hardware import Availability, Platform

_DISPATCHERS: dict[str, type[Dispatcher]] = {}

# Backends the engines know that moekit recognises but cannot run, with why.
UNAVAILABLE_REASONS = {
    "deepep": "DeepEP is not integrated: the only DeepEP on PyPI (deep-ep 1.0.0) is an sdist "
    "that cannot build: it lacks its own headers (deep_ep.hpp, kernels/api.cuh, configs.cuh, "
    "buffer.cuh, launch.cuh, utils.cuh, exception.cuh, ibgda_device.cuh; nvcc stops at "
    "'configs.cuh: No such file'), and it links a static libnvshmem.a and "
    "nvshmem_bootstrap_uid.so, which the nvidia-nvshmem-cu13 3.4.5 pip package does not ship "
    "(it has libnvshmem_host.so.3, libnvshmem_device.a, nvshmem_bootstrap_uid.so.3); "
    "scripts/gpu_deepep_build.sh logs the attempt. Use --moe-a2a-backend alltoall",
    "mooncake": "needs the mooncake transfer engine and RDMA NICs; not integrated",
    "flashinfer": "FlashInfer's all-to-all needs flashinfer-python with MNNVL (GB200 "
    "NVLink domains); not integrated",
    "ascend_fuseep": "needs Huawei Ascend NPUs",
}


def register(cls: type[Dispatcher]) -> type[Dispatcher]:
    if cls.name not in A2A_BACKENDS:
        raise ValueError(f"dispatcher name {cls.name!r} is not one of {A2A_BACKENDS}")
    _DISPATCHERS[cls.name] = cls
    return cls


def dispatcher_class(name: str) -> type[Dispatcher]:
    """The Dispatcher class for `name`; a loud error lists the backends otherwise."""
    _load_builtin()
    if name not in _DISPATCHERS:
        if name in UNAVAILABLE_REASONS:
            raise KeyError(f"--moe-a2a-backend {name}: {UNAVAILABLE_REASONS[name]}")
        raise KeyError(
            f"--moe-a2a-backend: unknown backend {name!r}; known: {', '.join(A2A_BACKENDS)}"
        )
    return _DISPATCHERS[name]


def availability(name: str, platform: Platform, parallel: ParallelConfig) -> Availability:
    _load_builtin()
    if name in _DISPATCHERS:
        return _DISPATCHERS[name].availability(platform, parallel)
    return Availability(False, UNAVAILABLE_REASONS.get(name, "not implemented"))


_loaded = False


def _load_builtin() -> None:
    global _loaded
    if _loaded:
        return
    _loaded = True
    from moekit.dispatch import alltoall, none

    register(none.NoneDispatcher)
    register(alltoall.AllToAllDispatcher)

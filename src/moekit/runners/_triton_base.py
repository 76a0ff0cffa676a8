"""What every Triton runner shares: where it can run (CUDA sm80+, or the CPU interpreter when
TRITON_INTERPRET=1 is set before Triton is imported) and the interpreter's bfloat16 limit."""

from __future__ import annotations

from moekit._triton_host import interpret_mode
from moekit.hardware import Availability, Platform
from moekit.runners.base import Runner

MIN_CAPABILITY = (8, 0)


def triton_devices() -> frozenset[str]:
    """Devices a Triton runner declares: CUDA, plus CPU in the interpreter."""
    return frozenset({"cuda", "cpu"} if interpret_mode() else {"cuda"})


class TritonRunnerBase(Runner):
    """Availability and the CPU-interpreter dtype rule of the Triton runners."""

    @classmethod
    def availability(cls, platform: Platform) -> Availability:
        if not platform.has("triton"):
            return Availability(False, "needs the triton package (pip install triton)")
        if platform.is_cuda:
            if platform.capability is not None and platform.capability < MIN_CAPABILITY:
                return Availability(
                    False,
                    f"needs a CUDA GPU of compute capability >= 8.0, found {platform.capability}",
                )
            return Availability(True)
        if interpret_mode():
            return Availability(True, "CPU through the Triton interpreter (TRITON_INTERPRET=1)")
        return Availability(
            False, "needs a CUDA GPU (or TRITON_INTERPRET=1 for the CPU interpreter)"
        )

    @classmethod
    def unsupported(
        cls, fmt: str, weight_format: str, activation: str, dtype: str, device: str, bias: bool
    ) -> str | None:
        problem = super().unsupported(fmt, weight_format, activation, dtype, device, bias)
        if problem is None and device == "cpu" and dtype == "bfloat16":
            return (
                f"runner {cls.name!r} does not support dtype 'bfloat16' on cpu (the Triton "
                "interpreter computes it wrongly); on cpu it supports: float16, float32"
            )
        return problem

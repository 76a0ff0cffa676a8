"""Runner backends: one module per backend plus the registry; `torch` is the reference."""

from moekit.hardware import Availability
from moekit.runners.base import Runner, RunnerCaps, RunnerError
from moekit.runners.registry import availability, register, registered, runner_class

__all__ = [
    "Availability",
    "Runner",
    "RunnerCaps",
    "RunnerError",
    "availability",
    "register",
    "registered",
    "runner_class",
]

"""The runner registry: backend name -> Runner class, and why a backend is unavailable."""

from __future__ import annotations

from moekit.config import RUNNER_BACKENDS
from moekit.hardware import Availability, Platform
from moekit.runners.base import Runner

_RUNNERS: dict[str, type[Runner]] = {}

# Names the engines know that this version does not implement, with why.
NOT_IMPLEMENTED = "not implemented in this version of moekit"


def register(cls: type[Runner]) -> type[Runner]:
    """Class decorator: make `cls` selectable under `cls.name`."""
    if cls.name not in RUNNER_BACKENDS:
        raise ValueError(f"runner name {cls.name!r} is not one of {RUNNER_BACKENDS}")
    _RUNNERS[cls.name] = cls
    return cls


def runner_class(name: str) -> type[Runner]:
    """The Runner class registered as `name`; a loud error lists the backends otherwise."""
    _load_builtin()
    if name not in _RUNNERS:
        known = ", ".join(n for n in RUNNER_BACKENDS if n != "auto")
        if name in RUNNER_BACKENDS:
            raise KeyError(f"--moe-runner-backend {name!r} is {NOT_IMPLEMENTED}; known: {known}")
        raise KeyError(f"--moe-runner-backend: unknown backend {name!r}; known: {known}")
    return _RUNNERS[name]


def availability(name: str, platform: Platform) -> Availability:
    """Whether backend `name` can run on `platform`, with the reason when not."""
    _load_builtin()
    if name not in _RUNNERS:
        return Availability(False, NOT_IMPLEMENTED)
    return _RUNNERS[name].availability(platform)


def registered() -> dict[str, type[Runner]]:
    _load_builtin()
    return dict(_RUNNERS)


_loaded = False


def _load_builtin() -> None:
    """Import the built-in runner modules once (each registers itself)."""
    global _loaded
    if _loaded:
        return
    _loaded = True
    from moekit.runners import builtin  # noqa: F401

"""The package logger, and log-once helpers for per-decision messages."""

from __future__ import annotations

import logging

from moekit import envs

logger = logging.getLogger("moekit")
if not logger.handlers:
    _handler = logging.StreamHandler()
    _handler.setFormatter(logging.Formatter("[moekit %(levelname)s] %(message)s"))
    logger.addHandler(_handler)
    logger.setLevel(envs.MOEKIT_LOG_LEVEL.get().upper())
    logger.propagate = False

_seen: set[str] = set()


def log_once(level: int, message: str) -> None:
    """Log `message` the first time it is seen in this process."""
    if message not in _seen:
        _seen.add(message)
        logger.log(level, message)

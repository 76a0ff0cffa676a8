"""nvcc builds of moekit's own CUDA sources (`runners/csrc`) into shared libraries, cached on
disk and loaded with ctypes: the deep_gemm and w4a16 runners' kernels.

A library's file name is a hash of everything that decides its contents (the caller's key
parts, the command line and the nvcc version), so a changed source or flag builds a new one.
Cache: $MOEKIT_CACHE_DIR or ~/.cache/moekit, one folder per runner.
"""

from __future__ import annotations

import functools
import hashlib
import os
import shutil
import subprocess
import threading
from pathlib import Path

DEFAULT_CUDA_HOMES = ("/usr/local/cuda",)
COMPILE_TIMEOUT_S = 600


def nvcc(homes: tuple[str, ...] = DEFAULT_CUDA_HOMES) -> str | None:
    """Path of nvcc: $CUDA_HOME/bin, $CUDA_PATH/bin, each of `homes`, then PATH."""
    env = (os.environ.get("CUDA_HOME"), os.environ.get("CUDA_PATH"))
    for home in (*env, *homes):
        if home and os.access(os.path.join(home, "bin", "nvcc"), os.X_OK):
            return os.path.join(home, "bin", "nvcc")
    return shutil.which("nvcc")


@functools.cache
def version(path: str) -> str:
    """The last line of `nvcc --version` ('?' when it prints nothing)."""
    out = subprocess.run([path, "--version"], capture_output=True, text=True, check=False)
    return out.stdout.strip().splitlines()[-1] if out.stdout.strip() else "?"


def cache_dir(runner: str) -> Path:
    root = os.environ.get("MOEKIT_CACHE_DIR") or os.path.join(
        os.environ.get("XDG_CACHE_HOME") or os.path.expanduser("~/.cache"), "moekit"
    )
    return Path(root) / runner


_locks: dict[Path, threading.Lock] = {}
_locks_lock = threading.Lock()


def _lock(path: Path) -> threading.Lock:
    """One lock per library file: builds of different libraries run in parallel."""
    with _locks_lock:
        return _locks.setdefault(path, threading.Lock())


def build(compiler: str, args: list[str], runner: str, key_parts: list[bytes], what: str) -> Path:
    """The shared library `compiler args -o <file>` builds, from the cache of `runner` or built
    now (thread-safe; a failed build raises RuntimeError naming `what` with nvcc's last lines)."""
    key = hashlib.sha256()
    for part in (*key_parts, repr(args).encode(), version(compiler).encode()):
        key.update(part)
    path = cache_dir(runner) / f"mk_{key.hexdigest()[:24]}.so"
    with _lock(path):
        if not path.is_file():
            path.parent.mkdir(parents=True, exist_ok=True)
            tmp = path.with_suffix(f".{os.getpid()}.tmp.so")
            r = subprocess.run([compiler, *args, "-o", str(tmp)], capture_output=True, text=True,
                               timeout=COMPILE_TIMEOUT_S, check=False)  # fmt: skip
            if r.returncode != 0:
                tail = "\n".join((r.stderr or r.stdout).strip().splitlines()[-8:])
                raise RuntimeError(f"nvcc failed to build {what}:\n{tail}")
            os.replace(tmp, path)
    return path

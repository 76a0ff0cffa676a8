"""Multi-process test groups: R workers joined by torch.distributed (gloo on CPU, forked; NCCL on
GPUs, spawned), started once and reused by many test cases (process start-up is the slow part).

    pool = get_pool(4)                  # cached per (world size, backend) in this process
    results = pool.run(case_fn, spec)   # case_fn(spec) on every rank; list of returns by rank

case_fn must be a module-level function (it is pickled by reference). An exception on any rank
fails the call with every rank's traceback; a hang fails it after `timeout` seconds. Either way
the pool is shut down and the next get_pool() starts a fresh one.
"""

from __future__ import annotations

import atexit
import datetime
import multiprocessing as mp
import os
import queue
import tempfile
import time
import traceback


def _worker(rank: int, world: int, backend: str, init_file: str, tasks, results) -> None:
    import torch
    import torch.distributed as dist

    torch.set_num_threads(1)
    os.environ["WORLD_SIZE"] = os.environ["LOCAL_WORLD_SIZE"] = str(world)  # one host, as torchrun
    if backend == "nccl":
        torch.cuda.set_device(rank)
    dist.init_process_group(
        backend, init_method=f"file://{init_file}", rank=rank, world_size=world,
        timeout=datetime.timedelta(seconds=60),
    )
    while True:
        item = tasks.get()
        if item is None:
            break
        fn, args = item
        try:
            results.put((rank, True, fn(*args)))
        except BaseException:  # noqa: BLE001 - report everything to the parent
            results.put((rank, False, traceback.format_exc()))
    dist.destroy_process_group()


class DistPool:
    """`world` spawned ranks in one process group; see the module docstring."""

    def __init__(self, world: int, backend: str = "gloo") -> None:
        # fork is fast (no re-import of torch per rank) and safe for CPU-only gloo workers;
        # CUDA needs spawn. MOEKIT_TEST_MP overrides.
        method = os.environ.get("MOEKIT_TEST_MP") or ("spawn" if backend == "nccl" else "fork")
        ctx = mp.get_context(method)
        fd, self.init_file = tempfile.mkstemp(prefix="moekit_dist_")
        os.close(fd)
        os.unlink(self.init_file)  # the file store creates it
        self.world, self.backend = world, backend
        self.tasks = [ctx.Queue() for _ in range(world)]
        self.results = ctx.Queue()
        self.procs = [
            ctx.Process(target=_worker, daemon=True,
                        args=(r, world, backend, self.init_file, self.tasks[r], self.results))
            for r in range(world)
        ]
        for p in self.procs:
            p.start()
        self.alive = True

    def run(self, fn, *args, timeout: float = 120.0) -> list:
        if not self.alive:
            raise RuntimeError("this DistPool was shut down")
        for q in self.tasks:
            q.put((fn, args))
        out, errors = [None] * self.world, {}
        deadline = time.monotonic() + timeout
        pending = set(range(self.world))
        while pending:
            left = deadline - time.monotonic()
            if left <= 0:
                break
            try:
                rank, ok, value = self.results.get(timeout=min(left, 1.0))
            except queue.Empty:
                if any(not p.is_alive() for p in self.procs):
                    break
                continue
            pending.discard(rank)
            if ok:
                out[rank] = value
            else:
                errors[rank] = value
                deadline = min(deadline, time.monotonic() + 10)  # the others may be stuck
        if errors or pending:
            self.close()
            msg = [f"{getattr(fn, '__name__', fn)}{args!r} failed on {self.world} ranks"]
            msg += [f"--- rank {r} ---\n{tb}" for r, tb in sorted(errors.items())]
            if pending:
                msg.append(f"no answer from ranks {sorted(pending)} (hang or crash)")
            raise AssertionError("\n".join(msg))
        return out

    def close(self) -> None:
        if not self.alive:
            return
        self.alive = False
        for q in self.tasks:
            try:
                q.put(None)
            except Exception:  # noqa: BLE001
                pass
        for p in self.procs:
            p.join(timeout=5)
            if p.is_alive():
                p.kill()
                p.join(timeout=5)
        try:
            os.unlink(self.init_file)
        except OSError:
            pass


_POOLS: dict[tuple[int, str], DistPool] = {}


def get_pool(world: int, backend: str = "gloo") -> DistPool:
    """The cached live pool of `world` ranks on `backend` (started on first use)."""
    pool = _POOLS.get((world, backend))
    if pool is None or not pool.alive or any(not p.is_alive() for p in pool.procs):
        if pool is not None:
            pool.close()
        pool = _POOLS[(world, backend)] = DistPool(world, backend)
    return pool


@atexit.register
def _close_all() -> None:
    for pool in _POOLS.values():
        pool.close()


# ---- inputs shared by the EP test cases ------------------------------------------------------


def ep_inputs(seed: int, Ts, E: int, K: int, H: int, routing: str = "random",
              dtype=None, skew_experts: int | None = None):
    """Every rank's tokens, identical on all ranks (seeded): xs[r] [T_r, H], topks[r] with
    distinct logical ids [T_r, K]. routing: 'random'; 'masked' (about 30% of ids -1);
    'skewed' (ids only in [0, skew_experts): every token goes to the first rank's experts);
    'one_expert' (column 0 = expert E - 1, the rest -1)."""
    import torch

    from moekit.router import TopKOutput

    g = torch.Generator().manual_seed(seed)
    xs, topks = [], []
    for T in Ts:
        x = torch.randn(T, H, generator=g)
        pool = skew_experts if routing == "skewed" else E
        ids = torch.rand(T, pool, generator=g).argsort(dim=1)[:, :K]
        if routing == "masked":
            ids[torch.rand(T, K, generator=g) < 0.3] = -1
        elif routing == "one_expert":
            ids[:, 0] = E - 1
            ids[:, 1:] = -1
        w = torch.rand(T, K, generator=g) + 0.1
        xs.append(x if dtype is None else x.to(dtype))
        topks.append(TopKOutput(w, ids.to(torch.int32)))
    return xs, topks

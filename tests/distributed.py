"""The one spawn helper every distributed test uses.

``run_distributed(fn, world_size, tmp_path, *args, **kwargs)`` runs
``fn(rank, world_size, *args, **kwargs)`` on ``world_size`` fresh processes that already
share a gloo process group (file store under ``tmp_path``), and returns the per-rank return
values in rank order. A rank that raises, dies or hangs fails the call with an error that
names the rank; every child is terminated before the call returns.

Processes come from a forkserver that has torch (and meshzero, tests.models) preloaded, so
a start costs a fork instead of a 3 s ``import torch``. ``fn`` and its arguments must be
picklable: define ``fn`` at module level.
"""

from __future__ import annotations

import contextlib
import faulthandler
import importlib
import itertools
import multiprocessing
import multiprocessing.connection
import multiprocessing.forkserver
import os
import pickle
import signal
import socket
import threading
import time
import traceback
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

REPO_ROOT = Path(__file__).resolve().parent.parent
FAILURE_GRACE_S = 0.5  # after a first failure, how long to gather the others
# gloo's connectFullMesh on loopback now and then fails with "Connection closed by peer"
# while every peer is alive (seen once in ~400 CI spawns); fn has not run then, so the
# whole spawn is retried on a fresh store. A failure inside fn is never retried.
GROUP_START_ATTEMPTS = 3
PRELOAD_MODULES = (
    "torch",
    "torch.distributed",
    "torch._dynamo",  # torch.optim's first step imports it lazily: 2.7 s per rank otherwise
    "pytest",
    "meshzero",
    "tests.distributed",
    "tests.models",
    "tests.engine_runs",
    # the Hugging Face models of the HF, tp and pattern tests: 9 s of CPU per rank otherwise
    "transformers.models.gpt2.modeling_gpt2",
)
_CTX = multiprocessing.get_context("forkserver")
_call_ids = itertools.count()
_preload_set = False


class DistributedTestError(AssertionError):
    """A rank raised, died without reporting, or did not finish in time."""


class _GroupStartError(DistributedTestError):
    """A rank could not join the gloo group (before fn ran): the spawn is retried."""


def run_distributed(
    fn: Callable[..., Any],
    world_size: int,
    tmp_path: str | os.PathLike,
    *args: Any,
    timeout: float = 120.0,
    **kwargs: Any,
) -> list:
    """Run fn(rank, world_size, *args, **kwargs) on world_size ranks; return the list of
    per-rank return values (rank order). Tensors come back detached, cloned, on CPU."""
    if world_size < 1:
        raise ValueError(f"world_size must be >= 1, got {world_size}")
    _ensure_forkserver()
    for attempt in range(GROUP_START_ATTEMPTS):
        try:
            return _spawn(fn, world_size, Path(tmp_path), timeout, args, kwargs)
        except _GroupStartError:
            if attempt == GROUP_START_ATTEMPTS - 1:
                raise
    raise AssertionError("unreachable")


def _spawn(fn, world_size: int, tmp_path: Path, timeout: float, args, kwargs) -> list:
    """One attempt: start the ranks, collect their results, stop every child."""
    call_id = next(_call_ids)
    tag = f"{os.getpid()}_{call_id}"
    store_path = tmp_path / f"store_{tag}"
    stack_paths = [tmp_path / f"stacks_{tag}_rank{r}.txt" for r in range(world_size)]
    env = {
        "WORLD_SIZE": str(world_size),
        "LOCAL_WORLD_SIZE": str(world_size),
        "MASTER_ADDR": "127.0.0.1",
        "MASTER_PORT": str(_free_port()),
        "GROUP_RANK": "0",
        "OMP_NUM_THREADS": "1",
    }
    procs: list[multiprocessing.process.BaseProcess] = []
    readers: list[multiprocessing.connection.Connection] = []
    try:
        for rank in range(world_size):
            reader, writer = _CTX.Pipe(duplex=False)
            proc = _CTX.Process(
                target=_rank_main,
                name=f"rank{rank}",
                args=(
                    fn,
                    rank,
                    world_size,
                    str(store_path),
                    str(stack_paths[rank]),
                    env,
                    writer,
                    timeout,
                    args,
                    kwargs,
                ),
            )
            try:
                proc.start()
            except (pickle.PicklingError, AttributeError, TypeError) as exc:
                raise TypeError(
                    f"run_distributed could not send {fn!r} and its arguments to the ranks "
                    f"({exc}); define fn at module level and pass picklable arguments"
                ) from exc
            finally:
                writer.close()  # the child holds its own end; EOF then means it is gone
            procs.append(proc)
            readers.append(reader)
        results = _collect(procs, readers, stack_paths, timeout)
        deadline = time.monotonic() + 5.0  # let the ranks leave the group on their own
        for proc in procs:
            proc.join(timeout=max(0.0, deadline - time.monotonic()))
        return results
    finally:
        _stop_all(procs)
        for reader in readers:
            reader.close()


def _collect(procs, readers, stack_paths, timeout: float) -> list:
    """Wait for one message per rank; fail on the first error, death or timeout.

    After the first failure, other failures are gathered for FAILURE_GRACE_S more, and
    deaths are listed before exceptions: a rank that dies makes its peers' collectives
    raise, and the death is the cause.
    """
    world_size = len(procs)
    results: list[Any] = [None] * world_size
    pending = set(range(world_size))
    deaths: list[str] = []
    errors: list[str] = []
    start_errors: list[str] = []
    deadline = time.monotonic() + timeout
    first_failure: float | None = None
    while pending:
        now = time.monotonic()
        limit = (
            deadline if first_failure is None else min(deadline, first_failure + FAILURE_GRACE_S)
        )
        if now >= limit:
            break
        watched = {readers[r]: r for r in pending} | {procs[r].sentinel: r for r in pending}
        ready = multiprocessing.connection.wait(list(watched), timeout=limit - now)
        for rank in sorted({watched[obj] for obj in ready}):
            pending.discard(rank)
            message = _receive(readers[rank])
            if message is None:  # exited (or closed its pipe) without a word
                procs[rank].join(timeout=5.0)
                deaths.append(
                    f"rank {rank} exited with code {procs[rank].exitcode} without reporting "
                    f"a result (os._exit, a signal or a crash in native code)"
                )
            elif message[1] == "error":
                errors.append(f"rank {rank} raised:\n{message[2]}")
            elif message[1] == "group_start_error":
                start_errors.append(f"rank {rank} could not join the group:\n{message[2]}")
            else:
                results[rank] = message[2]
            if first_failure is None and (deaths or errors or start_errors):
                first_failure = time.monotonic()
    if deaths or errors:
        raise DistributedTestError("\n".join(deaths + errors + start_errors))
    if start_errors:
        raise _GroupStartError("\n".join(start_errors))
    if pending:
        raise DistributedTestError(_timeout_message(sorted(pending), timeout, procs, stack_paths))
    return results


def _receive(reader) -> tuple | None:
    """One (rank, status, payload) message, or None if the rank is gone without one."""
    try:
        if not reader.poll():
            return None  # only the process sentinel fired
        return pickle.loads(reader.recv_bytes())
    except (EOFError, OSError):
        return None


def _timeout_message(hung: list[int], timeout: float, procs, stack_paths) -> str:
    """Name the ranks that did not finish, with their Python stacks (via faulthandler)."""
    for rank in hung:
        if procs[rank].is_alive() and procs[rank].pid is not None:
            with contextlib.suppress(ProcessLookupError):
                os.kill(procs[rank].pid, signal.SIGUSR1)
    time.sleep(0.3)  # let faulthandler write the stacks
    names = ", ".join(str(r) for r in hung)
    label = "rank" if len(hung) == 1 else "ranks"
    lines = [f"{label} {names} did not finish within {timeout} s"]
    for rank in hung:
        stacks = stack_paths[rank].read_text() if stack_paths[rank].exists() else ""
        if stacks.strip():
            lines.append(f"--- rank {rank} Python stacks ---\n{stacks.rstrip()}")
    return "\n".join(lines)


def _stop_all(procs) -> None:
    """Terminate every child still alive, then kill what ignores SIGTERM."""
    for proc in procs:
        if proc.is_alive():
            proc.terminate()
    deadline = time.monotonic() + 3.0
    for proc in procs:
        proc.join(timeout=max(0.0, deadline - time.monotonic()))
    for proc in procs:
        if proc.is_alive():
            proc.kill()
            proc.join(timeout=5.0)


def _ensure_forkserver() -> None:
    """Start the forkserver once with torch preloaded and the repo root importable.

    Python 3.11's forkserver ignores the parent's sys.path, so the repo root reaches it
    (and its children) through PYTHONPATH; OMP_NUM_THREADS=1 is set before OpenMP loads.
    """
    global _preload_set
    if not _preload_set:
        _CTX.set_forkserver_preload([m for m in PRELOAD_MODULES if _importable(m)])
        _preload_set = True
    saved = {k: os.environ.get(k) for k in ("PYTHONPATH", "OMP_NUM_THREADS")}
    paths = [p for p in os.environ.get("PYTHONPATH", "").split(os.pathsep) if p]
    os.environ["PYTHONPATH"] = os.pathsep.join([str(REPO_ROOT), *paths])
    os.environ["OMP_NUM_THREADS"] = "1"
    try:
        multiprocessing.forkserver.ensure_running()
    finally:
        for key, value in saved.items():
            if value is None:
                os.environ.pop(key, None)
            else:
                os.environ[key] = value


def _importable(module: str) -> bool:
    """Preload only what imports now, so a half-written package cannot kill the forkserver."""
    try:
        importlib.import_module(module)
    except Exception:
        return False
    return True


def _free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def _detach(obj: Any) -> Any:
    """Detached CPU clones of every tensor inside lists, tuples and dicts."""
    if isinstance(obj, torch.Tensor):
        return obj.detach().cpu().clone()
    if isinstance(obj, dict):
        return type(obj)((k, _detach(v)) for k, v in obj.items())
    if isinstance(obj, (list, tuple)) and not hasattr(obj, "_fields"):
        return type(obj)(_detach(v) for v in obj)
    return obj


def _watch_parent(timeout: float) -> None:
    """Exit if the parent dies, or long after it should have given up on us."""
    parent = multiprocessing.parent_process()
    sentinels = [parent.sentinel] if parent is not None else []
    multiprocessing.connection.wait(sentinels, timeout=timeout + 60.0)
    os._exit(70)


def _rank_main(
    fn, rank, world_size, store_path, stack_path, env, writer, timeout, args, kwargs
) -> None:
    """Child entry point: join the group, run fn, send (rank, status, payload) once."""
    os.environ.update(env, RANK=str(rank), LOCAL_RANK=str(rank))
    torch.set_num_threads(1)
    stack_file = open(stack_path, "w")  # noqa: SIM115 - must stay open for faulthandler
    faulthandler.register(signal.SIGUSR1, file=stack_file, all_threads=True)
    threading.Thread(target=_watch_parent, args=(timeout,), daemon=True).start()
    try:
        store = dist.FileStore(store_path, world_size)
        dist.init_process_group("gloo", store=store, rank=rank, world_size=world_size)
    except BaseException:
        writer.send_bytes(pickle.dumps((rank, "group_start_error", traceback.format_exc())))
        writer.close()
        threading.Event().wait()  # the parent kills every rank and spawns them again
    try:
        message = pickle.dumps((rank, "ok", _detach(fn(rank, world_size, *args, **kwargs))))
        failed = False
    except BaseException:
        message = pickle.dumps((rank, "error", traceback.format_exc()))
        failed = True
    writer.send_bytes(message)
    writer.close()
    if failed:
        # Stay in the group until the parent kills us: leaving would make the peers'
        # collectives fail with secondary errors that hide this one.
        threading.Event().wait()
    if dist.is_initialized():
        dist.destroy_process_group()

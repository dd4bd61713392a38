"""Who owns an NVMe offload directory; directories of dead runs reclaimed; ours removed on
SIGTERM / SIGINT.

Each rank's directory (``meshzero-rank00003-*`` under ``nvme_path``) holds ``owner.json``:
the host, the pid, the boot id, the pid's start time (in clock ticks since boot) and the pid
namespace of the process that made it. At initialize, a directory is removed when its owner
ran on this host, in this pid namespace, and is gone: the boot id differs (a reboot), the
pid is not running, or the pid now belongs to a process with another start time (reused).
Directories of another host or pid namespace, of a live owner, or without a readable
``owner.json`` are never touched.

SIGTERM (what Slurm and Kubernetes send at preemption, and torchrun to its workers) ends a
process without running ``atexit``, so the files would stay. While a store is open, handlers
for SIGTERM and SIGINT are installed (main thread only): a signal whose previous handling
was the default removes the directories, restores the default and re-sends the signal, so
the process still dies by it (exit status -15). A previous Python handler (SIGINT's
KeyboardInterrupt, a user's preemption handler that saves a checkpoint) is called instead
and decides; if it ends the process the files go with the normal exit. An ignored signal
stays ignored.

Removal comes first, and does not wait for the main thread: Python runs a signal handler
only when the main thread next runs bytecode, not while it is blocked in C++ (a collective's
wait, up to ``faults.comm_timeout``), and torchrun sends SIGKILL 30 s after its SIGTERM. So
the C-level handler also writes the signal number to a pipe (``signal.set_wakeup_fd``), and
a thread blocked on it removes the directories at once; the handler then ends the process
when the main thread gets to it (or SIGKILL does). A forked child drops the pipe (its
signals are not ours); where a wakeup fd is already set (an asyncio loop), only the handler
removes them.
"""

from __future__ import annotations

import contextlib
import json
import logging
import os
import shutil
import signal
import socket
import tempfile
import threading
from typing import Any

logger = logging.getLogger(__name__)

PREFIX = "meshzero-rank"
OWNER_FILE = "owner.json"


# -- the identity of a process ---------------------------------------------------------------
def _read(path: str) -> str | None:
    try:
        with open(path) as f:
            return f.read().strip()
    except OSError:
        return None


def start_time(pid: int) -> int | None:
    """Clock ticks after boot at which ``pid`` started (/proc; None where unknown)."""
    stat = _read(f"/proc/{pid}/stat")
    if stat is None:
        return None
    # the command name (field 2) may hold spaces and parentheses: split after the last ')'
    return int(stat.rsplit(")", 1)[1].split()[19])


def pid_namespace() -> str | None:
    try:
        return os.readlink("/proc/self/ns/pid")
    except OSError:
        return None


def identity() -> dict[str, Any]:
    """This process, as ``owner.json`` records it."""
    pid = os.getpid()
    return {"host": socket.gethostname(), "pid": pid, "start_time": start_time(pid),
            "boot_id": _read("/proc/sys/kernel/random/boot_id"), "pid_ns": pid_namespace()}


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:  # another user's process
        return True
    return True


def stale_reason(owner: dict[str, Any], me: dict[str, Any]) -> str | None:
    """Why ``owner``'s directory is stale, or None when it is (or may be) in use."""
    if owner.get("host") != me["host"] or owner.get("pid_ns") != me["pid_ns"]:
        return None  # another machine or container: its pids mean nothing here
    pid = owner.get("pid")
    if not isinstance(pid, int):
        return None
    if owner.get("boot_id") and me["boot_id"] and owner["boot_id"] != me["boot_id"]:
        return "written before this machine last booted"
    if not _alive(pid):
        return f"process {pid} is not running"
    now = start_time(pid)
    if owner.get("start_time") is not None and now is not None and now != owner["start_time"]:
        return f"process {pid} is not running (the pid now belongs to another process)"
    return None


# -- directories ------------------------------------------------------------------------------
def make_run_dir(parent: str, prefix: str) -> str:
    """A fresh directory under ``parent`` with this process's ``owner.json`` (written under
    a temporary name, fsynced and renamed)."""
    path = tempfile.mkdtemp(prefix=prefix, dir=parent)
    tmp = os.path.join(path, f".{OWNER_FILE}.tmp")
    with open(tmp, "w") as f:
        json.dump(identity(), f)
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, os.path.join(path, OWNER_FILE))
    return path


def make_rank_dirs(path: str | None, param_path: str | None, rank: int) -> tuple[str, str]:
    """``rank``'s directory under ``path`` and, when parameters go to another path, one
    under ``param_path`` (else the same), after reclaiming those of dead runs there."""
    assert path is not None  # checked by NvmeTier before any file is made
    reclaim_stale(path)
    main = make_run_dir(path, f"{PREFIX}{rank:05d}-")
    if param_path is None:
        return main, main
    reclaim_stale(param_path)
    return main, make_run_dir(param_path, f"{PREFIX}{rank:05d}-params-")


def reclaim_stale(parent: str) -> list[str]:
    """Remove the directories under ``parent`` whose owner is gone (module docstring);
    returns them."""
    me, removed = identity(), list[str]()
    try:
        names = sorted(os.listdir(parent))
    except OSError:
        return removed
    for name in names:
        path = os.path.join(parent, name)
        if not name.startswith(PREFIX) or not os.path.isdir(path):
            continue
        try:
            with open(os.path.join(path, OWNER_FILE)) as f:
                owner = json.load(f)
        except (OSError, ValueError):
            continue  # unknown owner (being created, or an older meshzero): keep
        reason = stale_reason(owner, me) if isinstance(owner, dict) else None
        if reason is not None:
            shutil.rmtree(path, ignore_errors=True)
            logger.warning("removed the NVMe offload directory %s of a dead run: %s", path,
                           reason)
            removed.append(path)
    return removed


def remove_dirs(paths: list[str], tries: int = 5) -> None:
    """Remove each directory, again while it is still there: a writer thread of the store
    opens its files with ``O_CREAT``, so a file just unlinked can come back before the last
    ``rmdir``."""
    for path in dict.fromkeys(paths):
        for _ in range(tries):
            shutil.rmtree(path, ignore_errors=True)
            if not os.path.lexists(path):
                break


# -- signals -----------------------------------------------------------------------------------
SIGNALS = (signal.SIGTERM, signal.SIGINT)


class SignalCleanup:
    """The directories to remove if this process is ended by a signal (module docstring).
    One per process (:data:`CLEANUP`): signal handlers are process-wide."""

    def __init__(self) -> None:
        self.paths: dict[int, list[str]] = {}
        self.previous: dict[int, Any] = {}
        self.pid = os.getpid()
        self._next = 0
        self._pipe: tuple[int, int] | None = None  # (read, write) of the wakeup fd
        # the watcher thread and the handler both remove: the handler, which ends the
        # process, waits until the watcher's removal (and its tries again) is done
        self._removing = threading.RLock()

    def add(self, paths: list[str]) -> int:
        """Remove ``paths`` on SIGTERM / SIGINT; returns a token for :meth:`discard`."""
        if os.getpid() != self.pid:  # a forked child: the parent's directories are not ours
            self.paths.clear()
            self.pid = os.getpid()
        self._next += 1
        self.paths[self._next] = list(paths)
        self._install()
        return self._next

    def discard(self, token: int) -> None:
        self.paths.pop(token, None)
        if not self.paths:
            self._uninstall()

    def _main_thread(self) -> bool:
        return threading.current_thread() is threading.main_thread()

    def _install(self) -> None:
        if self.previous or not self._main_thread():
            if not self.previous:
                logger.debug("NVMe files are not removed on signals: the engine was built "
                             "outside the main thread")
            return
        self.pid = os.getpid()
        for sig in SIGNALS:
            self.previous[sig] = signal.getsignal(sig)
            signal.signal(sig, self._handle)
        self._watch_wakeups()

    def _watch_wakeups(self) -> None:
        """Removal while the main thread is blocked in C++ (module docstring)."""
        read, write = os.pipe()
        os.set_blocking(write, False)
        if signal.set_wakeup_fd(write, warn_on_full_buffer=False) != -1:
            signal.set_wakeup_fd(-1)  # someone else's (asyncio): leave it, and them, alone
            logger.debug("NVMe files are removed on signals by the handler only: a wakeup "
                         "fd was set already")
            os.close(read)
            os.close(write)
            return
        self._pipe = (read, write)
        threading.Thread(target=self._watch, args=(read,), daemon=True,
                         name="meshzero-nvme-signals").start()

    def _watch(self, read: int) -> None:
        while True:
            data = os.read(read, 64)
            if not data or 0 in data:  # 0: _uninstall stops the thread
                os.close(read)
                return
            if any(self._removes_on(signum) for signum in data):
                self.remove_all()

    def _removes_on(self, signum: int) -> bool:
        """Whether our handling of ``signum`` removes the files: ours is its handler now (not
        one installed after us) and the one before was the default, in the process that
        made them."""
        prev = self.previous.get(signum, signal.SIG_DFL)
        return signum in SIGNALS and prev is not signal.SIG_IGN and not callable(prev) \
            and os.getpid() == self.pid and signal.getsignal(signum) == self._handle

    def remove_all(self) -> None:
        with self._removing:  # reentrant: a signal may arrive on a thread removing already
            for paths in list(self.paths.values()):
                remove_dirs(paths)

    def _uninstall(self) -> None:
        if not self.previous or not self._main_thread():
            return
        for sig, prev in self.previous.items():
            if signal.getsignal(sig) == self._handle:
                signal.signal(sig, prev if prev is not None else signal.SIG_DFL)
        self.previous = {}
        if self._pipe is not None:
            read, write = self._pipe
            self._pipe = None
            signal.set_wakeup_fd(-1)
            os.write(write, b"\0")  # the watching thread closes ``read`` and ends
            os.close(write)

    def after_fork_in_child(self) -> None:
        """A forked child (a DataLoader worker): its signals must not reach our watcher
        through the inherited pipe (it would remove the parent's files)."""
        if self._pipe is not None:
            with contextlib.suppress(ValueError):  # forked from another thread: not main
                signal.set_wakeup_fd(-1)
            for fd in self._pipe:
                os.close(fd)
            self._pipe = None

    def _handle(self, signum: int, frame: Any) -> None:
        if self._removes_on(signum):  # first: torchrun's SIGKILL may follow soon
            self.remove_all()
        prev = self.previous.get(signum, signal.SIG_DFL)
        if prev is signal.SIG_IGN:
            return
        if callable(prev):  # a Python handler decides; files go at a normal exit
            prev(signum, frame)
            return
        signal.signal(signum, signal.SIG_DFL)
        os.kill(os.getpid(), signum)  # die by the signal, as without us


CLEANUP = SignalCleanup()
os.register_at_fork(after_in_child=CLEANUP.after_fork_in_child)

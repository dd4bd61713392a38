"""Crash-safe writes: every file meshzero writes goes through here.

One file::

    write ``.{name}.meshzero-tmp`` -> fsync it -> rename onto ``name`` -> fsync the directory

A set of files that must change together (a sharded model and its index, config.json) is
written with a **journal**: every new file is first written whole under its temporary name
and fsynced; then a small journal ``.meshzero-journal.json`` naming the renames (and the
files of the previous set that the new one does not replace, to remove) is committed as
one file; then the renames run; then the journal is removed. A reader or writer that finds
a journal finishes it first (:func:`finish_journal`): the temporaries it names are complete,
so a kill at any point leaves the whole old set or, once the journal exists, the whole new
one. Temporaries without a journal are a write that never committed; the next write of the
directory removes them.

Every file-system step calls :func:`fs_step` first. Tests install a hook with
:func:`set_fault_hook` to kill the process, or raise ENOSPC, before step k.
"""

from __future__ import annotations

import contextlib
import ctypes
import errno as errno_codes
import functools
import json
import logging
import os
import shutil
from collections.abc import Callable, Iterable, Iterator
from pathlib import Path
from typing import IO, Any, TypeVar

logger = logging.getLogger(__name__)

TEMP_SUFFIX = ".meshzero-tmp"
JOURNAL = ".meshzero-journal.json"
T = TypeVar("T")
FaultHook = Callable[[str, Path], None]
_hook: FaultHook | None = None


def set_fault_hook(hook: FaultHook | None) -> FaultHook | None:
    """Call ``hook(kind, path)`` before every file-system step (for fault tests); returns
    the hook it replaces. Kinds: write, data, fsync, fsync-dir, mkdir, rename, exchange,
    remove."""
    global _hook
    previous, _hook = _hook, hook
    return previous


def fs_step(kind: str, path: str | os.PathLike) -> None:
    if _hook is not None:
        _hook(kind, Path(path))


class FileWriteError(OSError):
    """A write failed: names the file and the errno (a full disk says which file)."""

    def __str__(self) -> str:
        code = errno_codes.errorcode.get(self.errno or 0, "?")
        return f"cannot write {self.filename}: {self.strerror} (errno {self.errno} {code})"


@contextlib.contextmanager
def naming(path: str | os.PathLike, *also: str | os.PathLike) -> Iterator[None]:
    """Re-raise an OSError inside as a :class:`FileWriteError` naming ``path`` (one that
    names a file other than ``path`` or ``also``, e.g. a source being read, passes
    unchanged)."""
    try:
        yield
    except FileWriteError:
        raise
    except OSError as exc:
        ours = {os.fspath(p) for p in (path, *also)}
        if exc.filename is not None and os.fspath(exc.filename) not in ours:
            raise
        raise FileWriteError(exc.errno, exc.strerror or str(exc), str(path)) from exc


def fsync_dir(path: str | os.PathLike) -> None:
    """Make the directory's entries (renames, new files) durable."""
    fs_step("fsync-dir", path)
    with contextlib.suppress(OSError):  # not every file system lets a directory be fsynced
        fd = os.open(path, os.O_RDONLY)
        try:
            os.fsync(fd)
        finally:
            os.close(fd)


def rename(src: Path, dst: Path) -> None:
    fs_step("rename", dst)
    with naming(dst, src):
        os.replace(src, dst)


_AT_FDCWD, _RENAME_EXCHANGE = -100, 2  # <fcntl.h>, <linux/fs.h>


@functools.cache
def _renameat2() -> Callable[..., int] | None:
    """glibc's ``renameat2`` (Linux 3.15+, glibc 2.28+), or None where there is none."""
    try:
        fn = ctypes.CDLL(None, use_errno=True).renameat2
    except (AttributeError, OSError):
        return None
    fn.argtypes = [ctypes.c_int, ctypes.c_char_p, ctypes.c_int, ctypes.c_char_p, ctypes.c_uint]
    fn.restype = ctypes.c_int
    return fn


def exchange(a: Path, b: Path) -> bool:
    """Swap the entries ``a`` and ``b`` (both exist) in one atomic step: Linux's
    ``renameat2(RENAME_EXCHANGE)``, so ``b`` is at every instant the old or the new one, never
    missing. False, with nothing changed, where the system or the file system has no such
    call (the caller then moves ``b`` aside first)."""
    fs_step("exchange", b)
    fn = _renameat2()
    if fn is None:
        return False
    if fn(_AT_FDCWD, os.fsencode(a), _AT_FDCWD, os.fsencode(b), _RENAME_EXCHANGE) == 0:
        return True
    err = ctypes.get_errno()
    if err in (errno_codes.EINVAL, errno_codes.ENOSYS, errno_codes.EOPNOTSUPP):
        return False  # EINVAL: the file system does not support the flag
    with naming(b, a):
        raise OSError(err, os.strerror(err), str(a), None, str(b))


def remove_tree(path: Path) -> None:
    """Remove a directory (or file) if it is there; errors are ignored."""
    if path.is_dir() or path.exists():
        fs_step("remove", path)
        if path.is_dir() and not path.is_symlink():
            shutil.rmtree(path, ignore_errors=True)
        else:
            with contextlib.suppress(OSError):
                path.unlink()


def make_dir(path: Path) -> None:
    fs_step("mkdir", path)
    with naming(path):
        path.mkdir()


def write_in_place(path: Path, fill: Callable[[IO[bytes]], T], shown: Path | None = None
                   ) -> T:
    """Write ``path`` (a new file inside a temporary directory) with ``fill(f)`` and fsync
    it; returns what ``fill`` returns. An error names ``shown`` (default ``path``)."""
    with naming(shown or path, path):
        fs_step("write", path)
        with open(path, "wb") as f:
            result = fill(f)
            f.flush()
            fs_step("fsync", path)
            os.fsync(f.fileno())
    return result


def temp_path(directory: Path, name: str) -> Path:
    """``.{name}.meshzero-tmp`` (a name that starts with a dot keeps its one dot)."""
    return directory / f"{'' if name.startswith('.') else '.'}{name}{TEMP_SUFFIX}"


def write_temp(directory: Path, name: str, fill: Callable[[IO[bytes]], T]) -> T:
    """Write ``directory/name``'s temporary whole (see :func:`commit_files`); a failed
    write removes it."""
    tmp = temp_path(directory, name)
    try:  # an error names the file the user asked for
        return write_in_place(tmp, fill, shown=directory / name)
    except BaseException:
        with contextlib.suppress(OSError):
            tmp.unlink()
        raise


def write_temp_bytes(directory: Path, name: str, data: bytes) -> None:
    write_temp(directory, name, lambda f: f.write(data))


def write_atomic(path: Path, fill: Callable[[IO[bytes]], T]) -> T:
    """Replace one file atomically: a temporary, fsynced, renamed, directory fsynced."""
    result = write_temp(path.parent, path.name, fill)
    rename(temp_path(path.parent, path.name), path)
    fsync_dir(path.parent)
    return result


def json_bytes(obj: Any, indent: int | None = None) -> bytes:
    return json.dumps(obj, indent=indent).encode()


def prepare_dir(directory: Path) -> None:
    """Before new temporaries are written into ``directory``: finish an interrupted commit,
    then remove temporaries of writes that never committed."""
    with naming(directory):
        directory.mkdir(parents=True, exist_ok=True)
    if not finish_journal(directory):
        _remove_temps(directory, keep=())


def commit_files(directory: Path, names: Iterable[str], stale: Iterable[str] = ()) -> list[Path]:
    """Make the temporaries of ``names`` (all written whole) visible together, and remove
    the ``stale`` files of the set they replace; returns the final paths."""
    names = list(names)
    for name in [*names, *stale]:
        _check_name(name, directory)
    fsync_dir(directory)  # the temporaries' entries are durable before the journal names them
    journal = {"rename": [[temp_path(directory, n).name, n] for n in names],
               "remove": sorted(set(stale) - set(names))}
    try:
        write_atomic(directory / JOURNAL, lambda f: f.write(json_bytes(journal)))
    except BaseException:  # not committed: the old files stay, the new ones go
        discard_temps(directory, names)
        raise
    finish_journal(directory)
    return [directory / n for n in names]


def discard_temps(directory: Path, names: Iterable[str]) -> None:
    """Remove the temporaries of ``names`` (a write that failed before its commit; once a
    journal names them they are the new files and stay)."""
    if (directory / JOURNAL).exists():
        return
    for name in names:
        remove_tree(temp_path(directory, name))


def finish_journal(directory: Path) -> bool:
    """Complete an interrupted :func:`commit_files` in ``directory``; False if none was."""
    path = directory / JOURNAL
    if not path.is_file():
        return False
    try:
        journal = json.loads(path.read_text())
        renames = [(str(a), str(b)) for a, b in journal["rename"]]
        removes = [str(n) for n in journal["remove"]]
    except (OSError, ValueError, KeyError, TypeError) as exc:
        raise ValueError(f"{path} is not a meshzero write journal ({exc}); remove it and the "
                         f"{TEMP_SUFFIX} files beside it, then write again") from exc
    for name in [n for pair in renames for n in pair] + removes:
        _check_name(name, path)
    for tmp, final in renames:
        if (directory / tmp).exists():
            rename(directory / tmp, directory / final)
        elif not (directory / final).exists():
            raise ValueError(f"{path}: neither {tmp} nor {final} exists; the directory was "
                             "changed during a write")
    for name in removes:
        remove_tree(directory / name)
    fsync_dir(directory)
    remove_tree(path)
    _remove_temps(directory, keep=())
    fsync_dir(directory)
    logger.debug("finished the write journal of %s", directory)
    return True


def _remove_temps(directory: Path, keep: Iterable[str]) -> None:
    kept = set(keep)
    if not directory.is_dir():
        return
    for entry in directory.iterdir():
        if entry.name.endswith(TEMP_SUFFIX) and entry.name not in kept:
            remove_tree(entry)


def _check_name(name: str, where: Path) -> None:
    if Path(name).name != name or name in ("", ".", ".."):
        raise ValueError(f"{where}: {name!r} is not a plain file name")

"""NVMe tier building blocks: files read and written with ``os.preadv``/``os.pwrite``
(opened per access, so a removed file is noticed), the tiles the optimizer space is cut into,
and their host buffers."""

from __future__ import annotations

import ctypes
import errno
import os
import time
from collections.abc import Callable
from dataclasses import dataclass, field

import torch
from torch import nn

from meshzero.zero.units import Fragment


class NvmeIOError(RuntimeError):
    """An NVMe offload file is missing, truncated or cannot be written."""


def describe_os_error(exc: OSError) -> str:
    """``[ENOSPC] No space left on device``: the errno's name, then its text."""
    name = errno.errorcode.get(exc.errno or 0)
    return f"[{name}] {exc.strerror}" if name else str(exc.strerror or exc)


def _raw(t: torch.Tensor):
    """The bytes of a contiguous CPU tensor as a writable buffer (no copy)."""
    return (ctypes.c_char * (t.numel() * t.element_size())).from_address(t.data_ptr())


class NvmeFile:
    """One file, opened per access so a file removed under us is noticed."""

    def __init__(self, path: str, itemsize: int,
                 count: Callable[[bool, int, float], None] | None = None):
        """``count(writing, nbytes, seconds)``: told of every completed read and write."""
        self.path = path
        self.itemsize = itemsize
        self.count = count

    def _open(self, flags: int, what: str) -> int:
        try:
            return os.open(self.path, flags, 0o600)
        except FileNotFoundError:
            raise NvmeIOError(f"NVMe offload file {self.path} is missing ({what})") from None
        except OSError as exc:
            raise NvmeIOError(f"NVMe offload file {self.path} cannot be opened: "
                              f"{describe_os_error(exc)} ({what})") from None

    def extend(self, numel: int) -> None:
        """At least ``numel`` items long; the new end reads as zeros (a sparse hole)."""
        if os.path.getsize(self.path) < numel * self.itemsize:
            os.truncate(self.path, numel * self.itemsize)

    def write(self, index: int, t: torch.Tensor, what: str) -> None:
        self._transfer(index, t, what, writing=True)

    def read(self, index: int, t: torch.Tensor, what: str) -> None:
        self._transfer(index, t, what, writing=False)

    def _transfer(self, index: int, t: torch.Tensor, what: str, *, writing: bool) -> None:
        """``t``'s bytes to (or from) the file at element ``index``; a short read is a
        truncated file."""
        t0 = time.perf_counter()
        fd = self._open(os.O_WRONLY | os.O_CREAT if writing else os.O_RDONLY, what)
        view, offset = memoryview(_raw(t)).cast("B"), index * self.itemsize
        want = len(view)
        try:
            while view:
                n = os.pwrite(fd, view, offset) if writing else os.preadv(fd, [view], offset)
                if n == 0:
                    raise NvmeIOError(
                        f"NVMe offload file {self.path} is truncated: wanted {want} bytes at "
                        f"offset {index * self.itemsize}, got {want - len(view)} ({what})")
                view, offset = view[n:], offset + n
            if self.count is not None:
                self.count(writing, want, time.perf_counter() - t0)
        except OSError as exc:
            raise NvmeIOError(f"NVMe offload file {self.path} cannot be "
                              f"{'written' if writing else 'read'}: "
                              f"{describe_os_error(exc)} ({what})") from None
        finally:
            os.close(fd)


@dataclass
class Tile:
    index: int
    start: int  # in the optimizer space
    end: int
    first_leaf: int  # leaves of a tile have consecutive indices
    leaves: list[tuple[nn.Parameter, int, int]] = field(default_factory=list)  # (leaf, a, b)
    names: list[str] = field(default_factory=list)
    subset: list[list[torch.Tensor]] = field(default_factory=list)  # leaves per param group

    @property
    def numel(self) -> int:
        return self.end - self.start

    def describe(self) -> str:
        names = sorted(set(self.names))
        shown = ", ".join(names[:4]) + (", ..." if len(names) > 4 else "")
        return f"optimizer tile {self.index}, parameters {shown}"


class TileBuffers:
    """Host buffers for one tile: master, fp32 grad (and the 16-bit gradient it is converted
    from, with a 16-bit gradient dtype), compute-dtype params and state kinds."""

    def __init__(self, numel: int, leaves: int, compute_dtype: torch.dtype, pin: bool,
                 grad_dtype: torch.dtype = torch.float32):
        self.numel, self.leaves, self.pin = numel, leaves, pin
        self.master = torch.empty(numel, pin_memory=pin)
        self.grad = torch.empty(numel, pin_memory=pin)
        self.grad_raw = (None if grad_dtype == torch.float32
                         else torch.empty(numel, dtype=grad_dtype, pin_memory=pin))
        self.params = torch.empty(numel, dtype=compute_dtype, pin_memory=pin)
        self.kinds: dict[str, torch.Tensor] = {}

    def kind(self, name: str, dtype: torch.dtype, scalar: bool) -> torch.Tensor:
        if name not in self.kinds:
            self.kinds[name] = torch.empty(self.leaves if scalar else self.numel, dtype=dtype,
                                           pin_memory=self.pin)
        return self.kinds[name]

    def zero_missing(self, tile: Tile, kinds: dict[str, tuple[torch.dtype, bool]],
                     state_of: Callable[[nn.Parameter], dict]) -> None:
        """A leaf of ``tile`` skipped since before its first step has no state: its slots
        of each kind are zeros (Adam's fresh state: step 0, zero moments), not what the
        reused buffer held."""
        for i, (leaf, a, b) in enumerate(tile.leaves):
            state = state_of(leaf)
            for kind, (dtype, scalar) in kinds.items():
                if kind not in state:
                    t = self.kind(kind, dtype, scalar)
                    (t[i] if scalar else t[a:b]).zero_()

    @property
    def nbytes(self) -> int:
        raw = () if self.grad_raw is None else (self.grad_raw,)
        return sum(t.numel() * t.element_size()
                   for t in (self.master, self.grad, *raw, self.params, *self.kinds.values()))


CUT = 64  # fragments are cut at multiples of this from their start (see TilePlanner)


class TilePlanner:
    """Packs fragments, in optimizer-space order, into tiles of at most ``tile_numel``.

    A fragment that does not fit is cut at a multiple of CUT elements from its own start,
    so the vectorised optimizer kernels see the same element-to-lane mapping and tail as for
    the whole fragment: the update is bit-identical to the step without tiles.
    """

    def __init__(self, tile_numel: int):
        self.tile_numel = tile_numel
        self.bounds: list[list[int]] = []  # [start, end) of each tile in the space

    def add(self, frag: Fragment, position: int) -> list[tuple[Fragment, int]]:
        """``frag`` at ``position``: its pieces with the tile each lands in."""
        out, a = [], 0
        while a < frag.numel:
            pos = position + a
            if not self.bounds or pos - self.bounds[-1][0] >= self.tile_numel:
                self.bounds.append([pos, pos])
            room = self.bounds[-1][0] + self.tile_numel - pos
            take = frag.numel - a
            if take > room:
                take = room // CUT * CUT if room >= CUT else 0
                if take == 0:  # too little room to cut well: start the next tile
                    self.bounds.append([pos, pos])
                    take = min(frag.numel - a, max(self.tile_numel // CUT * CUT, 1))
            piece = Fragment(frag.slot, frag.start + a, frag.start + a + take,
                             frag.local_offset + a)
            self.bounds[-1][1] = pos + take
            out.append((piece, len(self.bounds) - 1))
            a += take
        return out

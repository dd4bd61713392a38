"""The demo's corpus: the running interpreter's standard library source, as bytes.

It exists on every machine without a download. Files are listed in sorted order of their
path relative to the stdlib directory, shuffled with a fixed seed and concatenated until
``max_bytes``, so the corpus is the same on every rank and every run of one Python version.
Batches are drawn from the *global* batch of each step (the same on every rank and world
size); a rank takes its contiguous slice, so world sizes 1, 2 and 4 train on the same data.
"""

from __future__ import annotations

import os
import random
import sysconfig
from pathlib import Path

import torch

SKIP_DIRS = {"site-packages", "dist-packages", "__pycache__"}  # third-party code is not stdlib


def stdlib_dir() -> Path:
    return Path(sysconfig.get_paths()["stdlib"])


def stdlib_files(root: Path | None = None) -> list[Path]:
    """Every ``*.py`` file under the stdlib directory, sorted by relative path."""
    root = root or stdlib_dir()
    files = []
    for dirpath, dirnames, filenames in os.walk(root):
        dirnames[:] = [d for d in dirnames if d not in SKIP_DIRS]  # prune, do not descend
        files += [Path(dirpath, f) for f in filenames if f.endswith(".py")]
    return sorted(files, key=lambda p: p.relative_to(root).as_posix())


def load_corpus(max_bytes: int = 2_000_000, seed: int = 0, root: Path | None = None
                ) -> torch.Tensor:
    """(max_bytes,) uint8: stdlib files in a seeded shuffle of sorted order, each followed by
    a newline, cut at ``max_bytes``."""
    files = stdlib_files(root)
    if not files:
        raise FileNotFoundError(f"no *.py files under {root or stdlib_dir()}")
    random.Random(seed).shuffle(files)
    chunks, total = [], 0
    for path in files:
        try:
            data = path.read_bytes() + b"\n"
        except OSError:  # unreadable file: skip it, as a missing one would be
            continue
        chunks.append(data)
        total += len(data)
        if total >= max_bytes:
            break
    corpus = b"".join(chunks)[:max_bytes]
    return torch.frombuffer(bytearray(corpus), dtype=torch.uint8)


def global_batch(corpus: torch.Tensor, step: int, batch: int, block: int, seed: int = 0
                 ) -> tuple[torch.Tensor, torch.Tensor]:
    """Step ``step``'s global batch: (batch, block) inputs and the next-byte targets, int64."""
    gen = torch.Generator().manual_seed(seed * 1_000_003 + step)
    starts = torch.randint(0, corpus.numel() - block - 1, (batch,), generator=gen)
    rows = torch.stack([corpus[s:s + block + 1] for s in starts.tolist()]).long()
    return rows[:, :-1], rows[:, 1:]


def rank_micro_batch(x: torch.Tensor, y: torch.Tensor, rank: int, micro: int, accum: int,
                     micro_step: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Rank ``rank``'s micro-batch ``micro_step`` of a global batch: the global batch is cut
    into contiguous rank chunks of ``micro * accum`` rows, each chunk into micro-batches."""
    lo = rank * micro * accum + micro_step * micro
    return x[lo:lo + micro], y[lo:lo + micro]

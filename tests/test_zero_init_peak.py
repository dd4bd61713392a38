"""zero_init's construction peak, measured as an outside probe would: the process's peak RSS
(VmHWM, i.e. getrusage's ru_maxrss, reset by ``/proc/self/clear_refs``) while ``initialize``
builds, beyond the model states the rank holds after (issue 26, item 3).

A unit in flight costs its whole flat buffer on top of the shards built so far, so a model
whose largest unit is not a block (the root, holding a tied embedding of several blocks'
bytes, with odd widths and padding) peaked at the shards plus that unit. The materializer
builds the largest unit first: the peak is the shards plus about one block. The ~100 MB
models of benchmarks/construction_peak.py are in the slow set (tests/test_zero_init_buffers.py).
"""

from __future__ import annotations

import functools
import gc

import torch
from torch import nn

import meshzero
from tests.distributed import run_distributed
from tests.engine_runs import zero_config
from tests.models import Block


class TiedOdd(nn.Module):
    """Odd widths; the head tied to an embedding of about four blocks' bytes."""

    def __init__(self, vocab: int, dim: int, hidden: int, blocks: int) -> None:
        super().__init__()
        self.embed = nn.Embedding(vocab, dim)
        self.blocks = nn.ModuleList(Block(dim, hidden) for _ in range(blocks))
        self.norm = nn.LayerNorm(dim)
        self.head = nn.Linear(dim, vocab, bias=False)
        self.head.weight = self.embed.weight

    def forward(self, idx: torch.Tensor) -> torch.Tensor:
        x = self.embed(idx)
        for block in self.blocks:
            x = block(x)
        return self.head(self.norm(x))


def _status(key: str) -> int:
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith(key + ":"):
                return int(line.split()[1]) * 1024
    raise RuntimeError(f"{key} not in /proc/self/status")


def _peak_beyond_states(rank: int, world_size: int, shape: tuple[int, int, int, int]
                        ) -> tuple[int, int, int]:
    """(peak RSS growth while building, model-state bytes held after, one block's bytes)."""
    cfg = zero_config(3, global_batch=world_size, seed=0)
    # the first engine's imports (torch._dynamo, meshzero's modules) whatever the model
    meshzero.initialize(model=functools.partial(TiedOdd, 8, 3, 5, 2), config=cfg)[0].close()
    gc.collect()
    with open("/proc/self/clear_refs", "w") as f:
        f.write("5")  # VmHWM := VmRSS
    base = _status("VmRSS")
    engine = meshzero.initialize(model=functools.partial(TiedOdd, *shape), config=cfg)[0]
    peak = _status("VmHWM") - base
    report = engine.memory_report()
    states = sum(sum(report[k].values()) for k in ("params", "master_params", "grads",
                                                   "optimizer_states") if k in report)
    unit = 4 * sum(p.numel() for p in engine.module.blocks[0].parameters())
    engine.close()
    return peak, states, unit


def test_tied_embedding_of_four_blocks_builds_within_two_units(tmp_path):
    """8,009 x 251 tied embedding (4.0 blocks' bytes, the root unit), 6 blocks of
    LayerNorm, Linear(251, 1,003), GELU, Linear(1,003, 251): before, the root was built
    after the blocks and the peak was the shards plus the root (3.95-4.0 units measured;
    after: 0.99-1.06)."""
    results = run_distributed(_peak_beyond_states, 2, tmp_path, (8009, 251, 1003, 6),
                              timeout=240)
    for peak, states, unit in results:
        assert states > 4 * unit  # the states are counted, not zero
        assert (peak - states) / unit <= 2.0, [(p - s) / u for p, s, u in results]

"""``deepspeed.runtime.dataloader``: DeepSpeed's loader classes over meshzero's
(:mod:`meshzero.data.loader`)."""

from __future__ import annotations

from collections.abc import Callable, Iterable
from typing import Any

import torch
from torch.utils.data import RandomSampler, Sampler
from torch.utils.data.distributed import DistributedSampler

from meshzero.data.loader import DistributedLoader, Repeating


class RepeatingLoader(Repeating):
    """DeepSpeed's `deepspeed.utils.RepeatingLoader`: `meshzero.data.Repeating`, endless.

    An iterator that restarts ``loader`` when it ends (an empty loader stops)."""

    def __init__(self, loader: Iterable[Any]):
        """DeepSpeed's `RepeatingLoader(loader)`: wraps any iterable (a DataLoader, a list)."""
        super().__init__(loader)


class DeepSpeedDataLoader:
    """DeepSpeed's `deepspeed.runtime.dataloader.DeepSpeedDataLoader`: a DistributedLoader.

    meshzero's `meshzero.data.DistributedLoader` with DeepSpeed's sampler choice; the
    engine's own loader is `engine.data_loader` / `initialize(training_data=...)`."""

    def __init__(self, dataset: Any, batch_size: int, pin_memory: bool, local_rank: int,
                 tput_timer: Any, collate_fn: Callable | None = None,
                 num_local_io_workers: int | None = None, data_sampler: Sampler | None = None,
                 data_parallel_world_size: int | None = None,
                 data_parallel_rank: int | None = None, dataloader_drop_last: bool = False,
                 deepspeed_dataloader_config: dict | None = None):
        """DeepSpeed's `DeepSpeedDataLoader(...)`: every argument honoured.

        With ``local_rank >= 0`` a DistributedSampler over
        ``data_parallel_world_size`` ranks (default: the world), else a RandomSampler over
        ``batch_size`` x the visible GPUs; ``data_sampler`` replaces either. Curriculum
        learning (``deepspeed_dataloader_config``) is refused."""
        if deepspeed_dataloader_config and deepspeed_dataloader_config.get(
                "curriculum_learning"):
            raise NotImplementedError("DeepSpeedDataLoader with curriculum_learning is not "
                                      "supported: build the sampler yourself and pass it as "
                                      "data_sampler")
        device_count = 1
        if data_sampler is None and local_rank >= 0:
            data_sampler = DistributedSampler(dataset, num_replicas=data_parallel_world_size,
                                              rank=data_parallel_rank)
        elif local_rank < 0:
            device_count = max(1, torch.cuda.device_count())
            data_sampler = data_sampler or RandomSampler(dataset)
        assert data_sampler is not None  # one of the branches above chose one
        workers = 2 * device_count if num_local_io_workers is None else num_local_io_workers
        self.tput_timer = tput_timer
        self.batch_size = batch_size * (device_count if local_rank < 0 else 1)
        self.data_sampler = data_sampler
        self.dataset, self.collate_fn, self.pin_memory = dataset, collate_fn, pin_memory
        self.dataloader_drop_last = dataloader_drop_last
        self.post_process_func: Callable | None = None
        self.loader = DistributedLoader(dataset, self.batch_size, sampler=data_sampler,
                                        collate_fn=collate_fn, drop_last=dataloader_drop_last,
                                        num_workers=workers, pin_memory=pin_memory)
        self.data: Any = None

    def __len__(self) -> int:
        """DeepSpeed's `DeepSpeedDataLoader.__len__`: batches in one pass."""
        return len(self.loader)

    def __iter__(self) -> DeepSpeedDataLoader:
        """DeepSpeed's `DeepSpeedDataLoader.__iter__`: starts a pass and returns itself."""
        self.data = iter(self.loader)
        return self

    def __next__(self) -> Any:
        """DeepSpeed's `DeepSpeedDataLoader.__next__`: the next batch (``tput_timer.start()``
        first, when one was given)."""
        if self.tput_timer is not None:
            self.tput_timer.start()
        if self.data is None:
            self.data = iter(self.loader)
        return next(self.data)

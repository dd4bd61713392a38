"""The distributed loader ``initialize(training_data=...)`` returns.

Each data-parallel rank reads its own part of the dataset: a ``DistributedSampler`` over the
data-parallel ranks (tensor-, pipeline- and sequence-parallel ranks of one replica read the
same samples), ``micro batch`` samples per batch. As DeepSpeed's ``deepspeed_io`` (the
sampler shuffles, seeded; drop_last from ``dataloader_drop_last``), with two differences: the
sampler's epoch advances with each pass over the data (DeepSpeed's loader never sets it, so
every epoch repeats one order), and batches are read in the training process (no worker
processes), which a process group makes the safe default.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Iterator
from typing import Any

from torch.utils.data import DataLoader, Dataset, IterableDataset, RandomSampler, Sampler
from torch.utils.data.distributed import DistributedSampler


class DistributedLoader:
    """Batches of ``batch_size`` samples of ``dataset`` in the order of ``sampler``; each
    ``iter()`` is one pass (one epoch: ``set_epoch`` on a sampler that has it)."""

    def __init__(self, dataset: Dataset, batch_size: int, *, sampler: Sampler,
                 collate_fn: Callable | None = None, drop_last: bool = False,
                 num_workers: int = 0, pin_memory: bool = False):
        if isinstance(batch_size, bool) or not isinstance(batch_size, int) or batch_size < 1:
            raise ValueError(f"batch_size must be a positive integer, got {batch_size!r}")
        self.dataset, self.batch_size, self.sampler = dataset, batch_size, sampler
        self.collate_fn, self.drop_last = collate_fn, drop_last
        self.epoch = 0
        kwargs: dict[str, Any] = {} if collate_fn is None else {"collate_fn": collate_fn}
        self.loader = DataLoader(dataset, batch_size=batch_size, sampler=sampler,
                                 drop_last=drop_last, num_workers=num_workers,
                                 pin_memory=pin_memory, **kwargs)

    def __len__(self) -> int:
        return len(self.loader)

    def __iter__(self) -> Iterator[Any]:
        set_epoch = getattr(self.sampler, "set_epoch", None)
        if set_epoch is not None:
            set_epoch(self.epoch)
        self.epoch += 1
        return iter(self.loader)


class Repeating:
    """An endless iterator over ``loader``: a new pass starts when one ends (an empty loader
    raises StopIteration instead of looping)."""

    def __init__(self, loader: Iterable[Any]):
        self.loader = loader
        self.data_iter = iter(loader)

    def __iter__(self) -> Repeating:
        return self

    def __next__(self) -> Any:
        try:
            return next(self.data_iter)
        except StopIteration:
            self.data_iter = iter(self.loader)
            return next(self.data_iter)


def loader_batch_size(training_data: Any) -> int | None:
    """The batch size a torch DataLoader given as training_data carries (None: a Dataset)."""
    if not isinstance(training_data, DataLoader):
        return None
    size = training_data.batch_size
    if size is None:
        raise ValueError("training_data is a DataLoader with batch_size None (a batch_sampler): "
                         "give it a batch_size, or pass its Dataset")
    return size


def training_loader(training_data: Any, *, micro_batch: int, dp_rank: int, dp_size: int,
                    collate_fn: Callable | None = None, drop_last: bool = False,
                    shuffle: bool = True, seed: int = 0, pin_memory: bool = False,
                    sampler: Sampler | None = None) -> DistributedLoader:
    """The loader over ``training_data`` (a map-style Dataset, or a DataLoader whose
    dataset, collate_fn and shuffling are kept) for data-parallel rank ``dp_rank``; a
    ``sampler`` given replaces the DistributedSampler."""
    dataset = training_data
    if isinstance(training_data, DataLoader):
        dataset = training_data.dataset
        collate_fn = collate_fn or training_data.collate_fn
        shuffle = isinstance(training_data.sampler, RandomSampler)
        drop_last = drop_last or training_data.drop_last
    if isinstance(dataset, IterableDataset) or not isinstance(dataset, Dataset) or \
            not hasattr(dataset, "__len__"):
        raise ValueError(f"training_data must be a map-style torch Dataset (with __len__) or a "
                         f"DataLoader over one, got {type(training_data).__name__}: a sampler "
                         "cannot split an iterable dataset over the data-parallel ranks; "
                         "shard it yourself and pass batches to the engine")
    if sampler is None:
        sampler = DistributedSampler(dataset, num_replicas=dp_size, rank=dp_rank,
                                     shuffle=shuffle, seed=seed, drop_last=drop_last)
    return DistributedLoader(dataset, micro_batch, sampler=sampler, collate_fn=collate_fn,
                             drop_last=drop_last, pin_memory=pin_memory)

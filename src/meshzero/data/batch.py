"""The batch numbers an engine trains with: train_batch_size = micro batch x gradient
accumulation steps x data-parallel size. With an ``"auto"`` micro batch that nothing in the
config gives, the micro batch is pending until the data says it: the batch size of a
DataLoader given as ``training_data``, else the leading dimension of the first batch the
engine's forward sees (one INFO line). Until then the numbers that depend on it raise."""

from __future__ import annotations

import logging
from typing import Any

import torch

from meshzero.config.schema import Config, pending_micro_batch_message
from meshzero.data.loader import loader_batch_size

logger = logging.getLogger(__name__)


class BatchSizes:
    """(train_batch_size, micro batch per rank, accumulation steps) for ``dp_size`` ranks;
    ``micro`` and ``global_batch`` None while the micro batch is pending."""

    def __init__(self, global_batch: int | None, micro: int | None, accumulation: int,
                 dp_size: int):
        self._global, self._micro = global_batch, micro
        self.accumulation, self.dp_size = accumulation, dp_size

    @property
    def pending(self) -> bool:
        return self._micro is None

    @property
    def global_batch(self) -> int:
        if self._global is None:
            raise ValueError(pending_micro_batch_message(False))
        return self._global

    @property
    def micro(self) -> int:
        if self._micro is None:
            raise ValueError(pending_micro_batch_message(False))
        return self._micro

    def resolve(self, micro: int, source: str) -> tuple[int, int, int]:
        """Fix the pending micro batch at ``micro`` (taken from ``source``)."""
        if isinstance(micro, bool) or not isinstance(micro, int) or micro < 1:
            raise ValueError(f"cannot take the micro batch from {source}: {micro!r} is not a "
                             "positive integer; give train_micro_batch_size_per_gpu a number")
        self._micro, self._global = micro, micro * self.accumulation * self.dp_size
        logger.info('"auto" train_micro_batch_size_per_gpu = %d, from %s: train_batch_size = '
                    "%d (x %d accumulation steps x %d data-parallel ranks)", micro, source,
                    self._global, self.accumulation, self.dp_size)
        return self._global, micro, self.accumulation

    def set_train_batch_size(self, train_batch_size: int) -> tuple[int, int, int]:
        """DeepSpeed's rule: the micro batch stays, the accumulation steps change."""
        per_step = self.micro * self.dp_size
        if isinstance(train_batch_size, bool) or not isinstance(train_batch_size, int) or \
                train_batch_size < 1 or train_batch_size % per_step:
            raise ValueError(
                f"train_batch_size ({train_batch_size!r}) must be a positive multiple of "
                f"train_micro_batch_size_per_gpu ({self.micro}) * data-parallel size "
                f"({self.dp_size}) = {per_step}: the micro batch stays, the gradient "
                "accumulation steps change")
        self._global, self.accumulation = train_batch_size, train_batch_size // per_step
        return self._global, self.micro, self.accumulation


def micro_batch_from_data(config: Config, training_data: Any) -> Config:
    """At initialize: a pending "auto" micro batch is training_data's batch size when it is
    a DataLoader; a Dataset has none, and is refused."""
    if not config.micro_batch_pending or training_data is None:
        return config
    size = loader_batch_size(training_data)
    if size is None:
        raise ValueError('train_micro_batch_size_per_gpu is "auto" and training_data is a '
                         "Dataset, which has no batch size to take it from: give "
                         "train_micro_batch_size_per_gpu a number, or pass training_data as a "
                         "torch DataLoader (its batch_size is the micro batch)")
    logger.info('"auto" train_micro_batch_size_per_gpu = %d, from training_data\'s batch_size',
                size)
    return config.with_micro_batch(size)


def leading_dim(args: tuple, kwargs: dict[str, Any]) -> int:
    """The leading dimension of the first tensor among a forward's arguments."""
    tensor = first_tensor(args)
    if tensor is None:
        tensor = first_tensor(kwargs)
    if tensor is None or tensor.dim() == 0:
        raise ValueError('train_micro_batch_size_per_gpu is "auto" and the first batch '
                         "engine(...) sees holds no tensor with a batch dimension to take it "
                         "from; give train_micro_batch_size_per_gpu a number")
    return int(tensor.shape[0])


def first_tensor(value: Any) -> torch.Tensor | None:
    """The first tensor in ``value`` (a tensor, or nested tuples, lists and dicts)."""
    if isinstance(value, torch.Tensor):
        return value
    items = value.values() if isinstance(value, dict) else value
    if isinstance(items, (list, tuple)) or isinstance(value, dict):
        for item in items:
            found = first_tensor(item)
            if found is not None:
                return found
    return None

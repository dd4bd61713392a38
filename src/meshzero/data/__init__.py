"""Data for training: the distributed loader ``initialize(training_data=...)`` builds, and the
batch numbers the engine holds (with an ``"auto"`` micro batch taken from the data).

    loader.py   DistributedLoader over the data-parallel ranks; Repeating (restarts a loader)
    batch.py    BatchSizes: train_batch_size, micro batch, accumulation; pending until known
    window.py   the Engine's accumulation window: boundary, no_sync, set_train_batch_size,
                the loader of initialize(training_data=...)
"""

from meshzero.data.batch import BatchSizes, leading_dim, micro_batch_from_data
from meshzero.data.loader import DistributedLoader, Repeating, training_loader

__all__ = ["BatchSizes", "DistributedLoader", "Repeating", "leading_dim", "micro_batch_from_data",
           "training_loader"]

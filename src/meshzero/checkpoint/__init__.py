"""Checkpoints and whole-model weight files, behind one seam: every function takes a
:class:`TrainingState` (module, ZeRO state, optimizer, scheduler, scaler, topology, step
counters), never the engine.

    atomic.py       crash-safe writes: temporary, fsync, rename; file sets by a journal
    format.py       the on-disk format: keys, manifests, atomic commit, CheckpointReader
    tags.py         a tag directory put back in order after a killed save
    model_files.py  Hugging Face model files: model.safetensors, shards + index, reading
    mesh.py         which ranks write which files on a (pp, dp, tp) mesh; agreement
    state.py        optimizer, scheduler, RNG and model names, captured and restored
    sharded.py      save_checkpoint / load_checkpoint (any dp size and stage on load)
    weights.py      consolidate, save_16bit_model, load_weights
    training.py     TrainingState and StepCounters: the seam
"""

from meshzero.checkpoint.sharded import load_checkpoint, save_checkpoint
from meshzero.checkpoint.training import StepCounters, TrainingState
from meshzero.checkpoint.weights import consolidate, load_weights, save_16bit_model

__all__ = ["StepCounters", "TrainingState", "consolidate", "load_checkpoint", "load_weights",
           "save_16bit_model", "save_checkpoint"]

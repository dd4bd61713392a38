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
    client_state.py client_state without pickle: tagged JSON + client_state.safetensors
    export.py       a tag's whole tensors in one process (TagTensors), consolidate
    weights.py      save_16bit_model, consolidated_state_dict, load_weights
    training.py     TrainingState and StepCounters: the seam
    methods.py      the engine's checkpoint methods (a mixin of Engine)
"""

from meshzero.checkpoint.export import TagTensors, consolidate
from meshzero.checkpoint.sharded import (
    LoadOptions,
    frozen_names,
    load_checkpoint,
    save_checkpoint,
)
from meshzero.checkpoint.training import StepCounters, TrainingState
from meshzero.checkpoint.weights import (
    consolidated_state_dict,
    load_weights,
    save_16bit_model,
)

__all__ = ["LoadOptions", "StepCounters", "TagTensors", "TrainingState", "consolidate",
           "consolidated_state_dict", "frozen_names", "load_checkpoint", "load_weights",
           "save_16bit_model", "save_checkpoint"]

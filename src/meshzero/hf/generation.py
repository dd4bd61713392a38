"""``model.generate`` on a stage-3 engine's model, and the Trainer's ``unwrap_model``.

At stage 3 each forward gathers every unit and releases it after use; ``generate`` runs one
forward per new token, so left alone it would all-gather the whole model once per token (and
every rank would have to run the same number of forwards: ``synced_gpus``). DeepSpeed's hybrid
engine and TRL's ``unwrap_model_for_generation`` (``trl/models/utils.py``, with
``ds3_gather_for_generation``, its default) gather every parameter once for the whole
generation instead. :func:`wrap_generate` does the same for ``engine.module.generate``:

    "once"      all units gathered on entry (one all-gather per unit), released on exit; no
                collective while tokens are produced, so ranks may stop at different lengths
    "per_unit"  the forward hooks gather each unit per token; ``synced_gpus=True`` keeps the
                ranks in step (a rank that finished runs dummy forwards)

"once" is chosen unless ``gather`` says otherwise (TRL's ``ds3_gather_for_generation=False``)
or the full model does not fit the memory free on the device (host memory on CPU); an INFO
line says which was chosen and why. benchmarks/hf_generation.py measures the two.
"""

from __future__ import annotations

import functools
import logging
import os
from collections.abc import Callable
from typing import Any

import torch
from torch import nn

import meshzero

logger = logging.getLogger(__name__)

HEADROOM = 0.8  # of the free memory the gathered model may take


def gathered_bytes(engine: meshzero.Engine) -> int:
    """Bytes of the full parameters of every stage-3 unit (what gathering all adds)."""
    sharder = engine.zero.sharder
    if sharder is None:
        return 0
    return sum(g.full_nbytes for unit in sharder.units for g in unit)


def free_bytes(device: torch.device) -> int:
    """Memory free now: on a CUDA device ``mem_get_info``, else the host's available memory
    (``MemAvailable`` of /proc/meminfo; free pages where there is none)."""
    if device.type == "cuda":
        return int(torch.cuda.mem_get_info(device)[0])
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    return os.sysconf("SC_AVPHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")


def choose_mode(engine: meshzero.Engine, gather: bool | None = None) -> tuple[str, str]:
    """("once" or "per_unit", why) for generation on ``engine``'s model."""
    if engine.zero_stage < 3:
        return "once", "stages 0-2 hold full parameters"
    if gather is False:
        return "per_unit", "gathering for generation is turned off (ds3_gather_for_generation)"
    need, free = gathered_bytes(engine), free_bytes(engine.device)
    if need > HEADROOM * free:
        return "per_unit", (f"the full model ({need / 2**20:.1f} MiB) does not fit "
                            f"{HEADROOM:.0%} of the free {engine.device.type} memory "
                            f"({free / 2**20:.1f} MiB)")
    return "once", f"the full model ({need / 2**20:.1f} MiB) fits the free memory"


def wrap_generate(engine: meshzero.Engine, gather: bool | None = None) -> str:
    """Make ``engine.module.generate`` work at stage 3 as the module docstring says (an
    instance attribute over the model's method); returns the mode chosen."""
    module = engine.module
    original = getattr(module, "generate", None)
    if original is None or engine.zero_stage < 3:
        return "once"
    original = getattr(original, "meshzero_original", original)  # wrapped before: the model's
    mode, why = choose_mode(engine, gather)
    logger.info("generate at ZeRO stage 3: parameters gathered %s (%s)",
                "once for each generate call" if mode == "once" else "unit by unit per token",
                why)
    setattr(module, "generate", _generate(engine, original, mode))  # noqa: B010 - for mypy
    return mode


def _generate(engine: meshzero.Engine, original: Callable, mode: str) -> Callable:
    @functools.wraps(original)
    def generate(*args: Any, **kwargs: Any) -> Any:
        if mode == "per_unit":
            kwargs.setdefault("synced_gpus", engine.dp_comm.size > 1)
            return original(*args, **kwargs)
        with torch.no_grad(), engine.gathered(list(engine.module.parameters())):
            return original(*args, **kwargs)

    generate.meshzero_original = original  # type: ignore[attr-defined]
    generate.meshzero_mode = mode  # type: ignore[attr-defined]
    return generate


def attach(trainer: Any, engine: meshzero.Engine) -> None:
    """The Trainer's view of the engine: ``accelerator.unwrap_model(engine)`` is the model
    (TRL unwraps ``model_wrapped`` to generate and to switch adapters), and ``generate``
    works at stage 3 (``ds3_gather_for_generation`` from TRL's arguments, when present)."""
    accelerator = trainer.accelerator
    unwrap = accelerator.unwrap_model

    @functools.wraps(unwrap)
    def unwrap_model(model: nn.Module, *args: Any, **kwargs: Any) -> nn.Module:
        return unwrap(engine.module if model is engine else model, *args, **kwargs)

    accelerator.unwrap_model = unwrap_model
    wrap_generate(engine, getattr(trainer.args, "ds3_gather_for_generation", None))

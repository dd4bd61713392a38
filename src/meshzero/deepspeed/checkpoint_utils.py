"""DeepSpeed's ``deepspeed.checkpoint.utils`` helper that real code imports (through
``deepspeed.utils``): copies of tensors that own their storage, ready to be saved."""

from __future__ import annotations

from typing import Any

import torch

__all__ = ["clone_tensors_for_torch_save"]


_CPU = torch.device("cpu")


def clone_tensors_for_torch_save(item: Any, device: torch.device | str = _CPU) -> Any:
    """DeepSpeed's `deepspeed.checkpoint.utils.clone_tensors_for_torch_save`: tensor copies.

    A copy of ``item`` with every tensor (nested in lists, tuples, dicts) detached and
    copied to ``device`` (default the CPU): each tensor owns its storage (a view of a larger
    buffer, e.g. a ZeRO flat buffer, no longer drags the whole buffer along); containers
    keep their type (an OrderedDict stays one); anything else is returned as it is.
    meshzero's own files are safetensors: pass the result to ``safetensors.torch.save_file``
    or ``engine.save_checkpoint(client_state=...)`` rather than ``torch.save``.
    """
    target = torch.device(device)
    if isinstance(item, torch.Tensor):
        out = item.detach()
        return out.clone() if out.device == target else out.to(target)
    if isinstance(item, list):
        return [clone_tensors_for_torch_save(v, target) for v in item]
    if isinstance(item, tuple):
        return type(item)(*(clone_tensors_for_torch_save(v, target) for v in item)) \
            if hasattr(item, "_fields") else tuple(clone_tensors_for_torch_save(v, target)
                                                   for v in item)
    if isinstance(item, dict):
        return type(item)({k: clone_tensors_for_torch_save(v, target) for k, v in item.items()})
    return item

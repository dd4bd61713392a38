"""Ulysses for Hugging Face models: the attention function ``meshzero_ulysses`` in
transformers' registry (``AttentionInterface``), chosen with ``attn_implementation``.

The function runs torch's SDPA over the whole sequence on this rank's heads between the two
all-to-alls of the engine's :class:`~meshzero.parallel.sequence.SequenceParallel`, which the
engine makes current for the length of its forward (:func:`active`). transformers builds no
mask for an implementation its mask registry does not know, so the model passes none:
attention is causal over whole sequences (padding goes at the end, with labels -100).
"""

from __future__ import annotations

import contextlib
import logging
from collections.abc import Iterator
from contextvars import ContextVar
from typing import TYPE_CHECKING, Any

import torch
import torch.nn.functional as F
from torch import nn

if TYPE_CHECKING:
    from meshzero.parallel.sequence import SequenceParallel

logger = logging.getLogger(__name__)

ATTN_IMPLEMENTATION = "meshzero_ulysses"
_current: ContextVar[SequenceParallel | None] = ContextVar("meshzero_sp", default=None)


@contextlib.contextmanager
def active(sp: SequenceParallel) -> Iterator[None]:
    """Inside: ``meshzero_ulysses`` attention runs over ``sp``."""
    token = _current.set(sp)
    try:
        yield
    finally:
        _current.reset(token)


def ulysses_attention_forward(module: nn.Module, query: torch.Tensor, key: torch.Tensor,
                              value: torch.Tensor, attention_mask: torch.Tensor | None,
                              dropout: float = 0.0, scaling: float | None = None,
                              is_causal: bool | None = None, **kwargs: Any
                              ) -> tuple[torch.Tensor, None]:
    """transformers' attention-function signature: q (B, H, T/sp, D), k and v (B, Hkv,
    T/sp, D) -> ((B, T/sp, H, D), None)."""
    sp = _current.get()
    where = f"{type(module).__name__} (attn_implementation {ATTN_IMPLEMENTATION!r})"
    if sp is None:
        raise ValueError(f"{where} runs only inside a meshzero engine's forward with "
                         "sequence_parallel_size > 1")
    if attention_mask is not None:
        raise ValueError(f"{where}: an attention mask under sequence parallelism is not "
                         "supported; pad at the end with labels -100 and pass no mask")
    causal = is_causal if is_causal is not None else getattr(module, "is_causal", True)

    def attend(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        return F.scaled_dot_product_attention(q, k, v, dropout_p=dropout, is_causal=causal,
                                              scale=scaling, enable_gqa=q.shape[1] != k.shape[1])

    out = sp.attention(query, key, value, attend, where)  # (B, H, T/sp, D)
    return out.transpose(1, 2).contiguous(), None


def use_ulysses(model: nn.Module) -> bool:
    """Register ``meshzero_ulysses`` and switch a transformers model to it; False for a model
    without transformers' attention registry (plain PyTorch: SDPA is routed instead)."""
    config: Any = getattr(model, "config", None)
    switch: Any = getattr(model, "set_attn_implementation", None)
    if not hasattr(config, "_attn_implementation") or not callable(switch):
        return False
    try:  # a model with transformers' attention switch: transformers is installed
        from transformers import AttentionInterface
    except ImportError:
        return False

    AttentionInterface.register(ATTN_IMPLEMENTATION, ulysses_attention_forward)
    if config._attn_implementation != ATTN_IMPLEMENTATION:
        logger.info("sequence parallelism: attn_implementation %r -> %r (torch SDPA between "
                    "the all-to-alls)", config._attn_implementation, ATTN_IMPLEMENTATION)
        switch(ATTN_IMPLEMENTATION)
    return True


def gather_batch(inputs: dict[str, Any], sp: SequenceParallel) -> dict[str, Any]:
    """The micro-batches of every rank of ``sp``'s group as one, concatenated along the batch
    in rank order (the Trainer's loader gives each rank its own): sequences right-padded to
    the longest, rounded up to a multiple of sp (labels -100, attention_mask 0, ids 0)."""
    tensors = {k: v for k, v in inputs.items() if isinstance(v, torch.Tensor) and v.dim() >= 2}
    if not tensors:
        return inputs
    first = next(iter(tensors.values()))
    shape = sp.all_gather(torch.tensor([first.shape[:2]], device=first.device))
    if bool((shape[:, 0] != shape[0, 0]).any()):
        raise ValueError(f"sequence parallelism: the ranks of an sp group hold micro-batches "
                         f"of {shape[:, 0].tolist()} samples; they must hold the same number "
                         "(set dataloader_drop_last=True)")
    length = int(shape[:, 1].max())
    length = -(-length // sp.size) * sp.size
    out = dict(inputs)
    for key, value in tensors.items():
        if value.shape[1] == first.shape[1]:
            fill = -100 if key in ("labels", "shift_labels") else 0
            value = F.pad(value, (0, 0) * (value.dim() - 2) + (0, length - value.shape[1]),
                          value=fill)
        out[key] = sp.all_gather(value)
    return out

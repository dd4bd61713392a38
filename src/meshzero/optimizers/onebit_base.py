"""What the 1-bit family (1-bit Adam, 0/1 Adam, 1-bit LAMB) shares: the data-parallel
communicator and the engine's switch for local gradients (``bind``), the error-feedback
buffers (restarted after a checkpoint load, as DeepSpeed drops them), and the refusal of
DeepSpeed's ``exp_avg_mask`` group key. Each optimizer says when it wants each rank's
gradient left unreduced (``wants_local_gradients``)."""

from __future__ import annotations

from collections.abc import Callable, Hashable, Iterable
from typing import Any

import torch

from meshzero.comm.communicator import Communicator
from meshzero.comm.compressed import ErrorFeedback


def check_group_keys(param_groups: list[dict[str, Any]], name: str) -> None:
    """DeepSpeed's ``exp_avg_mask`` param-group key: a tensor with one element per element
    of the group's parameters (in their order; DeepSpeed's has the shape of the group's one
    parameter), multiplied into what each compressed all-reduce gives for the group (see
    :func:`apply_mask`). 1-bit Adam's ``non_freeze`` is refused. All problems in one
    error."""
    problems = [f"param group {i}: 'non_freeze' is not supported (every group's momentum "
                "is compressed after the warm-up; DeepSpeed's 1-bit Adam would all-reduce "
                "this group's gradients in full): drop the key"
                for i, group in enumerate(param_groups) if group.get("non_freeze")]
    for i, group in enumerate(param_groups):
        mask = group.get("exp_avg_mask")
        if mask is None:
            continue
        numel = sum(p.numel() for p in group["params"])
        if not isinstance(mask, torch.Tensor):
            problems.append(f"param group {i}: exp_avg_mask is a {type(mask).__name__}, "
                            "not a tensor")
        elif mask.numel() != numel:
            problems.append(f"param group {i}: exp_avg_mask has {mask.numel()} elements, "
                            f"its parameters {numel}")
    if problems:
        raise ValueError(f"{name}: " + "; ".join(problems) + " (the mask needs one element "
                         "per element of the group's parameters, in their order)")


def apply_mask(group: dict[str, Any], params: list[torch.Tensor],
               tensors: list[torch.Tensor]) -> None:
    """``tensors`` (one per parameter of ``params``, all in ``group``) times their elements
    of the group's ``exp_avg_mask``, if it has one. DeepSpeed multiplies the mask into the
    result of each compressed all-reduce (``OnebitAdam.step``, ``OnebitLamb.step``,
    ``ZeroOneAdam.step``): 1-bit signs cannot carry an exact zero, so elements no batch
    reaches (position embeddings past the sequence length) would drift."""
    mask = group.get("exp_avg_mask")
    if mask is None:
        return
    flat, offsets, at = mask.reshape(-1), {}, 0
    for p in group["params"]:
        offsets[id(p)] = at
        at += p.numel()
    for p, t in zip(params, tensors, strict=True):
        a = offsets[id(p)]
        t.mul_(flat[a:a + p.numel()].view_as(t).to(t.device, t.dtype))


def closure_loss(closure: Callable[[], Any] | None) -> Any:
    """``step(closure)``'s loss: the closure run with gradients on (torch's convention)."""
    if closure is None:
        return None
    with torch.enable_grad():
        return closure()


class CompressingOptimizer(torch.optim.Optimizer):
    """A torch optimizer that sends its momentum, 1-bit compressed, instead of letting the
    engine all-reduce the gradients (after its warm-up)."""

    def __init__(self, params: Iterable[Any], defaults: dict[str, Any], name: str,
                 amsgrad: bool):
        if amsgrad:
            raise ValueError(f"{name} has no AMSGrad variant (amsgrad must be false)")
        super().__init__(params, defaults)
        check_group_keys(self.param_groups, name)
        self.comm: Communicator | None = None  # the data-parallel group (bind)
        self._keep_local: Callable[[bool], None] = lambda on: None
        # ("group", index) or ("param", id(p)) -> its errors (see flat_groups)
        self._errors: dict[Hashable, ErrorFeedback] = {}
        self.flat_groups = False  # a group's momenta as one vector (fp16/bf16), else each

    def wants_local_gradients(self) -> bool:
        """Whether the next step's gradients stay on their rank."""
        raise NotImplementedError

    def bind(self, comm: Communicator, keep_gradients_local: Callable[[bool], None],
             flat_groups: bool = False) -> None:
        """``comm``: the data-parallel communicator; ``keep_gradients_local(on)``: whether
        the engine leaves each rank's gradient unreduced; ``flat_groups``: compress a param
        group's momenta as one vector (DeepSpeed under fp16/bf16) rather than each
        parameter's on its own (DeepSpeed in fp32); 1-bit LAMB always compresses all
        momenta as one."""
        self.comm, self._keep_local, self.flat_groups = comm, keep_gradients_local, flat_groups
        keep_gradients_local(self.wants_local_gradients())

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        super().load_state_dict(state_dict)
        self.state_loaded()

    def state_loaded(self) -> None:
        """After a checkpoint load: the errors restart from zero (DeepSpeed drops them on
        load too) and the engine's gradients follow the loaded step count."""
        self._errors.clear()
        self._keep_local(self.wants_local_gradients())


class FreezingOptimizer(CompressingOptimizer):
    """1-bit Adam and 1-bit LAMB: full-precision gradients until ``freeze_step``, the
    compressed momentum after it."""

    freeze_step: int

    @property
    def compressing(self) -> bool:
        """Past the warm-up: the momentum crosses the group in 1 bit per element. DeepSpeed
        checks ``step >= freeze_step`` after each step but the first (state only): the
        next step compresses."""
        steps = [int(s["step"]) for s in self.state.values() if s]
        return bool(steps) and max(steps) >= max(self.freeze_step, 2)

    def wants_local_gradients(self) -> bool:
        return self.compressing

"""FLOPs measured at the dispatch level, attributed to the module tree, by phase.

Formulas come from ``torch.utils.flop_counter`` (matmul, conv, attention: what
``FlopCounterMode`` counts), plus the CPU attention kernels it does not register, so
``scaled_dot_product_attention`` counts on CPU too. Elementwise ops (norms, activations,
optimizer updates) and ZeRO's own copies and collectives have no formula and count zero.

Phases: ``forward``; ``backward``; ``recompute`` (forward ops executed during backward, i.e.
activation-checkpoint recomputation, which runs module forwards inside backward); ``step``.

Attribution: a module is *active* from its forward pre-hook to its forward hook, and in
backward from the moment its outputs' gradients are computed to the moment its inputs'
gradients are (multi-grad hooks, like ``torch.utils.module_tracker``). Every op counts for
every active module, so a module's count includes its descendants.
"""

from __future__ import annotations

from collections import Counter
from typing import Any

import torch
from torch import nn
from torch.autograd.graph import register_multi_grad_hook
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils.flop_counter import flop_registry, sdpa_backward_flop_count, sdpa_flop_count

aten = torch.ops.aten


def _sdpa_cpu_flops(query, key, value, *args, out_val=None, **kwargs) -> int:
    return sdpa_flop_count(query.shape, key.shape, value.shape)


def _sdpa_cpu_backward_flops(grad_out, query, key, value, *args, out_val=None, **kwargs) -> int:
    return sdpa_backward_flop_count(grad_out.shape, query.shape, key.shape, value.shape)


def _shape(x: Any) -> Any:
    if isinstance(x, torch.Tensor):
        return x.shape
    if isinstance(x, tuple | list):
        return [_shape(i) for i in x] if isinstance(x, list) else tuple(_shape(i) for i in x)
    return x


def _on_shapes(formula: Any) -> Any:
    """torch's formulas take shapes; its wrapper converts arguments with a pytree map, which
    costs more than the op on small tensors. The same conversion, without the pytree."""
    raw = getattr(formula, "__wrapped__", None)
    if raw is None:  # registered raw: it takes the tensors themselves
        return formula

    def on_shapes(*args: Any, out_val: Any = None, **kwargs: Any) -> int:
        return raw(*[_shape(a) for a in args], out_shape=_shape(out_val),
                   **{k: _shape(v) for k, v in kwargs.items()})
    return on_shapes


FORMULAS: dict[Any, Any] = {
    **{op: _on_shapes(f) for op, f in flop_registry.items()},
    aten._scaled_dot_product_flash_attention_for_cpu: _sdpa_cpu_flops,
    aten._scaled_dot_product_flash_attention_for_cpu_backward: _sdpa_cpu_backward_flops,
}

PHASES = ("forward", "backward", "recompute", "step")
_UNSEEN = object()
TOTAL, REPLICATED = "__total__", "__replicated__"  # counts keys beside module paths


def _tensors(obj: Any) -> list[torch.Tensor]:
    if isinstance(obj, torch.Tensor):
        return [obj] if obj.requires_grad else []
    if isinstance(obj, tuple | list):
        return [t for o in obj for t in _tensors(o)]
    if isinstance(obj, dict):
        return [t for o in obj.values() for t in _tensors(o)]
    return []


def on_first_grad(tensors: list[torch.Tensor], fn, handles: list[Any]) -> None:
    """``fn()`` when the first of ``tensors`` gets its gradient in a backward. One tensor
    (the usual module input or output) takes a plain tensor hook, much cheaper than a
    multi-grad hook: its gradient is computed once per backward."""
    if len(tensors) == 1:
        handles.append(tensors[0].register_hook(lambda _g: fn()))
    else:
        handles.append(register_multi_grad_hook(tensors, lambda _g: fn(), mode="any"))


class _CountingMode(TorchDispatchMode):
    """Runs every op and counts the FLOPs of those with a formula. Its cost is per op, on the
    host; the op itself runs as it would (asynchronously on CUDA)."""

    def __init__(self, counter: FlopCounter):
        super().__init__()
        self.counter = counter
        self.formulas: dict[int, Any] = {}
        self.seen: list[Any] = []

    @classmethod
    def _should_skip_dynamo(cls) -> bool:
        # torch otherwise wraps __torch_dispatch__ in a dynamo-disabling frame per op; nothing
        # is compiled here, and that frame costs more than counting
        return False

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        out = func(*args, **kwargs)
        # keyed by the overload's id (a long-lived singleton): hashing the op costs a call
        formula = self.formulas.get(id(func), _UNSEEN)
        if formula is _UNSEEN:
            formula = self.formulas[id(func)] = FORMULAS.get(func._overloadpacket)
            self.seen.append(func)  # keeps the id valid
        if formula is not None:
            self.counter.add(int(formula(*args, **kwargs, out_val=out)))
        return out


class FlopCounter:
    """Counts the FLOPs of ``root`` by phase and module while started; no hooks otherwise.

    ``counts[phase][path]`` are FLOPs (path ``""`` is the root, i.e. the whole model).
    ``replicated``: paths of modules every tensor-parallel rank runs whole (their FLOPs are
    also counted under ``REPLICATED``, so model FLOPs can count them once). ``called``: the
    paths whose forward ran; ``calls``: how many forwards ran. Counting costs a Python call
    per dispatched op: the engine counts in a step of its own, never in the timed one
    (docs/profiling.md); module times come from :class:`meshzero.profiling.marks.ModuleTimer`.
    """

    def __init__(self, root: nn.Module, replicated: frozenset[str] = frozenset()):
        self.root = root
        self.replicated = replicated
        self.paths = {m: p for p, m in root.named_modules()}
        self.counts: dict[str, Counter[str]] = {ph: Counter() for ph in PHASES}
        self.called: set[str] = set()
        self.calls = 0  # module forwards, recomputation included
        self.phase = "forward"
        self._active: dict[str, int] = {}  # path -> open scopes (only paths with some open)
        self._forward_depth = 0
        self._handles: list[Any] = []
        self._mode: _CountingMode | None = None

    # -- lifecycle -------------------------------------------------------------------------------
    def start(self) -> None:
        for module in self.paths:
            self._handles.append(module.register_forward_pre_hook(self._pre_forward))
            self._handles.append(module.register_forward_hook(self._post_forward, always_call=True))
        self._mode = _CountingMode(self)
        self._mode.__enter__()

    def stop(self) -> None:
        """Leave the dispatch mode and remove every hook."""
        if self._mode is not None:
            self._mode.__exit__(None, None, None)
            self._mode = None
        for h in self._handles:
            h.remove()
        self._handles.clear()
        self._active.clear()

    def set_phase(self, phase: str) -> None:
        """``forward`` / ``backward`` / ``step``; ends module scopes left open by backward."""
        self.end_backward()
        self.phase = phase

    def end_backward(self) -> None:
        """Close backward scopes still open when autograd returns: a module whose inputs need
        no grad never reports the end of its backward, which ends with autograd's."""
        self._active.clear()

    # -- counting ------------------------------------------------------------------------------
    def _current_phase(self) -> str:
        if self.phase == "backward" and self._forward_depth > 0:
            return "recompute"
        return self.phase

    def add(self, flops: int) -> None:
        counts = self.counts[self._current_phase()]
        counts[TOTAL] += flops
        replicated = False
        for path in self._active:
            counts[path] += flops
            replicated = replicated or path in self.replicated
        if replicated:  # inside a module every tp rank runs whole
            counts[REPLICATED] += flops

    def _enter(self, path: str) -> None:
        self._active[path] = self._active.get(path, 0) + 1

    def _exit(self, path: str) -> None:
        n = self._active.get(path, 0)
        if n > 1:
            self._active[path] = n - 1
        elif n == 1:
            del self._active[path]

    def _pre_forward(self, module: nn.Module, args) -> None:
        path = self.paths[module]
        self.called.add(path)
        self.calls += 1
        self._forward_depth += 1
        self._enter(path)
        inputs = _tensors(args)
        # backward scopes come from hooks set in the original forward; the recomputed graph
        # is consumed by the original one, so its own hooks are not needed
        if inputs and torch.is_grad_enabled() and self.phase != "backward":
            on_first_grad(inputs, lambda p=path: self._exit(p), self._handles)

    def _post_forward(self, module: nn.Module, args, output) -> None:
        path = self.paths[module]
        self._forward_depth -= 1
        self._exit(path)
        outputs = _tensors(output)
        if outputs and torch.is_grad_enabled() and self.phase != "backward":
            on_first_grad(outputs, lambda p=path: self._enter(p), self._handles)

    # -- results -------------------------------------------------------------------------------
    def total(self, phase: str) -> int:
        return self.counts[phase][TOTAL]

    def replicated_total(self, phase: str) -> int:
        """FLOPs of ``phase`` run inside a tp-replicated module (every tp rank runs them)."""
        return self.counts[phase][REPLICATED]

    def module_flops(self, phase: str, path: str) -> int:
        return self.counts[phase][path]

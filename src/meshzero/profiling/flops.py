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

import time
from collections import Counter, defaultdict
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


FORMULAS: dict[Any, Any] = {
    **flop_registry,
    aten._scaled_dot_product_flash_attention_for_cpu: _sdpa_cpu_flops,
    aten._scaled_dot_product_flash_attention_for_cpu_backward: _sdpa_cpu_backward_flops,
}

PHASES = ("forward", "backward", "recompute", "step")


def _tensors(obj: Any) -> list[torch.Tensor]:
    if isinstance(obj, torch.Tensor):
        return [obj] if obj.requires_grad else []
    if isinstance(obj, tuple | list):
        return [t for o in obj for t in _tensors(o)]
    if isinstance(obj, dict):
        return [t for o in obj.values() for t in _tensors(o)]
    return []


class Seconds(dict[str, float]):
    """Seconds per module path; a path never timed reads 0.0 without being added (as a
    Counter, whose values are typed int)."""

    def __missing__(self, key: str) -> float:
        return 0.0


class _CountingMode(TorchDispatchMode):
    def __init__(self, counter: FlopCounter):
        super().__init__()
        self.counter = counter

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        out = func(*args, **kwargs)
        formula = FORMULAS.get(func._overloadpacket)
        if formula is not None:
            self.counter.add(int(formula(*args, **kwargs, out_val=out)))
        return out


class FlopCounter:
    """Counts FLOPs and module latency of ``root`` while started; no hooks otherwise.

    ``counts[phase][path]`` are FLOPs (path ``""`` is the root, i.e. the whole model);
    ``latency[phase][path]`` seconds spent inside the module in that phase.
    """

    def __init__(self, root: nn.Module, sync=None):
        self.root = root
        self.sync = sync or (lambda: None)  # torch.cuda.synchronize on GPU
        self.paths = {m: p for p, m in root.named_modules()}
        self.counts: dict[str, Counter[str]] = {ph: Counter() for ph in PHASES}
        self.latency: dict[str, Seconds] = {ph: Seconds() for ph in PHASES}
        self.phase = "forward"
        self._active: Counter[str] = Counter()
        self._entered: dict[tuple[str, str], list[float]] = defaultdict(list)
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
        if self._mode is not None:
            self._mode.__exit__(None, None, None)
            self._mode = None
        for h in self._handles:
            h.remove()
        self._handles.clear()

    def set_phase(self, phase: str) -> None:
        """``forward`` / ``backward`` / ``step``; ends module scopes left open by backward."""
        self.end_backward()
        self.phase = phase

    def end_backward(self) -> None:
        """Close backward scopes still open when autograd returns: a module whose inputs need
        no grad never reports the end of its backward, which ends with autograd's."""
        self.sync()
        now = time.perf_counter()
        for (ph, path), starts in self._entered.items():
            if ph == "backward" and starts:
                self.latency[ph][path] += sum(now - t for t in starts)
        self._entered.clear()
        self._active.clear()

    # -- counting ------------------------------------------------------------------------------
    def _current_phase(self) -> str:
        if self.phase == "backward" and self._forward_depth > 0:
            return "recompute"
        return self.phase

    def add(self, flops: int) -> None:
        counts = self.counts[self._current_phase()]
        counts["__total__"] += flops
        for path, n in self._active.items():
            if n > 0:
                counts[path] += flops

    def _enter(self, phase: str, path: str) -> None:
        self._active[path] += 1
        self.sync()
        self._entered[(phase, path)].append(time.perf_counter())

    def _exit(self, phase: str, path: str) -> None:
        if self._active[path] > 0:
            self._active[path] -= 1
        starts = self._entered.get((phase, path))
        if starts:
            self.sync()
            self.latency[phase][path] += time.perf_counter() - starts.pop()

    def _pre_forward(self, module: nn.Module, args) -> None:
        path = self.paths[module]
        self._forward_depth += 1
        in_backward = self.phase == "backward"  # a module forward inside backward: recompute
        self._enter("recompute" if in_backward else "forward", path)
        inputs = _tensors(args)
        # backward scopes come from hooks set in the original forward; the recomputed graph
        # is consumed by the original one, so its own hooks are not needed
        if inputs and torch.is_grad_enabled() and not in_backward:
            self._handles.append(register_multi_grad_hook(
                inputs, lambda _g, p=path: self._exit("backward", p), mode="any"))

    def _post_forward(self, module: nn.Module, args, output) -> None:
        path = self.paths[module]
        self._forward_depth -= 1
        in_backward = self.phase == "backward"
        self._exit("recompute" if in_backward else "forward", path)
        outputs = _tensors(output)
        if outputs and torch.is_grad_enabled() and not in_backward:
            self._handles.append(register_multi_grad_hook(
                outputs, lambda _g, p=path: self._enter("backward", p), mode="any"))

    # -- results -------------------------------------------------------------------------------
    def total(self, phase: str) -> int:
        return self.counts[phase]["__total__"]

    def module_flops(self, phase: str, path: str) -> int:
        return self.counts[phase][path]


def measure_cpu_peak_flops(seconds: float = 0.2, n: int = 512) -> float:
    """FLOP/s of fp32 matmuls on this process's threads, measured once (a CPU 'peak')."""
    a, b = torch.randn(n, n), torch.randn(n, n)
    torch.mm(a, b)  # warm-up
    iters, t0 = 0, time.perf_counter()
    while time.perf_counter() - t0 < seconds:
        torch.mm(a, b)
        iters += 1
    return 2 * n**3 * iters / (time.perf_counter() - t0)


# Dense bf16 tensor-core peak FLOP/s per GPU (vendor datasheets, without sparsity).
GPU_PEAK_FLOPS = {
    "H200": 989e12, "H100": 989e12, "H800": 989e12, "GH200": 989e12, "A100": 312e12,
    "A800": 312e12, "L40S": 362e12, "L40": 181e12, "L4": 121e12, "A10": 125e12,
    "V100": 125e12, "B200": 2250e12, "MI300X": 1307e12, "MI250X": 383e12,
}


def device_peak_flops(device: torch.device, user_value: float | None) -> tuple[float, str]:
    """(peak FLOP/s of one rank's device, where the number comes from)."""
    if user_value is not None:
        return user_value, "config flops_profiler.peak_flops"
    if device.type == "cuda":
        name = torch.cuda.get_device_name(device)
        for key in sorted(GPU_PEAK_FLOPS, key=len, reverse=True):
            if key in name:
                return GPU_PEAK_FLOPS[key], f"datasheet bf16 peak of {key}"
        return float("nan"), f"unknown GPU {name!r}: set flops_profiler.peak_flops"
    return measure_cpu_peak_flops(), "fp32 matmul measured on this CPU"

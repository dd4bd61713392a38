"""Module times of the profiled step at the least host cost: marks, read once at its end.

A :class:`ModuleTimer` is built and its hooks registered *before* the timed step (at the end
of the FLOP-counting step, or at its start when one step does both), and armed for that step
only. In the step a hook does two things: append the module's tag to a list, and make a mark:

- CPU: ``time.perf_counter()`` appended to a list;
- CUDA: the next event of a pool created and recorded once beforehand (a CUDA event is
  created lazily on its first record, which is slow) is recorded on the compute stream,
  read once when the timer is built, not per mark.

Nothing waits until :meth:`ModuleTimer.read`, which waits once for the last mark and turns
pairs of marks into seconds. Forward marks are taken for every module; backward marks
(tensor hooks registered in forward, one per module output and input) only for
``backward_paths``, by default the top-level blocks (:func:`top_level_paths`), since a
backward mark costs a hook registration in forward as well as the mark itself.
"""

from __future__ import annotations

import time
from collections import defaultdict
from typing import Any, Protocol

import torch
from torch import nn

from meshzero.profiling.flops import PHASES, _tensors, on_first_grad

# tags: 4 * module index + kind (forward enter / exit, backward enter / exit); phases below 0
_FWD_IN, _FWD_OUT, _BWD_IN, _BWD_OUT = range(4)
_END_BACKWARD = -len(PHASES) - 1  # closes every backward scope still open


class Marks(Protocol):
    def mark(self) -> None:
        """Append a mark (the hot path: no waiting)."""
        ...

    def read(self) -> list[float]:
        """Seconds of every mark since the first; waits once for the last. Then empty."""
        ...


class CpuMarks:
    def __init__(self) -> None:
        self.times: list[float] = []

    def mark(self, _now=time.perf_counter) -> None:
        self.times.append(_now())

    def read(self) -> list[float]:
        times, self.times = self.times, []
        return [t - times[0] for t in times] if times else []


class CudaMarks:
    """A pool of ``size`` timing events, each recorded once when made, so that recording in
    the step reuses a created event; the stream is read once, here (the compute stream:
    ZeRO's collectives and copies run on their own streams). The pool grows if a step needs
    more marks than expected."""

    def __init__(self, device: torch.device, size: int) -> None:
        self.stream = torch.cuda.current_stream(device)
        self.events = [self._created() for _ in range(size)]
        self.used = 0

    def _created(self) -> torch.cuda.Event:
        event = torch.cuda.Event(enable_timing=True)
        event.record(self.stream)
        return event

    def mark(self) -> None:
        i = self.used
        if i == len(self.events):
            self.events.append(self._created())
        self.events[i].record(self.stream)
        self.used = i + 1

    def read(self) -> list[float]:
        events, used, self.used = self.events, self.used, 0
        if not used:
            return []
        events[used - 1].synchronize()
        first = events[0]
        return [first.elapsed_time(e) / 1e3 for e in events[:used]]  # ms -> s


def marks_for(device: torch.device, size: int) -> Marks:
    return CudaMarks(device, size) if device.type == "cuda" else CpuMarks()


def top_level_paths(root: nn.Module) -> frozenset[str]:
    """The root's children, a container that is never called itself (ModuleList, ModuleDict)
    replaced by its children: for a GPT the embeddings, each block, the final norm, the
    head."""
    paths: list[str] = []

    def visit(prefix: str, module: nn.Module) -> None:
        for name, child in module.named_children():
            path = f"{prefix}{name}"
            if isinstance(child, nn.ModuleList | nn.ModuleDict):
                visit(path + ".", child)
            else:
                paths.append(path)
    visit("", root)
    return frozenset(paths)


class ModuleTimer:
    """Seconds per phase and per module path of one step (see the module docstring).
    ``latency[phase][path]``: forward and recompute for every module, backward for
    ``backward_paths`` and the root; ``phase_latency[phase]`` from :meth:`set_phase`."""

    def __init__(self, root: nn.Module, marks: Marks,
                 backward_paths: frozenset[str] | None = None) -> None:
        self.root, self.marks = root, marks
        self.backward_paths = (top_level_paths(root) if backward_paths is None
                               else backward_paths) | {""}
        self.paths = [p for p, _ in root.named_modules()]
        self.tags: list[int] = []
        self.armed = False
        self.phase = "forward"
        self.latency: dict[str, dict[str, float]] = {ph: defaultdict(float) for ph in PHASES}
        self.phase_latency: dict[str, float] = defaultdict(float)
        self._handles: list[Any] = []

    # -- before the step: hooks, once ----------------------------------------------------------
    def register(self) -> None:
        for i, (path, module) in enumerate(self.root.named_modules()):
            timed = path in self.backward_paths
            self._handles.append(module.register_forward_pre_hook(self._pre_hook(4 * i, timed)))
            self._handles.append(module.register_forward_hook(self._post_hook(4 * i, timed),
                                                              always_call=True))

    def _pre_hook(self, code: int, backward: bool):
        tags, mark, handles, enter = self.tags, self.marks.mark, self._handles, code + _FWD_IN
        if not backward:  # most modules: an append and a mark, nothing else
            def pre(module: nn.Module, args: Any) -> None:
                if self.armed:
                    tags.append(enter)
                    mark()
            return pre
        exit_backward = self._marker(code + _BWD_OUT)

        def pre_with_backward(module: nn.Module, args: Any) -> None:
            if self.armed:
                tags.append(enter)
                mark()
                if (self.phase != "backward" and torch.is_grad_enabled()
                        and (inputs := _tensors(args))):
                    on_first_grad(inputs, exit_backward, handles)
        return pre_with_backward

    def _post_hook(self, code: int, backward: bool):
        tags, mark, handles, leave = self.tags, self.marks.mark, self._handles, code + _FWD_OUT
        if not backward:
            def post(module: nn.Module, args: Any, output: Any) -> None:
                if self.armed:
                    tags.append(leave)
                    mark()
            return post
        enter_backward = self._marker(code + _BWD_IN)

        def post_with_backward(module: nn.Module, args: Any, output: Any) -> None:
            if self.armed:
                tags.append(leave)
                mark()
                if (self.phase != "backward" and torch.is_grad_enabled()
                        and (outputs := _tensors(output))):
                    on_first_grad(outputs, enter_backward, handles)
        return post_with_backward

    def _marker(self, code: int):
        tags, mark = self.tags, self.marks.mark

        def marker() -> None:
            if self.armed:
                tags.append(code)
                mark()
        return marker

    # -- in the step ------------------------------------------------------------------------------
    def arm(self) -> None:
        self.armed = True

    def set_phase(self, phase: str) -> None:
        """A phase begins (and the one before ends) here; forward marks in backward are
        activation-checkpoint recomputation."""
        self.end_backward()
        self.phase = phase
        self.tags.append(-1 - PHASES.index(phase))
        self.marks.mark()

    def end_backward(self) -> None:
        """autograd returned: backward scopes still open end here (a module whose inputs need
        no grad, such as the root on token ids, never reports the end of its backward)."""
        if self.phase == "backward":
            self.tags.append(_END_BACKWARD)
            self.marks.mark()

    # -- after the step --------------------------------------------------------------------------
    def stop(self) -> None:
        """The last mark (it ends the last phase), then the hooks go."""
        self.end_backward()
        self.tags.append(_END_BACKWARD - 1)
        self.marks.mark()
        self.armed = False
        for h in self._handles:
            h.remove()
        self._handles.clear()

    def read(self) -> None:
        """Turn the marks into ``latency`` and ``phase_latency`` (waits once, for the last)."""
        times = self.marks.read()
        phase, phase_start = None, 0.0
        open_at: dict[int, list[float]] = defaultdict(list)
        for code, t in zip(self.tags, times, strict=True):
            if code < 0:
                if code <= _END_BACKWARD:  # close open backward scopes
                    self._close_backward(open_at, t)
                if code != _END_BACKWARD:  # a phase begins, or (the last mark) none
                    if phase is not None:
                        self.phase_latency[phase] += t - phase_start
                    phase, phase_start = (PHASES[-1 - code] if code > _END_BACKWARD
                                          else None), t
                continue
            index, kind = divmod(code, 4)
            if kind in (_FWD_IN, _BWD_IN):
                open_at[code].append(t)
            elif starts := open_at.get(code - 1):
                where = ("backward" if kind == _BWD_OUT else
                         "recompute" if phase == "backward" else "forward")
                self.latency[where][self.paths[index]] += t - starts.pop()
        self.tags.clear()

    def _close_backward(self, open_at: dict[int, list[float]], t: float) -> None:
        for code, starts in open_at.items():
            if code % 4 == _BWD_IN:
                path = self.paths[code // 4]
                self.latency["backward"][path] += sum(t - s for s in starts)
                starts.clear()

"""The random draws of construction: taken on the meta device as eager code would, replayed
per parameter when it is made real.

Eager construction draws every initial value from one CPU generator, in the order the
constructors run. Some models initialise a parameter twice: a Hugging Face model's layers
run torch's default ``reset_parameters()`` in their constructors, then ``post_init()`` draws
every weight again with the model's own scheme, so a weight's final values come from a
generator state that depends on everything drawn before it. To reproduce that unit by unit:

    record (zero_init)   a random op on a meta tensor (``uniform_``, ``normal_``, ...) is also
                         run on a CPU scratch tensor of the same shape, so the generator moves
                         exactly as in eager construction, and the generator state before it
                         is kept for the parameter the op writes (by storage: views count)
    replay (materialise) a random op on a parameter being made real starts from the state
                         recorded for the same op (for a draw over the whole tensor: the
                         last such draw of that op), so its values are eager construction's
                         whatever order the units are built in

Draws the replay cannot place (a temporary inside an init function, a tensor that is not a
parameter of the module) continue from the generator as it is. Both sides are
``TorchDispatchMode``s: nothing in torch is patched.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import torch
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_map

from meshzero.zero.heap import trim_heap


def _is_random(func: Any) -> bool:
    return torch.Tag.nondeterministic_seeded in func.tags


def _writes_first_arg(func: Any) -> bool:
    args = func._schema.arguments
    return bool(args) and args[0].alias_info is not None and args[0].alias_info.is_write


def _covers_storage(t: torch.Tensor) -> bool:
    return t.storage_offset() == 0 and t.numel() * t.element_size() == (
        t.untyped_storage().nbytes())


@dataclass
class Draw:
    """One random op on (a view of) a tensor: its name, whether it covered the whole
    tensor, and the generator state before it."""

    op: str
    whole: bool
    state: torch.Tensor


@dataclass
class DrawLog:
    """The draws of one construction, by the storage of the meta tensor they wrote."""

    draws: dict[int, list[Draw]] = field(default_factory=dict)
    # the meta storages themselves (no memory): held so that an id is never reused
    storages: dict[int, Any] = field(default_factory=dict)

    def add(self, t: torch.Tensor, op: str, state: torch.Tensor) -> None:
        storage = t.untyped_storage()
        key = storage._cdata
        self.storages.setdefault(key, storage)
        self.draws.setdefault(key, []).append(Draw(op, _covers_storage(t), state))

    def of(self, meta: torch.Tensor) -> list[Draw]:
        """Every recorded draw on ``meta`` (or a view of it), in order."""
        return self.draws.get(meta.untyped_storage()._cdata, [])

    def states(self) -> list[torch.Tensor]:
        return [d.state for ds in self.draws.values() for d in ds]

    def set_states(self, states: list[torch.Tensor]) -> None:
        """Replace the states, in :meth:`states` order (rank 0's, broadcast)."""
        it = iter(states)
        for ds in self.draws.values():
            for d in ds:
                d.state = next(it)


def _span_bytes(t: torch.Tensor) -> int:
    """Bytes of the storage span ``t`` covers with its strides."""
    if t.numel() == 0:
        return 0
    last = sum((size - 1) * stride for size, stride in zip(t.shape, t.stride(), strict=True))
    return (last + 1) * t.element_size()


class RecordDraws(TorchDispatchMode):
    """Active during a ``zero_init`` block: random ops on meta tensors move the CPU
    generator as they would on real ones, and are logged. The draws land in one scratch
    buffer, reused (a fresh tensor per draw, freed at once, would leave glibc holding a
    model's worth of touched heap pages)."""

    def __init__(self, log: DrawLog) -> None:
        super().__init__()
        self.log = log
        self.buffer = torch.empty(0, dtype=torch.uint8)

    def _scratch(self, t: Any) -> Any:
        if isinstance(t, torch.Tensor) and t.is_meta:
            nbytes = _span_bytes(t)
            if self.buffer.numel() < nbytes:
                self.buffer = torch.empty(0, dtype=torch.uint8)  # the old one goes first
                self.buffer = torch.empty(nbytes, dtype=torch.uint8)
            flat = self.buffer[:nbytes].view(t.dtype)  # offset 0: aligned for any dtype
            return flat.as_strided(t.shape, t.stride())
        if isinstance(t, torch.device) and t.type == "meta":
            return torch.device("cpu")
        return t

    def __exit__(self, *exc: Any) -> None:
        self.buffer = torch.empty(0, dtype=torch.uint8)
        trim_heap()
        super().__exit__(*exc)

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        metas = [a for a in (*args, *kwargs.values()) if isinstance(a, torch.Tensor)
                 and a.is_meta] or [v for v in kwargs.values()
                                    if isinstance(v, torch.device) and v.type == "meta"]
        if _is_random(func) and metas:
            if (_writes_first_arg(func) and isinstance(args[0], torch.Tensor)
                    and kwargs.get("generator") is None):
                self.log.add(args[0], str(func), torch.get_rng_state())
            # the draw itself (one meta tensor per op, so one scratch view at a time)
            func(*tree_map(self._scratch, args), **tree_map(self._scratch, kwargs))
        return func(*args, **kwargs)


class ReplayDraws(TorchDispatchMode):
    """Active while one module's init runs on its real tensors: a random op on one of
    ``targets`` ((real tensor, its recorded draws)) starts from a recorded state. A draw
    over the whole tensor takes the state of the last recorded whole draw of the same op
    (an init that runs torch's default and then the model's scheme finds both); a draw over
    a view takes the next recorded draw after it, or of the last initialisation."""

    def __init__(self, targets: list[tuple[torch.Tensor, list[Draw]]]) -> None:
        super().__init__()
        self.spans = [(t.data_ptr(), t.data_ptr() + t.numel() * t.element_size(), draws)
                      for t, draws in targets if draws and t.numel() > 0]
        self.cursor = [_last_init_start(draws) for _, _, draws in self.spans]

    def _span_of(self, t: torch.Tensor) -> int | None:
        ptr = t.data_ptr()
        for i, (lo, hi, _) in enumerate(self.spans):
            if lo <= ptr < hi:
                return i
        return None

    def _draw_for(self, t: torch.Tensor, op: str) -> Draw | None:
        i = self._span_of(t)
        if i is None:
            return None
        lo, hi, draws = self.spans[i]
        if t.data_ptr() == lo and t.numel() * t.element_size() == hi - lo:
            same = [j for j, d in enumerate(draws) if d.whole and d.op == op]
            if same:
                self.cursor[i] = same[-1]
        j = self.cursor[i]
        if j >= len(draws) or draws[j].op != op:
            return None
        self.cursor[i] = j + 1
        return draws[j]

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if (_is_random(func) and _writes_first_arg(func) and args
                and isinstance(args[0], torch.Tensor) and not args[0].is_meta
                and kwargs.get("generator") is None):
            draw = self._draw_for(args[0], str(func))
            if draw is not None:
                torch.set_rng_state(draw.state)
        return func(*args, **kwargs)


def _last_init_start(draws: list[Draw]) -> int:
    starts = [i for i, d in enumerate(draws) if d.whole]
    return starts[-1] if starts else 0

"""UnitCompiler: torch.compile of each leaf ZeRO unit's own ``forward``, the engine's eager
bookkeeping around it (the package docstring says why)."""

from __future__ import annotations

import logging
import types
from collections.abc import Callable
from dataclasses import dataclass, field
from types import CodeType
from typing import Any, Protocol

import torch
from torch import nn

from meshzero.compile.checkpointing import call_checkpointed, compiled_target
from meshzero.compile.counts import Delta, since, snapshot
from meshzero.config.compile import backend_problem, combination_problems, kwargs_problems

logger = logging.getLogger(__name__)


class Sharder(Protocol):
    """What the compiler reads of stage 3's ParameterSharder (zero/sharded_params.py)."""

    sticky: set[int]  # units gathered on a use outside their hooks (kept to the step's end)


@dataclass
class UnitStats:
    """One compiled unit: what dynamo compiled during its calls."""

    index: int
    counts: Delta = field(default_factory=Delta)
    compiled_calls: int = 0
    check: str = "todo"  # stage 3: "todo", "this step" (eager, checked), "done"
    settled: bool = False  # a step ended after its first compiled call: compiles now warn

    def as_dict(self) -> dict[str, Any]:
        c = self.counts
        return {"graph_breaks": c.graph_breaks, "recompiles": c.recompiles,
                "frames": c.frames, "graphs": c.graphs, "compile_seconds": c.compile_seconds,
                "compiled_calls": self.compiled_calls}


def _checkpointing(compiled: Callable) -> Callable:
    def call(module: nn.Module, *args: Any, **kwargs: Any) -> Any:
        return call_checkpointed(module, compiled, args, kwargs)

    return call


class UnitCompiler:
    """Compiles the forward of every ZeRO unit that holds no other unit (the repeated blocks;
    the root too when it is the only unit), keeps dynamo's counts per unit, and warns when a
    unit compiles again after the step it first compiled in."""

    def __init__(self, model: nn.Module, unit_paths: list[str], *,
                 sharder: Sharder | None = None, tp_size: int = 1, sp_size: int = 1) -> None:
        self.model = model
        self.unit_paths = unit_paths
        self.sharder = sharder
        self.sizes = {"tp_size": tp_size, "sp_size": sp_size}
        self.backend: str | Callable | None = None
        self.kwargs: dict[str, Any] = {}
        self.stats: dict[str, UnitStats] = {}
        self.eager_units: dict[str, str] = {}  # unit -> why it stays eager
        self.steps = 0  # optimizer steps closed since compile()
        # True while the flops profiler counts or times a step: units run eager then
        self.profiling_active: Callable[[], bool] = lambda: False

    @property
    def is_compiled(self) -> bool:
        return self.backend is not None

    def leaf_units(self) -> list[tuple[int, str]]:
        """``(index, path)`` of the units no other unit lies inside."""
        return [(i, p) for i, p in enumerate(self.unit_paths)
                if not any(q != p and (p == "" or q.startswith(p + ".")) for q in self.unit_paths)]

    def check(self, backend: object, kwargs: object, schedule: object = None) -> None:
        """Every problem with these arguments and this engine, in one ValueError."""
        problems = []
        bad = backend_problem(backend)
        if bad is not None:
            problems.append(f"backend {backend!r} {bad}")
        problems += [f"compile_kwargs {p}" for p in kwargs_problems(kwargs)]
        if schedule is not None:
            problems.append("schedule is DeepCompile's pass schedule, which meshzero does not "
                            "run (it compiles each ZeRO unit's forward); pass schedule=None")
        problems += combination_problems(**self.sizes, key="compile")
        if problems:
            raise ValueError("cannot compile: " + "; ".join(problems))

    def compile(self, backend: str | Callable = "inductor",
                kwargs: dict[str, Any] | None = None, schedule: object = None) -> None:
        """Compile each leaf unit's forward; one compiled function per forward function, so
        identical blocks share one cache entry. A second call is a no-op (as DeepSpeed's)."""
        kwargs = {} if kwargs is None else kwargs
        self.check(backend, kwargs, schedule)
        if self.is_compiled:
            logger.info("compile: the units are compiled already (backend %r)", self.backend)
            return
        shared: dict[Any, Callable] = {}
        for index, path in self.leaf_units():
            module = self.model.get_submodule(path)
            if "forward" in vars(module):  # an instance's own forward: left as it is
                self.eager_units[path or "<root>"] = "its forward is an instance attribute"
                continue
            function, checkpointed = compiled_target(type(module).forward)
            if function not in shared:
                shared[function] = torch.compile(function, backend=backend, **kwargs)
            compiled = shared[function]
            if checkpointed:  # the layer's own checkpointing runs eager around it
                compiled = _checkpointing(compiled)
            self._wrap(index, path or "<root>", module, compiled,
                       getattr(function, "__code__", None))
        self.backend, self.kwargs = backend, dict(kwargs)
        if getattr(getattr(self.model, "config", None), "use_cache", False) is True:
            logger.warning("compile: the model's config.use_cache is true: a transformers "
                           "cache is indexed by each layer's layer_idx, so every decoder layer "
                           "compiles a graph of its own (and past torch._dynamo's recompile "
                           "limit runs eager); set model.config.use_cache = False for training")
        logger.info("compile: %d unit forward(s) compiled with backend %r%s", len(self.stats),
                    backend, f" ({len(self.eager_units)} eager)" if self.eager_units else "")

    def _wrap(self, index: int, name: str, module: nn.Module, compiled: Callable,
              code: CodeType | None) -> None:
        stats = self.stats[name] = UnitStats(index)
        eager = types.MethodType(type(module).forward, module)

        def forward(*args: Any, **kwargs: Any) -> Any:
            if name in self.eager_units or self.profiling_active():
                return eager(*args, **kwargs)
            if self.sharder is not None and stats.check != "done":  # stage 3: the first
                # step after compile runs eager (forward and any recompute in backward alike:
                # a checkpoint must recompute what it saved), its first call checked
                first, stats.check = stats.check == "todo", "this step"
                if first:
                    return self._checked(name, index, self.sharder, eager, args, kwargs)
                return eager(*args, **kwargs)
            before = snapshot(code)
            out = compiled(module, *args, **kwargs)
            delta = since(before, code)
            stats.compiled_calls += 1
            if not delta.empty:
                self._account(name, stats, delta)
            return out

        module.forward = forward  # an instance attribute: nn.Module.__call__ runs the hooks

    def _checked(self, name: str, index: int, sharder: Sharder, eager: Callable,
                 args: tuple, kwargs: dict) -> Any:
        """Stage 3: a compiled forward cannot gather, so a unit whose forward reads another
        unit's released parameters (found gathered on use in this eager call) stays eager."""
        sticky = set(sharder.sticky)
        out = eager(*args, **kwargs)
        others = sorted(u for u in sharder.sticky - sticky if u != index)
        if others:
            paths = [self.unit_paths[u] or "<root>" for u in others]
            self.eager_units[name] = f"its forward reads the parameters of unit(s) {paths}"
            logger.warning("compile: unit %r stays eager: %s, which a compiled forward "
                           "cannot gather", name, self.eager_units[name])
        return out

    def _account(self, name: str, stats: UnitStats, delta: Delta) -> None:
        """Add ``delta`` to the unit's counts; a break or recompile is a WARNING (a unit's
        first compile is one frame: anything more defeats sharing one graph)."""
        stats.counts.add(delta)
        when = f"after step {self.steps - 1}" if stats.settled else "in its first compiled step"
        for reason in delta.reasons:
            logger.warning("compile: unit %r %s: %s", name, when, reason)
        if stats.settled and not delta.reasons:
            logger.warning("compile: unit %r compiled %d new frame(s) %s", name, delta.frames,
                           when)

    def close_step(self) -> None:
        """The engine ended an optimizer step: a unit that ran compiled in it is settled."""
        self.steps += 1
        for stats in self.stats.values():
            if stats.compiled_calls:
                stats.settled = True
            if stats.check == "this step":
                stats.check = "done"

    def report(self) -> dict[str, Any]:
        """``engine.compile_report()``: dynamo's counts, in total and per unit."""
        total = Delta()
        for stats in self.stats.values():
            total.add(stats.counts)
        backend = self.backend if self.backend is None or isinstance(self.backend, str) \
            else getattr(self.backend, "__name__", repr(self.backend))
        return {"backend": backend, "kwargs": dict(self.kwargs),
                "units": len(self.stats) - len(self.eager_units.keys() & self.stats.keys()),
                "graph_breaks": total.graph_breaks, "recompiles": total.recompiles,
                "frames": total.frames, "graphs": total.graphs,
                "compile_seconds": total.compile_seconds,
                "eager_units": dict(self.eager_units),
                "per_unit": {n: s.as_dict() for n, s in self.stats.items()}}

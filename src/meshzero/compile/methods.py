"""The engine's compile methods (a mixin of :class:`meshzero.Engine`), with DeepSpeed's
signature (`deepspeed/runtime/engine.py` `DeepSpeedEngine.compile`)."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from meshzero.compile.units import UnitCompiler


class CompileMethods:
    """``compile``, ``is_compiled`` and ``compile_report`` over the engine's UnitCompiler."""

    compiler: UnitCompiler

    def compile(self, backend: str | Callable = "inductor",
                compile_kwargs: dict[str, Any] | None = None, schedule: Any = None,
                compiled_autograd_enabled: bool = False) -> None:
        """torch.compile each ZeRO unit's forward (meshzero/compile/) with ``backend`` (a
        torch.compile backend name or callable) and ``compile_kwargs`` (torch.compile's
        fullgraph, dynamic, mode, options); every problem is raised before anything is
        compiled. ``schedule`` (DeepCompile's) and ``compiled_autograd_enabled`` are refused.
        A second call is a no-op, as DeepSpeed's."""
        if compiled_autograd_enabled:
            raise ValueError("compiled_autograd_enabled=True is not supported: meshzero's "
                             "reduce-scatters run in eager gradient hooks during backward; "
                             "leave it False")
        self.compiler.compile(backend, compile_kwargs, schedule)

    @property
    def is_compiled(self) -> bool:
        """Whether the unit forwards are compiled (``compile()`` or ``compile.enabled``)."""
        return self.compiler.is_compiled

    def compile_report(self) -> dict:
        """Dynamo's counts since compile, measured per unit call: ``backend``, ``units``
        (compiled unit forwards), ``graph_breaks``, ``recompiles``, ``frames``
        (frame compiles), ``graphs`` (FX graphs), ``compile_seconds``, ``eager_units`` ({unit:
        why it stays eager}) and ``per_unit`` ({unit: {graph_breaks, recompiles, frames,
        graphs, compile_seconds, compiled_calls}})."""
        return self.compiler.report()

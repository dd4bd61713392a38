"""`compile`: torch.compile of each ZeRO unit's forward (meshzero/compile/), and DeepSpeed's
other fields of the section, each honoured or refused.

``enabled``, ``backend`` and ``kwargs`` (DeepSpeed 0.14's spelling, which Hugging Face and
Accelerate write) are honoured: ``enabled`` does at ``initialize`` what ``engine.compile(backend,
kwargs)`` does. ``disable`` (axolotl's configs write ``"disable": false``) is the opposite of
``enabled``. The other fields configure DeepCompile (DeepSpeed's `deepspeed/compile/config.py`
`CompileConfig`), whose graph passes meshzero does not run: at DeepSpeed's default they ask for
nothing and are dropped (config/compat.py); any other value is refused with one line
(config/unsupported.py)."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from pydantic import field_validator, model_validator

from meshzero.config.errors import InvalidValue
from meshzero.config.scalars import Bool, Section

if TYPE_CHECKING:
    from meshzero.config.schema import Config

# torch.compile's keyword arguments a unit's compile takes (its model and backend are ours)
COMPILE_KWARGS = ("fullgraph", "dynamic", "mode", "options")
MODES = (None, "default", "reduce-overhead", "max-autotune", "max-autotune-no-cudagraphs")

def known_backends() -> list[str]:
    """torch.compile's registered backend names (torch._dynamo.list_backends)."""
    import torch._dynamo

    return sorted(n for n in torch._dynamo.list_backends(exclude_tags=())
                  if not n.endswith("TESTING_ONLY"))


def backend_problem(backend: object) -> str | None:
    """Why ``backend`` is not a torch.compile backend (a registered name or a callable)."""
    if callable(backend):
        return None
    if not isinstance(backend, str):
        return f"is a {type(backend).__name__}; give a backend name or a callable"
    names = known_backends()
    if backend not in names:
        return f"is not a torch.compile backend; valid: {names}"
    return None


def kwargs_problems(kwargs: object) -> list[str]:
    """What is wrong with ``kwargs`` for a unit's torch.compile, each a phrase after the key."""
    if not isinstance(kwargs, dict):
        return [f"is a {type(kwargs).__name__}; give a dict of torch.compile's keyword "
                f"arguments {list(COMPILE_KWARGS)}"]
    problems = []
    for key in kwargs:
        if key == "backend":
            problems.append("has 'backend': give it as compile.backend (engine.compile's "
                            "backend=)")
        elif key not in COMPILE_KWARGS:
            problems.append(f"has {key!r}, which is not one of torch.compile's keyword "
                            f"arguments meshzero passes: {list(COMPILE_KWARGS)}")
    if kwargs.get("mode") not in MODES:
        problems.append(f"has mode {kwargs.get('mode')!r}; valid: {list(MODES)}")
    if kwargs.get("mode") is not None and kwargs.get("options") is not None:
        problems.append("has both mode and options; torch.compile takes one of them")
    for key, kind in (("fullgraph", bool), ("options", dict)):
        if kwargs.get(key) is not None and not isinstance(kwargs[key], kind):
            problems.append(f"has {key} {kwargs[key]!r}; give a {kind.__name__}")
    if kwargs.get("dynamic") not in (None, True, False):
        problems.append(f"has dynamic {kwargs['dynamic']!r}; give true, false or null")
    return problems


class CompileConfig(Section):
    """`compile`: ``enabled`` compiles each ZeRO unit's forward at ``initialize`` with
    ``backend`` (a torch.compile backend name) and ``kwargs`` (torch.compile's fullgraph,
    dynamic, mode, options)."""

    enabled: Bool = False
    disable: Bool = False  # axolotl's spelling: true never compiles
    backend: str = "inductor"
    kwargs: dict[str, Any] = {}

    @field_validator("backend")
    @classmethod
    def _backend(cls, value: str) -> str:
        problem = backend_problem(value)
        if problem is not None:
            raise InvalidValue(problem)
        return value

    @field_validator("kwargs")
    @classmethod
    def _kwargs(cls, value: dict[str, Any]) -> dict[str, Any]:
        problems = kwargs_problems(value)
        if problems:
            raise InvalidValue("; ".join(problems))
        return value

    @model_validator(mode="after")
    def _on_and_off(self) -> CompileConfig:
        if self.enabled and self.disable:
            raise ValueError("compile.enabled and compile.disable are both true; give one")
        return self


def combination_problems(*, tp_size: int, pp_size: int, sp_size: int,
                         key: str = "compile.enabled") -> list[str]:
    """The parallelisms whose communication runs inside a unit's forward, which a compiled
    unit cannot hold without a graph break: each a line naming the combination."""
    inside = [(tp_size, "tensor_parallel.size", "tensor parallelism's all-reduces and "
               "gathers run in hooks inside each block"),
              (sp_size, "sequence_parallel_size", "Ulysses' all-to-alls run inside each "
               "block's attention"),
              (pp_size, "pipeline_parallel.size", "the pipeline's stages run units by its "
               "own schedule, not tested compiled yet")]
    return [f"{key} with {name} = {size} is not supported yet: {why}, which would break the "
            "unit's compiled graph; compile without it, or train it eager"
            for size, name, why in inside if size > 1]


def compile_problems(config: Config) -> list[str]:
    """The cross-key checks of the section (Config's validator collects them)."""
    if not config.compile.enabled:
        return []
    return combination_problems(tp_size=config.tensor_parallel.size,
                                pp_size=config.pipeline_parallel.size,
                                sp_size=config.sequence_parallel_size)



"""Which (tp, pp) meshes ``meshzero plan --search-mesh`` tries for a model and cluster.

Following the engine's rank order (tp innermost, then dp, pp outermost), tp stays inside a
node: powers of two that divide ``gpus_per_node``; pp takes powers of two that divide what is
left of the world and are at most the number of pipeline layers. tp needs a plan (the
settings', else the shipped plan whose patterns all match the model) and pp a pipeline layout
(the given one, else the config's); a dimension without one is not searched, and
the plan's notes say so.
"""

from __future__ import annotations

from fnmatch import fnmatchcase

from torch import nn

from meshzero.estimate.model import ModelSpec
from meshzero.estimate.settings import Cluster, Settings


def inferred_tp_plan(model: nn.Module) -> str | None:
    """The name of the shipped tensor-parallel plan whose every pattern names a module of
    ``model`` (the demo GPT, Hugging Face GPT-2, Llama-style models), else None."""
    from meshzero.parallel.plans import SHIPPED_PLANS

    names = [name for name, _ in model.named_modules()]
    for plan_name, plan in SHIPPED_PLANS.items():
        if all(any(fnmatchcase(n, pattern) for n in names) for pattern in plan):
            return plan_name
    return None


def _powers_of_two_dividing(n: int, limit: int) -> list[int]:
    return [1 << k for k in range(n.bit_length()) if n % (1 << k) == 0 and 1 << k <= limit]


def _pipeline_layers(spec: ModelSpec, base: Settings, given) -> int | None:
    """How many layers a pipeline could cut, or None without a usable layout."""
    from meshzero.estimate.mesh import pipeline_layout_of
    from meshzero.parallel.pipeline_split import layer_list

    layout = pipeline_layout_of(spec, base, given)
    if not layout.layers and not isinstance(spec.model, nn.Sequential):
        return None  # only an nn.Sequential is its own layer list
    try:
        return len(layer_list(spec.model, layout))
    except ValueError:
        return None


def mesh_settings(spec: ModelSpec, base: Settings, cluster: Cluster, layout=None
                  ) -> tuple[list[Settings], list[str]]:
    """The base settings for every (tp, pp) to try, and notes on what was not searched."""
    if not spec.runnable:
        return [base], ["tp/pp not searched: a bare parameter count has no modules to split"]
    notes = []
    plan = base.tp_plan if base.tp_plan is not None else inferred_tp_plan(spec.model)
    if plan is None:
        tps = [1]
        notes.append(f"tp not searched: no shipped tensor-parallel plan matches "
                     f"{type(spec.model).__name__} (give --tp-plan or tensor_parallel.plan)")
    else:
        tps = _powers_of_two_dividing(cluster.gpus_per_node, cluster.gpus_per_node)
    layers = _pipeline_layers(spec, base, layout)
    if layers is None:
        notes.append(f"pp not searched: no pipeline layout for {type(spec.model).__name__} "
                     "(give pipeline_parallel.layers/first/last or --pipeline-layout)")
    out = []
    for tp in tps:
        pps = [1] if layers is None else _powers_of_two_dividing(cluster.world_size // tp,
                                                                 layers)
        for pp in pps:
            out.append(base.replace(tp=tp, pp=pp,
                                    tp_plan=plan if tp > 1 else base.tp_plan))
    return out, notes

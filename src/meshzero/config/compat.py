"""DeepSpeed's spellings, hints and no-op values, turned into the keys the schema validates.

A real ds_config.json carries more than the keys that change what training computes: older
spellings and aliases of keys meshzero honours, performance hints for DeepSpeed's own kernels,
and blocks switched off (``{"enabled": false}``). DeepSpeed's users should not have to delete
any of them, so `normalize` runs before validation and:

* renames aliases and older spellings to the key the schema knows (a deprecated one is said
  once, at ``initialize``);
* drops a key whose value asks for nothing (`NOOP_VALUES`);
* drops a performance hint that cannot change results (`HINTS`) and keeps a note of it for the
  one INFO line ``initialize`` logs;
* resolves ``"auto"`` the way Hugging Face's integration does, when the model is known
  (`resolve_auto`), and lists every ``"auto"`` it cannot resolve.

What is left is validated by the schema; the keys in `config.unsupported.UNSUPPORTED_KEYS` are the
ones that would change results and that meshzero cannot honour.
"""

from __future__ import annotations

import copy
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from meshzero.config.auto import ModelFacts, is_auto, needs_model, resolve_auto
from meshzero.config.unsupported import DEEPCOMPILE_DEFAULTS

# DeepSpeed's other spellings of keys meshzero honours: dotted old -> dotted new, and whether
# DeepSpeed itself calls the old one deprecated.
ALIASES: dict[str, tuple[str, bool]] = {
    "bfloat16": ("bf16", False),
    "zero_optimization.stage3_gather_fp16_weights_on_model_save":
        ("zero_optimization.stage3_gather_16bit_weights_on_model_save", True),
    "zero_optimization.gather_16bit_weights_on_model_save":
        ("zero_optimization.stage3_gather_16bit_weights_on_model_save", False),
    "zero_optimization.max_live_parameters": ("zero_optimization.stage3_max_live_parameters",
                                              False),
    "zero_optimization.max_reuse_distance": ("zero_optimization.stage3_max_reuse_distance",
                                             False),
    "zero_optimization.prefetch_bucket_size": ("zero_optimization.stage3_prefetch_bucket_size",
                                               False),
    "zero_optimization.param_persistence_threshold":
        ("zero_optimization.stage3_param_persistence_threshold", False),
}  # fmt: skip

# The pre-0.3 offload switches: key -> the offload block (and its key) they set.
OLD_OFFLOAD: dict[str, tuple[str, str]] = {
    "cpu_offload": ("offload_optimizer", "device"),
    "cpu_offload_params": ("offload_param", "device"),
    "cpu_offload_use_pin_memory": ("offload_optimizer", "pin_memory"),
}

# Performance and bookkeeping hints: accepted with one INFO line, because whatever their value
# meshzero computes the same parameters. dotted key -> why it changes nothing here.
HINTS: dict[str, str] = {
    "zero_allow_untested_optimizer": "meshzero steps any torch.optim optimizer over its shards",
    "zero_force_ds_cpu_optimizer": "offloaded states are stepped by torch.optim on the host",
    "zero_optimization.round_robin_gradients": "a DeepSpeed gradient-copy order for offload",
    "zero_optimization.contiguous_gradients": "meshzero always keeps flat gradient buffers",
    "zero_optimization.reduce_scatter": "meshzero always reduce-scatters gradients",
    "zero_optimization.allgather_partitions": "meshzero always all-gathers whole partitions",
    "zero_optimization.memory_efficient_linear": "a DeepSpeed linear kernel for ZeRO-3",
    "zero_optimization.use_multi_rank_bucket_allreduce": "a DeepSpeed all-reduce layout",
    "zero_optimization.log_trace_cache_warnings": "DeepSpeed's prefetch trace logging",
    "zero_optimization.elastic_checkpoint": "meshzero checkpoints load at any dp size",
    "zero_optimization.load_from_fp32_weights": "meshzero checkpoints always restore the "
                                                "fp32 master",
    "zero_optimization.ignore_unused_parameters": "unused parameters get a zero gradient",
    "zero_optimization.legacy_stage1": "stage 1 gives the same parameters either way",
    "zero_optimization.stage3_model_persistence_threshold": "a ZeRO-3 residency hint",
    "zero_optimization.mics_hierarchical_params_gather": "a MiCS gather order",
    # how DeepSpeed's ZeRO-3 fetches parameters; meshzero gathers whole units
    # (zero_optimization.unit_classes), with the same results
    "zero_optimization.stage3_use_all_reduce_for_fetch_params": "a ZeRO-3 fetch collective",
    "zero_optimization.use_all_reduce_for_fetch_params": "a ZeRO-3 fetch collective",
    "zero_optimization.stage3_module_granularity_threshold": "a ZeRO-3 fetch granularity",
    "zero_optimization.module_granularity_threshold": "a ZeRO-3 fetch granularity",
    "zero_optimization.stage3_allgather_sequential": "a ZeRO-3 gather order",
    "zero_optimization.allgather_sequential": "a ZeRO-3 gather order",
    "zero_optimization.leaf_module": "ZeRO-3 leaf modules, a fetch granularity",
    "zero_optimization.override_module_apply": "how DeepSpeed's zero.Init patches "
                                                "Module.apply",
    "zero_optimization.enable_sanity_checks": "DeepSpeed's debug checks",
    "zero_optimization.pipeline_loading_checkpoint": "how DeepSpeed loads checkpoint shards",
    "zero_optimization.offload_optimizer.fast_init": "how DeepSpeed first fills NVMe files",
    "zero_optimization.offload_optimizer.pipeline": "meshzero always overlaps NVMe I/O",
    "zero_optimization.offload_optimizer.pipeline_read": "meshzero always overlaps NVMe I/O",
    "zero_optimization.offload_optimizer.pipeline_write": "meshzero always overlaps NVMe I/O",
    "zero_optimization.offload_optimizer.ratio": "partial offload: meshzero offloads all "
                                                 "optimizer states of the rank",
    "zero_optimization.offload_param.buffer_size": "meshzero sizes NVMe read buffers by unit",
    "zero_optimization.offload_param.max_in_cpu": "meshzero keeps buffer_count units in host "
                                                  "memory",
    "aio": "meshzero's NVMe tier uses os.pread/pwrite threads",
    "memory_breakdown": "engine.memory_report() gives the bytes by tier",
    "activation_checkpointing": "it configures deepspeed.checkpointing calls; use "
                                "torch.utils.checkpoint (same results, less memory)",
    "checkpoint": "DeepSpeed's checkpoint-engine options",
    "pipeline": "DeepSpeed's PipelineModule settings; meshzero's is pipeline_parallel",
    "dump_state": "DeepSpeed's debug print of its state",
    "sparse_attention": "it configures DeepSpeed's sparse attention modules, which a model "
                        "without them never reads",
    "timers": "meshzero times every step (wall_clock_breakdown)",
    "graph_harvesting": "CUDA graph capture of DeepSpeed's kernels",
    "tensor_parallel.tp_overlap_comm": "AutoTP's all-reduce overlap",
    "log_level": "DeepSpeed's own log level (meshzero's is MESHZERO_LOG_LEVEL)",
    "use_data_before_expert_parallelism": "a data order for MoE expert parallelism",
    "bf16.immediate_grad_update": "when DeepSpeed folds bf16 gradients into fp32",
    "bf16.check_grad_overflow": "bf16 needs no overflow check",
    "bf16.loss_scale": "bf16 needs no loss scaling; DeepSpeed ignores it too",
    "bf16.loss_scale_window": "bf16 needs no loss scaling; DeepSpeed ignores it too",
    "bf16.initial_scale_power": "bf16 needs no loss scaling; DeepSpeed ignores it too",
    "bf16.hysteresis": "bf16 needs no loss scaling; DeepSpeed ignores it too",
    "bf16.min_loss_scale": "bf16 needs no loss scaling; DeepSpeed ignores it too",
    # keys DeepSpeed's own parser does not read (seen in LLaMA-Factory's configs)
    "comms_config": "not a DeepSpeed key; DeepSpeed ignores it too",
    "monitor_config": "not a DeepSpeed key (its monitors are tensorboard, wandb, csv_monitor); "
                      "DeepSpeed ignores it too",
}

# Values that ask for nothing: dotted key -> the values that mean "off". A block whose
# "enabled" is false asks for nothing whatever else it holds (`OFF_WHEN_DISABLED`).
NOOP_VALUES: dict[str, tuple[Any, ...]] = {
    "gradient_predivide_factor": (1, 1.0),
    "gradient_allreduce_op": ("mean",),
    "managed_gradient_accumulation": (True,),
    "sparse_gradients": (False,),
    "fp16.fp16_master_weights_and_grads": (False,),
    "zero_optimization.zero_quantized_weights": (False,),
    "zero_optimization.zero_quantized_gradients": (False,),
    "zero_optimization.zero_quantized_nontrainable_weights": (False,),
    "zero_optimization.zeropp_loco_param": (None,),
    "scheduler.params.last_batch_iteration": (-1,),
    "tensor_parallel.autotp_size": (0, 1),
    "bf16.bf16_master_weights_and_grads": (False,),
    **{f"compile.{key}": (value,) for key, value in DEEPCOMPILE_DEFAULTS.items()},
}
# DeepSpeed's other spellings of values: dotted key -> {DeepSpeed's value: meshzero's}
VALUE_ALIASES: dict[str, dict[str, str]] = {
    "communication_data_type": {"bfp16": "bf16", "fp16": "fp16", "bf16": "bf16",
                                "fp32": "fp32"},
    # DeepSpeed's DtypeEnum spellings
    "data_types.grad_accum_dtype": {
        "fp32": "fp32", "float32": "fp32", "float": "fp32", "torch.float32": "fp32",
        "bf16": "bf16", "bfloat16": "bf16", "torch.bfloat16": "bf16",
        "fp16": "fp16", "float16": "fp16", "half": "fp16", "torch.float16": "fp16"},
}
OFF_WHEN_DISABLED = (
    "amp", "torch_autocast", "hybrid_engine", "curriculum_learning", "data_efficiency",
    "progressive_layer_drop", "eigenvalue", "elasticity", "autotuning", "compression_training",
    "tensorboard", "wandb", "csv_monitor", "comms_logger", "flops_profiler", "nebula",
    "comet", "quantize_training", "weight_quantization",
)  # fmt: skip
# DeepSpeed's retired keys: read by its parser and used for nothing since (accepted with a
# deprecation line). key -> what DeepSpeed does with it.
RETIRED: dict[str, str] = {
    "disable_allgather": "its config still reads it; nothing uses it",
    "vocabulary_size": "it only warns when the size is not a multiple of 8",
    "allgather_size": "only the boolean zero_optimization spelling read it",
}


def deepspeed_keys() -> set[str]:
    """Every dotted DeepSpeed key this module accepts outside the schema (for the nearest-key
    suggestion of a misspelt one)."""
    zero = {f"zero_optimization.{k}" for k in OLD_OFFLOAD}
    return {*ALIASES, *HINTS, *NOOP_VALUES, *OFF_WHEN_DISABLED, *RETIRED, *zero}


@dataclass
class Normalized:
    """`normalize`'s result: the dict the schema validates, and what it said along the way."""

    raw: dict[str, Any]
    hints: list[str] = field(default_factory=list)
    deprecations: list[str] = field(default_factory=list)
    problems: list[str] = field(default_factory=list)
    auto: list[str] = field(default_factory=list)  # "auto" left unresolved
    resolved: list[str] = field(default_factory=list)  # "auto" resolved, one line per key
    warnings: list[str] = field(default_factory=list)
    needs_model: bool = False  # "auto" or AutoTP that the model decides


def _get(raw: dict[str, Any], dotted: str) -> tuple[dict[str, Any] | None, str]:
    """The dict holding `dotted`'s last part (None when a parent is missing) and that part."""
    *parents, last = dotted.split(".")
    node: Any = raw
    for part in parents:
        node = node.get(part) if isinstance(node, dict) else None
    return (node if isinstance(node, dict) else None), last


def _rename(out: Normalized, old: str, new: str, deprecated: bool) -> None:
    parent, key = _get(out.raw, old)
    if parent is None or key not in parent:
        return
    value = parent.pop(key)
    target, new_key = _get(out.raw, new)
    if target is None:  # bfloat16 -> bf16 at the top level always has a parent
        return
    if new_key in target and target[new_key] != value:
        out.problems.append(f"{old} = {value!r} and {new} = {target[new_key]!r} are the same "
                            f"key in two spellings with different values; keep {new}")
        return
    target[new_key] = value
    if deprecated:
        out.deprecations.append(f"{old} is DeepSpeed's deprecated spelling of {new}")


def _old_offload(out: Normalized) -> None:
    zc = out.raw.get("zero_optimization")
    if not isinstance(zc, dict):
        return
    for old, (block, key) in OLD_OFFLOAD.items():
        if old not in zc:
            continue
        value = zc.pop(old)
        if value is False:
            continue  # asks for nothing
        if value is not True:
            out.problems.append(f"zero_optimization.{old} = {value!r}: give true or false")
            continue
        section = zc.setdefault(block, {})
        if isinstance(section, dict):
            section.setdefault(key, "cpu" if key == "device" else True)
        out.deprecations.append(f"zero_optimization.{old} is DeepSpeed's deprecated spelling of "
                                f"zero_optimization.{block}.{key}")


def _drop_noops(out: Normalized) -> None:
    for dotted, values in NOOP_VALUES.items():
        parent, key = _get(out.raw, dotted)
        if parent is not None and key in parent and _same(parent[key], values):
            del parent[key]
    for name in OFF_WHEN_DISABLED:
        block = out.raw.get(name)
        if isinstance(block, dict) and block.get("enabled") is False:
            del out.raw[name]


def _same(value: Any, values: tuple[Any, ...]) -> bool:
    return any(type(value) is type(v) and value == v or (value is None and v is None)
               or (isinstance(value, float) and isinstance(v, int) and not isinstance(v, bool)
                   and value == v)
               for v in values)


def _comments(out: Normalized) -> None:
    """Top-level keys starting with "_" are comments ({"_comment": ...}); DeepSpeed ignores
    them too."""
    for key in [k for k in out.raw if isinstance(k, str) and k.startswith("_")]:
        del out.raw[key]


def _value_aliases(out: Normalized) -> None:
    for dotted, spellings in VALUE_ALIASES.items():
        parent, key = _get(out.raw, dotted)
        value = parent.get(key) if parent is not None else None
        if isinstance(value, str) and value in spellings:
            parent[key] = spellings[value]  # type: ignore[index]


def _drop_hints(out: Normalized) -> None:
    zc = out.raw.get("zero_optimization")
    for dotted, why in HINTS.items():
        parent, key = _get(out.raw, dotted)
        if parent is None or key not in parent:
            continue
        value = parent[key]
        if dotted.endswith(("contiguous_gradients", "reduce_scatter", "allgather_partitions")):
            if value is True:
                continue  # what meshzero does: the schema keeps it
            if value is not False:
                continue  # a wrong type: the schema reports it
        del parent[key]
        out.hints.append(f"{dotted} ({why})")
    if isinstance(zc, dict) and zc.get("sub_group_size") == 0:
        zc.pop("sub_group_size")  # DeepSpeed accepts 0; the default tiles nothing smaller
        out.hints.append("zero_optimization.sub_group_size = 0 (the default tile is used)")


def normalize(raw: dict[str, Any], model: ModelFacts | None = None,
              tp_plan: Callable[[], str | None] | None = None) -> Normalized:
    """A copy of `raw` in the schema's spellings, without hints, retired keys and no-op values,
    with the "auto" values resolved that can be (config.auto; `model`: what the model says,
    when it is known) and AutoTP's size turned into tensor_parallel.size, over the plan
    `tp_plan` infers (without it the plan is inferred at initialize)."""
    out = Normalized(copy.deepcopy(raw))
    for old, (new, deprecated) in ALIASES.items():
        _rename(out, old, new, deprecated)
    _old_zero(out)
    _old_offload(out)
    _zero_aio(out)
    _retired(out)
    _comments(out)
    _value_aliases(out)
    out.needs_model = needs_model(out.raw)
    out.resolved = resolve_auto(out.raw, model or ModelFacts())
    _drop_noops(out)
    _drop_hints(out)
    _adam_max_grad_norm(out)
    _autotp(out, tp_plan)
    out.auto = find_auto(out.raw, "")
    return out


def _autotp(out: Normalized, tp_plan: Callable[[], str | None] | None) -> None:
    """DeepSpeed's AutoTP (tensor_parallel.autotp_size > 1): tp of that size over the shipped
    plan that matches the model, as `meshzero plan --search-mesh` infers it. Without
    `tp_plan` (no model yet) the size is set and the plan left for initialize to infer."""
    tp = out.raw.get("tensor_parallel")
    size = tp.get("autotp_size") if isinstance(tp, dict) else None
    if not isinstance(size, int) or isinstance(size, bool) or size <= 1:
        return  # absent, 0 or 1 (no AutoTP), or a wrong type the schema reports
    assert isinstance(tp, dict)  # the size was read from it
    if tp.get("size", size) != size:
        out.problems.append(f"tensor_parallel.autotp_size = {size} and tensor_parallel.size = "
                            f"{tp['size']} disagree; give one")
        return
    tp["size"] = size
    if tp.get("plan") is not None:
        return
    if tp_plan is None:
        out.needs_model = True  # the schema keeps autotp_size as the plan still to infer
        return
    plan = tp_plan()
    if plan is None:
        out.problems.append(f"tensor_parallel.autotp_size = {size}: no shipped tensor-parallel "
                            "plan (gpt, hf_gpt2, llama) matches the model's modules; give "
                            "tensor_parallel.plan ({module pattern: colwise|rowwise|vocab})")
        return
    tp["plan"] = plan


def _old_zero(out: Normalized) -> None:
    """DeepSpeed's oldest ZeRO spelling, ``"zero_optimization": true`` (stage 1, its bucket
    in the top-level ``allgather_size``) or false (stage 0)."""
    value = out.raw.get("zero_optimization")
    if not isinstance(value, bool):
        return
    zc: dict[str, Any] = {"stage": 1 if value else 0}
    if value and "allgather_size" in out.raw:
        zc["allgather_bucket_size"] = out.raw.pop("allgather_size")
    out.raw["zero_optimization"] = zc
    out.deprecations.append(f"zero_optimization: {str(value).lower()} is DeepSpeed's deprecated "
                            f"spelling of zero_optimization.stage {zc['stage']}")


def _zero_aio(out: Normalized) -> None:
    """An ``aio`` block written inside ``zero_optimization`` is read as the top-level one."""
    zc = out.raw.get("zero_optimization")
    if not isinstance(zc, dict) or "aio" not in zc:
        return
    block = zc.pop("aio")
    if "aio" in out.raw and out.raw["aio"] != block:
        out.problems.append("zero_optimization.aio and aio are both given and differ; aio "
                            "belongs at the top level: keep that one")
        return
    out.raw["aio"] = block
    out.warnings.append("zero_optimization.aio: aio belongs at the top level of the config, "
                        "not inside zero_optimization; read as the top-level aio")


def _retired(out: Normalized) -> None:
    for key, why in RETIRED.items():
        if key in out.raw:
            del out.raw[key]
            out.deprecations.append(f"{key} is retired in DeepSpeed ({why}); accepted as a "
                                    "no-op")


ADAM_TYPES = ("adam", "adamw")


def _adam_max_grad_norm(out: Normalized) -> None:
    """optimizer.params.max_grad_norm on Adam: DeepSpeed's fused Adam does not read it."""
    opt = out.raw.get("optimizer")
    params = opt.get("params") if isinstance(opt, dict) else None
    kind = opt.get("type") if isinstance(opt, dict) else None
    if not isinstance(params, dict) or "max_grad_norm" not in params or not isinstance(
            kind, str) or kind.lower() not in ADAM_TYPES:
        return
    value = params.pop("max_grad_norm")
    out.warnings.append(f"optimizer.params.max_grad_norm = {value!r} is ignored: {kind} does "
                        "not clip (DeepSpeed's fused Adam ignores it too); clip with the "
                        "top-level gradient_clipping")


# --- "auto" left after config.auto resolved what it can ------------------------------


def find_auto(node: Any, key: str) -> list[str]:
    """Dotted keys of every "auto" value at any depth (list items as key[i])."""
    if is_auto(node):
        return [key]
    if isinstance(node, dict):
        return [k for name, v in node.items()
                for k in find_auto(v, f"{key}.{name}" if key else str(name))]
    if isinstance(node, list):
        return [k for i, v in enumerate(node) for k in find_auto(v, f"{key}[{i}]")]
    return []


def drop_auto(raw: dict[str, Any], keys: list[str]) -> None:
    """Remove the keys holding an unresolved "auto" (a list holding one goes whole), so the
    schema reports only the other problems."""
    for key in keys:
        parent, last = _get(raw, key.split("[")[0])
        if parent is not None:
            parent.pop(last, None)

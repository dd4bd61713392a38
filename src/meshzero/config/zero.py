"""`zero_optimization`: the ZeRO stage, its buckets and thresholds, and where states live."""

from typing import Annotated

from pydantic import Field, Strict, model_validator

from meshzero.config.offload import OffloadOptimizerConfig, OffloadParamConfig
from meshzero.config.scalars import Bool, Int, NonNegInt, PosInt, Section


class ZeroConfig(Section):
    """`zero_optimization`; unit_classes (meshzero's own key) names the module classes whose
    instances become ZeRO units (gathered and released together)."""

    stage: Annotated[Int, Field(ge=0, le=3)] = 0
    overlap_comm: Bool = True
    # what meshzero always does; false is accepted as a hint (config.compat)
    contiguous_gradients: Bool = True
    reduce_scatter: Bool = True
    allgather_partitions: Bool = True
    reduce_bucket_size: NonNegInt = 500_000_000
    allgather_bucket_size: NonNegInt = 500_000_000
    stage3_prefetch_bucket_size: NonNegInt = 50_000_000
    stage3_param_persistence_threshold: NonNegInt = 100_000
    stage3_max_live_parameters: NonNegInt = 1_000_000_000
    stage3_max_reuse_distance: NonNegInt = 1_000_000_000
    unit_classes: list[Annotated[str, Strict(), Field(min_length=1)]] | None = None
    offload_optimizer: OffloadOptimizerConfig = Field(default_factory=OffloadOptimizerConfig)
    offload_param: OffloadParamConfig = Field(default_factory=OffloadParamConfig)
    sub_group_size: PosInt = 1_000_000_000
    zero_hpz_partition_size: PosInt = 1
    # ZeRO++ (docs/compression.md): int8 weights in stage 3's gathers (all, or frozen only),
    # int4 gradients across nodes in the reduce-scatter
    zero_quantized_weights: Bool = False
    zero_quantized_nontrainable_weights: Bool = False
    zero_quantized_gradients: Bool = False
    mics_shard_size: Annotated[Int, Field(ge=-1)] = -1
    # None: not given, and save_16bit_model saves; false at stage 3: it saves nothing, as in
    # DeepSpeed (whose default is false)
    stage3_gather_16bit_weights_on_model_save: Bool | None = None

    @model_validator(mode="after")
    def _offload_fits_stage(self) -> "ZeroConfig":
        problems = []
        opt, par = self.offload_optimizer.device, self.offload_param.device
        if opt != "none" and self.stage == 0:
            problems.append(f"zero_optimization.offload_optimizer.device = {opt!r} needs "
                            "zero_optimization.stage 1, 2 or 3 (stage is 0)")
        if par != "none" and self.stage != 3:
            problems.append(f"zero_optimization.offload_param.device = {par!r} needs "
                            f"zero_optimization.stage 3 (stage is {self.stage}): parameters "
                            "are sharded, and so can be offloaded, only at stage 3")
        if self.zero_hpz_partition_size > 1 and self.stage != 3:
            problems.append(f"zero_optimization.zero_hpz_partition_size = "
                            f"{self.zero_hpz_partition_size} needs zero_optimization.stage 3 "
                            f"(stage is {self.stage}): it keeps a secondary parameter shard")
        problems += self._zeropp_problems()
        if self.mics_shard_size not in (-1, 0, 1) and self.stage == 0:
            problems.append(f"zero_optimization.mics_shard_size = {self.mics_shard_size} needs "
                            "zero_optimization.stage 1, 2 or 3 (stage is 0)")
        if self.mics_shard_size > 1 and self.zero_hpz_partition_size > 1:
            problems.append("zero_optimization.mics_shard_size and zero_hpz_partition_size are "
                            "both set; choose one way of keeping traffic inside a node")
        if par == "nvme" and opt != "nvme":
            problems.append("zero_optimization.offload_param.device = 'nvme' needs "
                            f"zero_optimization.offload_optimizer.device = 'nvme' (it is "
                            f"{opt!r}): the NVMe optimizer step writes the parameter files")
        for key, section in (("offload_optimizer", self.offload_optimizer),
                             ("offload_param", self.offload_param)):
            if section.device == "nvme" and section.nvme_path is None:
                problems.append(f"zero_optimization.{key}.device = 'nvme' needs "
                                f"zero_optimization.{key}.nvme_path (a writable directory)")
        if problems:
            raise ValueError("\n".join(problems))
        return self

    def _zeropp_problems(self) -> list[str]:
        """qwZ / qgZ against the stage, offload and MiCS (the mesh: config/schema.py)."""
        problems = []
        weights = [k for k in ("zero_quantized_weights", "zero_quantized_nontrainable_weights")
                   if getattr(self, k)]
        for key in weights:
            if self.stage != 3:
                problems.append(f"zero_optimization.{key} = true needs zero_optimization.stage 3 "
                                f"(stage is {self.stage}): only stage 3 gathers weights")
        quantized = weights + (["zero_quantized_gradients"] if self.zero_quantized_gradients
                               else [])
        if self.zero_quantized_gradients and self.stage == 0:
            problems.append("zero_optimization.zero_quantized_gradients = true needs "
                            "zero_optimization.stage 1, 2 or 3 (stage is 0): stage 0 "
                            "all-reduces gradients, qgZ quantizes a reduce-scatter")
        offload = [k for k, d in (("offload_optimizer", self.offload_optimizer.device),
                                  ("offload_param", self.offload_param.device)) if d != "none"]
        for key in quantized:
            if offload:
                problems.append(f"zero_optimization.{key} with zero_optimization."
                                f"{offload[0]} is not supported yet; drop one of them")
            if self.mics_shard_size not in (-1, 0, 1):
                problems.append(f"zero_optimization.{key} with mics_shard_size = "
                                f"{self.mics_shard_size} is not supported yet; use "
                                "zero_hpz_partition_size to keep gathers inside a node")
        return problems

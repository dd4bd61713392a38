"""`optimizer` and `scheduler`: a type (any case, stored in its canonical spelling) and params
checked against that type's own model, so a misspelt param is an unknown key."""

import builtins  # the sections' own ``type`` field shadows the builtin in their bodies
from typing import Any, ClassVar, Literal

from pydantic import Field, ValidationInfo, field_validator

from meshzero.config.errors import InvalidValue
from meshzero.config.scalars import (
    Beta,
    Bool,
    Float,
    NonNegFloat,
    NonNegInt,
    PosFloat,
    PosInt,
    Ratio,
    Section,
    WarmupType,
)


class AdamParams(Section):
    """DeepSpeed's "Adam": decoupled weight decay (i.e. AdamW) unless adam_w_mode is false.

    With adam_w_mode false, weight_decay is added to the gradient (L2 regularisation, the
    behaviour of torch.optim.Adam). torch_adam asks for torch.optim, which meshzero uses
    whenever it can; bias_correction false (DeepSpeed's fused and CPU Adam divide m and v by
    nothing) is computed by meshzero's DeepSpeedAdam, as torch's always corrects.
    """

    lr: PosFloat = 1e-3
    betas: tuple[Beta, Beta] = (0.9, 0.999)
    eps: PosFloat = 1e-8
    weight_decay: NonNegFloat = 0.0
    amsgrad: Bool = False
    adam_w_mode: Bool = True
    torch_adam: Bool = False
    bias_correction: Bool = True

    @field_validator("bias_correction")
    @classmethod
    def _no_amsgrad(cls, value: bool, info: ValidationInfo) -> bool:
        if not value and info.data.get("amsgrad"):
            raise InvalidValue("false with amsgrad true is not supported (DeepSpeed's fused "
                               "and CPU Adam have no AMSGrad); drop one of them")
        return value


class AdamWParams(AdamParams):
    """DeepSpeed's "AdamW": Adam with decoupled weight decay (torch.optim.AdamW) whatever
    adam_w_mode says, as in DeepSpeed."""

    weight_decay: NonNegFloat = 0.01


class SGDParams(Section):
    """torch.optim.SGD's arguments; lr has no default, as in torch."""

    lr: PosFloat
    momentum: NonNegFloat = 0.0
    dampening: Float = 0.0
    weight_decay: NonNegFloat = 0.0
    nesterov: Bool = False

    @field_validator("nesterov")
    @classmethod
    def _nesterov_needs_momentum(cls, nesterov: bool, info: ValidationInfo) -> bool:
        if nesterov and (info.data.get("momentum", 1.0) <= 0 or info.data.get("dampening")):
            raise InvalidValue("needs momentum > 0 and dampening = 0")
        return nesterov


def _at_most(bound: str) -> Any:
    """A field validator: the value may not exceed the (earlier) field ``bound``."""
    def check(cls: type, value: float, info: ValidationInfo) -> float:
        top = info.data.get(bound, value)
        if value > top:
            raise InvalidValue(f"is greater than {bound} ({top})")
        return value
    return classmethod(check)


class _FusedParams(Section):
    """The params DeepSpeed's fused LAMB and its 1-bit optimizers share."""

    lr: PosFloat = 1e-3
    betas: tuple[Beta, Beta] = (0.9, 0.999)
    eps: PosFloat = 1e-8
    weight_decay: NonNegFloat = 0.0
    bias_correction: Bool = True
    eps_inside_sqrt: Bool = False
    max_grad_norm: NonNegFloat = 0.0


class LambParams(_FusedParams):
    """DeepSpeed's "Lamb" (FusedLamb): Adam's moments, a per-parameter trust ratio
    ||w|| / ||update|| clamped to [min_coeff, max_coeff], weight decay inside the update;
    max_grad_norm > 0 clips the global gradient norm first (meshzero/optimizers/lamb.py)."""

    max_coeff: NonNegFloat = 10.0
    min_coeff: NonNegFloat = 0.01

    _coeffs_ordered = field_validator("min_coeff")(_at_most("max_coeff"))


class _OneBitParams(_FusedParams):
    """The params DeepSpeed's 1-bit optimizers share. As in DeepSpeed, ``bias_correction``,
    ``eps_inside_sqrt`` and ``max_grad_norm`` are accepted and change nothing (its 1-bit
    optimizers never read them). ``comm_backend_name`` picks DeepSpeed's transport (NCCL,
    MPI, HCCL or its compressed backend): meshzero's communicator over the data-parallel
    process group carries every one of them (NCCL on GPUs, gloo on CPU), so all four mean
    the same here; ``cuda_aware`` (an MPI build that sends device memory) changes nothing
    either: the process group's backend sends device tensors as they are."""

    amsgrad: Literal[False] = False
    cuda_aware: Bool = False
    comm_backend_name: Literal["nccl", "mpi", "hccl", "compressed"] = "nccl"


class OneBitAdamParams(_OneBitParams):
    """DeepSpeed's "OneBitAdam" (meshzero/optimizers/onebit.py): Adam for ``freeze_step``
    steps, then the momentum crosses the data-parallel group in 1 bit per element with error
    feedback, and v is frozen."""

    freeze_step: NonNegInt = 100000


class ZeroOneAdamParams(_OneBitParams):
    """DeepSpeed's "ZeroOneAdam" (meshzero/optimizers/zeroone.py): v updated on steps
    ``var_interval`` apart (doubling every ``var_update_scaler`` updates) until
    ``var_freeze_step``, 1-bit gradients in between; then local steps synchronised in 1 bit
    every ``local_step_interval`` steps (doubling every ``local_step_scaler`` steps, up to
    ``local_step_clipper``)."""

    var_freeze_step: NonNegInt = 100000
    var_update_scaler: PosInt = 16
    local_step_scaler: PosInt = 32678
    local_step_clipper: PosInt = 16


class OneBitLambParams(_OneBitParams):
    """DeepSpeed's "OneBitLamb" (meshzero/optimizers/onebit_lamb.py): LAMB for
    ``freeze_step`` steps, its trust ratio averaged with ``coeff_beta``; then 1-bit
    momentum and the frozen ratio times a factor in [factor_min, factor_max] that moves by
    at most ``factor_threshold`` a step."""

    freeze_step: NonNegInt = 100000
    max_coeff: NonNegFloat = 10.0
    min_coeff: NonNegFloat = 0.01
    coeff_beta: Beta = 0.9
    factor_max: PosFloat = 4.0
    factor_min: PosFloat = 0.5
    factor_threshold: NonNegFloat = 0.1

    _factors_ordered = field_validator("factor_min")(_at_most("factor_max"))


OPTIMIZER_PARAMS: dict[str, type[Section]] = {
    "Adam": AdamParams,
    "AdamW": AdamWParams,
    "SGD": SGDParams,
    "Lamb": LambParams,
    "OneBitAdam": OneBitAdamParams,
    "ZeroOneAdam": ZeroOneAdamParams,
    "OneBitLamb": OneBitLambParams,
}
ONE_BIT_OPTIMIZERS = ("OneBitAdam", "ZeroOneAdam", "OneBitLamb")
DEEPSPEED_ONLY_OPTIMIZERS = (
    "Lion", "Adagrad", "MuAdam", "MuAdamW",
    "MuSGD", "FusedAdam", "FusedLamb", "FusedLion", "CPUAdam", "CPUAdagrad", "CPULion", "Adafactor",
)  # fmt: skip


def _after_warmup(total: int, info: ValidationInfo) -> int:
    warmup = info.data.get("warmup_num_steps", 0)
    if total <= warmup:
        raise InvalidValue(f"must be greater than warmup_num_steps ({warmup})")
    return total


class WarmupLRParams(Section):
    warmup_min_lr: NonNegFloat = 0.0
    warmup_max_lr: NonNegFloat = 0.001
    warmup_num_steps: NonNegInt = 1000
    warmup_type: WarmupType = "log"


class WarmupDecayLRParams(WarmupLRParams):
    total_num_steps: PosInt  # declared after warmup_num_steps so its validator can compare

    _total = field_validator("total_num_steps")(_after_warmup)


class WarmupCosineLRParams(Section):
    warmup_num_steps: NonNegInt = 1000
    total_num_steps: PosInt
    warmup_min_ratio: Ratio = 0.0
    cos_min_ratio: Ratio = 0.0001
    warmup_type: WarmupType = "log"

    _total = field_validator("total_num_steps")(_after_warmup)


SCHEDULER_PARAMS: dict[str, type[Section]] = {
    "WarmupLR": WarmupLRParams,
    "WarmupDecayLR": WarmupDecayLRParams,
    "WarmupCosineLR": WarmupCosineLRParams,
}
DEEPSPEED_ONLY_SCHEDULERS = ("OneCycle", "LRRangeTest")


class _TypedSection(Section):
    """A `type`, matched case-insensitively and kept in its canonical spelling, and `params`,
    checked against that type's own model (so a misspelt param is an unknown key) and stored
    complete: every param of the type, defaults filled, ints as ints."""

    kinds: ClassVar[dict[str, type[Section]]]
    deepspeed_only: ClassVar[tuple[str, ...]]
    what: ClassVar[str]

    type: str
    params: dict[str, Any] = Field(default_factory=dict)

    @classmethod
    def params_model(cls, kind: Any) -> builtins.type[Section] | None:
        """The params model for `kind` in any case, or None if it is not a known type."""
        lower = str(kind).lower()
        return next((model for name, model in cls.kinds.items() if name.lower() == lower), None)

    @field_validator("type", mode="before")
    @classmethod
    def _canonical_type(cls, value: Any) -> Any:
        if not isinstance(value, str):
            return value  # the str field reports the wrong type
        for name in cls.kinds:
            if name.lower() == value.lower():
                return name
        valid = ", ".join(cls.kinds)
        if value.lower() in {name.lower() for name in cls.deepspeed_only}:
            raise InvalidValue(
                f"is a DeepSpeed {cls.what} meshzero does not implement; valid: {valid}")
        raise InvalidValue(f"is not a {cls.what} meshzero knows; valid: {valid}")

    @field_validator("params")
    @classmethod
    def _check_params(cls, params: dict[str, Any], info: ValidationInfo) -> dict[str, Any]:
        if "type" not in info.data:  # a bad type was reported already; params cannot be checked
            return params
        return cls.kinds[info.data["type"]].model_validate(params).model_dump()

    def validated_params(self) -> dict[str, Any]:
        """All params of this type, defaults filled in."""
        return self.kinds[self.type].model_validate(self.params).model_dump()


class OptimizerConfig(_TypedSection):
    """`optimizer`: type Adam, AdamW, SGD or Lamb (any case) and its params."""

    kinds = OPTIMIZER_PARAMS
    deepspeed_only = DEEPSPEED_ONLY_OPTIMIZERS
    what = "optimizer"


class SchedulerConfig(_TypedSection):
    """`scheduler`: type WarmupLR, WarmupDecayLR or WarmupCosineLR (any case) and its params."""

    kinds = SCHEDULER_PARAMS
    deepspeed_only = DEEPSPEED_ONLY_SCHEDULERS
    what = "scheduler"


def optimizer_problems(optimizer: OptimizerConfig | None, *, tp_size: int, pp_size: int,
                       offload_optimizer: str, bf16_states: bool = False,
                       stage: int = 0, bf16_master: bool = False) -> list[str]:
    """What the chosen optimizer cannot run with. bf16 states are Adam's m and v. LAMB's
    trust ratio needs each parameter's whole norm: summed over ZeRO's shards, but not (yet)
    over tensor-parallel slices or pipeline stages, nor over NVMe tiles stepped apart."""
    if optimizer is not None and optimizer.type in ONE_BIT_OPTIMIZERS:
        return one_bit_problems(optimizer.type, stage=stage, tp_size=tp_size,
                                pp_size=pp_size, bf16_master=bf16_master)
    if bf16_states and optimizer is not None and optimizer.type not in ("Adam", "AdamW"):
        return [f"bf16.bf16_optimizer_states with optimizer.type {optimizer.type!r} is not "
                "supported: it keeps Adam's m and v in bf16; use type Adam or AdamW"]
    if bf16_states and optimizer is not None and optimizer.params.get("amsgrad"):
        return ["bf16.bf16_optimizer_states with optimizer.params.amsgrad true is not "
                "supported (DeepSpeed's Adam has no AMSGrad); drop one of them"]
    if bf16_states and offload_optimizer == "nvme":
        return ["bf16.bf16_optimizer_states with zero_optimization.offload_optimizer.device "
                "'nvme' is not supported yet (the NVMe files lay out fp32 states); use 'cpu' "
                "or 'none'"]
    if optimizer is None or optimizer.type != "Lamb":
        return []
    clashes = [f"{key} = {value}" for key, value, bad in (
        ("tensor_parallel.size", tp_size, tp_size > 1),
        ("pipeline_parallel.size", pp_size, pp_size > 1),
        ("zero_optimization.offload_optimizer.device", repr(offload_optimizer),
         offload_optimizer == "nvme")) if bad]
    if not clashes:
        return []
    return [f"optimizer.type 'Lamb' with {', '.join(clashes)} is not supported: its trust "
            "ratio needs whole-parameter norms, which meshzero sums over ZeRO shards only; "
            "use tensor_parallel.size 1, pipeline_parallel.size 1 and offload_optimizer "
            "'none' or 'cpu', or an Adam type"]


def one_bit_problems(kind: str, *, stage: int, tp_size: int, pp_size: int,
                     bf16_master: bool) -> list[str]:
    """The 1-bit optimizers compress the momentum of whole parameters, every rank holding
    all of it: ZeRO stage 0 only, as in DeepSpeed (its engine asserts ``not
    zero_optimization()`` for them). From stage 1 on a rank holds the momentum of its
    shard only, and stages 2-3 reduce-scatter the gradients, which after the warm-up must
    stay on their rank."""
    problems = []
    if stage != 0:
        problems.append(
            f"optimizer.type {kind!r} with zero_optimization.stage {stage} is not supported: "
            "it all-reduces each rank's whole momentum in 1 bit after the warm-up, which "
            "needs the whole momentum and the unreduced gradient on every rank (ZeRO stage "
            "0; DeepSpeed refuses it with ZeRO too); use zero_optimization.stage 0, or "
            "type Adam with stage 1-3")
    clashes = [f"{key} = {value}" for key, value in (
        ("tensor_parallel.size", tp_size), ("pipeline_parallel.size", pp_size)) if value > 1]
    if clashes:
        problems.append(f"optimizer.type {kind!r} with {', '.join(clashes)} is not supported "
                        "yet: it compresses over the data-parallel group of whole "
                        "parameters; use sizes 1")
    if bf16_master:
        problems.append(f"optimizer.type {kind!r} with bf16.bf16_master_weights_and_grads "
                        "is not supported: its momentum and error feedback are fp32; drop "
                        "bf16_master_weights_and_grads")
    return problems

"""The batch rule train_batch_size = micro batch * accumulation steps * data-parallel size,
and the mesh's data-parallel size: checked once for every caller (the config's own check,
the engine, the topology and the estimator)."""

from meshzero.config.errors import ConfigError


def batch_problems(tbs: int | None, micro: int | None, gas: int | None) -> list[str]:
    """Checks of train_batch_size (tbs), train_micro_batch_size_per_gpu (micro) and
    gradient_accumulation_steps (gas) that hold whatever the data-parallel size is."""
    if tbs is None and micro is None and gas is not None:
        return [
            f"gradient_accumulation_steps ({gas}) alone does not set the batch size; also give "
            "train_batch_size or train_micro_batch_size_per_gpu"
        ]
    per_rank = (micro or 1) * (gas or 1)
    if tbs is None or tbs % per_rank == 0:
        return []
    names = {"train_micro_batch_size_per_gpu": micro, "gradient_accumulation_steps": gas}
    factors = " * ".join(f"{name} ({n})" for name, n in names.items() if n is not None)
    product = f" = {per_rank}" if micro and gas else ""
    return [
        f"train_batch_size ({tbs}) is not divisible by {factors}{product}, so no data-parallel "
        "size satisfies train_batch_size = train_micro_batch_size_per_gpu * "
        "gradient_accumulation_steps * data-parallel size"
    ]


def resolve_batch(tbs: int | None, micro: int | None, gas: int | None,
                  dp_size: int) -> tuple[int, int, int]:
    """(train_batch_size, micro batch per rank, gradient accumulation steps) for `dp_size`
    ranks, under train_batch_size == micro * accumulation * dp_size; a missing value is
    derived from the others (micro and accumulation default to 1)."""
    if isinstance(dp_size, bool) or not isinstance(dp_size, int) or dp_size < 1:
        raise ConfigError(f"data-parallel size must be a positive integer, got {dp_size!r}")
    if tbs is None:
        if micro is None and gas is not None:
            raise ConfigError(batch_problems(tbs, micro, gas)[0])
        micro, gas = micro or 1, gas or 1
        return micro * gas * dp_size, micro, gas
    if micro is None:
        gas = gas or 1
        micro = _divide(tbs, gas, dp_size, "gradient_accumulation_steps",
                        "train_micro_batch_size_per_gpu")  # fmt: skip
    elif gas is None:
        gas = _divide(tbs, micro, dp_size, "train_micro_batch_size_per_gpu",
                      "gradient_accumulation_steps")  # fmt: skip
    if tbs != micro * gas * dp_size:
        raise ConfigError(
            f"train_batch_size ({tbs}) != train_micro_batch_size_per_gpu ({micro}) * "
            f"gradient_accumulation_steps ({gas}) * data-parallel size ({dp_size}) = "
            f"{micro * gas * dp_size}"
        )
    return tbs, micro, gas


def _divide(tbs: int, known: int, dp_size: int, known_key: str, missing_key: str) -> int:
    """train_batch_size / (known * dp_size), which must be a whole number."""
    if tbs % (known * dp_size):
        raise ConfigError(
            f"train_batch_size ({tbs}) is not divisible by {known_key} ({known}) * data-parallel "
            f"size ({dp_size}) = {known * dp_size}, so {missing_key} would be "
            f"{tbs / (known * dp_size):g}"
        )
    return tbs // (known * dp_size)


def data_parallel_size(world_size: int, tp: int, pp: int, sp: int = 1) -> int:
    """dp = world / (tp * pp * sp): the data-parallel ranks (the batch rule's; ZeRO shards
    over dp x sp), given the mesh's tp, pp and sequence-parallel sizes."""
    if world_size % (tp * pp * sp) != 0:
        names = f"tensor_parallel.size ({tp}) x pipeline_parallel.size ({pp})"
        if sp > 1:
            names += f" x sequence_parallel_size ({sp})"
        raise ConfigError(
            f"{names} = {tp * pp * sp} does not divide the world size {world_size}, so no "
            f"data-parallel size makes sp x tp x pp x dp = {world_size}; valid: sizes whose "
            f"product divides {world_size}"
        )
    return world_size // (tp * pp * sp)


def check_pipeline_batches(micro_batches: int | None, global_batch: int, micro: int, gas: int,
                           dp_size: int) -> None:
    """With pipelining the micro-batches of one step are its accumulation steps."""
    if micro_batches is not None and micro_batches != gas:
        raise ConfigError(
            f"pipeline_parallel.micro_batches ({micro_batches}) != the gradient "
            f"accumulation steps ({gas}, from train_batch_size {global_batch} / micro batch "
            f"{micro} / dp {dp_size}): the micro-batches of one pipeline step are its "
            "accumulation steps")

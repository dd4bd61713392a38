"""`faults` (meshzero's key; DeepSpeed has none): what a step does with non-finite
gradients, and how long a collective may wait for its peers."""

from typing import Literal

from meshzero.config.scalars import PosFloat, Section

# the default comm_timeout: far below gloo's and NCCL's 30 minutes, long enough for a slow
# checkpoint write on one rank while the others wait in the next collective
DEFAULT_COMM_TIMEOUT_S = 600.0


class FaultsConfig(Section):
    """`faults`: ``nonfinite_grads`` "skip" (the step is skipped on every rank with a
    warning and counted in ``skipped_steps``) or "raise" (skipped, then
    ``NonFiniteGradientsError`` on every rank), at fp32 and bf16 (fp16 keeps its loss
    scaler: an overflow is skipped and the scale lowered); ``comm_timeout``: seconds a
    collective may wait for its peers before it fails naming the op, the group and the step
    (passed to ``init_process_group`` when meshzero creates it, and to every group meshzero
    creates)."""

    nonfinite_grads: Literal["skip", "raise"] = "skip"
    comm_timeout: PosFloat = DEFAULT_COMM_TIMEOUT_S

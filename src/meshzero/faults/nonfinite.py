"""Non-finite gradients: detected at every precision and stage, and the step skipped (or
refused) on every rank alike.

What makes the decision the same on every rank:

- A non-finite loss seeds its backward with NaN (:meth:`StepGuard.seed`), so it always makes
  non-finite gradients (``loss + inf`` alone would give finite ones).
- At the step, the count of non-finite gradient elements and the squared gradient norm
  (``gradient_clipping``, the fp16 overflow check) are summed over the ZeRO ranks once, by
  the phase check's exchange (faults/phase.py: it carries the step's phase check too),
  counted as ``step_check``; at one rank by an all-reduce (stage 0 needs none: its
  gradients are all-reduced, so every rank holds the same values; tensor and pipeline
  parallel ranks are always included, by all-reduces over their groups).
- With ``offload_optimizer: cpu`` and nothing global before the step, units are stepped
  during backward: a rank's non-finite gradient is spread to the whole reduced group (every
  rank's shard holds NaN), each rank's stepper refuses that unit and every one after it, and
  :meth:`StepGuard.check_unit_steps` agrees on the outcome.

fp16 keeps its loss scaler: an overflow skips the step and lowers the scale (never raises).
"""

from __future__ import annotations

import logging
import math
from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING

import torch

if TYPE_CHECKING:
    from meshzero.comm import Communicator
    from meshzero.faults.phase import PhaseCheck
    from meshzero.zero.sharded_optimizer import ShardedOptimizerState

logger = logging.getLogger(__name__)

CHECK_OP = "step_check"  # the comm_report name of the check's own all-reduce


class NonFiniteGradientsError(FloatingPointError):
    """A step met inf/nan gradients with ``faults.nonfinite_grads: "raise"`` (the step was
    skipped first), or after units were already stepped during backward."""


class StepGuard:
    """The non-finite check of one engine's steps and what it decided."""

    def __init__(self, *, mode: str, scales_loss: bool, comm: Communicator,
                 model_parallel: Sequence[Communicator] = (), rank: int = 0,
                 phases: PhaseCheck | None = None):
        """``mode``: faults.nonfinite_grads; ``scales_loss``: fp16 or a float16 autocast (an
        overflow is the loss scaler's business, never an error); ``comm``: the ranks ZeRO
        shards over;
        ``model_parallel``: tp and pp communicators (their ranks hold other parameters);
        ``phases``: the phase check over ``comm``'s ranks (faults/phase.py), whose exchange
        the sum over ``comm`` is made on: the step's phase check rides on it (None: an
        all-reduce over ``comm``)."""
        if mode not in ("skip", "raise"):
            raise ValueError(f"faults.nonfinite_grads = {mode!r}; use 'skip' or 'raise'")
        self.mode = mode
        self.scales_loss = scales_loss
        self.comm = comm
        self.model_parallel = list(model_parallel)
        self.rank = rank
        self.phases = phases
        self.step_applied = False  # whether the last step() changed the weights

    @staticmethod
    def seed(loss: torch.Tensor) -> torch.Tensor:
        """The gradient to start ``backward`` of a scalar ``loss`` from: 1, or NaN when the
        loss is inf/nan (no host sync: a device-side select)."""
        finite = torch.isfinite(loss.detach()).all()
        one = torch.ones((), dtype=torch.float32, device=loss.device)
        return torch.where(finite, one, torch.full_like(one, math.nan))

    def grad_stats(self, state: ShardedOptimizerState, *, clip: float,
                   replicated_weight: dict[int, float] | None) -> tuple[float | None, bool]:
        """(squared global gradient norm, whether any gradient on any rank is non-finite),
        with the step's one all-reduce (the norm rides on the check: engine.last_grad_norm
        is set by every step, as DeepSpeed's get_global_grad_norm). The norm is None when
        nothing clips and taking it would read every gradient back from NVMe."""
        rides = clip > 0 or self.scales_loss  # the step all-reduces stats anyway
        need_norm = clip > 0 or not state.tier.norm_reads_storage
        sq, overflow = state.reduce_grad_stats(
            need_norm=need_norm, need_overflow=True, model_parallel=self.model_parallel,
            replicated_weight=replicated_weight, op="all_reduce" if rides else CHECK_OP,
            exchange=self._exchange())
        return (sq if need_norm else None), overflow

    def _exchange(self) -> Callable[[torch.Tensor, str], None] | None:
        """The sum over ``comm``'s ranks as a phase exchange, when there is a group: counted
        as the check's own op (``step_check``) whatever rides on it, the exchange's rows
        being the phase check's, not a gradient all-reduce's."""
        phases = self.phases
        if phases is None or not phases.posts_ahead:  # one rank, or watched waits
            return None
        return lambda values, _: phases.all_reduce(values, CHECK_OP)

    def check_unit_steps(self, stepped: int, refused: int, sq_norm: float | None, step: int
                         ) -> tuple[bool, float | None]:
        """After units were stepped during backward: (True: skip the step, when every rank
        refused its first unit for non-finite gradients; the squared global gradient norm
        from every rank's ``sq_norm``, None if a rank has none), in one all-reduce; raise
        when some units were stepped and others refused."""
        # a rank without its norm sends NaN: the sum is then NaN, and the norm None
        flags = torch.tensor([float(refused > 0), float(stepped > 0),
                              math.nan if sq_norm is None else sq_norm], dtype=torch.float64)
        exchange = self._exchange()
        if exchange is None:
            self.comm.all_reduce(flags, name=CHECK_OP).wait()
        else:
            exchange(flags, CHECK_OP)
        for comm in self.model_parallel:
            comm.all_reduce(flags, name=CHECK_OP).wait()
        any_refused, any_stepped, sq = flags.tolist()
        if not any_refused:
            return False, None if math.isnan(sq) else sq
        if any_stepped:
            raise NonFiniteGradientsError(
                f"step {step}: non-finite gradients reached the optimizer after some units "
                "had been stepped during backward (offload_optimizer cpu steps each unit as "
                "soon as its gradient is reduced); no weight holds inf/nan, but the step was "
                "applied to part of the model: load the last checkpoint. To have such "
                "steps skipped whole, set gradient_clipping > 0 or "
                "engine.overlap_offload_step = False")
        return True, None

    def count_skip(self, counters, step: int, loss_scale: float) -> None:
        """Count a skipped step in ``counters.skipped_steps`` and say why."""
        counters.skipped_steps += 1
        if self.scales_loss:
            logger.info("step %d: gradient overflow at loss scale %g, skipping the step",
                        step, loss_scale)
        elif self.rank == 0:  # the decision is the same on every rank: say it once
            logger.warning("step %d: inf/nan gradients (or loss) on some rank; the step was "
                           "skipped on every rank (faults.nonfinite_grads: %s, skipped_steps "
                           "%d)", step, self.mode, counters.skipped_steps)

    def finish(self, skipped: bool, step: int) -> bool:
        """Record the step's outcome (returned: whether it was applied); in "raise" mode a
        skipped fp32/bf16 step raises, on every rank, after the step is closed."""
        self.step_applied = not skipped
        if skipped and self.mode == "raise" and not self.scales_loss:
            raise NonFiniteGradientsError(
                f"step {step}: inf/nan gradients (or loss) on some rank; the step was skipped "
                "on every rank, no weight changed (faults.nonfinite_grads: raise; 'skip' "
                "goes on training)")
        return self.step_applied

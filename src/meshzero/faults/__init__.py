"""Guards that turn silent faults into decisions every rank makes alike (docs/failures.md).

    nonfinite.py    inf/nan gradients: the step skipped (or refused) on every rank
    fingerprint.py  ranks that must agree (config, batch, model), checked at initialize
    phase.py        an engine call made on some ranks only: the calls' posts on a control group
    stall.py        the stall watch: waits that close a cycle raise on every rank of it

The communication timeout and :class:`meshzero.comm.CollectiveError` live in ``comm/``
and ``topology.py`` (``faults.comm_timeout``).
"""

from meshzero.faults.fingerprint import RankMismatchError, check_ranks_agree
from meshzero.faults.nonfinite import NonFiniteGradientsError, StepGuard

__all__ = ["NonFiniteGradientsError", "RankMismatchError", "StepGuard", "check_ranks_agree"]

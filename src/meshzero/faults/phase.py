"""The phase check: every rank makes the same collective engine calls in the same order.

Before each engine call between steps (a checkpoint save or load, ``full_state_dict``, the
16-bit save, a weights load) and each stage-3 gather, every rank posts where it is on a small
control group of its own, one row per rank::

    [phase code, step, payload...]      int64, the same width on every rank

(the payload: stage 3's unit-order check, ``zero/sharded_params.py``: [count, units..., -1
padding]; a sum's values, :meth:`PhaseCheck.all_reduce`: [0, float64 bits...]). A call made
on some ranks only, ``if rank == 0: engine.save_checkpoint(...)``, then fails on every rank
of the group, naming both sides ("save_checkpoint was called on rank 0 while rank 1 is in
forward (step 3, gathering unit 2 ('blocks.2')); call it on every rank"), instead of waiting
for the collective timeout with no line on either rank: at once where the other side posts
too, within seconds where it waits in a collective that posts nothing (below).

The group is the ZeRO shard group's ranks (the ranks that run the same collectives in
lockstep; with tensor or pipeline parallelism, the data-parallel ranks of one piece). It is
a process group of its own: on the data group the check would queue behind the gathers and
reductions in flight (gloo runs a group's ops in order) and wait for them all. It is a gloo
group on host tensors whatever the data backend: with NCCL, a check on the device would make
the host wait for every kernel queued before it (reading the rows back), so the host could no
longer run ahead of the GPU at each stage-3 gather.

On gloo, training posts nothing: a call made on some ranks while the others train is found
by the stall watch (faults/stall.py), from the waits that block, at no cost to a step. Only
where a wait does not block the host (NCCL), or there is no store to report in, does the
engine post ahead (:attr:`posts_ahead`): one exchange per step, posted at the backward's
entry and waited on before its first wait that can block (its latency hides behind the
backward's compute); the step posts nothing of its own: its first collective, the
non-finite check's sum (faults/nonfinite.py), is made on this group as a phase exchange
(:meth:`all_reduce`), so a rank in ``step()`` meets a rank in another call there. On two busy
CPU cores that costs about 1.5 ms on steps of 6-11 ms (benchmarks/phase_check.py,
docs/failures.md).
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from contextlib import contextmanager

import torch
import torch.distributed as dist

from meshzero.comm import CommStats, Communicator, Handle
from meshzero.faults.stall import StallWatch, default_store

TRAINING = ("forward", "backward", "step")
# an engine call between steps -> the phase its collectives are counted and named in
CALLS = {"save_checkpoint": "checkpoint save", "load_checkpoint": "checkpoint load",
         "full_state_dict": "full_state_dict", "save_16bit_model": "16-bit model save",
         "load_weights": "weights load"}
PHASES = TRAINING + tuple(CALLS.values())  # a phase's code is its index; unknown: len()
# the values a sum exchange carries: the step's squared norm and non-finite count, or, after
# units were stepped in backward, the refused and stepped flags and the squared norm
SUM_WIDTH = 3
_CALL_OF = {phase: call for call, phase in CALLS.items()}


class PhaseError(RuntimeError):
    """The ranks of a group were in different engine calls at the same collective."""


def _ranks(ranks: list[int]) -> str:
    return f"rank {ranks[0]}" if len(ranks) == 1 else f"ranks {', '.join(map(str, ranks))}"


class PhaseCheck:
    """Posts this rank's phase on the control group ``comm`` (None: one rank, nothing to
    check) before a collective and raises :class:`PhaseError` where the ranks differ.
    ``payload``: the width of the payload every post carries (padded with -1);
    ``unit_names``: stage 3's units, to name a gather in the error."""

    def __init__(self, comm: Communicator | None, stats: CommStats, device: torch.device,
                 payload: int = 0, unit_names: Sequence[str] = (), watch: bool = False):
        self.comm = comm
        self.stats = stats
        self.device = device
        # [phase, step] and a payload that fits the unit-order check and a sum's [0, values]
        self.width = 2 + max(payload, 1 + SUM_WIDTH)
        self.unit_names = list(unit_names)
        self.ranks = [0] if comm is None or comm.group is None \
            else dist.get_process_group_ranks(comm.group)
        self.posts = 0  # rows exchanged (the cost: one small all-gather each)
        self._ahead: tuple[Handle, torch.Tensor] | None = None  # posted, not yet waited on
        # ``watch`` (the data collectives are gloo's: their waits can be made in slices):
        # stalled waits are reported and compared instead of posts ahead (faults/stall.py)
        self.watch = self._watch() if watch else None

    def _watch(self) -> StallWatch | None:
        store = default_store()
        if self.comm is None or self.comm.group is None or store is None:
            return None
        watch = StallWatch(
            store, f"meshzero/stall/{self.comm.group.group_name}", dist.get_rank(),
            self.ranks, self._head, self.stats.issued, self.stats.members,
            lambda rows: PhaseError(self._mismatch(rows)))
        self.stats.watch = watch
        return watch

    @property
    def posts_ahead(self) -> bool:
        """Whether training's collectives need a post ahead of them (a group, no watch)."""
        return self.comm is not None and self.watch is None

    def enter(self, phase: str, post: bool = True) -> None:
        """A training phase starts (``backward``, ``step``): collectives are named in it from
        now on; ``post``: collectives follow, so post the phase ahead of them (settled before
        the first wait on any of them: its latency hides behind the backward's compute). A
        step whose first collective is the non-finite check's sum needs no post: that sum
        is a phase exchange (:meth:`all_reduce`)."""
        self.stats.phase = phase
        if post and self.posts_ahead:
            assert self.comm is not None  # (posts_ahead)
            self.settle()
            every = self._every()
            self._ahead = (self.comm.all_gather(every, self._row(()), op="phase_check"), every)
            self.stats.gate = self.settle

    def settle(self) -> None:
        """Wait for the phase posted ahead, if any; PhaseError where the ranks differ."""
        ahead, self._ahead = self._ahead, None
        if ahead is None:
            return
        if self.stats.gate == self.settle:
            self.stats.gate = None
        handle, every = ahead
        handle.wait()
        self._check(every)

    @contextmanager
    def entry(self, call: str) -> Iterator[None]:
        """Around an engine call between steps (``save_checkpoint``, ...): its collectives
        are counted and named in its own phase, after one check that every rank made it."""
        with self.stats.in_phase(CALLS[call]):
            self.post()
            yield

    def post(self, payload: Sequence[int] = (), op: str = "phase_check",
             tail: torch.Tensor | None = None) -> list[list[int]] | None:
        """Exchange [the current phase, step, ``payload``, ``tail``] with every rank of the
        group (counted as ``op``); PhaseError on every rank unless all are in the same phase.
        Returns every rank's payload row (None without a group)."""
        comm = self.comm
        if comm is None:
            return None
        self.settle()  # a phase posted ahead comes first on the group
        every = self._every()
        comm.all_gather(every, self._row(payload, tail), op=op).wait()
        return self._check(every)

    def all_reduce(self, values: torch.Tensor, op: str) -> None:
        """``values`` (k,) float64 <- their sum over the group's ranks, by one phase
        exchange (counted as ``op``; PhaseError where the ranks' phases differ): the step's
        first collective carries its phase check this way instead of a post of its own.
        Every rank adds the rows in rank order, so every rank gets the same bits."""
        k = values.numel()
        assert self.comm is not None and values.dtype == torch.float64 and k <= SUM_WIDTH
        rows = self.post([0], op=op, tail=values.view(torch.int64))
        assert rows is not None  # a group: rows come back
        summed = torch.tensor([row[1:1 + k] for row in rows], dtype=torch.int64)
        values.copy_(summed.view(torch.float64).sum(0))

    def _row(self, payload: Sequence[int], tail: torch.Tensor | None = None) -> torch.Tensor:
        """[phase code, step, payload..., tail..., -1 padding] (width,) int64 on the check's
        device, the host (``tail``: int64, copied there from wherever it is: the step's
        sums, which the step reads on the host anyway)."""
        more = 0 if tail is None else tail.numel()
        assert len(payload) + more <= self.width - 2, "a payload wider than the check allows"
        self.posts += 1
        head = self._head() + list(payload)
        mine = torch.tensor(head + [-1] * (self.width - len(head)), dtype=torch.int64)
        mine = mine.to(self.device)
        if tail is not None:
            mine[len(head):len(head) + more] = tail.to(self.device)
        return mine

    def _head(self) -> list[int]:
        """[the current phase's code, step]."""
        phase = self.stats.phase
        return [PHASES.index(phase) if phase in PHASES else len(PHASES),
                -1 if self.stats.step is None else self.stats.step]

    def _every(self) -> torch.Tensor:
        assert self.comm is not None  # called only with a group
        return torch.empty(self.comm.size * self.width, dtype=torch.int64, device=self.device)

    def _check(self, every: torch.Tensor) -> list[list[int]]:
        """Every rank's payload row, after PhaseError if the ranks' phases differ."""
        rows = every.view(-1, self.width).tolist()
        if any(row[0] != rows[0][0] for row in rows):
            raise PhaseError(self._mismatch(dict(zip(self.ranks, rows, strict=True))))
        return [row[2:] for row in rows]

    def close(self) -> None:
        """Let go of the control group (the engine's end); a phase posted ahead is dropped
        (the engine's end waits for or releases the ops in flight first). The group is not
        destroyed here: a gloo group shut down on one rank while the ranks build the next
        engine's groups made that build fail in connectFullMesh ("Connection closed by
        peer", CI 2026-12-06); like the mesh's groups it goes with the user's
        destroy_process_group() (docs/lifecycle.md)."""
        self._ahead = None
        if self.stats.gate == self.settle:
            self.stats.gate = None
        if self.watch is not None:
            self.watch.close()
            self.stats.watch = self.watch = None
        self.comm = None

    def _mismatch(self, rows: dict[int, list[int]]) -> str:
        """The same sentence on every rank given the same rows (``rows``: global rank -> its
        row, in rank order; a deadlock the stall watch found gives each rank the ranks that
        had reported when it looked): the side of the first rank and the first that differs
        (in phase, else in step); an engine call made on some ranks only is named as the
        call."""
        sides: dict[tuple[int, int], list[int]] = {}
        for r, row in rows.items():
            sides.setdefault((row[0], row[1]), []).append(r)
        if len(sides) == 1:  # waiting on each other in the same phase: rank order differs
            sides = {(row[0], -2 - r): [r] for r, row in rows.items()}
        ((a, _), ra), ((b, _), rb) = list(sides.items())[:2]
        if self._is_call(b) and not self._is_call(a):
            (a, ra), (b, rb) = (b, rb), (a, ra)
        first, other = _ranks(ra), _ranks(rb)
        verb = "is" if len(rb) == 1 else "are"
        if self._is_call(a) and self._is_call(b):
            return (f"{self._call(a)} was called on {first} while {other} called "
                    f"{self._describe(rows[rb[0]])}; every rank must make the same engine "
                    "calls in the same order")
        if self._is_call(a):
            return (f"{self._call(a)} was called on {first} while {other} {verb} in "
                    f"{self._describe(rows[rb[0]])}; call it on every rank")
        return (f"{first} {'is' if len(ra) == 1 else 'are'} in {self._describe(rows[ra[0]])} "
                f"while {other} {verb} in {self._describe(rows[rb[0]])}; every rank must run "
                "forward, backward and step() together (an engine call made on some ranks "
                "only, or rank-dependent control flow)")

    @staticmethod
    def _is_call(code: int) -> bool:
        return code < len(PHASES) and PHASES[code] in _CALL_OF

    @staticmethod
    def _call(code: int) -> str:
        if code >= len(PHASES):
            return "another engine call"
        phase = PHASES[code]
        return _CALL_OF.get(phase, "step()" if phase == "step" else phase)

    def _describe(self, row: list[int]) -> str:
        """``forward (step 3, gathering unit 2 ('blocks.2'))``."""
        where = [f"step {row[1]}"] if row[1] >= 0 else ["initialize"]
        count = row[2] if len(row) > 2 else 0
        if count > 0 and 0 <= row[3] < len(self.unit_names):
            where.append(f"gathering unit {row[3]} ({self.unit_names[row[3]]!r})")
        return f"{self._call(row[0])} ({', '.join(where)})"

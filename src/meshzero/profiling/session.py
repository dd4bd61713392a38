"""The engine's profiling: the step clock every step, and the profiler of one step.

Every optimizer step is timed by the :class:`StepClock` (a mark at the first forward, one at
the end of ``step()``: a timestamp on CPU, a CUDA event on GPU). ``flops_profiler.profile_step``
P is profiled by a :class:`StepProfiler` over two steps: step P-1 counts FLOPs (a dispatch
mode: slow, so not timed) and step P is timed with cheap marks, reusing P-1's counts when its
inputs have the same shapes (at P = 0, or with other shapes, P counts too and says so). The
report's headline (latency, throughput, FLOP/s, MFU, HFU) is the median of the last
``flops_profiler.headline_steps`` (K) steps after step 0 (which records the unit order and
warms up) other than P-1 and P: profiling never becomes the job's speed. The report is
final, printed, written and sent to the monitors once K such steps exist (at the profiled
step when enough came before it, else later), or at ``engine.close()`` with the steps there
are; until then ``engine.last_profile`` and the JSON file hold it with the headline from the
steps so far (``headline_final`` false).
"""

from __future__ import annotations

import time
import weakref
from dataclasses import replace
from typing import Any

from meshzero.profiling.monitor import Event
from meshzero.profiling.report import ProfileReport
from meshzero.profiling.step import StepProfiler, with_headline, write_report
from meshzero.profiling.timing import StepClock, StepTime, timeline_for


def describe_steps(steps: list[StepTime]) -> str:
    numbers = [s.step for s in steps]
    runs = "steps " + ", ".join(str(n) for n in numbers) if len(numbers) <= 6 else \
        f"steps {numbers[0]}..{numbers[-1]} (unprofiled)"
    return (f"median of {len(numbers)} unprofiled step(s), {runs}; this rank's step clock "
            "(first forward to the end of step())")


class EngineProfiling:
    """What the engine calls: :meth:`open_step`, :meth:`set_phase`, :meth:`end_backward`,
    :meth:`close_step` and :meth:`close`; ``report`` is ``engine.last_profile``."""

    def __init__(self, engine: Any) -> None:
        # a proxy, not a reference: the engine owns this, and a cycle would keep a dropped
        # engine (and its NVMe files) alive until the garbage collector runs
        self.engine = weakref.proxy(engine)
        self.config = engine.config.flops_profiler
        self.clock = StepClock(timeline_for(engine.device),
                               keep=max(64, 2 * self.config.headline_steps + 2))
        self.profiler: StepProfiler | None = None
        self.report: ProfileReport | None = None
        self.pending = False  # a report whose headline still waits for steps
        engine.compiler.profiling_active = self.active  # compiled units run eager in P-1, P

    # -- the hot path: a mark per step; hooks only in steps P-1 (counting) and P (timed) ---------
    def _profiled(self, step: int) -> bool:
        """Step P, and P-1, which counts its FLOPs: neither enters a headline."""
        p = self.config.profile_step
        return self.config.enabled and p >= 0 and step in (p - 1, p)

    def active(self) -> bool:
        """Whether the FLOP-counting or the timed step is under way (its hooks are set)."""
        return self.profiler is not None

    def open_step(self, step: int, args: tuple, kwargs: dict) -> None:
        self.clock.open()
        if not self._profiled(step):
            return
        p = self.config.profile_step
        if self.profiler is None:
            self.profiler = StepProfiler(self.engine, p)
        if step == p - 1:
            self.profiler.start_counting(step, args, kwargs)
        else:
            self.profiler.start_timing(args, kwargs)

    def set_phase(self, phase: str) -> None:
        if self.profiler is not None:
            self.profiler.set_phase(phase)

    def end_backward(self) -> None:
        if self.profiler is not None:
            self.profiler.end_backward()

    def close_step(self, step: int) -> None:
        """The end of optimizer step ``step``: its clock mark, then the profiler's work."""
        self.clock.close(step, self._profiled(step))
        if self.profiler is None:
            if self.pending and self._enough():
                self._headline(final=True)
        elif step == self.config.profile_step - 1:
            self.profiler.stop_counting()  # and registers step P's timer, outside step P
        elif step == self.config.profile_step:
            t0 = time.perf_counter()
            report = self.profiler.finish(self.clock.steps[-1], self.clock)
            compiled = self.engine.compile_report() if self.engine.is_compiled else None
            self.report = replace(report, report_build_s=time.perf_counter() - t0,
                                  compile=compiled)
            self.profiler = None
            self.pending = True
            self._headline(final=self._enough())
            if self.pending:  # a JSON file exists from the profiled step on
                write_report(self.report, self.config.output_file, show=False)

    def close(self) -> None:
        """The engine closes: a pending report takes the steps there are."""
        if self.profiler is not None:  # closed between steps P-1 and P: nothing to report
            self.profiler.stop()
            self.profiler = None
        if self.pending:
            self._headline(final=True)

    # -- the headline ----------------------------------------------------------------------------
    def _enough(self) -> bool:
        k = self.config.headline_steps
        return len(self.clock.steady(k)) >= k

    def _headline(self, final: bool) -> None:
        assert self.report is not None
        steady = self.clock.steady(self.config.headline_steps)
        if steady:  # reading the clock waits for the last of these steps, once
            self.report = with_headline(self.report, self.clock.median(steady),
                                        [s.step for s in steady], describe_steps(steady),
                                        final)
        else:
            self.report.headline_final = final
        if final:
            self.pending = False
            write_report(self.report, self.config.output_file, show=True)
            if self.engine.monitor is not None:
                self.engine.monitor.write(self.events())

    def events(self) -> list[Event]:
        """The headline for the monitors: ``Profile/<key>`` at the samples seen by the end
        of the profiled step (DeepSpeed's x)."""
        r = self.report
        assert r is not None and r.profile_step is not None
        x = (r.profile_step + 1) * r.global_batch
        return [(f"Profile/{key}", float(value), x) for key, value in r.headline().items()
                if value is not None]

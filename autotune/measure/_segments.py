"""A closed-loop trial's run cut into segments: warm-up until it converges, then
measurement until it is precise (or capped, or a clear loser), by an
:class:`autotune.measure.SegmentRule`; the server log watched for kernels JIT-compiled
during the run (``docs/measurement.md``).

Private to :mod:`autotune.trial`: :class:`SegmentWatch` is the
:class:`autotune.load.SegmentControl` a trial hands to the load generator.
"""

from __future__ import annotations

import logging
import math
import re
from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING

__all__ = ["JIT_LINE", "LogWatch", "SegmentWatch", "tell_phase"]

if TYPE_CHECKING:
    from autotune.measure._screen import CoarseRecord, Screen
    from autotune.measure._stats import SegmentRule

logger = logging.getLogger(__name__)

# vLLM's kernel JIT monitor (vllm/utils/jit_monitor.py, GPU workers, after warm-up):
# "Triton kernel JIT compilation during inference: fused_moe_kernel (...). This causes a
# latency spike; consider extending warmup to cover this shape/config." (autotuning cache
# misses read "... autotuning during inference: ..."). CPU workers install no monitor.
JIT_LINE = re.compile(rb"during inference: .*consider extending warmup")


class LogWatch:
    """New lines of the server log since the last look: was a kernel JIT-compiled?"""

    def __init__(self, path: Path | None) -> None:
        self.path = path
        self.offset = 0
        self.events = 0
        self.broken = False
        if path is not None:
            try:
                self.offset = path.stat().st_size
            except OSError:
                self.offset = 0

    def jit_since_last(self) -> bool:
        if self.path is None or self.broken:
            return False
        try:
            with open(self.path, "rb") as f:
                f.seek(self.offset)
                data = f.read()
        except OSError as exc:  # a log problem never costs the measurement
            logger.warning("cannot read the server log %s for JIT events: %s", self.path, exc)
            self.broken = True
            return False
        cut = data.rfind(b"\n") + 1  # a half-written last line is read next time
        self.offset += cut
        n = len(JIT_LINE.findall(data[:cut]))
        self.events += n
        return n > 0


class SegmentWatch:
    """A :class:`~autotune.load.SegmentControl`: warm-up, then measurement, by ``rule``.

    ``phase(name, detail)`` hears ``warming_up`` after each warm-up segment that did not
    end it and ``measuring`` once, when the warm-up ends (the study's ``on_trial_phase``
    vocabulary)."""

    def __init__(self, rule: SegmentRule, segment_requests: int, watch: LogWatch,
                 incumbent_low: float | None, number: int,
                 phase: Callable[[str, str], None] | None = None, *,
                 screen: Screen | None = None) -> None:
        self.rule = rule
        self.screen = screen  # screen, then refine: the bar of the coarse reading
        self.coarse: CoarseRecord | None = None
        self.segment_requests = segment_requests
        self.watch = watch
        self.incumbent_low = incumbent_low
        self.number = number
        self.phase = phase
        self.last_t, self.last_tokens, self.last_failed = 0.0, 0, 0
        self.warm_rates: list[float] = []
        self.jit_last = False
        self.warm_end: float | None = None
        self.converged = False
        self.bounds: list[float] = []
        self.rates: list[float] = []
        self.stop: str | None = None
        self.jit_measuring = 0  # measured segments during which a kernel was compiled

    def on_segment(self, t_s: float, tokens: int, failed: int) -> bool:
        dt = t_s - self.last_t
        rate = (tokens - self.last_tokens) / dt if dt > 0 else math.nan
        all_failed = failed - self.last_failed >= self.segment_requests
        self.last_t, self.last_tokens, self.last_failed = t_s, tokens, failed
        if all_failed:  # a dead or broken server: stop now, the trial says why
            self.stop = "failing"
            logger.warning("trial %d: every request of a segment failed; stopping the run",
                           self.number)
            return True
        if self.warm_end is None:
            self.jit_last = self.watch.jit_since_last()
            self.warm_rates.append(rate)
            detail = (f"segment {len(self.warm_rates)}: {rate:,.1f} tok/s"
                      + (", a kernel was JIT-compiled" if self.jit_last else ""))
            logger.info("trial %d warm-up %s at %.1f s", self.number, detail, t_s)
            if self.rule.warmup(self.warm_rates, self.jit_last, t_s) == "warm":
                self.warm_end = t_s
                self.converged = self.rule.warmup_converged(self.warm_rates, self.jit_last)
                self.bounds = [t_s]
                self._phase("measuring", (
                    f"warm after {len(self.warm_rates)} segments, {t_s:.0f} s"
                    + ("" if self.converged else " (capped, not converged)")))
            else:
                self._phase("warming_up", detail)
            return False
        self.rates.append(rate)
        self.bounds.append(t_s)
        if self.watch.jit_since_last():  # evidence: the warm-up did not cover everything
            self.jit_measuring += 1
        if self._screened(t_s - self.warm_end):
            self.stop = "screened"
            return True
        decision = self.rule.measure(self.rates, t_s - self.warm_end, self.incumbent_low)
        logger.info("trial %d measured segment %d at %.1f s: %.1f tok/s (%s)", self.number,
                    len(self.rates), t_s, rate, decision)
        if decision == "continue":
            return False
        self.stop = decision.removeprefix("stop_")
        return True

    def _screened(self, measured_s: float) -> bool:
        """The first coarse reading (:mod:`autotune.measure._screen`) is kept; True when
        it is no leader (the run stops there, screened)."""
        from autotune.measure._screen import coarse_ready
        from autotune.measure._stats import mean_interval, relative_half_width

        if self.screen is None or self.coarse is not None:
            return False
        iv = mean_interval(self.rates, self.rule.confidence)
        if iv is None or not coarse_ready(len(self.rates), relative_half_width(iv),
                                          self.rule.precision, self.screen.precision_factor):
            return False
        self.coarse = self.screen.record(iv.value, iv.low, iv.high, measured_s)
        verdict = "promoted to full resolution" if self.coarse["promoted"] else "screened"
        logger.info("trial %d coarse reading %.1f tok/s [%.1f, %.1f] against the bar %.1f: %s",
                    self.number, iv.value, iv.low, iv.high, self.screen.bar, verdict)
        self._phase("measuring", f"coarse reading {iv.value:,.1f} tok/s: {verdict}")
        return not self.coarse["promoted"]

    def _phase(self, name: str, detail: str) -> None:
        tell_phase(self.phase, self.number, name, detail)


def tell_phase(phase: Callable[[str, str], None] | None, number: int, name: str,
               detail: str) -> None:
    """``phase(name, detail)``, if any; a failing display is logged, never raised."""
    if phase is not None:
        try:
            phase(name, detail)
        except Exception:  # a display must never cost the measurement
            logger.warning("trial %d: phase callback failed", number, exc_info=True)

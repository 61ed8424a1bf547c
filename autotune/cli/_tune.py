"""``autotune tune``: run a Bayesian study against real vLLM servers.

Every option is declared once, in :data:`OPTIONS`: its flag, the :class:`TuneSettings`
field it sets and its help. Types, choices and defaults come from the settings model, so a
default is written in one place (``autotune/config.py``).
"""

from __future__ import annotations

import argparse
import json
import math
import signal
import sys
import types
import typing
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any, TextIO

from autotune.cli._cost import COST_OPTIONS
from autotune.config import TuneSettings, parse_slo
from autotune.errors import ConfigError
from autotune.measure import fmt_interval
from autotune.quality._caveat import caveat_line

__all__ = ["OPTIONS", "Option", "add_tune_options", "register", "resolve_config",
           "run_study_command", "settings_from_args", "tune_actions", "tune_parser"]


@dataclass(frozen=True)
class Option:
    """One ``autotune tune`` option: ``flag`` sets the settings ``field``.

    ``action``: "store" (a value), "store_true"/"store_false" (a switch), "append"
    (repeatable). ``parse`` turns the command-line text into the settings value (then the
    flag's own default is None: the settings' default applies when it is not given)."""

    flag: str
    field: str
    group: str
    help: str
    action: str = "store"
    metavar: str | None = None
    required: bool = False
    parse: Callable[[Any], Any] | None = None
    aliases: tuple[str, ...] = ()  # other spellings of the flag


_GROUPS = {
    "what": "what to tune",
    "where": "where results go",
    "search": "search",
    "measure": "measurement",
    "resources": "resources",
    "cost": "what it is worth (docs/cost.md; no price is built in)",
}

OPTIONS: tuple[Option, ...] = (
    Option("--model", "model", "what", required=True,
           help="local model directory (config.json, tokenizer; weights optional with "
                "--load-format dummy in the space's fixed flags)"),
    Option("--shape", "shape", "what", required=True,
           help="traffic shape JSON (autotune shape fit ...; examples in traffic/)"),
    Option("--space", "space", "what", required=True,
           help="search space YAML (search_spaces/cpu.yaml, hybrid-mtp.yaml, ...)"),
    Option("--trials", "trials", "what",
           help="finished trials the study should have (the baseline counts)"),
    Option("--storage", "storage", "where",
           help="Optuna storage URL (SQLite file, or PostgreSQL for many workers)"),
    Option("--tracking-uri", "tracking_uri", "where",
           help="MLflow store (default sqlite:///$PWD/experiments/mlflow.db; or an "
                "http://host:5000 tracking server)"),
    Option("--experiment", "experiment", "where", help="MLflow experiment name"),
    Option("--study-name", "study_name", "where",
           help="study name (default SPACE-SHAPE-TIMESTAMP)"),
    Option("--out", "out", "where",
           help="output folder for best.json, trials.csv, logs (default "
                "experiments/<study-name>/)"),
    Option("--resume", "resume", "where", action="store_true",
           help="continue a killed study (the newest one in --storage unless --study-name "
                "is given); finished trials are kept"),
    Option("--sampler", "sampler", "search",
           help="tpe: Bayesian (multivariate TPE with constraints); random: baseline"),
    Option("--objective", "objective", "search",
           help="auto (default): capacity for a shape replayed as recorded arrivals (open "
                "loop, e.g. from 'autotune shape fit'), throughput for a closed loop "
                "(concurrency streams): at a fixed arrival rate every config that keeps up "
                "serves the same tokens/s, so throughput is refused there (use --concurrency "
                "N to replay such a shape as a closed loop). Or: "
                "maximise output tokens/s (throughput), requests/s that meet the SLOs "
                "(goodput), both throughput and --pareto-latency as two objectives "
                "(pareto: the front is reported, plotted and logged), or capacity: the "
                "highest arrival rate (req/s, a scale of the shape's recorded rate) one "
                "server sustains with --capacity-goodput of the requests within --slo, "
                "found per trial by a bracketing search on one running server; reported "
                "with its interval, output tokens/s at that rate and the GPUs the "
                "recorded traffic needs. Needs a shape with a recorded arrival rate (fitted "
                "from a timestamped trace); without --slo it judges "
                "ttft_p99=2.0,tpot_p99=0.1 (docs/measurement.md)"),
    Option("--pareto-latency", "pareto_latency", "search",
           help="the latency a Pareto study minimises (ttft_p99, tpot_p99, e2e_p99, ...)"),
    Option("--slo", "slo", "search", parse=parse_slo,
           help="latency SLOs in seconds, e.g. ttft_p99=2.0,tpot_p99=0.05; trials that miss "
                "them are infeasible (--objective capacity: each request of a load level is "
                "judged by them; the percentile suffix is then ignored)"),
    Option("--max-error-rate", "max_error_rate", "search",
           help="trials with more failed requests are infeasible"),
    Option("--no-baseline", "baseline", "search", action="store_false",
           help="do not measure vLLM's defaults first"),
    Option("--seed", "seed", "search", help="sampler and traffic seed"),
    Option("--quality", "quality", "search", metavar="THRESHOLDS",
           help="bound the accuracy cost of lossy knobs, e.g. min_agreement=0.95 (greedy "
                "exact-match rate vs the full-precision reference; also max_logprob_diff, "
                "min_divergence_p10): trials below are infeasible (docs/quality.md)"),
    Option("--no-quality-probe", "quality_probe", "search", action="store_false",
           help="do not probe lossy trials (no reference server, no quality figures)"),
    Option("--enqueue", "enqueue", "search", action="append", metavar="JSON",
           parse=lambda xs: [x if isinstance(x, dict) else _json_arg(x) for x in xs or []],
           help="a config to try first, as JSON knob values (e.g. '{\"mtp_depth\": 1}' or "
                "@file.json); knobs not given take vLLM's defaults; repeatable"),
    Option("--timeout", "timeout_s", "search", metavar="SECONDS", aliases=("--budget",),
           help="time budget of the whole study, re-check included: the search stops when "
                "what is left would not fit the re-check at the mean trial time so far; "
                "running trials finish, then the verdict"),
    Option("--kernel-budget", "kernel_budget_s", "search", metavar="SECONDS",
           help="wall time for tuning kernels before trial 0 when the space has a knob "
                "with 'tuned' (moe_config; once per model, GPU, shape and streams, cached "
                "under --cache-dir; at most a quarter of --timeout; token counts that do not "
                "fit are skipped: vLLM's default config there). Not tuned at all when no "
                "trial can pick 'tuned' (--trials filled by the baseline and --enqueue "
                "configs without it); docs/kernels.md"),
    Option("--kernel-trials", "kernel_trials", "search", metavar="N",
           help="kernel configs timed per token count in that tuning"),
    Option("--pruner", "pruner", "search",
           help="interval (default): stop a trial as soon as its 95 %% interval lies wholly "
                "below the incumbent's (recorded as 'pruned'; throughput studies only); "
                "none: measure every trial to the end"),
    Option("--capacity-goodput", "capacity_goodput", "measure", metavar="SHARE",
           help="--objective capacity: a load level passes when at least this share of "
                "its offered requests met every --slo (failed requests count as misses) "
                "and no more than --max-error-rate failed (default 0.99)"),
    Option("--capacity-tolerance", "capacity_tolerance", "measure", metavar="FRACTION",
           help="--objective capacity: bisect until the bracket [highest passing rate, "
                "lowest failing rate] is within this fraction (default 0.1 = 10 %%)"),
    Option("--capacity-level-s", "capacity_level_s", "measure", metavar="SECONDS",
           help="--objective capacity: seconds of open-loop arrivals per load level, at "
                "least (at least 10 requests; default 10); stretched to 3 of the shape's "
                "request durations as the warm-up measured them (at most 4x), so that a "
                "level judges a sustained rate, not a burst; a level stops early once it "
                "cannot pass"),
    Option("--capacity-max-s", "capacity_max_s", "measure", metavar="SECONDS",
           help="--objective capacity: the load levels of one trial stop once the next "
                "would end after this many seconds (default 90: a trial in minutes); the "
                "bracket is then as narrow as they made it (status 'time'); raise it for a "
                "tighter bracket"),
    Option("--capacity-start", "capacity_start", "measure", metavar="SCALE",
           help="--objective capacity: the first level, as a scale of the recorded rate "
                "(default 1.0; passes double it, fails halve it until bracketed)"),
    Option("--capacity-max-levels", "capacity_max_levels", "measure", metavar="N",
           help="--objective capacity: load levels per trial at most (default 10)"),
    Option("--repeats", "repeats", "measure",
           help="measured replays per trial on the same server (median reported)"),
    Option("--recheck", "recheck", "measure", metavar="K",
           help="before the verdict, measure the top K configs and vLLM's defaults again on "
                "fresh servers (--recheck-starts each); a winner is declared only if the "
                "95 %% interval of its ratio to the defaults lies above 1 (default 3; 0 = "
                "off: the verdict then rests on within-run intervals)"),
    Option("--recheck-starts", "recheck_starts", "measure", metavar="N",
           help="fresh server starts per re-checked config (default 2); when the "
                "defaults remain best only because the interval is wide, the verdict says "
                "how many starts would show the best ratio found"),
    Option("--precision", "precision", "measure",
           help="stop measuring a trial when the 95 %% interval of its output tokens/s is "
                "within this fraction of it (default 0.02 = 2 %%)"),
    Option("--min-segments", "min_segments", "measure", metavar="N",
           help="measured segments before --precision may stop a trial (default 5: with 3, "
                "a few agreeing segments stopped runs that then drifted by up to 4.6 %%)"),
    Option("--measure-max-s", "measure_max_s", "measure", metavar="SECONDS",
           help="measure a trial at most this long (default 180; an open loop's measured "
                "replay too: its length comes from --precision and this cap, not from a "
                "number of requests)"),
    Option("--warmup-max-s", "warmup_max_s", "measure", metavar="SECONDS",
           help="warm up at most this long; the warm-up ends earlier when two consecutive "
                "segments agree within --warmup-tolerance, the last three do not climb (or "
                "fall) by more than 3x it, and the server logged no kernel JIT compilation "
                "in the last one (default 120)"),
    Option("--warmup-tolerance", "warmup_tolerance", "measure",
           help="segments agree when they differ by at most this fraction (0.05)"),
    Option("--segment-requests", "segment_requests", "measure", metavar="N",
           help="completed requests per segment (default max(concurrency, 16): about one "
                "wave of the closed loop)"),
    Option("--output-jitter", "output_jitter", "measure", metavar="FRACTION",
           help="closed loop: each request's output length times a factor drawn from "
                "[1 - FRACTION, 1 + FRACTION] (default 0.1; 0 replays the shape's lengths "
                "exactly): streams of equal lengths otherwise lock into step again and the "
                "throughput climbs for minutes (docs/measurement.md, section 4)"),
    Option("--warmup-requests", "warmup_requests", "measure",
           help="open-loop shapes only: a fixed warm-up of N requests (closed loop) before "
                "the measured replay (0: no warm-up); by default an open loop warms up on "
                "the shape's own arrivals until the server holds their steady state (two "
                "request durations) and closed loops until two segments agree"),
    Option("--num-requests", "num_requests", "measure",
           help="requests per replay (default: the shape's load.requests)"),
    Option("--concurrency", "concurrency", "measure",
           help="closed-loop streams (default: the shape's load.concurrency; an open-loop "
                "shape is then replayed as a closed loop of N streams, its lengths without "
                "its arrivals: what --objective throughput needs); also the "
                "streams a 'tuned' kernel knob's token counts come from"),
    Option("--api", "api", "measure", help="OpenAI endpoint the load generator uses"),
    Option("--start-timeout", "start_timeout_s", "measure",
           help="seconds a server may take to answer /health"),
    Option("--request-timeout", "request_timeout_s", "measure",
           help="seconds one request may take"),
    Option("--ray-address", "ray_address", "resources",
           help="join a Ray cluster (host:port of 'ray start --head'); default: a local Ray of "
                "this study's own, even when a cluster runs here or RAY_ADDRESS is set"),
    Option("--no-ray", "use_ray", "resources", action="store_false",
           help="run trials in this process (debugging)"),
    Option("--gpus-per-trial", "gpus_per_trial", "resources",
           help="GPUs per trial at least (default 1 on GPU hosts, 0 on CPU); a config's "
                "tensor x data parallel size sets its own (docs/search-spaces.md)"),
    Option("--parallel", "parallel", "resources",
           help="trials at once (default: one per GPU slot; 1 on CPU)"),
    Option("--cache-dir", "cache_dir", "resources",
           help="compile/JIT cache shared by all trials (default ~/.cache/autotune)"),
    Option("--cpu-kv-cache-gib", "cpu_kv_cache_gib", "resources",
           help="KV cache GiB for the CPU build (VLLM_CPU_KVCACHE_SPACE)"),
    Option("--no-preload", "preload", "resources", action="store_false",
           help="start every server as a fresh 'python -m vllm...' instead of forking it "
                "from an interpreter that imported vLLM once per study and environment "
                "(18-21 s of each start on the H200 machine; docs/measurement.md, section 10)"),
    *(Option(**kw) for kw in COST_OPTIONS),
)


def _field_type(field: str) -> tuple[Any, tuple[Any, ...] | None]:
    """(argparse type, choices) from the settings field's annotation."""
    ann = TuneSettings.model_fields[field].annotation
    args = typing.get_args(ann)
    if isinstance(ann, types.UnionType) or typing.get_origin(ann) is typing.Union:
        ann = next(a for a in args if a is not type(None))
        args = typing.get_args(ann)
    if typing.get_origin(ann) is typing.Literal:
        return str, args
    return (ann if ann in (int, float, Path) else str), None


def _default(field: str) -> Any:
    info = TuneSettings.model_fields[field]
    return info.get_default(call_default_factory=True)


def add_tune_options(p: argparse.ArgumentParser) -> None:
    """Add every option of :data:`OPTIONS` to ``p`` (in its group)."""
    groups = {key: p.add_argument_group(title) for key, title in _GROUPS.items()}
    for opt in OPTIONS:
        g = groups[opt.group]
        kw: dict[str, Any] = {"dest": opt.field, "help": opt.help}
        if opt.action in ("store_true", "store_false"):
            g.add_argument(opt.flag, action=opt.action, **kw)
            continue
        kw["metavar"] = opt.metavar or opt.flag.lstrip("-").upper().replace("-", "_")
        if opt.action == "append":
            g.add_argument(opt.flag, action="append", default=[], **kw)
            continue
        typ, choices = _field_type(opt.field)
        if opt.parse is not None:
            typ, choices = str, None
        if choices is not None and opt.metavar is None:
            del kw["metavar"]  # argparse shows {a,b,c}
        if opt.required:  # here or in --config: checked once the file is read
            kw["help"] = f"(required) {opt.help}"
        kw.update(type=typ, choices=choices)
        kw["default"] = None if opt.parse is not None or opt.required else _default(opt.field)
        g.add_argument(opt.flag, *opt.aliases, **kw)
    cf = p.add_argument_group("config file and display")
    cf.add_argument("--config", type=Path, default=None, metavar="FILE",
                    help="a YAML file of these options (keys: the flags without '--' or the "
                         "settings' names, e.g. 'trials: 12', 'slo: {ttft_p99: 2.0}', "
                         "'baseline: false'); flags on the command line override it. Every "
                         "study saves its resolved config as OUT/config.yaml, which runs "
                         "again as it is")
    cf.add_argument("--print-config", action="store_true",
                    help="print a config file of every option (with the values given so "
                         "far) and exit: 'autotune tune --print-config > study.yaml'")
    cf.add_argument("-q", "--quiet", action="store_true",
                    help="no live display: one plain line per finished trial (the live panel "
                         "is drawn only on a terminal; logs and CI always get plain lines)")


def register(sub: argparse._SubParsersAction) -> None:  # type: ignore[type-arg]
    p = sub.add_parser(
        "tune",
        help="search vLLM engine settings for a traffic shape (real servers, Optuna, MLflow)",
        description=(
            "Run an Optuna study whose trials each start a real vLLM server with sampled "
            "flags, replay the traffic shape against it, measure, and stop it. vLLM's "
            "defaults are measured first (trial 0) so results are ratios to defaults. "
            "Trials run under Ray; every trial is logged to MLflow; the best config is "
            "written to OUT/best.json with its 'vllm serve' command."
        ),
    )
    add_tune_options(p)
    p.add_argument("--json", action="store_true",
                   help="print the result (best.json content) as JSON at the end")
    p.set_defaults(func=_tune)


def tune_parser() -> argparse.ArgumentParser:
    """A fresh parser of ``autotune tune``."""
    holder = argparse.ArgumentParser(add_help=False)
    register(holder.add_subparsers())
    for action in holder._actions:
        if isinstance(action, argparse._SubParsersAction):
            return action.choices["tune"]  # type: ignore[no-any-return]
    raise RuntimeError("autotune.cli._tune registered no 'tune' parser")  # a bug, not input


def tune_actions() -> list[argparse.Action]:
    """The argparse actions of ``autotune tune``."""
    return list(tune_parser()._actions)


def resolve_config(args: argparse.Namespace) -> None:
    """Fill ``args`` from ``--config FILE`` where no flag was given (flags win)."""
    from autotune.cli._config_file import apply_config, explicit_dests, load_config_file

    if getattr(args, "config", None) is None:
        return
    actions = tune_actions()
    values = load_config_file(args.config)
    apply_config(args, actions, values, where=f"--config {args.config}",
                 explicit=explicit_dests(actions, getattr(args, "argv", None) or []))


def settings_from_args(args: argparse.Namespace) -> TuneSettings:
    """The validated :class:`TuneSettings` of parsed ``tune`` options (``--config FILE``
    first, flags over it); one-line errors that name the flag."""
    from pydantic import ValidationError

    resolve_config(args)
    missing = [o.flag for o in OPTIONS if o.required and getattr(args, o.field, None) is None]
    if missing:
        raise ConfigError(f"{', '.join(missing)} {'is' if len(missing) == 1 else 'are'} "
                          "required: give them as flags or in a --config file (autotune tune "
                          "--print-config writes one)")
    values = {}
    for opt in OPTIONS:
        value = getattr(args, opt.field)
        values[opt.field] = opt.parse(value) if opt.parse is not None else value
    from autotune.study import resolve_settings

    try:
        settings = TuneSettings(**values)
    except ValidationError as exc:
        flags = {opt.field: opt.flag for opt in OPTIONS}
        msgs = "; ".join(
            f"{flags.get(str(e['loc'][0]), '--' + str(e['loc'][0]).replace('_', '-'))} "
            f"{e.get('input')!r}: {e['msg']}" for e in exc.errors()
        )
        raise ConfigError(msgs) from None
    return resolve_settings(settings, strict=False)  # --objective auto: from the shape



def _json_arg(text: str) -> dict[str, Any]:
    src = text
    if text.startswith("@"):
        try:
            src = Path(text[1:]).read_text()
        except OSError as exc:
            raise ConfigError(f"--enqueue {text}: cannot read the file: {exc}") from None
    try:
        value = json.loads(src)
    except json.JSONDecodeError as exc:
        raise ConfigError(f"--enqueue {text[:80]!r} is not valid JSON: {exc}") from None
    if not isinstance(value, dict):
        raise ConfigError(f"--enqueue {text[:80]!r} must be a JSON object of knob values")
    return value


def _best_line(b: dict[str, Any], objective: str) -> str:
    """best.json's declared config in one line: its reading (a re-check names the trial
    that first measured the config, as the verdict line does), the value, the ratio."""
    from autotune.store import objective_label

    ratio = f" = {b['ratio_to_baseline']:.2f}x vLLM defaults" if b.get("ratio_to_baseline") else ""
    of = (f" (re-check of trial {b['recheck_of']})" if b.get("recheck_of") is not None
          and b["recheck_of"] != b["trial"] else "")
    n = len(b.get("readings") or [])
    median = f", the median of {n} readings" if n > 1 else ""
    return (f"best: trial {b['trial']}{of}: {b['objective']['value']:,.1f} "
            f"{objective_label(objective)}{_per_gpu(b)}{median}{ratio}")


def _per_gpu(b: dict[str, Any]) -> str:
    """" per GPU (a server of 2 GPUs; the recorded traffic needs 1.4 servers, 2.8 GPUs)"."""
    g = b.get("gpus")
    if not g:  # a best.json written before autotune counted GPUs per server
        return ""
    n = int(g.get("per_server") or 1)
    need = (f"; the recorded traffic needs {g['servers_needed']:.2f} server(s), "
            f"{g['gpus_needed']:.2f} GPU(s)" if g.get("servers_needed") is not None else "")
    return f" per GPU (a server of {n} GPU{'s' if n > 1 else ''}{need})"


def _verdict_line(v: dict[str, Any]) -> str:
    """The verdict for people: who won, by how much, how sure."""
    from autotune.measure import WITHIN_RUN_ONLY

    r = v.get("ratio_to_defaults")
    ci = (f"{r['median']:.3f}x the defaults (95 % interval "
          f"{fmt_interval(r['ci_low'], r['ci_high'], '.3f')})" if r else "no ratio to the defaults")
    if v.get("method") == WITHIN_RUN_ONLY and not v.get("candidate_pruned"):
        # one start of each (--recheck 0): the interval holds no start-to-start spread
        ci += ("; one server start of each, no fresh-server re-check: add it with --resume "
               "--recheck 1")
    if v.get("verdict") == "winner":  # the number: not in an MLflow-only record
        who = f" trial {v['winner_number']}" if v.get("winner_number") is not None else ""
        n = v.get("candidate_gpus")
        if isinstance(n, int) and n > 1:  # per GPU: a 1-GPU winner needs no word
            who += f" ({n} GPUs per server)"
        return f"verdict: WINNER{who}: {ci}"
    if v.get("verdict") == "defaults_best":
        if v.get("candidate_number") is None and not r:  # nothing else measured feasible
            return (f"verdict: vLLM's defaults remain best for this shape "
                    f"({v.get('reason') or 'no other config was measured'})")
        how = (" (pruned as a clear loser; within-run figures)" if v.get("candidate_pruned")
               else "")
        need = v.get("starts_needed") or {}
        sd = v.get("start_spread") or 0.0
        more = (f"; to show it at the measured start-to-start SD of {sd * 100:.1f} %: "
                f"about {need['per_config']} starts of each (rerun with --resume "
                f"--recheck-starts {need['recheck_starts']})"
                if need and v.get("start_spread") is not None else "")
        who = (f" (trial {v['candidate_number']}{how})" if v.get("candidate_number") is not None
               else how)
        return (f"verdict: vLLM's defaults remain best for this shape; best other config"
                f"{who}: {ci}{more}")
    return f"verdict: {v.get('verdict', 'none')}: {v.get('reason', '')}"


def capacity_line(c: dict[str, Any]) -> str:
    """best.json's ``capacity`` in one line (what operators size a fleet by), and a note
    when the capacity is chance within a range (``CapacityResult.flat_misses``)."""
    from autotune.trial import flat_note

    def num(x: Any, fmt: str = ",.3g") -> str:
        return format(x, fmt) if isinstance(x, (int, float)) else "?"

    lo = c.get("capacity_rps_ci_low")
    # a median over fresh starts is no bracket's lower end: say whose bracket follows
    whose = ("bracket" if isinstance(lo, (int, float)) and math.isclose(lo, c["capacity_rps"])
             else "the median over starts; the bracket of the reading it rests on")
    return (f"capacity: {num(c['capacity_rps'])} req/s within the SLOs "
            f"({whose} [{num(lo)}, "
            f"{num(c.get('capacity_rps_ci_high'))}] req/s, >= {c['goodput_bar']:.0%} of "
            f"requests within {', '.join(f'{k}={v:g}s' for k, v in c['slo'].items())}); "
            f"{num(c.get('output_tokens_per_s_at_capacity'), ',.1f')} out tok/s at that rate; "
            f"GPUs needed for the recorded {num(c['recorded_rps'])} req/s: "
            f"{num(c.get('gpus_needed'), '.2f')}"
            + (f"\nnote: {flat_note(c['flat_misses_rps'])}" if c.get("flat_misses_rps")
               else ""))


def _gpu_time_lines(acct: dict[str, dict[str, float]]) -> list[str]:
    lines = []
    for label, a in sorted(acct.items()):
        total = sum(v for k, v in a.items() if k != "compile_s") or 1.0
        comp = (f" (compiling {a['compile_s']:.0f} s)" if a.get("compile_s") else "")
        lines.append(f"time on {label}: start {a.get('start_s', 0):.0f} s{comp}, warm-up "
                     f"{a.get('warmup_s', 0):.0f} s, measuring {a.get('measure_s', 0):.0f} s "
                     f"({a.get('measure_s', 0) / total:.0%}), other {a.get('other_s', 0):.0f} s, "
                     f"idle {a.get('idle_s', 0):.0f} s"
                     + (f", kernel tuning {a['kernels_s']:.0f} s" if a.get("kernels_s") else ""))
    return lines


def run_study_command(settings: TuneSettings, *, as_json: bool, out: TextIO,
                      warm_start: Any = None, quiet: bool = False) -> int:
    """The tail ``tune`` and ``retune`` share: run the study (SIGTERM stops it like Ctrl-C)
    with the progress display, then print the result; exit 0 when a config won, else 1."""
    from autotune.cli._cost import cost_lines
    from autotune.store import objective_label
    from autotune.study import tune

    def _sigterm(signum: int, frame: Any) -> None:  # SIGTERM stops cleanly, like Ctrl-C
        raise KeyboardInterrupt

    from autotune.cli._progress import make_display
    from autotune.study import resolve_settings

    settings = resolve_settings(settings)  # a shape that cannot be read stops here
    display = make_display(objective_label(settings.objective), quiet=quiet)
    old = signal.signal(signal.SIGTERM, _sigterm)
    try:
        result = tune(settings, callbacks=[display], warm_start=warm_start)
    finally:
        display.close()
        signal.signal(signal.SIGTERM, old)
    if as_json:
        print(json.dumps(result.best, indent=2), file=out)
        return 0 if result.best else 1
    print(f"\nstudy {result.study_name}: {_trial_counts(result)}", file=out)
    for line in _mlflow_lines(result):
        print(line, file=out)
    report = f"\nreport: {result.report} (opens offline in a browser)" if result.report else ""
    if result.best is None:
        print(f"no trial met the constraints: {result.explanation}", file=out)
        print(f"every trial's reason and message: {result.out_dir}/trials.csv{report}",
              file=out)
        return 1
    b = result.best
    print(_verdict_line(result.verdict), file=out)
    if caveat := caveat_line(result.verdict.get("quality")):
        print(caveat, file=out)
    print(_best_line(b, settings.objective), file=out)
    if b.get("capacity"):
        print(capacity_line(b["capacity"]), file=out)
    for line in cost_lines(b):
        print(line, file=out)
    print(f"params: {json.dumps(b['params'])}", file=out)
    print(f"serve command:\n  {b['serve_command']}", file=out)
    from autotune.deploy import STAND_IN_NOTE, deployable

    dep = deployable(b.get("flags") or [], b.get("env") or {})
    if dep.stand_in:  # the command above is as the trials ran it; a deployment drops these
        print(f"note: {STAND_IN_NOTE}; 'autotune export {result.out_dir} --format serve' "
              f"prints it without {', '.join(dep.dropped)}", file=out)
    for line in _gpu_time_lines(result.gpu_time):
        print(line, file=out)
    print(f"written: {result.out_dir / 'best.json'}", file=out)
    print(f"browse: mlflow ui --backend-store-uri {result.tracking_uri}", file=out)
    if result.report:
        print(f"report: {result.report} (opens offline in a browser)", file=out)
    return 0


def _tune(args: argparse.Namespace) -> int:
    if args.print_config:
        from autotune.cli._config_file import render_config

        resolve_config(args)
        sys.stdout.write(render_config(args, tune_actions(),
                                       required=[o.field for o in OPTIONS if o.required]))
        return 0
    return run_study_command(settings_from_args(args), as_json=args.json, out=sys.stdout,
                             quiet=args.quiet)


def _mlflow_lines(result: Any) -> list[str]:
    """What the MLflow store missed while it was away: logged late, or still to sync."""
    lines = []
    if result.mlflow_late:
        lines.append(f"MLflow: trial(s) {', '.join(map(str, result.mlflow_late))} logged late "
                     "(the tracking store was away meanwhile); nothing is missing")
    if result.mlflow_unlogged:
        lines.append(f"MLflow: not logged (the tracking store did not answer): "
                     f"{', '.join(result.mlflow_unlogged)}; nothing is lost (the Optuna storage "
                     f"has every trial): once it answers, run: autotune sync {result.out_dir}")
    return lines


def _trial_counts(result: Any) -> str:
    """'5 trials, 4 feasible, 0 failed; 1 not run (queued when the --budget ended the
    search)', '3 trials, 1 feasible, 1 failed; why not feasible: oom 1, slo 1': trials the
    budget left unstarted are not failures, and each reason is counted (failed, pruned and
    infeasible trials)."""
    reasons = dict(result.failures_by_reason or {})
    not_run = int(reasons.pop("budget", 0))
    failed = max(0, int(result.n_failed) - not_run)
    text = f"{result.n_trials} trials, {result.n_ok} feasible, {failed} failed"
    if reasons:
        text += "; why not feasible: " + ", ".join(f"{k} {v}" for k, v in sorted(reasons.items()))
    if not_run:
        text += f"; {not_run} not run (queued when the --budget ended the search)"
    return text

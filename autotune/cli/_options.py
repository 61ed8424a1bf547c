"""The option table of ``autotune tune`` (and ``retune``), and the rows ``bench`` shares.

Every option is declared once, in :data:`OPTIONS`: its flag, the :class:`TuneSettings`
field it sets and its help. Types, choices and defaults come from the settings model, so a
default is written in one place (``autotune/config.py``). ``retune`` takes ``tune``'s parser
whole; ``bench`` adds the rows it shares by flag (:func:`add_option`).
"""

from __future__ import annotations

import json
import types
import typing
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from autotune.cli._cost import COST_OPTIONS
from autotune.config import TuneSettings, parse_slo
from autotune.errors import ConfigError


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
    # no default of their own: the stores follow --out (TuneSettings._stores)
    Option("--storage", "storage", "where", parse=lambda v: v,
           help="Optuna storage URL (SQLite file, or PostgreSQL for many workers; a folder "
                "means its autotune.db). Default: OUT/autotune.db with --out, else "
                "experiments/autotune.db"),
    Option("--tracking-uri", "tracking_uri", "where",
           help="MLflow store (an http://host:5000 tracking server, or a SQLite file). "
                "Default: OUT/mlflow.db with --out, else experiments/mlflow.db"),
    Option("--experiment", "experiment", "where", help="MLflow experiment name"),
    Option("--study-name", "study_name", "where",
           help="study name (default SPACE-SHAPE-TIMESTAMP)"),
    Option("--out", "out", "where",
           help="output folder for best.json, trials.csv, logs and, unless --storage and "
                "--tracking-uri say otherwise, the study's stores (default "
                "experiments/<study-name>/, stores in experiments/)"),
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
           help="--objective capacity: search until the bracket [highest passing rate, "
                "lowest failing rate] is within this fraction (default 0.25: the two ends "
                "at most 1.25x apart; each halving of it costs about one more level)"),
    Option("--capacity-level-s", "capacity_level_s", "measure", metavar="SECONDS",
           help="--objective capacity: seconds of open-loop arrivals per load level, at "
                "least (default 10; and at least 40 requests, from the busiest stretch of "
                "the recorded arrivals that holds them); stretched to 3 of the shape's "
                "request durations as the warm-up measured them (at most 4x), so that a "
                "level judges a sustained rate, not a burst; a level stops early once it "
                "cannot pass"),
    Option("--capacity-max-s", "capacity_max_s", "measure", metavar="SECONDS",
           help="--objective capacity: a time cap on the load levels of one trial: they "
                "stop once the next would end after this many seconds. Default: none, the "
                "search runs until its bracket is within --capacity-tolerance (or "
                "--capacity-max-levels are spent). A cap that ends it sooner leaves a wider "
                "or open bracket (status 'time'): the trial says so and the verdict gives "
                "no ratio from it"),
    Option("--capacity-start", "capacity_start", "measure", metavar="SCALE",
           help="--objective capacity: the warm-up's and the first level's rate, as a scale "
                "of the recorded rate (default 1.0; a warm-up that fell behind moves the "
                "first level to just below what the server served; then steps of 1.25x, "
                "1.56x, then 2x up after a pass, down after a fail, until bracketed)"),
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


def option(flag: str) -> Option:
    """The row of :data:`OPTIONS` whose flag is ``flag`` (for a command that shares it)."""
    for opt in OPTIONS:
        if opt.flag == flag:
            return opt
    raise RuntimeError(f"no tune option {flag}")  # a bug in a caller, not input


def _argparse_kwargs(opt: Option) -> dict[str, Any]:
    """The ``add_argument`` keywords of one row: type, choices and default from the
    settings model."""
    kw: dict[str, Any] = {"dest": opt.field, "help": opt.help}
    if opt.action in ("store_true", "store_false"):
        kw["action"] = opt.action
        return kw
    kw["metavar"] = opt.metavar or opt.flag.lstrip("-").upper().replace("-", "_")
    if opt.action == "append":
        kw.update(action="append", default=[])
        return kw
    typ, choices = _field_type(opt.field)
    if opt.parse is not None:
        typ, choices = str, None
    if choices is not None and opt.metavar is None:
        del kw["metavar"]  # argparse shows {a,b,c}
    if opt.required:  # here or in --config: checked once the file is read
        kw["help"] = f"(required) {opt.help}"
    kw.update(type=typ, choices=choices)
    kw["default"] = None if opt.parse is not None or opt.required else _default(opt.field)
    return kw


def add_option(group: Any, flag: str, **override: Any) -> None:
    """Add the ``tune`` option ``flag`` to another command's parser or group (``bench``):
    the same flag, settings field (its ``dest``), type and default, written once here.
    ``override``: ``add_argument`` keywords that differ for that command (its own help;
    a default of None where that command derives the value itself)."""
    opt = option(flag)
    kw = _argparse_kwargs(opt)
    kw.update(override)
    group.add_argument(opt.flag, *opt.aliases, **kw)


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

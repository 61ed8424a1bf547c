"""The option table of ``autotune tune`` (and ``retune``), and the rows ``bench`` shares.

Every option is declared once. The measurement options (:data:`MEASURE_OPTIONS`) are
generated from :class:`MeasureSettings`: flag, group, help and default come from the
model's fields, and ``tune`` and ``bench`` both add them all, so a new measurement setting
is a new field there and nothing here. The study's own options are rows of
:data:`OPTIONS` (flag, the :class:`TuneSettings` field it sets, help); their types,
choices and defaults come from the settings model too. ``retune`` takes ``tune``'s parser
whole; ``bench`` adds the few study rows it shares by flag (:func:`add_option`).
"""

from __future__ import annotations

import argparse
import json
import types
import typing
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from pydantic import ValidationError
from pydantic.fields import FieldInfo

from autotune.cli._cost import COST_OPTIONS
from autotune.config import MEASURE_KEYS, MeasureSettings, TuneSettings, parse_slo
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
    "capacity": "capacity search (tune --objective capacity, bench --capacity)",
    "resources": "resources",
    "cost": "what it is worth (docs/cost.md; no price is built in)",
}


#: command-line text -> settings value, for the measurement fields argparse cannot type
_PARSERS: dict[str, Callable[[Any], Any]] = {"slo": parse_slo}


def _measure_row(name: str, info: FieldInfo) -> Option:
    extra = info.json_schema_extra
    if not isinstance(extra, dict) or not info.description:  # a bug in config.py
        raise RuntimeError(f"MeasureSettings.{name} names no flag or has no description")
    metavar = extra.get("metavar")
    return Option(str(extra["flag"]), name, str(extra["group"]), help=info.description,
                  metavar=str(metavar) if metavar else None, parse=_PARSERS.get(name))


#: one row per :class:`MeasureSettings` field, in its order (``tune`` and ``bench``)
MEASURE_OPTIONS: tuple[Option, ...] = tuple(
    _measure_row(name, info) for name, info in MeasureSettings.model_fields.items())


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
    Option("--timeout", "timeout_s", "search", metavar="SECONDS",
           help="time budget of the whole study, re-check included: the search stops when "
                "what is left would not fit the re-check at the mean trial time so far; "
                "running trials finish, then the verdict"),
    Option("--budget", "budget", "search", metavar="GPU_TIME",
           help="GPU time the study may spend, re-check included: 2h, 90m or 5400s "
                "(GPU-hours, -minutes, -seconds; a trial on 2 GPUs spends 2 a second); the "
                "study says at the start how many trials and server starts fit, stops "
                "searching when what is left would not fit the next trial and the "
                "re-check, and reports GPU-seconds by phase. A bare number is seconds of "
                "wall time, as --timeout"),
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
                "below the incumbent's (throughput), or a capacity trial as soon as one of "
                "its load levels fails below the incumbent's capacity (recorded as "
                "'pruned'); none: measure every trial to the end"),
    Option("--no-failure-model", "failure_model", "search", action="store_false",
           help="start every sample the rules allow; by default a model of the start "
                "failures of the store's earlier trials (same engine version and hardware) "
                "and of this study steers samples predicted not to start away (never "
                "started, not counted, told to the sampler as failed), unless the sampler "
                "insists (proposes the config again, or after 3 steered in a row)"),
    Option("--no-learn", "learn", "search", action="store_false",
           help="start the sampler cold; by default a new study learns from the trials of "
                "every earlier study in its store on the same model and hardware (any "
                "shape, any space they fit), each reading weighted by how near its shape is "
                "to this one (1 for the same shape, 0.5 at the drift threshold), and its "
                "first lines say from which studies and with what weight"),
    Option("--no-screen", "screen", "search", action="store_false",
           help="measure every trial to full resolution; by default each search trial is "
                "first read at a coarse fidelity on its own server (throughput within 3x "
                "--precision, or a capacity bracket within 2x) and only the leaders go on "
                "to full resolution: a coarse reading in the top third of the coarse "
                "readings so far, or whose interval still reaches the best so far. The "
                "others stop there ('screened', their coarse reading kept in Optuna and "
                "MLflow); the verdict and the re-check rest on full-resolution readings "
                "only, and the summary counts the trials at each rung"),
    Option("--recheck", "recheck", "measure", metavar="K",
           help="before the verdict, measure the top K configs and vLLM's defaults again on "
                "fresh servers (--recheck-starts each); a winner is declared only if the "
                "95 %% interval of its ratio to the defaults lies above 1 (default 3; 0 = "
                "off: the verdict then rests on within-run intervals)"),
    Option("--recheck-starts", "recheck_starts", "measure", metavar="N",
           help="fresh server starts per re-checked config (default 2); when the "
                "defaults remain best only because the interval is wide, the verdict says "
                "how many starts would show the best ratio found"),
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
    Option("--no-preload", "preload", "resources", action="store_false",
           help="start every server as a fresh 'python -m vllm...' instead of forking it "
                "from an interpreter that imported vLLM once per study and environment "
                "(18-21 s of each start on the H200 machine; docs/measurement.md, section 10)"),
    *MEASURE_OPTIONS,
    *(Option(**kw) for kw in COST_OPTIONS),
)


def _field_info(field: str) -> FieldInfo:
    """The settings field an option sets: a measurement one, or the study's own."""
    if field in MEASURE_KEYS:
        return MeasureSettings.model_fields[field]
    return TuneSettings.model_fields[field]


#: a settings field's annotation -> the argparse type of its option (any other: str)
_ARG_TYPES: dict[object, Callable[[str], object]] = {int: int, float: float, Path: Path}


def _field_type(field: str) -> tuple[Callable[[str], object], tuple[object, ...] | None]:
    """(argparse type, choices) from the settings field's annotation."""
    ann = _field_info(field).annotation
    args = typing.get_args(ann)
    if isinstance(ann, types.UnionType) or typing.get_origin(ann) is typing.Union:
        ann = next(a for a in args if a is not type(None))
        args = typing.get_args(ann)
    if typing.get_origin(ann) is typing.Literal:
        return str, args
    return _ARG_TYPES.get(ann, str), None


def _default(field: str) -> object:
    return _field_info(field).get_default(call_default_factory=True)


def option(flag: str) -> Option:
    """The row of :data:`OPTIONS` whose flag is ``flag`` (for a command that shares it)."""
    for opt in OPTIONS:
        if opt.flag == flag:
            return opt
    raise RuntimeError(f"no tune option {flag}")  # a bug in a caller, not input


def _argparse_kwargs(opt: Option) -> dict[str, Any]:
    """The ``add_argument`` keywords of one row: type, choices and default from the
    settings model."""
    kw: dict[str, Any] = {"dest": opt.field, "help": _help(opt)}
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
        kw["help"] = f"(required) {kw['help']}"
    kw.update(type=typ, choices=choices)
    kw["default"] = None if opt.parse is not None or opt.required else _default(opt.field)
    return kw


def _help(opt: Option) -> str:
    """A row's help; a measurement row's is its field's description (argparse-escaped) and
    its default, both from :class:`MeasureSettings`."""
    if opt.field not in MEASURE_KEYS:
        return opt.help
    default = _default(opt.field)
    text = opt.help.replace("%", "%%")
    return text if default in (None, {}) else f"{text} (default: {default})"


def flag_of(field: str) -> str:
    """The flag that sets a settings field (``precision`` -> ``--precision``)."""
    return next((o.flag for o in OPTIONS if o.field == field),
                "--" + field.replace("_", "-"))


def validation_message(exc: ValidationError) -> str:
    """A settings :class:`ValidationError` as one line naming each offending flag."""
    def where(loc: tuple[int | str, ...]) -> str:
        name = loc[1] if loc[0] == "measure" and len(loc) > 1 else loc[0]
        return flag_of(str(name))

    return "; ".join(f"{where(e['loc'])} {e.get('input')!r}: {e['msg']}" for e in exc.errors())


def measure_settings(args: argparse.Namespace, **override: object) -> MeasureSettings:
    """The validated :class:`MeasureSettings` of parsed measurement options (not given:
    the model's default); ``override``: values the command sets itself. A bad value is a
    one-line :class:`ConfigError` naming its flag."""
    values: dict[str, object] = {}
    for opt in MEASURE_OPTIONS:
        value = getattr(args, opt.field, None)
        if value is not None:
            values[opt.field] = opt.parse(value) if opt.parse is not None else value
    try:
        return MeasureSettings.model_validate({**values, **override})
    except ValidationError as exc:
        raise ConfigError(validation_message(exc)) from None


def add_measure_options(parser: argparse.ArgumentParser,
                        groups: Mapping[str, argparse._ActionsContainer] | None = None,
                        **override: Mapping[str, object]) -> None:
    """Add every measurement option (:data:`MEASURE_OPTIONS`) to ``parser``, each in
    ``groups[its group]`` where given; ``override``: ``add_argument`` keywords by field
    (bench's ``--output-jitter`` default, which ``--no-stagger`` sets)."""
    for opt in MEASURE_OPTIONS:
        target = (groups or {}).get(opt.group, parser)
        target.add_argument(opt.flag, *opt.aliases,
                            **{**_argparse_kwargs(opt), **override.get(opt.field, {})})


def add_option(group: argparse._ActionsContainer, flag: str, **override: object) -> None:
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

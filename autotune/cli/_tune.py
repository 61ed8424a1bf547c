"""``autotune tune``: run a Bayesian study against real vLLM servers.

Every option is declared once, in :data:`OPTIONS`: its flag, the :class:`TuneSettings`
field it sets and its help. Types, choices and defaults come from the settings model, so a
default is written in one place (``autotune/config.py``).
"""

from __future__ import annotations

import argparse
import json
import signal
import sys
import types
import typing
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any, TextIO

from autotune.config import TuneSettings, parse_slo
from autotune.errors import ConfigError
from autotune.events import StudyCallback, StudyContext, StudyEvent, TrialRecord

__all__ = ["OPTIONS", "Option", "add_tune_options", "register", "run_study_command",
           "settings_from_args"]


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


_GROUPS = {
    "what": "what to tune",
    "where": "where results go",
    "search": "search",
    "measure": "measurement",
    "resources": "resources",
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
           help="MLflow store (default sqlite:///experiments/mlflow.db; or an "
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
           help="maximise output tokens/s (throughput), requests/s that meet the SLOs "
                "(goodput), or both throughput and --pareto-latency as two objectives "
                "(pareto: the front is reported, plotted and logged)"),
    Option("--pareto-latency", "pareto_latency", "search",
           help="the latency a Pareto study minimises (ttft_p99, tpot_p99, e2e_p99, ...)"),
    Option("--slo", "slo", "search", parse=parse_slo,
           help="latency SLOs in seconds, e.g. ttft_p99=2.0,tpot_p99=0.05; trials that miss "
                "them are infeasible"),
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
           parse=lambda xs: [_json_arg(x) for x in xs or []],
           help="a config to try first, as JSON knob values (e.g. '{\"mtp_depth\": 1}' or "
                "@file.json); knobs not given take vLLM's defaults; repeatable"),
    Option("--timeout", "timeout_s", "search", metavar="SECONDS",
           help="time budget: start no new trial after this many seconds"),
    Option("--repeats", "repeats", "measure",
           help="measured replays per trial on the same server (median reported)"),
    Option("--recheck", "recheck", "measure", metavar="K",
           help="before declaring a winner, measure the top K configs and the baseline once "
                "more (new server starts) and choose by the median of all readings "
                "(default 3; 0 = off)"),
    Option("--warmup-requests", "warmup_requests", "measure",
           help="warm-up requests before measuring (default 2 x concurrency)"),
    Option("--num-requests", "num_requests", "measure",
           help="requests per replay (default: the shape's load.requests)"),
    Option("--concurrency", "concurrency", "measure",
           help="closed-loop streams (default: the shape's load.concurrency)"),
    Option("--api", "api", "measure", help="OpenAI endpoint the load generator uses"),
    Option("--start-timeout", "start_timeout_s", "measure",
           help="seconds a server may take to answer /health"),
    Option("--request-timeout", "request_timeout_s", "measure",
           help="seconds one request may take"),
    Option("--ray-address", "ray_address", "resources",
           help="join a Ray cluster (host:port of 'ray start --head'); default: a local Ray"),
    Option("--no-ray", "use_ray", "resources", action="store_false",
           help="run trials in this process (debugging)"),
    Option("--gpus-per-trial", "gpus_per_trial", "resources",
           help="GPUs per trial (default 1 on GPU hosts, 0 on CPU)"),
    Option("--parallel", "parallel", "resources",
           help="trials at once (default: one per GPU slot; 1 on CPU)"),
    Option("--cache-dir", "cache_dir", "resources",
           help="compile/JIT cache shared by all trials (default ~/.cache/autotune)"),
    Option("--cpu-kv-cache-gib", "cpu_kv_cache_gib", "resources",
           help="KV cache GiB for the CPU build (VLLM_CPU_KVCACHE_SPACE)"),
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
        kw.update(type=typ, choices=choices, required=opt.required)
        if not opt.required:
            kw["default"] = None if opt.parse is not None else _default(opt.field)
        g.add_argument(opt.flag, **kw)


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


def settings_from_args(args: argparse.Namespace) -> TuneSettings:
    """The validated :class:`TuneSettings` of parsed ``tune`` options; one-line errors that
    name the flag."""
    from pydantic import ValidationError

    values = {}
    for opt in OPTIONS:
        value = getattr(args, opt.field)
        values[opt.field] = opt.parse(value) if opt.parse is not None else value
    try:
        return TuneSettings(**values)
    except ValidationError as exc:
        flags = {opt.field: opt.flag for opt in OPTIONS}
        msgs = "; ".join(
            f"{flags.get(str(e['loc'][0]), '--' + str(e['loc'][0]).replace('_', '-'))} "
            f"{e.get('input')!r}: {e['msg']}" for e in exc.errors()
        )
        raise ConfigError(msgs) from None



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


def _fmt_s(s: float | None) -> str:
    if s is None:
        return "?"
    s = int(s)
    return f"{s // 3600}h{s % 3600 // 60:02d}m" if s >= 3600 else f"{s // 60}m{s % 60:02d}s"


class Display(StudyCallback):
    """Progress for people, on stderr: a line per event (a subscriber of the study)."""

    def __init__(self, objective: str) -> None:
        from rich.console import Console

        from autotune.schema import objective_label

        self.console = Console(stderr=True, highlight=False)
        self.label = objective_label(objective)

    def _head(self, e: StudyEvent) -> str:
        best = f"{e.best_value:,.1f} (trial {e.best_number})" if e.best_value is not None else "-"
        return (f"[{e.done}/{e.total} done, {e.running} running | best {best} | "
                f"elapsed {_fmt_s(e.elapsed_s)}, left ~{_fmt_s(e.eta_s)}]")

    def on_study_start(self, event: StudyEvent, context: StudyContext) -> None:
        self.console.print(f"study [bold]{event.study_name}[/]: {event.message}")

    def on_note(self, event: StudyEvent) -> None:
        self.console.print(f"{self._head(event)} {event.message}")

    def on_trial_start(self, event: StudyEvent) -> None:
        params = ", ".join(f"{k}={v}" for k, v in event.trial_params.items()) or "vLLM defaults"
        self.console.print(f"{self._head(event)} trial {event.trial_number} started: {params}")

    def on_trial_end(self, event: StudyEvent, record: TrialRecord) -> None:
        if record.rejected:
            return
        e = event
        if e.trial_value is not None and e.trial_reason is None:
            what = f"[green]{e.trial_value:,.1f} {self.label}[/]"
            if e.baseline_value:
                what += f" ({e.trial_value / e.baseline_value:.2f}x defaults)"
        elif e.trial_value is not None:
            what = f"[yellow]{e.trial_value:,.1f} {self.label}, infeasible ({e.trial_reason})[/]"
        else:
            what = f"[red]failed: {e.trial_reason}[/] {e.message[:160]}"
        self.console.print(f"{self._head(e)} trial {e.trial_number}: {what}")

    def on_study_end(self, event: StudyEvent, result: Any) -> None:
        if result is not None:
            self.console.print(f"study finished in {_fmt_s(event.elapsed_s)}")


def run_study_command(settings: TuneSettings, *, as_json: bool, out: TextIO,
                      warm_start: Any = None) -> int:
    """The tail ``tune`` and ``retune`` share: run the study (SIGTERM stops it like Ctrl-C)
    with the progress display, then print the result; exit 0 when a config won, else 1."""
    from autotune.schema import objective_label
    from autotune.study import tune

    def _sigterm(signum: int, frame: Any) -> None:  # SIGTERM stops cleanly, like Ctrl-C
        raise KeyboardInterrupt

    old = signal.signal(signal.SIGTERM, _sigterm)
    try:
        result = tune(settings, callbacks=[Display(settings.objective)], warm_start=warm_start)
    finally:
        signal.signal(signal.SIGTERM, old)
    if as_json:
        print(json.dumps(result.best, indent=2), file=out)
        return 0 if result.best else 1
    print(f"\nstudy {result.study_name}: {result.n_trials} trials, {result.n_ok} feasible, "
          f"{result.n_failed} failed {result.failures_by_reason or ''}", file=out)
    if result.best is None:
        print("no trial met the constraints; see the failure reasons above and in "
              f"{result.out_dir}/trials.csv", file=out)
        return 1
    b = result.best
    ratio = f" = {b['ratio_to_baseline']:.2f}x vLLM defaults" if b.get("ratio_to_baseline") else ""
    print(f"best: trial {b['trial']}: {b['objective']['value']:,.1f} "
          f"{objective_label(settings.objective)}{ratio}", file=out)
    print(f"params: {json.dumps(b['params'])}", file=out)
    print(f"serve command:\n  {b['serve_command']}", file=out)
    print(f"written: {result.out_dir / 'best.json'}", file=out)
    print(f"browse: mlflow ui --backend-store-uri {result.tracking_uri}", file=out)
    return 0


def _tune(args: argparse.Namespace) -> int:
    return run_study_command(settings_from_args(args), as_json=args.json, out=sys.stdout)

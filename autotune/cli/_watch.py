"""``autotune watch``: build shapes from a live endpoint, compare them with the tuned one."""

from __future__ import annotations

import argparse
import shlex
import signal
import sys
from datetime import UTC, datetime
from pathlib import Path
from typing import TYPE_CHECKING

from autotune.cli._from_prometheus import add_connection_args, client_from_args
from autotune.cli._shape import _resolve, parse_duration
from autotune.config import DEFAULT_STORAGE, storage_url, store_where
from autotune.errors import ConfigError

if TYPE_CHECKING:
    from autotune.results import TunedStudy
    from autotune.traffic import ShapeDiff, TrafficShape
    from autotune.watch import PrometheusWindows, WatchEvent, WatchSummary
    from autotune.watch._watch import WatchCallback

EXIT_OK = 0
EXIT_INTERRUPTED = 130


def register(sub: argparse._SubParsersAction) -> None:  # type: ignore[type-arg]
    p = sub.add_parser(
        "watch",
        help="watch a live vLLM endpoint's traffic for drift from the tuned shape",
        description=(
            "Every --every, build the shape of the traffic a running vLLM server served "
            "(from its /metrics, as 'autotune shape from-metrics') and compare it with the "
            "shape the current config was tuned for ('autotune shape diff'). On drift, print "
            "the 'autotune retune' command, or run --on-drift with the new shape's path; "
            "once per drift episode: the action is re-armed only after a window compares "
            "'same' again. Every state goes to OUT/watch.jsonl and to MLflow (a run per "
            "watch in experiment 'autotune-watch', a metric per comparison). An endpoint "
            "that goes away is retried (1 s, 2 s, ... up to 60 s). Ctrl-C stops it with a "
            "summary line (exit 130); --checks N stops after N comparisons (exit 0). "
            "See docs/traffic.md section 8."
        ),
        formatter_class=argparse.ArgumentDefaultsHelpFormatter,
    )
    p.add_argument("url", metavar="URL", nargs="?", default=None,
                   help="the vLLM server, e.g. http://localhost:8000 (or --prometheus)")
    p.add_argument("--prometheus", metavar="PROM_URL", default=None,
                   help="read each window from this Prometheus instead of sampling one "
                   "server: the whole fleet the --selector matches (default: the tuned "
                   "shape's selector when it came from Prometheus); see 'autotune shape "
                   "from-prometheus --help'")
    p.add_argument("--lag", default="30s", type=parse_duration,
                   help="with --prometheus: a window ends this long before now, so that "
                   "the replicas' last scrapes are in (about two scrape intervals)")
    p.add_argument("--tuned", required=True, metavar="SHAPE_OR_STUDY",
                   help="the shape the current config was tuned for: a shape JSON file, a "
                   "name in traffic/, or a study name in --storage (its recorded shape)")
    p.add_argument("--every", default="10m", type=parse_duration,
                   help="window length: a shape is built and compared every this long "
                   "(90, 90s, 10m, 1h); burstiness is only compared with windows >= 2m")
    p.add_argument("--interval", default=None, type=parse_duration,
                   help="scrape interval within a window (default: window/20, 0.5-10 s)")
    p.add_argument("--on-drift", metavar="CMD", default=None,
                   help="shell command run on drift: {shape} in it is replaced by the new "
                   "(shell-quoted) shape's path, else the path is appended as the last "
                   "argument; env AUTOTUNE_SHAPE (the path), AUTOTUNE_TUNED_SHAPE, "
                   "AUTOTUNE_DRIFTED (dimensions, comma-separated). Default: print the "
                   "retune command")
    p.add_argument("--request-log", metavar="LOG", default=None,
                   help="the server's log with --enable-log-requests: arrival times from it "
                   "(see 'autotune shape from-metrics --help')")
    p.add_argument("--checks", type=int, default=None,
                   help="stop after this many comparisons (default: run until Ctrl-C)")
    p.add_argument("--out", type=Path, default=None,
                   help="where the window shapes and watch.jsonl go "
                   "(default: experiments/watch/<UTC time>)")
    p.add_argument("--storage", default=DEFAULT_STORAGE,
                   help="Optuna storage (or a study's output folder), to read --tuned "
                        "STUDY's shape")
    p.add_argument("--tracking-uri", default=None,
                   help="MLflow store (default sqlite:///experiments/mlflow.db)")
    p.add_argument("--no-mlflow", action="store_true", help="do not log to MLflow")
    p.add_argument("--model", default=None,
                   help="model for the printed retune command (default: that of the study "
                   "tuned for --tuned, else the one the server at URL serves)")
    p.add_argument("--space", default=None,
                   help="search space for the printed retune command (default: that of the "
                   "study tuned for --tuned)")
    add_connection_args(p)
    p.set_defaults(func=_watch)


def _tuned(ref: str, storage: str) -> tuple[TrafficShape, str | None, TunedStudy | None]:
    """(shape, its path, its study) for --tuned: a file or a traffic/ name (no study), or a
    study in ``storage`` (its recorded shape)."""
    from autotune.traffic import load_shape

    path = _resolve(ref)
    if path.exists():
        return load_shape(path), str(path), None
    from autotune.results import tuned_studies

    for info in tuned_studies(storage=storage):
        if info.name == ref:
            if not info.shape_path or not Path(info.shape_path).exists():
                raise ConfigError(
                    f"--tuned {ref}: study {ref} recorded the shape file "
                    f"{info.shape_path!r}, which does not exist here; pass the shape file")
            return load_shape(info.shape_path), info.shape_path, info
    raise ConfigError(f"--tuned {ref!r} is neither a shape file, a name in traffic/, nor a "
                      f"study in {store_where(storage)}; pass a shape JSON file or a study "
                      "name (with --storage of its --out folder)")


def _retune_command(args: argparse.Namespace, tuned: TrafficShape, storage: str,
                    study: TunedStudy | None) -> tuple[str | None, str]:
    """(the ``autotune retune`` printed on drift, before ``--shape NEW``; why there is none).

    Every value in it is a real one: the model and space from --model/--space, else the
    study --tuned names or the newest tuned for its shape, else (the model) what the
    server at URL serves; its storage when not the default one. When the model or the
    space stays unknown no command is made (a placeholder would not run): the reason says
    which to give. None with no reason under --on-drift, which runs instead."""
    from autotune.results import tuned_studies
    from autotune.watch import served_model

    if args.on_drift is not None:  # runs that command instead: nothing printed
        return None, ""
    if study is None and not (args.model and args.space):  # the newest tuned for the shape
        same = [s for s in tuned_studies(storage=storage)
                if s.shape_fingerprint == tuned.fingerprint]
        study = same[-1] if same else None
    model = args.model or (study.model if study else None) or (
        served_model(args.url) if args.url else None)
    space = args.space or (study.space if study else None)
    missing = [opt for opt, v in (("--model", model), ("--space", space)) if not v]
    if missing:
        why = (f"no study in {store_where(storage)} was tuned for {tuned.name} "
               f"[{tuned.fingerprint}]")
        if "--model" in missing and args.url:
            why += f" and {args.url} named no model at /v1/models"
        need = " and ".join(missing)
        return None, (f"no retune command: it needs {need} ({why}); give watch {need} (the "
                      "model the server serves, the search space to tune), or --on-drift CMD")
    where = (f" --storage {shlex.quote(store_where(storage))}"
             if storage != DEFAULT_STORAGE else "")
    return (f"autotune retune --model {shlex.quote(str(model))} --space "
            f"{shlex.quote(str(space))}{where}"), ""


class _Printer:
    """Prints each state as one line (the retune command on the first drift, or why there
    is none)."""

    def __init__(self, retune: str | None, why_not: str = "") -> None:
        self.retune, self.why_not = retune, why_not

    def on_start(self, *, url: str, tuned: TrafficShape, every_s: float) -> None:
        print(f"watching {url} every {every_s:g} s against {tuned.name} "
              f"[{tuned.fingerprint}] (Ctrl-C stops)", flush=True)

    def on_event(self, ev: WatchEvent, diff: ShapeDiff | None) -> None:
        t = ev.time[11:19]
        if ev.state in ("unreachable", "not_vllm", "idle"):
            print(f"{t} {ev.state}: {ev.message}", flush=True)
            return
        what = ("same" if ev.state == "same"
                else "DRIFTED in " + ", ".join(ev.drifted_dimensions))
        print(f"{t} check {ev.check}: {what} (distance {ev.distance:.3g}; {ev.requests} "
              f"requests, {ev.rate_rps:.3g} req/s) -> {ev.shape_path}", flush=True)
        if ev.action == "printed" and self.retune is None:
            print(f"  traffic drifted; {self.why_not}", flush=True)
        elif ev.action == "printed":
            print(f"  traffic drifted; re-tune with:\n    {self.retune} --shape "
                  f"{shlex.quote(ev.shape_path or '')}", flush=True)
        elif ev.action is not None:
            print(f"  drift action: {ev.action}", flush=True)
        elif ev.state == "drifted":
            print("  (still drifted: the action already ran for this episode)", flush=True)

    def on_end(self, summary: WatchSummary) -> None:
        print(summary.line(), flush=True)


def _prometheus_source(args: argparse.Namespace, tuned: TrafficShape
                       ) -> tuple[PrometheusWindows, str]:
    """The Prometheus windows, on the tuned shape's selector unless --selector says else
    (like with like: a note when they differ)."""
    from autotune.traffic import normalize_selector
    from autotune.watch import PrometheusWindows

    if args.interval is not None or args.request_log:
        raise ConfigError("--interval and --request-log are for sampling one server's "
                          "/metrics; Prometheus has its own scrape interval")
    rng = tuned.source.prometheus if tuned.source is not None else None
    if args.selector is None and rng is not None:
        args.selector = rng.selector
        print(f"selector {rng.selector}: the one the tuned shape {tuned.name} was fitted "
              f"with ({rng.start_iso} .. {rng.end_iso})", flush=True)
    elif rng is not None and normalize_selector(args.selector) != normalize_selector(
            rng.selector):
        print(f"note: --selector {args.selector} is not the tuned shape's {rng.selector}: "
              "the windows and the tuned shape describe different replicas", flush=True)
    client = client_from_args(args.prometheus, args)
    windows = PrometheusWindows(client, every_s=args.every, lag_s=args.lag,
                                selector=args.selector)
    return windows, f"{client.url} {args.selector or '{}'}"


def _watch(args: argparse.Namespace) -> int:
    from autotune.results import default_tracking_uri
    from autotune.watch import JsonlLog, MlflowWatchLog, metrics_url, run_command, watch

    if args.checks is not None and args.checks < 1:
        raise ConfigError(f"--checks must be >= 1 (got {args.checks})")
    if (args.url is None) == (args.prometheus is None):
        raise ConfigError("give the vLLM server's URL or --prometheus PROM_URL (one of them)")
    if args.url is not None:
        metrics_url(args.url)  # validates the URL's form before anything else
    if args.request_log and not Path(args.request_log).is_file():
        raise ConfigError(f"--request-log {args.request_log}: no such file")
    storage = storage_url(args.storage)
    tuned, tuned_path, study = _tuned(args.tuned, storage)
    retune, why_not = _retune_command(args, tuned, storage, study)
    if why_not:  # said now, not first at a drift hours later
        print(f"note: {why_not}", file=sys.stderr, flush=True)
    source, where = _prometheus_source(args, tuned) if args.prometheus else (None, args.url)
    out = args.out or Path("experiments") / "watch" / datetime.now(UTC).strftime(
        "%Y%m%dT%H%M%SZ")
    out.mkdir(parents=True, exist_ok=True)
    callbacks: list[WatchCallback] = [_Printer(retune, why_not), JsonlLog(out / "watch.jsonl")]
    if not args.no_mlflow:
        callbacks.append(MlflowWatchLog(args.tracking_uri or default_tracking_uri()))

    def on_drift(shape: TrafficShape, path: Path, diff: ShapeDiff) -> str:
        if args.on_drift is None:
            return "printed"
        rc = run_command(args.on_drift, path, diff, tuned_path=tuned_path)
        return f"ran {args.on_drift!r}: exit {rc}"

    def _sigterm(signum: int, frame: object) -> None:  # SIGTERM stops cleanly, like Ctrl-C
        raise KeyboardInterrupt

    old = signal.signal(signal.SIGTERM, _sigterm)
    try:
        summary = watch(url=where, tuned=tuned, every_s=args.every,
                        interval_s=args.interval, shapes_dir=out, on_drift=on_drift,
                        callbacks=callbacks, max_checks=args.checks,
                        request_log=args.request_log, source=source)
    finally:
        signal.signal(signal.SIGTERM, old)
    print(f"log: {out / 'watch.jsonl'}", file=sys.stderr)
    return EXIT_INTERRUPTED if summary.interrupted else EXIT_OK

"""``autotune rollout``: move live traffic behind vLLM's router to the tuned config, step by
step, and roll back when it is worse."""

from __future__ import annotations

import argparse
import sys
from collections.abc import Mapping
from datetime import UTC, datetime
from pathlib import Path
from typing import TYPE_CHECKING, Any

from autotune.cli._shape import parse_duration
from autotune.errors import ConfigError

if TYPE_CHECKING:
    from autotune.records import BestFile
    from autotune.rollout import ManagedServer, RolloutLog, RolloutResult, RolloutSettings

EXIT_PROMOTED = 0
EXIT_ROLLED_BACK = 1

_DESCRIPTION = """\
Move the traffic a vLLM router (vllm-router, driven through its admin API: /list_workers,
/add_worker, /remove_worker) sends to the current servers over to a new server with the
tuned config: --new URL (already running), or --start (started from --best best.json as the
trials started it).

Steps (--steps, default 1,50%,100%): first one new server in the router, then half the
fleet, then all of it. New servers are added before old ones are taken out, so capacity
never drops. Each step but the last is held while autotune scrapes every server's own
/metrics at the same moments (--interval) and compares the new side with the old over the
same window: TTFT, TPOT and end-to-end latency p50/p99 from the histograms (--metrics), the
error fraction, output tokens/s and requests running/waiting per server. A latency passes
when the 95 % interval of its new/old ratio lies below 1 + --tolerance; it is a regression
when the interval lies above it; errors likewise on the difference of the error fractions
(--error-tolerance). A step passes when every metric passed (after at least --min-hold and
--min-requests per side); it is rolled back at once on a regression, an error burst
(--error-burst) or a new server that stops answering, and also when it is still undecided
after --step-timeout (promotion needs proof). The last step is the switch: the old servers
leave the router, stay up for --min-hold while the new ones are watched, then are drained
(stopped once they run and queue no request: by autotune for servers it started, else by
--stop-drained). A rollback puts the old servers back first, then drains the new ones.

Every step is recorded in OUT/rollout.jsonl and OUT/summary.json, and in an MLflow run
linked to the study that chose the config. Exit 0: promoted; 1: rolled back; 2: bad input,
or the router or a server is not usable (nothing changed). See docs/rollout.md."""


def register(sub: argparse._SubParsersAction) -> None:  # type: ignore[type-arg]
    from autotune.rollout import DEFAULT_STEPS, METRICS

    p = sub.add_parser(
        "rollout",
        help="move live traffic behind vllm-router to the tuned config; roll back if worse",
        description=_DESCRIPTION,
        formatter_class=lambda prog: argparse.RawDescriptionHelpFormatter(prog, width=100),
    )
    p.add_argument("--router", required=True, metavar="URL",
                   help="the vllm-router in front of the current servers, e.g. "
                   "http://localhost:30000")
    who = p.add_argument_group("servers")
    who.add_argument("--new", nargs="+", default=[], metavar="URL",
                     help="new servers, already running with the tuned config")
    who.add_argument("--start", action="store_true",
                     help="start the new server from --best (its flags and env) on this host")
    who.add_argument("--best", type=Path, default=None, metavar="BEST_JSON",
                     help="the study's best.json: the config --start runs, and the study the "
                     "MLflow run is linked to")
    who.add_argument("--model", default=None,
                     help="with --start: the model to serve (default: best.json's)")
    who.add_argument("--served-model-name", default=None,
                     help="with --start: the name it serves (default: the old servers')")
    who.add_argument("--old", nargs="+", default=[], metavar="URL",
                     help="the current servers (default: every worker of the router)")
    who.add_argument("--stop-drained", default=None, metavar="CMD",
                     help="shell command that stops a drained old server ({url} is replaced "
                     "by its URL); default: only report that it is safe to stop")
    how = p.add_argument_group("steps and judgement")
    how.add_argument("--steps", default=DEFAULT_STEPS,
                     help="new servers per step, a count or a share (default "
                     f"{DEFAULT_STEPS.replace('%', '%%')})")
    how.add_argument("--tolerance", type=float, default=0.10,
                     help="how much worse (relative) a latency may be (default 0.10: 10 %%)")
    how.add_argument("--error-tolerance", type=float, default=0.01,
                     help="how much higher the error fraction may be (default 0.01)")
    how.add_argument("--error-burst", type=int, default=5,
                     help="this many new errors above the old rate roll back (default 5)")
    how.add_argument("--metrics", default=",".join(METRICS),
                     help="the latency metrics judged (default: all of them)")
    how.add_argument("--min-requests", type=int, default=30,
                     help="finished requests per side before a step is judged (default 30)")
    how.add_argument("--interval", type=parse_duration, default=5.0,
                     help="scrape interval (default 5s)")
    how.add_argument("--min-hold", type=parse_duration, default=60.0,
                     help="each step is held at least this long (default 60s)")
    how.add_argument("--step-timeout", type=parse_duration, default=600.0,
                     help="a step still undecided after this long rolls back (default 10m)")
    how.add_argument("--drain-timeout", type=parse_duration, default=600.0,
                     help="how long a removed server's requests may take to finish "
                     "(default 10m)")
    rec = p.add_argument_group("record")
    rec.add_argument("--out", type=Path, default=None,
                     help="folder of rollout.jsonl and summary.json (default "
                     "experiments/rollout/<UTC time>)")
    rec.add_argument("--tracking-uri", default=None,
                     help="MLflow store (default sqlite:///experiments/mlflow.db)")
    rec.add_argument("--no-mlflow", action="store_true", help="do not log to MLflow")
    rec.add_argument("--dry-run", action="store_true",
                     help="print the plan (after checking that the router answers) and stop")
    p.set_defaults(func=_rollout)


def _settings(args: argparse.Namespace, out: Path, new: list[str]) -> RolloutSettings:
    from pydantic import ValidationError

    from autotune.rollout import RolloutSettings

    try:
        return RolloutSettings(
            router=args.router, old=tuple(args.old), new=tuple(new), steps=args.steps,
            metrics=tuple(m.strip() for m in args.metrics.split(",") if m.strip()),
            tolerance=args.tolerance, error_tolerance=args.error_tolerance,
            error_burst=args.error_burst, min_requests=args.min_requests,
            interval_s=args.interval, min_hold_s=args.min_hold,
            step_timeout_s=args.step_timeout, drain_timeout_s=args.drain_timeout,
            stop_drained=args.stop_drained, out=out)
    except ValidationError as exc:
        err = exc.errors()[0]
        where = ("--" + str(err["loc"][0]).removesuffix("_s").replace("_", "-")
                 if err["loc"] else "rollout")
        raise ConfigError(f"{where}: {err['msg']}") from None


def _echo(rec: Mapping[str, Any]) -> None:
    kind, t = rec["event"], datetime.fromtimestamp(rec["t"], UTC).strftime("%H:%M:%S")
    if kind == "step":
        print(f"{t} step {rec['step']} ({rec['label']}): router -> {', '.join(rec['router'])}",
              flush=True)
    elif kind == "compare":
        ratios = ", ".join(f"{m['metric']} {m['ratio']:.2f} [{m['low']:.2f}, {m['high']:.2f}]"
                           for m in rec["metrics"]
                           if m["ratio"] is not None and m["low"] is not None)
        print(f"{t}   {rec['elapsed_s']:.0f} s: {rec['decision']}: new "
              f"{rec['new']['finished']} / old {rec['old']['finished']} requests; {ratios}",
              flush=True)
    elif kind in ("rollback", "promoted", "drained", "stopped"):
        detail = rec.get("why") or rec.get("url") or ""
        print(f"{t} {kind}: {detail}", flush=True)


def _dry_run(settings: RolloutSettings, new: list[str]) -> int:
    from autotune.rollout import RouterClient, plan_steps

    router = RouterClient(settings.router)
    old = list(settings.old) or router.list_workers()
    plan = plan_steps(old=old, new=new, steps=settings.steps)
    print(f"router {router.base_url}: {len(old)} old server(s), {len(new)} new")
    for s in plan:
        held = ("the switch: old servers out, new ones watched for "
                f"{settings.min_hold_s:g} s" if s.final else
                f"held {settings.min_hold_s:g}-{settings.step_timeout_s:g} s until decided")
        print(f"step {s.number} ({s.label}): new {', '.join(s.new)} | old "
              f"{', '.join(s.old) or '-'} | {held}")
    print(f"judged on {', '.join(settings.metrics)} (tolerance {settings.tolerance:g}) and "
          f"errors (tolerance {settings.error_tolerance:g}), 95 % intervals")
    return EXIT_PROMOTED


def _rollout(args: argparse.Namespace) -> int:
    from autotune.rollout import RolloutLog, run_rollout
    from autotune.rollout._start import load_best, served_model_name, start_new_server

    if args.start == bool(args.new):
        raise ConfigError("give either --new URL (a running server) or --start (with --best)")
    if args.start and args.best is None:
        raise ConfigError("--start needs --best BEST_JSON (the config to start)")
    best = load_best(args.best) if args.best is not None else None
    out = args.out or Path("experiments") / "rollout" / datetime.now(UTC).strftime(
        "%Y%m%dT%H%M%SZ")
    placeholder = ["http://new-server (--start)"] if args.start else list(args.new)
    settings = _settings(args, out, [] if args.start else list(args.new))
    if args.dry_run:
        return _dry_run(settings, placeholder)
    from autotune.rollout import RouterClient

    workers = RouterClient(settings.router).list_workers()  # no router: nothing written
    out.mkdir(parents=True, exist_ok=True)
    new: list[ManagedServer] = []
    if args.start:
        old = list(settings.old) or workers
        if not old:
            raise ConfigError("the router holds no server to compare with; give --old URL")
        name = args.served_model_name or served_model_name(old[0])
        print(f"starting the new server from {args.best} (log: {out / 'new-server.log'})",
              flush=True)
        if best is None:
            raise ConfigError("--start needs --best BEST_JSON (the config to start)")
        new.append(start_new_server(best=best, model=args.model, served_name=name,
                                    log_path=out / "new-server.log"))
        print(f"new server up at {new[0].url}", flush=True)
    else:
        from autotune.rollout import ManagedServer

        new = [ManagedServer(u.rstrip("/")) for u in args.new]
    log = RolloutLog(out / "rollout.jsonl", echo=_echo)
    started = datetime.now(UTC).isoformat(timespec="seconds")
    try:
        result = run_rollout(settings=settings, new=new, log=log)
    except BaseException:
        for m in new:
            if m.stop is not None and not m.exited():
                m.stop()
        raise
    finally:
        log.close()
    rc = _finish(args, result, log, best, settings, started)
    if rc == EXIT_PROMOTED and args.start:
        _serve(new)
    return rc


def _serve(new: list[ManagedServer]) -> None:
    """A server started by --start lives as long as this process (it is its child, stopped
    with it): after promotion, stay in the foreground until Ctrl-C or SIGTERM."""
    import signal
    import time

    def _sigterm(signum: int, frame: object) -> None:
        raise KeyboardInterrupt

    old = signal.signal(signal.SIGTERM, _sigterm)
    print(f"serving: {', '.join(m.url for m in new)} runs while this command runs "
          "(Ctrl-C or SIGTERM stops it)", flush=True)
    try:
        while not any(m.exited() for m in new):
            time.sleep(1.0)
        print("the new server exited", file=sys.stderr)
    except KeyboardInterrupt:
        pass
    finally:
        signal.signal(signal.SIGTERM, old)
        for m in new:
            if m.stop is not None:
                m.stop()


def _finish(args: argparse.Namespace, result: RolloutResult, log: RolloutLog,
            best: BestFile | None, settings: RolloutSettings, started: str) -> int:
    summary = {**result.as_dict(), "started": started,
               "finished": datetime.now(UTC).isoformat(timespec="seconds"),
               "router": settings.router, "settings": settings.model_dump(mode="json"),
               "study": best.study if best is not None else None,
               "best": str(args.best) if args.best else None,
               "log": str(log.path)}
    path = log.write_summary(summary)
    if not args.no_mlflow:
        from autotune.results import default_tracking_uri
        from autotune.rollout._record import log_rollout_run

        rid, failures = log_rollout_run(
            tracking_uri=args.tracking_uri or default_tracking_uri(), summary=summary,
            files=[log.path, path], best=best)
        for f in failures:
            print(f"warning: {f}", file=sys.stderr)
        if rid:
            summary["mlflow_run_id"] = rid
            log.write_summary(summary)
    lost = (f"; at least {result.lost_requests} request(s) held by the dead server were cut"
            if result.lost_requests else "")
    print(f"{result.outcome.replace('_', ' ')}: {result.why}{lost}")
    print(f"log: {log.path}\nsummary: {path}", file=sys.stderr)
    return EXIT_PROMOTED if result.outcome == "promoted" else EXIT_ROLLED_BACK

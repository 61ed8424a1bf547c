"""``autotune tune``: run a Bayesian study against real vLLM servers."""

from __future__ import annotations

import argparse
import signal
import sys
from pathlib import Path
from typing import Any

from autotune.config import DEFAULT_STORAGE, parse_slo


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
    req = p.add_argument_group("what to tune")
    req.add_argument("--model", required=True, type=Path,
                     help="local model directory (config.json, tokenizer; weights optional "
                          "with --load-format dummy in the space's fixed flags)")
    req.add_argument("--shape", required=True, type=Path,
                     help="traffic shape JSON (autotune shape fit ...; examples in traffic/)")
    req.add_argument("--space", required=True, type=Path,
                     help="search space YAML (search_spaces/cpu.yaml, hybrid-mtp.yaml, ...)")
    req.add_argument("--trials", type=int, default=20,
                     help="finished trials the study should have (the baseline counts)")
    st = p.add_argument_group("where results go")
    st.add_argument("--storage", default=DEFAULT_STORAGE,
                    help="Optuna storage URL (SQLite file, or PostgreSQL for many workers)")
    st.add_argument("--tracking-uri", default=None,
                    help="MLflow store (default sqlite:///experiments/mlflow.db; or an "
                         "http://host:5000 tracking server)")
    st.add_argument("--experiment", default="autotune", help="MLflow experiment name")
    st.add_argument("--study-name", default=None,
                    help="study name (default SPACE-SHAPE-TIMESTAMP)")
    st.add_argument("--out", type=Path, default=None,
                    help="output folder for best.json, trials.csv, logs "
                         "(default experiments/<study-name>/)")
    st.add_argument("--resume", action="store_true",
                    help="continue a killed study (the newest one in --storage unless "
                         "--study-name is given); finished trials are kept")
    se = p.add_argument_group("search")
    se.add_argument("--sampler", choices=("tpe", "random"), default="tpe",
                    help="tpe: Bayesian (multivariate TPE with constraints); random: baseline")
    se.add_argument("--objective", choices=("throughput", "goodput", "pareto"),
                    default="throughput",
                    help="maximise output tokens/s (throughput), requests/s that meet the "
                         "SLOs (goodput), or both throughput and --pareto-latency as two "
                         "objectives (pareto: the front is reported, plotted and logged)")
    se.add_argument("--pareto-latency", default="ttft_p99",
                    help="the latency a Pareto study minimises (ttft_p99, tpot_p99, e2e_p99, ...)")
    se.add_argument("--slo", default=None,
                    help="latency SLOs in seconds, e.g. ttft_p99=2.0,tpot_p99=0.05; trials "
                         "that miss them are infeasible")
    se.add_argument("--max-error-rate", type=float, default=0.05,
                    help="trials with more failed requests are infeasible")
    se.add_argument("--no-baseline", dest="baseline", action="store_false",
                    help="do not measure vLLM's defaults first")
    se.add_argument("--seed", type=int, default=0, help="sampler and traffic seed")
    se.add_argument("--quality", default=None, metavar="THRESHOLDS",
                    help="bound the accuracy cost of lossy knobs, e.g. min_agreement=0.95 "
                         "(greedy exact-match rate vs the full-precision reference; also "
                         "max_logprob_diff, min_divergence_p10): trials below are infeasible "
                         "(docs/quality.md)")
    se.add_argument("--no-quality-probe", dest="quality_probe", action="store_false",
                    help="do not probe lossy trials (no reference server, no quality figures)")
    se.add_argument("--enqueue", action="append", default=[], metavar="JSON",
                    help="a config to try first, as JSON knob values (e.g. '{\"mtp_depth\": 1}'"
                         " or @file.json); knobs not given take vLLM's defaults; repeatable")
    se.add_argument("--timeout", "--budget", dest="timeout", type=float, default=None,
                    metavar="SECONDS",
                    help="time budget of the whole study, re-check included: the search "
                         "stops when what is left would not fit the re-check at the mean "
                         "trial time so far; running trials finish, then the verdict")
    se.add_argument("--pruner", choices=("interval", "none"), default="interval",
                    help="interval (default): stop a trial as soon as its 95 %% interval lies "
                         "wholly below the incumbent's (recorded as 'pruned'; throughput "
                         "studies only); none: measure every trial to the end")
    ms = p.add_argument_group("measurement")
    ms.add_argument("--repeats", type=int, default=1,
                    help="measured replays per trial on the same server (median reported)")
    ms.add_argument("--recheck", type=int, default=3, metavar="K",
                    help="before the verdict, measure the top K configs and vLLM's defaults "
                         "again on fresh servers (--recheck-starts each); a winner is declared "
                         "only if the 95 %% interval of its ratio to the defaults lies above 1 "
                         "(default 3; 0 = off: the verdict then rests on within-run intervals)")
    ms.add_argument("--recheck-starts", type=int, default=2, metavar="N",
                    help="fresh server starts per re-checked config (default 2)")
    ms.add_argument("--precision", type=float, default=0.02,
                    help="stop measuring a trial when the 95 %% interval of its output "
                         "tokens/s is within this fraction of it (default 0.02 = 2 %%)")
    ms.add_argument("--measure-max-s", type=float, default=180.0, metavar="SECONDS",
                    help="measure a trial at most this long (default 180)")
    ms.add_argument("--warmup-max-s", type=float, default=120.0, metavar="SECONDS",
                    help="warm up at most this long; the warm-up ends earlier when two "
                         "consecutive segments agree within --warmup-tolerance and the server "
                         "logged no kernel JIT compilation in the last one (default 120)")
    ms.add_argument("--warmup-tolerance", type=float, default=0.05,
                    help="segments agree when they differ by at most this fraction (0.05)")
    ms.add_argument("--segment-requests", type=int, default=None, metavar="N",
                    help="completed requests per segment (default max(concurrency, 16): "
                         "about one wave of the closed loop)")
    ms.add_argument("--warmup-requests", type=int, default=None,
                    help="open-loop shapes only: warm-up requests before the measured "
                         "replay (default 2 x concurrency); closed loops warm up in segments")
    ms.add_argument("--num-requests", type=int, default=None,
                    help="requests per replay (default: the shape's load.requests)")
    ms.add_argument("--concurrency", type=int, default=None,
                    help="closed-loop streams (default: the shape's load.concurrency)")
    ms.add_argument("--api", choices=("completions", "chat"), default="completions",
                    help="OpenAI endpoint the load generator uses")
    ms.add_argument("--start-timeout", type=float, default=600.0,
                    help="seconds a server may take to answer /health")
    ms.add_argument("--request-timeout", type=float, default=600.0,
                    help="seconds one request may take")
    rs = p.add_argument_group("resources")
    rs.add_argument("--ray-address", default=None,
                    help="join a Ray cluster (host:port of 'ray start --head'); default: "
                         "a local Ray")
    rs.add_argument("--no-ray", dest="use_ray", action="store_false",
                    help="run trials in this process (debugging)")
    rs.add_argument("--gpus-per-trial", type=int, default=None,
                    help="GPUs per trial (default 1 on GPU hosts, 0 on CPU)")
    rs.add_argument("--parallel", type=int, default=None,
                    help="trials at once (default: one per GPU slot; 1 on CPU)")
    rs.add_argument("--cache-dir", type=Path, default=None,
                    help="compile/JIT cache shared by all trials (default ~/.cache/autotune)")
    rs.add_argument("--cpu-kv-cache-gib", type=float, default=1.0,
                    help="KV cache GiB for the CPU build (VLLM_CPU_KVCACHE_SPACE)")
    p.add_argument("--json", action="store_true",
                   help="print the result (best.json content) as JSON at the end")
    p.set_defaults(func=_tune)


def _settings(args: argparse.Namespace) -> Any:
    from pydantic import ValidationError

    from autotune.config import TuneSettings
    from autotune.errors import ConfigError

    try:
        return TuneSettings(
            model=args.model, shape=args.shape, space=args.space, trials=args.trials,
            storage=args.storage, tracking_uri=args.tracking_uri, experiment=args.experiment,
            study_name=args.study_name, out=args.out, ray_address=args.ray_address,
            use_ray=args.use_ray, seed=args.seed, sampler=args.sampler,
            objective=args.objective, pareto_latency=args.pareto_latency,
            slo=parse_slo(args.slo),
            max_error_rate=args.max_error_rate, baseline=args.baseline, repeats=args.repeats,
            recheck=args.recheck,
            warmup_requests=args.warmup_requests, num_requests=args.num_requests,
            concurrency=args.concurrency, api=args.api, start_timeout_s=args.start_timeout,
            request_timeout_s=args.request_timeout, gpus_per_trial=args.gpus_per_trial,
            parallel=args.parallel, cache_dir=args.cache_dir,
            cpu_kv_cache_gib=args.cpu_kv_cache_gib, resume=args.resume,
            enqueue=[_json_arg(x) for x in args.enqueue], timeout_s=args.timeout,
            quality=args.quality, quality_probe=args.quality_probe,
            precision=args.precision, pruner=args.pruner, recheck_starts=args.recheck_starts,
            measure_max_s=args.measure_max_s, warmup_max_s=args.warmup_max_s,
            warmup_tolerance=args.warmup_tolerance, segment_requests=args.segment_requests,
        )  # fmt: skip
    except ValidationError as exc:
        flag = {"timeout_s": "--timeout", "start_timeout_s": "--start-timeout",
                "measure_max_s": "--measure-max-s", "warmup_max_s": "--warmup-max-s",
                "request_timeout_s": "--request-timeout", "use_ray": "--no-ray"}
        msgs = "; ".join(
            f"{flag.get(str(e['loc'][0]), '--' + str(e['loc'][0]).replace('_', '-'))} "
            f"{e.get('input')!r}: {e['msg']}" for e in exc.errors()
        )
        raise ConfigError(msgs) from None


def _json_arg(text: str) -> dict[str, Any]:
    import json

    from autotune.errors import ConfigError

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


class _Display:
    """Progress for people: a line per event; a live bar on a terminal."""

    def __init__(self, metric_label: str) -> None:
        from rich.console import Console

        self.console = Console(stderr=True, highlight=False)
        self.label = metric_label

    def __call__(self, e: Any) -> None:
        best = f"{e.best_value:,.1f} (trial {e.best_number})" if e.best_value is not None else "-"
        head = f"[{e.done}/{e.total} done, {e.running} running | best {best} | " \
               f"elapsed {_fmt_s(e.elapsed_s)}, left ~{_fmt_s(e.eta_s)}]"
        if e.kind == "study_started":
            self.console.print(f"study [bold]{e.study_name}[/]: {e.message}")
        elif e.kind == "note":
            self.console.print(f"{head} {e.message}")
        elif e.kind == "recheck_started":
            self.console.print(f"{head} {e.message}")
        elif e.kind == "trial_started":
            params = ", ".join(f"{k}={v}" for k, v in e.trial_params.items()) or "vLLM defaults"
            self.console.print(f"{head} trial {e.trial_number} started: {params}")
        elif e.kind == "trial_finished":
            if e.trial_value is not None and e.trial_reason is None:
                what = f"[green]{e.trial_value:,.1f} {self.label}[/]"
                if e.baseline_value:
                    what += f" ({e.trial_value / e.baseline_value:.2f}x defaults)"
            elif e.trial_reason == "pruned":
                what = f"[cyan]pruned[/] {e.message[:160]}"
            elif e.trial_value is not None:
                what = f"[yellow]{e.trial_value:,.1f} {self.label}, infeasible ({e.trial_reason})[/]"
            else:
                what = f"[red]failed: {e.trial_reason}[/] {e.message[:160]}"
            self.console.print(f"{head} trial {e.trial_number}: {what}")
        elif e.kind == "study_finished":
            self.console.print(f"study finished in {_fmt_s(e.elapsed_s)}")


def _verdict_line(v: dict[str, Any]) -> str:
    """The verdict for people: who won, by how much, how sure."""
    r = v.get("ratio_to_defaults")
    ci = (f"{r['median']:.3f}x the defaults (95 % interval {r['ci_low']:.3f}-{r['ci_high']:.3f})"
          if r else "no ratio to the defaults")
    if v.get("verdict") == "winner":
        return f"verdict: WINNER trial {v.get('winner_number')}: {ci}"
    if v.get("verdict") == "defaults_best":
        return (f"verdict: vLLM's defaults remain best for this shape; best other config "
                f"(trial {v.get('candidate_number')}): {ci}")
    return f"verdict: {v.get('verdict', 'none')}: {v.get('reason', '')}"


def _gpu_time_lines(acct: dict[str, dict[str, float]]) -> list[str]:
    lines = []
    for label, a in sorted(acct.items()):
        total = sum(a.values()) or 1.0
        lines.append(f"time on {label}: start {a.get('start_s', 0):.0f} s, warm-up "
                     f"{a.get('warmup_s', 0):.0f} s, measuring {a.get('measure_s', 0):.0f} s "
                     f"({a.get('measure_s', 0) / total:.0%}), other {a.get('other_s', 0):.0f} s, "
                     f"idle {a.get('idle_s', 0):.0f} s")
    return lines


def _tune(args: argparse.Namespace) -> int:
    import json

    from autotune.study import tune

    settings = _settings(args)
    label = "goodput req/s" if settings.objective == "goodput" else "out tok/s"

    def _sigterm(signum: int, frame: Any) -> None:  # SIGTERM stops cleanly, like Ctrl-C
        raise KeyboardInterrupt

    old = signal.signal(signal.SIGTERM, _sigterm)
    try:
        result = tune(settings, on_event=_Display(label))
    finally:
        signal.signal(signal.SIGTERM, old)
    out = sys.stdout
    if args.json:
        print(json.dumps(result.best, indent=2), file=out)
        return 0 if result.best else 1
    print(f"\nstudy {result.study_name}: {result.n_trials} trials, {result.n_ok} feasible, "
          f"{result.n_failed} failed {result.failures_by_reason or ''}", file=out)
    if result.best is None:
        print("no trial met the constraints; see the failure reasons above and in "
              f"{result.out_dir}/trials.csv", file=out)
        return 1
    b = result.best
    print(_verdict_line(result.verdict), file=out)
    ratio = f" = {b['ratio_to_baseline']:.2f}x vLLM defaults" if b.get("ratio_to_baseline") else ""
    print(f"best: trial {b['trial']}: {b['objective']['value']:,.1f} {label}{ratio}", file=out)
    print(f"params: {json.dumps(b['params'])}", file=out)
    print(f"serve command:\n  {b['serve_command']}", file=out)
    for line in _gpu_time_lines(result.gpu_time):
        print(line, file=out)
    print(f"written: {result.out_dir / 'best.json'}", file=out)
    print(f"browse: mlflow ui --backend-store-uri {result.tracking_uri}", file=out)
    return 0

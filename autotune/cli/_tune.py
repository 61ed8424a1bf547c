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
    cf = p.add_argument_group("config file")
    cf.add_argument("--config", type=Path, default=None, metavar="FILE",
                    help="a YAML file of tune options (keys: the flags without '--', e.g. "
                         "'trials: 12', 'slo: {ttft_p99: 2.0}', 'baseline: false'); flags on "
                         "the command line override it. Every study saves its resolved "
                         "config as OUT/config.yaml, which runs again as it is")
    cf.add_argument("--print-config", action="store_true",
                    help="print a config file of every option (with the values given so "
                         "far) and exit: 'autotune tune --print-config > study.yaml'")
    req = p.add_argument_group("what to tune")
    req.add_argument("--model", type=Path, default=None,
                     help="(required, here or in --config) local model directory "
                          "(config.json, tokenizer; weights optional with --load-format "
                          "dummy in the space's fixed flags)")
    req.add_argument("--shape", type=Path, default=None,
                     help="(required) traffic shape JSON (autotune shape fit ...; examples "
                          "in traffic/)")
    req.add_argument("--space", type=Path, default=None,
                     help="(required) search space YAML (search_spaces/cpu.yaml, "
                          "hybrid-mtp.yaml, ...)")
    req.add_argument("--trials", type=int, default=20,
                     help="finished trials the study should have (the baseline counts)")
    st = p.add_argument_group("where results go")
    st.add_argument("--storage", default=DEFAULT_STORAGE,
                    help="Optuna storage URL (SQLite file, or PostgreSQL for many workers)")
    st.add_argument("--tracking-uri", default=None,
                    help="MLflow store (default sqlite:///$PWD/experiments/mlflow.db; or an "
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
    se.add_argument("--timeout", type=float, default=None, metavar="SECONDS",
                    help="time budget: start no new trial after this many seconds")
    ms = p.add_argument_group("measurement")
    ms.add_argument("--repeats", type=int, default=1,
                    help="measured replays per trial on the same server (median reported)")
    ms.add_argument("--recheck", type=int, default=3, metavar="K",
                    help="before declaring a winner, measure the top K configs and the "
                         "baseline once more (new server starts) and choose by the median of "
                         "all readings (default 3; 0 = off)")
    ms.add_argument("--warmup-requests", type=int, default=None,
                    help="warm-up requests before measuring (default 2 x concurrency)")
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
    p.add_argument("-q", "--quiet", action="store_true",
                   help="no live display: one plain line per finished trial (the live panel "
                        "is drawn only on a terminal; logs and CI always get plain lines)")
    p.set_defaults(func=_tune)


_REQUIRED = ("model", "shape", "space")


def tune_parser() -> argparse.ArgumentParser:
    """A fresh parser of ``autotune tune`` (the one declaration of its options)."""
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


def _settings(args: argparse.Namespace) -> Any:
    from pydantic import ValidationError

    from autotune.config import TuneSettings
    from autotune.errors import ConfigError

    resolve_config(args)
    missing = [f"--{k}" for k in _REQUIRED if getattr(args, k, None) is None]
    if missing:
        raise ConfigError(f"{', '.join(missing)} {'is' if len(missing) == 1 else 'are'} "
                          "required: give them as flags or in a --config file (autotune tune "
                          "--print-config writes one)")
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
            enqueue=[x if isinstance(x, dict) else _json_arg(x) for x in args.enqueue], timeout_s=args.timeout,
            quality=args.quality, quality_probe=args.quality_probe,
        )  # fmt: skip
    except ValidationError as exc:
        flag = {"timeout_s": "--timeout", "start_timeout_s": "--start-timeout",
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


def _tune(args: argparse.Namespace) -> int:
    import json

    from autotune.study import tune

    if args.print_config:
        from autotune.cli._config_file import render_config

        resolve_config(args)
        sys.stdout.write(render_config(args, tune_actions(), required=_REQUIRED))
        return 0
    settings = _settings(args)
    label = "goodput req/s" if settings.objective == "goodput" else "out tok/s"

    def _sigterm(signum: int, frame: Any) -> None:  # SIGTERM stops cleanly, like Ctrl-C
        raise KeyboardInterrupt

    from autotune.cli._progress import make_display

    display = make_display(label, quiet=args.quiet)
    old = signal.signal(signal.SIGTERM, _sigterm)
    try:
        result = tune(settings, on_event=display)
    finally:
        display.close()
        signal.signal(signal.SIGTERM, old)
    out = sys.stdout
    if args.json:
        print(json.dumps(result.best, indent=2), file=out)
        return 0 if result.best else 1
    print(f"\nstudy {result.study_name}: {result.n_trials} trials, {result.n_ok} feasible, "
          f"{result.n_failed} failed {result.failures_by_reason or ''}", file=out)
    report = f"\nreport: {result.report} (opens offline in a browser)" if result.report else ""
    if result.best is None:
        print(f"no trial met the constraints: {result.explanation}", file=out)
        print(f"every trial's reason and message: {result.out_dir}/trials.csv{report}",
              file=out)
        return 1
    b = result.best
    ratio = f" = {b['ratio_to_baseline']:.2f}x vLLM defaults" if b.get("ratio_to_baseline") else ""
    print(f"best: trial {b['trial']}: {b['objective']['value']:,.1f} {label}{ratio}", file=out)
    print(f"params: {json.dumps(b['params'])}", file=out)
    print(f"serve command:\n  {b['serve_command']}", file=out)
    print(f"written: {result.out_dir / 'best.json'}", file=out)
    print(f"browse: mlflow ui --backend-store-uri {result.tracking_uri}", file=out)
    if result.report:
        print(f"report: {result.report} (opens offline in a browser)", file=out)
    return 0

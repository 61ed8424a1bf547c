"""``autotune best`` and ``autotune retune``: the best config per traffic shape, re-tuning on
drift."""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path
from typing import TYPE_CHECKING, TextIO

from autotune.config import DEFAULT_STORAGE, storage_url, store_where, tracking_url
from autotune.measure import fmt_value
from autotune.records import CapacityDeclared

if TYPE_CHECKING:
    from autotune.deploy import Deployable, Fit
    from autotune.results._registry import RegistryHit
    from autotune.space import ModelFacts
    from autotune.traffic import ShapeDiff, TrafficShape

EXIT_OK = 0
EXIT_NOTHING = 1  # no tuned study (or no feasible trial) to answer from


def register(sub: argparse._SubParsersAction) -> None:  # type: ignore[type-arg]
    best = sub.add_parser(
        "best",
        help="print the best known config for a traffic shape",
        description=(
            "Look up the best feasible config tuned for a traffic shape in the Optuna "
            "storage: the studies tuned for the exact shape fingerprint, else the nearest "
            "tuned shape (its distance and drift verdict are printed), with that study's "
            "verdict: the winner's ratio to vLLM's defaults and its 95 % interval, or that "
            "the defaults remain best. The serve command printed drops settings only a "
            "stand-in model needs; a config whose context cannot hold the shape's requests is "
            "named but no command is printed. Exits 1 when nothing was tuned or the config "
            "cannot serve the shape. See docs/registry.md."
        ),
        formatter_class=argparse.ArgumentDefaultsHelpFormatter,
    )
    best.add_argument("--shape", required=True, type=Path, help="traffic shape JSON")
    best.add_argument("--model", default=None,
                      help="only studies of this model (path, or its folder name)")
    best.add_argument("--gpu", default=None,
                      help="only studies run on this GPU type (e.g. H200; case-insensitive)")
    best.add_argument("--storage", default=DEFAULT_STORAGE,
                      help="Optuna storage URL, or a study's output folder (the --out of "
                           "'autotune tune': its stores are there)")
    best.add_argument("--tracking-uri", default=None, metavar="URI",
                      help="answer from an MLflow store instead (e.g. sqlite:///PATH/mlflow.db, "
                           "http://host:5000 or a study's output folder): the trial runs tagged "
                           "autotune.best_for_shape=<the shape's fingerprint>; exact shape only")
    best.add_argument("--json", action="store_true", help="print the hit as JSON")
    best.set_defaults(func=_best)

    retune = sub.add_parser(
        "retune",
        parents=[_tune_options()],
        conflict_handler="resolve",
        help="re-tune for a new traffic shape when it drifted, warm-started from the last study",
        description=(
            "Compare the new shape with the shape the current best config (for this model) "
            "was tuned for. If it did not drift, say so and exit 0. If it drifted, run a new "
            "study (same options as 'autotune tune') that first measures the earlier study's "
            "top configs and starts the sampler from its trials. See docs/registry.md."
        ),
        formatter_class=argparse.ArgumentDefaultsHelpFormatter,
    )
    rt = retune.add_argument_group("re-tune")
    rt.add_argument("--top-k", type=int, default=3,
                    help="best configs of the earlier study measured first in the new one")
    rt.add_argument("--gpu", default=None, help="only compare with studies on this GPU type")
    rt.add_argument("--force", action="store_true",
                    help="re-tune (warm-started) even when the shape did not drift")
    retune.set_defaults(func=_retune)


def _tune_options() -> argparse.ArgumentParser:
    """The parser of ``autotune tune``, as a parent: retune takes exactly its options."""
    from autotune.cli._tune import tune_parser

    return tune_parser()


def _facts(model: str) -> ModelFacts | None:
    """The model's facts for the space's rules; None where they cannot be read yet (the
    comparison needs no engine; tune() reports a missing model or vLLM itself)."""
    from autotune.engine import detect_engine
    from autotune.errors import AutotuneError
    from autotune.space import ModelFacts

    try:
        return ModelFacts.from_model_dir(model, device=detect_engine().device)
    except AutotuneError:
        return None


def _diff_lines(diff: ShapeDiff) -> list[str]:
    lines = []
    for name, d in diff.dimensions.items():
        dist = "n/a (not measured on both)" if d.distance is None else f"{d.distance:.4g}"
        flag = "  DRIFTED" if d.drifted else ""
        lines.append(f"  {name:<15} {dist} (threshold {d.threshold:.4g}, {d.metric}){flag}")
    return lines


def _deploy_view(hit: RegistryHit, shape: TrafficShape,
                 shape_path: Path | None = None) -> tuple[Fit, Deployable, str]:
    """(can it serve the shape, its flags fit to deploy, the serve command of those): the
    context against the shape's lengths; stand-in-only settings dropped."""
    from autotune.deploy import check_fit, context_of, deployable
    from autotune.engine import serve_command

    dep = deployable(hit.flags, hit.env)
    ctx, where = context_of(dep.flags, hit.model)
    return (check_fit(shape, ctx, where, shape_path), dep,
            serve_command(hit.model or "MODEL", dep.flags, dep.env))


def _print_command(hit: RegistryHit, shape: TrafficShape, out: TextIO,
                   shape_path: Path | None = None) -> bool:
    """The serve command, or why this config cannot serve the shape (False then)."""
    from autotune.deploy import STAND_IN_NOTE

    fit, dep, command = _deploy_view(hit, shape, shape_path)
    if not fit.ok:
        print(f"CANNOT SERVE shape {shape.name}: {fit.message}", file=out)
        return False
    print(f"serve command:\n  {command}", file=out)
    if fit.warning:
        print(f"warning: {fit.warning}", file=out)
    if dep.stand_in:
        print(f"note: {STAND_IN_NOTE}; dropped: {', '.join(dep.dropped)}", file=out)
    return True


def _print_hit(hit: RegistryHit, shape: TrafficShape, out: TextIO,
               shape_path: Path | None = None) -> bool:
    if hit.exact:
        print(f"best known config for shape {shape.name} ({shape.fingerprint}): tuned for "
              "this exact shape", file=out)
    else:
        where = hit.shape_path or hit.shape_fingerprint
        drift = (f"drifted in {', '.join(hit.drifted_dimensions)}" if hit.verdict == "drifted"
                 else "within every threshold")
        print(f"no study was tuned for shape {shape.name} ({shape.fingerprint}); nearest tuned "
              f"shape: {where} ({hit.shape_fingerprint}) at distance {hit.distance:.3g} "
              f"(verdict: {hit.verdict}, {drift})", file=out)
    reading = (f" (median of {len(hit.readings)} readings: "
               + ", ".join(fmt_value(v) for v in hit.readings) + ")"
               if len(hit.readings) > 1 else "")
    # a capacity search that found no failing level measured a lower bound
    least = ("at least " if hit.objective == "capacity"
             and hit.metrics.get("capacity_rps_ci_high") is None else "")
    print(f"study {hit.study}, trial {hit.trial}{' (vLLM defaults)' if hit.is_baseline else ''}:"
          f" {least}{fmt_value(hit.value)} {hit.metric}{reading}", file=out)
    if hit.study_verdict:
        from autotune.cli._tune import _verdict_line

        print(_verdict_line(hit.study_verdict), file=out)
    if hit.objective == "capacity" and hit.metrics.get("gpus_needed") is not None:
        from autotune.hardware import unit_of
        from autotune.report import capacity_line

        print(capacity_line(_capacity_of(hit), unit_of(hit.gpu_type)), file=out)
    from autotune.hardware import is_cpu

    where = "a CPU server" if is_cpu(hit.gpu_type) else f"GPU {hit.gpu_type}"
    print(f"model {hit.model}, engine {hit.engine_version or 'version not recorded'}, "
          f"{where}", file=out)
    print(f"params: {json.dumps(hit.params)}", file=out)
    if hit.quality:
        print("quality: " + ", ".join(f"{k}={v:.4g}" for k, v in sorted(hit.quality.items())),
              file=out)
    if hit.cost:
        from autotune.cost import cost_line

        print(cost_line(hit.cost), file=out)
        if not hit.exact:
            print(f"note: that cost is for the traffic study {hit.study} was tuned for; "
                  f"'autotune cost' of that study's output folder {_cost_options(hit, shape_path)}"
                  " prices its best.json for this one", file=out)
    served = _print_command(hit, shape, out, shape_path)
    for note in hit.notes:
        print(f"note: {note}", file=out)
    if not hit.exact and hit.verdict == "drifted":
        import shlex

        given = " ".join(f"{flag} {shlex.quote(str(v))}" for flag, v in
                         (("--shape", shape_path), ("--model", hit.model)) if v is not None)
        print(f"this shape drifted from every tuned one: 'autotune retune' with {given} and "
              "the study's --space tunes for it, warm-started from this study", file=out)
    return served


def _cost_options(hit: RegistryHit, shape_path: Path | None) -> str:
    """The options of the ``autotune cost`` that prices a hit's study for another shape:
    this shape's file and the price the study was given (no placeholder to fill in)."""
    import shlex

    prices = (hit.cost or {}).get("prices")
    price = prices.get("gpu_hour_usd") if isinstance(prices, dict) else None
    opts = [f"--shape {shlex.quote(str(shape_path))}" if shape_path is not None else "",
            f"--gpu-hour-price {price:g}" if isinstance(price, (int, float)) else ""]
    return "with " + " ".join(o for o in opts if o) if any(opts) else "with --shape this shape"


def _capacity_of(hit: RegistryHit) -> CapacityDeclared:
    """best.json's ``capacity`` keys (those :func:`autotune.report.capacity_line` reads)
    from a hit's trial metrics, at the declared capacity: the hit's value is per GPU (the
    median of its readings), the metrics are its trial's server's."""
    m = hit.metrics
    per_server = m["gpus_needed"] / m["servers_needed"] if m.get("servers_needed") else 1.0
    value = hit.value * per_server
    rec = m.get("capacity_recorded_rps")
    sps = m.get("capacity_recorded_sps")  # a session search: the same scale in sessions/s
    return CapacityDeclared(
        capacity_rps=value, capacity_rps_ci_low=m.get("capacity_rps_ci_low"),
        capacity_rps_ci_high=m.get("capacity_rps_ci_high"),
        output_tokens_per_s_at_capacity=m.get("output_tokens_per_s_at_capacity"),
        recorded_rps=rec or 0.0,
        gpus_needed=rec / value * per_server if rec and value > 0 else None,
        capacity_sps=value * sps / rec if sps is not None and rec else None,
        recorded_sps=sps)


def _tracked_miss_fix(args: argparse.Namespace, uri: str, storage: str) -> str:
    """The commands that answer when an MLflow store has no best for the shape, as they
    run: the lookup of the nearest tuned shape in the Optuna storage and, where the store
    names a model and a space (its newest study's, of --model), the study of this shape."""
    import shlex

    from autotune.results import tracked_inputs

    shape = shlex.quote(str(args.shape))
    gpu = f" --gpu {shlex.quote(args.gpu)}" if args.gpu else ""
    model = f" --model {shlex.quote(args.model)}" if args.model else ""
    look = (f"look up the nearest tuned shape in the Optuna storage: 'autotune best --shape "
            f"{shape} --storage {shlex.quote(store_where(storage))}{model}{gpu}'")
    known = tracked_inputs(tracking_uri=uri, model=args.model)
    if known is None:
        return (f"{look}, or tune this shape ('autotune tune' with --model, --space and "
                f"--tracking-uri {shlex.quote(store_where(uri))})")
    space = Path(known[1])
    return (f"tune it with 'autotune tune --model {shlex.quote(known[0])} --space "
            f"{shlex.quote(str(space.resolve() if space.exists() else space))} --shape "
            f"{shape} --tracking-uri {shlex.quote(store_where(uri))}' (the model and space "
            f"of the newest study there), or {look}")


def _best(args: argparse.Namespace) -> int:
    from autotune.results import explain_miss, find_best
    from autotune.traffic import load_shape

    shape = load_shape(args.shape)
    storage = storage_url(args.storage)
    if args.tracking_uri:
        from autotune.results import find_best_tracked

        uri = tracking_url(args.tracking_uri)
        hit = find_best_tracked(tracking_uri=uri, shape=shape, model=args.model, gpu=args.gpu)
        if hit is None:
            print(f"autotune: no MLflow run in {store_where(uri)} is tagged "
                  f"autotune.best_for_shape={shape.fingerprint} (shape {shape.name}"
                  f"{', model ' + args.model if args.model else ''}"
                  f"{', GPU ' + args.gpu if args.gpu else ''}); "
                  f"{_tracked_miss_fix(args, uri, storage)}", file=sys.stderr)
            return EXIT_NOTHING
    else:
        hit = find_best(storage=storage, shape=shape, model=args.model, gpu=args.gpu)
    if hit is None:
        print(f"autotune: {explain_miss(storage=storage, model=args.model, gpu=args.gpu)}",
              file=sys.stderr)
        return EXIT_NOTHING
    if args.json:
        fit, dep, command = _deploy_view(hit, shape, args.shape)
        print(json.dumps({**hit.to_dict(), "fits_shape": fit.to_dict(),
                          "deploy": {"serve_command": command if fit.ok else None,
                                     "flags": dep.flags, "env": dep.env,
                                     "stand_in_dropped": dep.dropped}}, indent=2))
        return EXIT_OK if fit.ok else EXIT_NOTHING
    return EXIT_OK if _print_hit(hit, shape, sys.stdout, args.shape) else EXIT_NOTHING


def _retune(args: argparse.Namespace) -> int:
    from autotune.cli._tune import run_study_command, settings_from_args
    from autotune.results import explain_miss, plan_retune
    from autotune.space import load_space
    from autotune.study import resolve_study

    # every option validated, the shape read and the objective resolved from it, once,
    # before comparing anything
    resolved = resolve_study(settings_from_args(args))
    settings, shape = resolved.settings, resolved.shape
    out = sys.stdout
    ws = None
    if args.resume:
        print("--resume: continuing the re-tune study as it is (its warm start is already in "
              "its storage)", file=out)
    else:
        model = str(Path(args.model).expanduser().resolve())
        space = load_space(args.space, facts=_facts(model))
        # the earlier studies: in the new study's storage (--storage, or --out's), else, with
        # neither given, in the shared one where studies without --out keep theirs
        looked = [settings.storage]
        if args.storage is None and settings.storage != DEFAULT_STORAGE:
            looked.append(DEFAULT_STORAGE)
        plan = None
        for storage in looked:
            plan = plan_retune(storage=storage, shape=shape, model=model, gpu=args.gpu,
                               top_k=args.top_k, space=space, force=args.force,
                               objective=settings.objective,
                               pareto_latency=settings.pareto_latency,
                               include_baseline=not settings.baseline)
            if plan is not None:
                break
        if plan is None:
            why = "; ".join(explain_miss(storage=s, model=model, gpu=args.gpu) for s in looked)
            print(f"autotune: nothing to re-tune from: {why}", file=sys.stderr)
            return EXIT_NOTHING
        hit = plan.hit
        tuned = hit.shape_path or hit.shape_fingerprint
        if plan.diff is None:
            print(f"shape {shape.name} ({shape.fingerprint}) is the shape study {hit.study} was "
                  "tuned for: it did not drift (distance 0)", file=out)
        else:
            verdict = ("DRIFTED in " + ", ".join(plan.diff.drifted_dimensions) if plan.drifted
                       else "did not drift")
            print(f"shape {shape.name} vs {tuned} (study {hit.study}): {verdict}; distance "
                  f"{plan.diff.distance:.3g} (<= 1 everywhere = same)", file=out)
            for line in _diff_lines(plan.diff):
                print(line, file=out)
        if not plan.drifted and not args.force:
            print(f"keep the current best (study {hit.study}, trial {hit.trial}: "
                  f"{fmt_value(hit.value)} {hit.metric}):\n  {hit.serve_command}", file=out)
            return EXIT_OK
        ws = plan.warm_start
        if ws is not None:
            print(f"re-tuning, warm-started from study {ws.source_study}: "
                  f"{len(ws.enqueue)} config(s) measured first, {len(ws.prior_trials)} earlier "
                  "trial(s) as prior knowledge (their values were measured under the old shape)",
                  file=out)

    return run_study_command(resolved, as_json=args.json, out=out, warm_start=ws,
                             quiet=args.quiet)

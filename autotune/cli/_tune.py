"""``autotune tune``: run a Bayesian study against real vLLM servers.

Every option is declared once, in :data:`autotune.cli._options.OPTIONS`: its flag, the
:class:`TuneSettings` field it sets and its help. Types, choices and defaults come from the
settings model, so a default is written in one place (``autotune/config.py``).
"""

from __future__ import annotations

import argparse
import json
import signal
import sys
from pathlib import Path
from types import FrameType
from typing import TYPE_CHECKING, Any, TextIO

from autotune.cli._options import _GROUPS, OPTIONS, _argparse_kwargs, validation_message
from autotune.config import TuneSettings
from autotune.errors import ConfigError
from autotune.measure import fmt_interval, fmt_ratio, fmt_value
from autotune.quality._caveat import caveat_line
from autotune.report import capacity_line, needed_text

if TYPE_CHECKING:
    from autotune.records import BestFile
    from autotune.results import TuneResult, WarmStart
    from autotune.study import ResolvedStudy


def add_tune_options(p: argparse.ArgumentParser) -> None:
    """Add every option of :data:`OPTIONS` to ``p`` (in its group)."""
    groups = {key: p.add_argument_group(title) for key, title in _GROUPS.items()}
    for opt in OPTIONS:
        groups[opt.group].add_argument(opt.flag, *opt.aliases, **_argparse_kwargs(opt))
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
            "written to OUT/best.json with its 'vllm serve' command. A winner needs a "
            "second server start of it and of the defaults (the re-check, --recheck): a lead "
            "from one start each is 'unconfirmed', and the line gives the command that "
            "confirms it. Exit status: 0 a verdict (a winner, or vLLM's defaults remain "
            "best), 1 no trial met the constraints, 2 an error, 3 unconfirmed, 130 "
            "interrupted."
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
    first, flags over it); one-line errors that name the flag. The objective is resolved
    from the shape later, once (:func:`autotune.study.resolve_study`)."""
    from pydantic import ValidationError

    resolve_config(args)
    missing = [o.flag for o in OPTIONS if o.required and getattr(args, o.field, None) is None]
    if missing:
        from autotune.hardware import gpu_names

        cpu = ("; on a CPU host, the demo's tiny model and the CPU space: --model "
               "models/tiny-hybrid (made by 'autotune model tiny models/tiny-hybrid --arch "
               "nemotron_h') --space search_spaces/cpu.yaml" if not gpu_names() else "")
        raise ConfigError(f"{', '.join(missing)} {'is' if len(missing) == 1 else 'are'} "
                          "required: give them as flags or in a --config file (autotune tune "
                          f"--print-config writes one){cpu}")
    values = {}
    for opt in OPTIONS:
        value = getattr(args, opt.field)
        values[opt.field] = opt.parse(value) if opt.parse is not None else value
    try:
        return TuneSettings(**values)
    except ValidationError as exc:
        raise ConfigError(validation_message(exc)) from None


def _best_line(b: BestFile, objective: str) -> str:
    """best.json's declared config in one line: its reading (a re-check names the trial
    that first measured the config, as the verdict line does), the value, the ratio."""
    from autotune.store import objective_label

    ratio = (f" = {fmt_ratio(b.ratio_to_baseline)} vLLM defaults" if b.ratio_to_baseline
             else "")
    of = (f" (re-check of trial {b.recheck_of})" if b.recheck_of is not None
          and b.recheck_of != b.trial else "")
    n = len(b.readings)
    median = f", the median of {n} readings" if n > 1 else ""
    # a capacity search that found no failing level measured a lower bound
    least = ("at least " if b.capacity is not None and b.capacity.bracket_closed is False
             else "")
    return (f"best: trial {b.trial}{of}: {least}{fmt_value(b.objective.value)} "
            f"{objective_label(objective)}{_per_gpu(b)}{median}{ratio}")


def _per_gpu(b: BestFile) -> str:
    """" per GPU (a server of 2 GPUs; the recorded traffic needs 1.40 servers, 2.80 GPUs)";
    from a capacity, "needs at most 1.40 server(s) (...), at most 2.80 GPU(s) (...)"; on the
    CPU build " per server (...)", no GPU to count."""
    from autotune.hardware import is_cpu

    g = b.gpus
    if g is None:  # a best.json written before autotune counted GPUs per server
        return ""
    n = g.per_server
    servers = gpus = ""
    if g.servers_needed is None:
        pass
    elif g.needed_is == "at_most":  # a passing level's rate: an upper bound
        servers = needed_text(g.servers_needed, g.servers_needed_low, "server(s)")
        gpus = needed_text(g.gpus_needed or 0.0, g.gpus_needed_low, "GPU(s)")
    else:
        servers = f"{fmt_value(g.servers_needed)} server(s)"
        gpus = f"{fmt_value(g.gpus_needed or 0.0)} GPU(s)"
    if is_cpu(b.engine.device if b.engine is not None else None) and n == 1:  # no GPU
        return " per server" + (f" (the recorded traffic needs {servers})" if servers else "")
    need = f"; the recorded traffic needs {servers}, {gpus}" if servers else ""
    return f" per GPU (a server of {n} GPU{'s' if n > 1 else ''}{need})"


def _ratio_text(v: dict[str, Any]) -> str:
    """"1.094x the defaults (95 % interval [0.847, 1.412])"; from one start each, what the
    interval is: one run's own noise ("95 % within-run interval") or, for a capacity, "the
    range the brackets allow"; a capacity bound's "at least 1.234x the defaults (a bound,
    not a ratio)", or "no ratio to the defaults"."""
    from autotune.measure import CAPACITY_BRACKETS, WITHIN_RUN_ONLY

    r, bound = v.get("ratio_to_defaults"), v.get("ratio_bound")
    if r:
        iv = fmt_interval(r["ci_low"], r["ci_high"], ".3f")
        prior = v.get("prior_spread")  # one start each, widened by a spread from elsewhere
        what = {CAPACITY_BRACKETS: f"the range the brackets allow {iv}, not a 95 % interval"
                if not prior else f"the range the brackets allow widened by the {prior}: "
                                  f"{iv}, not a 95 % interval",
                WITHIN_RUN_ONLY: f"95 % within-run interval {iv}: one run's own noise, no "
                                 "start-to-start spread" if not prior else
                                 f"95 % interval {iv}: one run's own noise and the {prior}"
                }.get(str(v.get("method")), f"95 % interval {iv}")
        return f"{fmt_ratio(r['median'])} the defaults ({what})"
    if bound:
        return (f"{bound['kind'].replace('_', ' ')} {fmt_ratio(bound['value'])} the defaults "
                "(a bound, not a ratio)")
    return "no ratio to the defaults"


def _verdict_line(v: dict[str, Any]) -> str:
    """The verdict for people: who won, by how much, how sure."""
    from autotune.measure import CAPACITY_BRACKETS, WITHIN_RUN_ONLY

    r = v.get("ratio_to_defaults")
    ci = _ratio_text(v)
    if not r and v.get("reason") and v.get("candidate_number") is not None:
        # a capacity without a ratio: which trial's search was cut, where, and the fix
        ci = f"{ci}; {v['reason']}" if v.get("ratio_bound") else v["reason"]
    if v.get("verdict") == "unconfirmed":  # a lead from one start each: never a WINNER
        confirm = v.get("confirm_command") or "add it with --resume --recheck 1"
        return (f"verdict: trial {v.get('candidate_number')} leads, unconfirmed: one server "
                f"start each: {ci}; best.json keeps vLLM's defaults until a fresh-server "
                f"re-check of both confirms it: {confirm}")
    if v.get("method") in (WITHIN_RUN_ONLY, CAPACITY_BRACKETS) and not v.get("candidate_pruned"):
        # one start of each (--recheck 0): the interval holds no start-to-start spread
        ci += ("; one server start of each, no fresh-server re-check: add it with "
               + (v.get("confirm_command") or "--resume --recheck 1"))
    if v.get("verdict") == "winner":  # the number: not in an MLflow-only record
        who = f" trial {v['winner_number']}" if v.get("winner_number") is not None else ""
        n = v.get("candidate_gpus")
        if isinstance(n, int) and n > 1:  # per GPU: a 1-GPU winner needs no word
            who += f" ({n} GPUs per server)"
        return f"verdict: WINNER{who}: {ci}"
    if v.get("verdict") == "defaults_best":
        return _defaults_best_line(v, ci)
    return f"verdict: {v.get('verdict', 'none')}: {v.get('reason', '')}"


def _defaults_best_line(v: dict[str, Any], ci: str) -> str:
    """"vLLM's defaults remain best": why, the best other config's ratio and, when the
    starts could not show its gain, how many starts would."""
    r = v.get("ratio_to_defaults")
    if v.get("candidate_number") is None and not r and not v.get("ratio_bound"):
        # nothing else measured feasible
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


def run_study_command(settings: TuneSettings | ResolvedStudy, *, as_json: bool, out: TextIO,
                      warm_start: WarmStart | None = None, quiet: bool = False) -> int:
    """The tail ``tune`` and ``retune`` share: run the study (SIGTERM stops it like Ctrl-C)
    with the progress display, then print the result; exit :func:`exit_code`.
    The shape is read and the objective resolved once, here, unless the caller did
    (:func:`autotune.study.resolve_study`)."""
    from autotune.store import objective_label
    from autotune.study import tune

    def _sigterm(signum: int, frame: FrameType | None) -> None:  # stops cleanly, like Ctrl-C
        raise KeyboardInterrupt

    from autotune.cli._progress import make_display
    from autotune.study import resolve_study

    resolved = resolve_study(settings)  # a shape that cannot be read stops here
    objective = resolved.settings.objective
    display = make_display(objective_label(objective), quiet=quiet)
    old = signal.signal(signal.SIGTERM, _sigterm)
    try:
        result = tune(resolved, callbacks=[display], warm_start=warm_start)
    finally:
        display.close()
        signal.signal(signal.SIGTERM, old)
    if as_json:
        print(json.dumps(result.best.to_json() if result.best else None, indent=2), file=out)
    else:
        print("\n".join(summary_lines(result, objective)), file=out)
    return exit_code(result)


#: ``tune``'s exit status for a lead from one server start each (verdict ``unconfirmed``)
EXIT_UNCONFIRMED = 3


def exit_code(result: TuneResult) -> int:
    """0: a verdict (a winner, or vLLM's defaults remain best); 1: no trial met the
    constraints; 3: a lead from one server start each, unconfirmed (the printed command
    confirms it)."""
    if result.best is None:
        return 1
    return EXIT_UNCONFIRMED if result.verdict.get("verdict") == "unconfirmed" else 0


def summary_lines(result: TuneResult, objective: str) -> list[str]:
    """What ``tune`` prints once the study ends: the trial counts, then the verdict and the
    declared config (or why no trial met the constraints) and where the results are."""
    from autotune.cli._cost import cost_lines

    lines = [f"\nstudy {result.study_name}: {_trial_counts(result)}", *_mlflow_lines(result)]
    report = f"\nreport: {result.report} (opens offline in a browser)" if result.report else ""
    if result.best is None:
        return [*lines, f"no trial met the constraints: {result.explanation}",
                f"every trial's reason and message: {result.out_dir}/trials.csv{report}"]
    b = result.best
    lines.append(_verdict_line(result.verdict))
    quality = result.verdict.get("quality")
    if caveat := caveat_line(quality if isinstance(quality, dict) else None):
        lines.append(caveat)
    lines.append(_best_line(b, objective))
    if b.capacity is not None:
        from autotune.hardware import unit_of

        lines.append(capacity_line(b.capacity, unit_of(b.engine.device if b.engine else None)))
    lines += cost_lines(b)
    lines += [f"params: {json.dumps(b.params)}", f"serve command:\n  {b.serve_command}"]
    from autotune.deploy import STAND_IN_NOTE, deployable

    dep = deployable(b.flags, b.env)
    if dep.stand_in:  # the command above is as the trials ran it; a deployment drops these
        lines.append(f"note: {STAND_IN_NOTE}; 'autotune export {result.out_dir} --format "
                     f"serve' prints it without {', '.join(dep.dropped)}")
    lines += _gpu_time_lines(result.gpu_time)
    if result.gpu_phases:
        from autotune.study import phases_line

        lines.append(phases_line(result.gpu_phases))
    lines += [f"written: {result.out_dir / 'best.json'}",
              f"browse: mlflow ui --backend-store-uri {result.tracking_uri}"]
    if result.report:
        lines.append(f"report: {result.report} (opens offline in a browser)")
    return lines


def _tune(args: argparse.Namespace) -> int:
    if args.print_config:
        from autotune.cli._config_file import render_config

        resolve_config(args)
        sys.stdout.write(render_config(args, tune_actions(),
                                       required=[o.field for o in OPTIONS if o.required]))
        return 0
    return run_study_command(settings_from_args(args), as_json=args.json, out=sys.stdout,
                             quiet=args.quiet)


def _mlflow_lines(result: TuneResult) -> list[str]:
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


def _trial_counts(result: TuneResult) -> str:
    """'5 trials, 4 feasible, 0 failed; 1 not run (queued when the --budget ended the
    search)', '3 trials, 1 feasible, 1 failed; why not feasible: oom 1, slo 1', '6 trials,
    3 feasible, 0 failed, 2 pruned (...)': trials the budget left unstarted and trials the
    pruner stopped early are not failures, and each reason is counted (failed and
    infeasible trials)."""
    reasons = dict(result.failures_by_reason or {})
    not_run = int(reasons.pop("budget", 0))
    reasons.pop("pruned", None)  # counted on their own below
    reasons.pop("screened", None)
    failed = max(0, int(result.n_failed) - not_run)
    text = f"{result.n_trials} trials, {result.n_ok} feasible, {failed} failed"
    if result.n_pruned:
        text += (f", {result.n_pruned} pruned (stopped early: measured below the best so far, "
                 "not failed)")
    rungs = result.rungs
    if rungs:
        text += (f"; rungs: {rungs.get('screened', 0)} screened at rung 0, "
                 f"{rungs.get('refined', 0)} refined to full resolution")
    if reasons:
        text += "; why not feasible: " + ", ".join(f"{k} {v}" for k, v in sorted(reasons.items()))
    if not_run:
        text += f"; {not_run} not run (queued when the --budget ended the search)"
    return text

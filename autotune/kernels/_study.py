"""Kernels a study tunes before trial 0, for the knobs whose value ``tuned`` needs them.

A space knob with ``tuned: moe`` (``moe_config: default|tuned`` in
``search_spaces/hybrid-mtp.yaml``) sets ``VLLM_TUNED_CONFIG_FOLDER`` to a folder of
fused-MoE configs tuned for this model, GPU and traffic shape. :func:`bind_tuned_kernels`
makes (or finds in ``--cache-dir``) that folder once, for every token count the space can
produce (its MTP depths, ``--max-num-batched-tokens`` and ``--max-num-seqs`` choices) at
the streams the study replays (the shape's, or ``--concurrency``), and binds it to the
space. When it cannot (the CPU build has no fused-MoE Triton kernel; a dense model has no
experts; the tuning failed or the budget fitted no token count) or need not (no trial of
the study can pick ``tuned``: see :class:`TrialPlan`) the value ``tuned`` becomes a rule
violation with that reason: samples with it are rejected before any server starts, the
other knobs search on.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

from autotune.errors import AutotuneError
from autotune.kernels._cache import ensure_tuned_moe
from autotune.kernels._search import KernelTimer
from autotune.kernels._sizes import (
    DEFAULT_MAX_BATCHED_TOKENS,
    DEFAULT_MAX_NUM_SEQS,
    active_streams,
    streams_of,
)
from autotune.kernels._tune import MoeTuneResult, Progress
from autotune.space import Knob, SearchSpace

if TYPE_CHECKING:
    from autotune.engine import EngineInfo

__all__ = ["TrialPlan", "bind_tuned_kernels", "space_batched_tokens", "space_max_num_seqs",
           "space_mtp_depths"]

logger = logging.getLogger(__name__)

_MTP_TARGET = "--speculative-config.num_speculative_tokens"


def _values(knob: Knob) -> list[int]:
    if knob.type == "categorical":
        return [int(c) for c in knob.choices or [] if isinstance(c, int | float)]
    if knob.type == "int":
        low, high = knob.bounds
        return list(range(int(low), int(high) + 1, int(knob.step or 1)))
    return []


def space_mtp_depths(space: SearchSpace) -> tuple[int, ...]:
    """MTP depths the space can run (0 always: the baseline has no speculation)."""
    depths = {0}
    for name, knob in space.knobs.items():
        if knob.json_flag == _MTP_TARGET and space.is_active(name, {}):
            depths.update(_values(knob))
    return tuple(sorted(depths))


def _flag_values(space: SearchSpace, flag: str, vllm_default: int) -> tuple[int, ...]:
    """Values of a whole-number engine ``flag`` the space can pass: its fixed value (else
    vLLM's default) and its knobs' values (an int range by its two ends)."""
    fixed = space.fixed_flag(flag)
    values = {int(fixed) if fixed is not None and fixed.isdigit() else vllm_default}
    for knob in space.knobs.values():
        if knob.flag == flag:
            vals = _values(knob)
            values.update([min(vals), max(vals)] if knob.type == "int" else vals)
    return tuple(sorted(values))


def space_batched_tokens(space: SearchSpace) -> tuple[int, ...]:
    """``--max-num-batched-tokens`` values the space can pass (vLLM's default included)."""
    return _flag_values(space, "--max-num-batched-tokens", DEFAULT_MAX_BATCHED_TOKENS)


def space_max_num_seqs(space: SearchSpace) -> tuple[int, ...]:
    """``--max-num-seqs`` values the space can pass (vLLM's default included): a step holds
    at most that many sequences, so fewer seqs than streams make smaller decode steps."""
    return _flag_values(space, "--max-num-seqs", DEFAULT_MAX_NUM_SEQS)


@dataclass(frozen=True)
class TrialPlan:
    """The trials a study can still run, to tell whether a knob's ``tuned`` can be picked.

    ``sampled``: trials the sampler chooses (None: not known, any number); ``fixed``: the
    configs the study runs as they are (the baseline, ``--enqueue`` and warm-start configs,
    a resumed study's queued trials and those its re-check may run again); ``summary``
    says where they come from, for the one-line note."""

    sampled: int | None = None
    fixed: tuple[Mapping[str, object], ...] = ()
    summary: str = ""

    def can_pick(self, knobs: Sequence[str], value: str = "tuned") -> bool:
        """Whether some trial may set one of ``knobs`` to ``value``."""
        return self.sampled != 0 or any(cfg.get(k) == value for cfg in self.fixed for k in knobs)


def bind_tuned_kernels(space: SearchSpace, *, model: Path, shape_path: Path,
                       shape_fingerprint: str, cache_dir: Path, engine: EngineInfo, gpu_name: str,
                       concurrency: int | None = None, budget_s: float | None = None,
                       trials: int = 48, plan: TrialPlan | None = None,
                       note: Callable[[str], None] | None = None,
                       on_progress: Callable[[Progress], None] | None = None,
                       timers: Sequence[KernelTimer] | None = None,
                       on_tuned: Callable[[MoeTuneResult], None] | None = None,
                       clock: Callable[[], float] = time.monotonic) -> SearchSpace:
    """``space`` with its ``tuned`` kernel folders bound (or their absence explained).

    ``concurrency``: the study's ``--concurrency`` (the streams the token counts come
    from; None: the shape's own); ``plan``: the trials the study can run (None: any, so
    tune); ``timers`` (one per GPU) default to worker processes on every visible GPU;
    ``on_tuned`` receives the tuning's result (its seconds and GPUs: the study's account);
    ``clock``: the budget's clock (tests simulate it)."""
    kinds = space.tuned_kinds()
    if "moe" not in kinds:
        return space
    knobs = ", ".join(kinds["moe"])
    say = note or (lambda m: logger.warning("%s", m))

    def off(why: str, line: str | None = None) -> SearchSpace:
        say(line or f"knob {knobs}: 'tuned' is off ({why})")
        return space.with_tuned({}, {"moe": why})

    if engine.device != "cuda":
        return off(f"{engine.package} {engine.version} has no fused-MoE Triton kernel: MoE "
                   "runs on the CPU's own path")
    if not space.facts.moe:
        return off(f"{model} has no routed experts")
    if plan is not None and not plan.can_pick(kinds["moe"]):
        why = f"{plan.summary}; none sets {knobs}=tuned"
        return off(f"no trial of this study can pick it ({why})",
                   f"knob {knobs}: not tuned: no trial of this study can pick 'tuned' ({why})")
    from autotune.traffic import load_shape

    depths, mnbt = space_mtp_depths(space), space_batched_tokens(space)
    seqs = space_max_num_seqs(space)
    try:
        streams, source = streams_of(load_shape(shape_path), concurrency)
        held = [n for n in active_streams(streams, seqs) if n < streams]
    except AutotuneError as exc:
        return off(f"the kernel tuning failed: {exc}",
                   f"knob {knobs}: 'tuned' is off: the kernel tuning failed ({exc})")
    cut = f", {held} of them per step by --max-num-seqs" if held else ""
    within = f" within {budget_s:.0f} s" if budget_s else ""
    say(f"fused-MoE kernels for knob {knobs}: tuning once per model, GPU, shape and streams "
        f"({source}{cut}, MTP depths {list(depths)}, chunks {list(mnbt)}){within}; cached "
        f"under {cache_dir}/kernels")
    from autotune.kernels._tune import check_cuda

    def progress(p: Progress) -> None:
        if p.done is not None:
            r = p.done
            speed = f"{r.speedup:.2f}x the default" if r.speedup else "no valid time"
            if r.kept_default:
                speed += f" (kept the default: {r.kept_default})"
            say(f"fused-MoE M={r.m} ({p.sizes_done}/{p.sizes_total}): {speed}, "
                f"{r.timed} configs timed ({r.failed} failed) in {r.seconds:.0f} s")
        if on_progress is not None:
            on_progress(p)

    try:
        result = ensure_tuned_moe(
            cache_dir=cache_dir, model=model, shape_path=shape_path,
            shape_fingerprint=shape_fingerprint, gpu_name=gpu_name,
            vllm_version=engine.version, mtp_depths=depths, max_batched_tokens=mnbt,
            max_num_seqs=seqs, concurrency=concurrency,
            gpus=len(timers) if timers else len(check_cuda()),
            budget_s=budget_s, trials=trials, on_progress=progress, timers=timers,
            clock=clock)
    except AutotuneError as exc:
        return off(f"the kernel tuning failed: {exc}",
                   f"knob {knobs}: 'tuned' is off: the kernel tuning failed ({exc})")
    if on_tuned is not None:
        on_tuned(result)
    first_why = next(iter(result.skipped.values()), "")
    if not result.results and not result.reused:
        return off(f"no token count fit the kernel budget{within} ({first_why}); raise "
                   "--kernel-budget (or --timeout)")
    skipped = ""
    if result.skipped:
        ms = ", ".join(map(str, result.skipped))
        skipped = (f"; {len(result.skipped)} skipped for the budget (M={ms}: vLLM's default "
                   f"config there; {first_why})")
    folder = result.path.parent
    kept = f"; {len(result.reused)} token count(s) from the cache" if result.reused else ""
    say(f"fused-MoE kernels ready: {folder} ({len(result.results)} token count(s) tuned in "
        f"{result.seconds:.0f} s{kept}{skipped})")
    return space.with_tuned({"moe": str(folder)})

"""``autotune kernels moe``: tune the fused-MoE kernel for the token counts a shape makes.

model config.json -> :class:`MoeShape` (E, N, K, top-k, dtype); traffic shape -> token
counts (:mod:`._sizes`); per token count an Optuna search over the kernel's config space
(:mod:`._search`) timed by one worker process per GPU (:mod:`._timer`, :mod:`._worker`);
the winners -> ``OUT/<vLLM's file name>`` (what ``VLLM_TUNED_CONFIG_FOLDER`` points at),
with every candidate's time beside it (``<stem>.results.json``, ``<stem>.candidates.csv``).

Token counts already in ``OUT``'s results (same MoE shape, GPU and search settings) are
kept, not tuned again: a study's cache folder grows instead of starting over. The file is
written anew each time from the results: per count the winner, or vLLM's default when the
winner's measured gain is below ``min_gain`` (decided again from the recorded times, so a
run with another ``--min-gain`` times nothing new), plus guard keys (:mod:`._guard`) that
hold vLLM's default config wherever no tuned count is the nearest key. Guard keys are
listed apart (``guard_keys``), never as rows of ``sizes``: a later run does not take them
for tuned counts.

A budget (``budget_s``) holds the whole tuning, the workers' start included (they start
at once, one per GPU): token counts go out decode steps first, prefill chunks last; each
gets its share of the time left (:func:`autotune.kernels.search_size` fits its search and
re-check into it), and a count whose least cost (:meth:`TimingCosts.floor_s`) no longer
fits is skipped. A skipped count's key holds vLLM's default config, so steps near it run
as without a file instead of borrowing another count's tiles; the results say which
counts were skipped and why, and the next run into the folder tunes them. A worker's
timing that hangs is stopped when the budget runs out (at least 30 s after it began), not
300 s later.
"""

from __future__ import annotations

import csv
import io
import json
import logging
import os
import threading
import time
from collections import deque
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass, field
from datetime import UTC, datetime
from pathlib import Path
from typing import TYPE_CHECKING, Unpack

from pydantic import BaseModel, ConfigDict, Field

from autotune.errors import AutotuneError, ConfigError
from autotune.kernels._guard import with_guard_keys
from autotune.kernels._moe_shape import MoeShape, config_file_name, moe_shape_from_model
from autotune.kernels._search import (
    Candidate,
    KernelTimer,
    SearchSettings,
    SizeResult,
    SizeRow,
    TimingCosts,
    kept_default_reason,
    search_size,
)
from autotune.kernels._sizes import (
    DEFAULT_MAX_BATCHED_TOKENS,
    DEFAULT_MAX_NUM_SEQS,
    TokenCount,
    token_counts,
)
from autotune.kernels._space import KEYS, KernelConfig, default_config

if TYPE_CHECKING:
    from autotune.kernels._timer import TimerOptions, WorkerTimer

__all__ = ["KernelsUnavailable", "MoeTuneResult", "MoeTuneSettings", "Progress",
           "check_cuda", "tune_moe", "write_moe_config"]

logger = logging.getLogger(__name__)


class KernelsUnavailable(AutotuneError):
    """This machine cannot run the fused-MoE Triton kernel (no CUDA GPU or CUDA vLLM)."""


class MoeTuneSettings(BaseModel):
    """What ``autotune kernels moe`` tunes, and how hard."""

    model_config = ConfigDict(frozen=True, extra="forbid")

    model: Path
    shape: Path
    out: Path
    gpus: int = Field(default=1, ge=1, le=64)
    mtp_depths: tuple[int, ...] = (0,)
    max_batched_tokens: tuple[int, ...] = (DEFAULT_MAX_BATCHED_TOKENS,)
    max_num_seqs: tuple[int, ...] = (DEFAULT_MAX_NUM_SEQS,)  # a step holds min(streams, this)
    concurrency: int | None = Field(default=None, ge=1)
    sizes: tuple[int, ...] = ()  # token counts to add to the shape's
    trials: int = Field(default=48, ge=1, le=2000)  # configs timed per token count
    budget_s: float | None = Field(default=None, gt=0)  # the whole tuning's wall time
    recheck: int = Field(default=3, ge=0, le=20)
    tp: int = Field(default=1, ge=1)
    seed: int = 0
    reuse: bool = True  # keep token counts already tuned in OUT
    # a count keeps vLLM's default unless the re-check shows the winner this much faster
    min_gain: float = Field(default=0.03, ge=0.0, le=1.0)
    guard_keys: bool = True  # vLLM's default config at keys no tuned count is nearest to


@dataclass(frozen=True)
class Progress:
    """One event of a tuning: a candidate timed (``candidate``) or a size done (``done``)."""

    m: int
    sizes_done: int
    sizes_total: int
    gpu: int
    candidate: Candidate | None = None
    done: SizeResult | None = None


@dataclass
class MoeTuneResult:
    """Where the tuned file is and what each token count got."""

    path: Path  # OUT/<vLLM's file name>
    results_path: Path
    csv_path: Path
    shape: MoeShape
    gpu_name: str
    sizes: list[TokenCount]
    results: list[SizeResult] = field(default_factory=list)
    reused: list[int] = field(default_factory=list)  # token counts kept from an earlier run
    skipped: dict[int, str] = field(default_factory=dict)  # token count -> why not tuned
    guard_keys: list[int] = field(default_factory=list)  # keys holding vLLM's default config
    seconds: float = 0.0
    gpus: list[int] = field(default_factory=list)  # GPUs timed on ([]: nothing was timed)


def check_cuda() -> list[int]:
    """GPU indices usable for tuning; raises :class:`KernelsUnavailable` in one line."""
    from autotune.engine import detect_engine
    from autotune.hardware import gpu_names

    info = detect_engine()
    names = gpu_names()
    if info.device != "cuda" or not names:
        have = f"{info.package} {info.version}" + ("" if names else ", no NVIDIA GPU")
        raise KernelsUnavailable(
            f"the fused-MoE Triton kernel runs only on a CUDA GPU (this machine: {have}); "
            "run 'autotune kernels moe' on the GPU host with the 'gpu' extra "
            "(pip install -e '.[gpu]'), then copy the folder it writes")
    visible = os.environ.get("CUDA_VISIBLE_DEVICES")
    if visible:
        return [int(x) for x in visible.split(",") if x.strip().isdigit()] or [0]
    return list(range(len(names)))


def _atomic_write(path: Path, text: str) -> None:
    tmp = path.with_name(f".{path.name}.tmp-{os.getpid()}")
    tmp.write_text(text)
    os.replace(tmp, path)


def write_moe_config(path: Path, best: dict[int, dict[str, int]],
                     triton_version: str | None = None) -> None:
    """Write vLLM's JSON format: ``{"<M>": {BLOCK_SIZE_M..num_stages}, ...}`` sorted by M
    (``triton_version`` as vLLM's benchmark records it; the loader drops that key)."""
    obj: dict[str, str | dict[str, int]] = {}
    if triton_version:
        obj["triton_version"] = triton_version
    for m in sorted(best):
        obj[str(int(m))] = {k: int(best[m][k]) for k in KEYS}
    path.parent.mkdir(parents=True, exist_ok=True)
    _atomic_write(path, json.dumps(obj, indent=4) + "\n")


def _previous(results_path: Path, shape: MoeShape, gpu_name: str,
              search: SearchSettings) -> dict[int, SizeRow]:
    """Token counts tuned by an earlier run into the same folder, if it matches."""
    try:
        old = json.loads(results_path.read_text())
    except (OSError, ValueError):
        return {}
    if (old.get("moe_shape") != asdict(shape) or old.get("gpu") != gpu_name
            or _timing_settings(old.get("search")) != _timing_settings(asdict(search))):
        return {}
    return {int(r["m"]): r for r in old.get("sizes", []) if r.get("best")}


def _timing_settings(search: object) -> object:
    """What a search's times depend on: ``min_gain`` only decides the verdict (taken again
    from the recorded times), and results written before it existed lack it."""
    if not isinstance(search, dict):
        return search
    return {k: v for k, v in search.items() if k != "min_gain"}


def _earlier_row(row: SizeRow, min_gain: float) -> tuple[SizeRow, KernelConfig]:
    """An earlier run's row with its verdict decided at ``min_gain``, and the config the
    file holds for it."""
    best = row["best"]
    assert best is not None  # _previous keeps the rows with a best only
    default = row.get("default")
    if default is None or best == default:
        return {**row, "kept_default": None}, best
    kept = kept_default_reason(row.get("speedup"), min_gain)
    return {**row, "kept_default": kept}, (default if kept else best)


def _old_versions(results_path: Path) -> dict[str, str]:
    try:
        return dict(json.loads(results_path.read_text()).get("versions") or {})
    except (OSError, ValueError, AttributeError):
        return {}


_PRIORITY = {"decode": 0, "draft": 1, "mixed": 2, "prefill": 3}


def _by_priority(sizes: Sequence[TokenCount]) -> list[TokenCount]:
    """The order a budget serves token counts in: decode steps first (most of a serving
    run's steps), then draft and mixed steps, prefill chunks last; smaller M first."""
    return sorted(sizes, key=lambda tc: (min(_PRIORITY.get(k, 4) for k in tc.kinds), tc.m))


def _run_workers(todo: list[TokenCount], timers: Sequence[KernelTimer], shape: MoeShape,
                 search: SearchSettings, end: float | None,
                 on_progress: Callable[[Progress], None] | None,
                 clock: Callable[[], float] = time.monotonic
                 ) -> tuple[list[SizeResult], dict[int, str], list[BaseException]]:
    """Each timer (one GPU) takes the next token count from a shared queue, with a
    deadline: its share of what is left until ``end`` (a time of ``clock``). Returns the
    finished sizes, the skipped ones (why) and what stopped a GPU's loop (its other sizes
    are not tuned)."""
    work = deque(_by_priority(todo))
    costs = TimingCosts(search)
    results: list[SizeResult] = []
    skipped: dict[int, str] = {}
    errors: list[BaseException] = []
    lock = threading.Lock()

    def take() -> tuple[TokenCount, float | None] | None:
        """The next token count that fits and its deadline (called under the lock)."""
        while work:
            tc = work.popleft()
            if end is None:
                return tc, None
            now = clock()
            left = end - now
            floor = costs.floor_s(tc.m)
            if left <= 0 or (floor is not None and floor > left):
                need = f"; it needs about {floor:.0f} s" if floor is not None else ""
                skipped[tc.m] = f"the budget had {max(0.0, left):.0f} s left{need}"
                continue
            gpus = max(1, len(timers) - len(errors))
            share = left / -(-(len(work) + 1) // gpus)  # the rounds left, this one included
            return tc, now + min(left, max(share, floor or 0.0))
        return None

    def worker(gpu: int, timer: KernelTimer) -> None:
        warm: list[dict[str, int]] = []
        while True:
            with lock:
                nxt = take()
            if nxt is None:
                return
            tc, deadline = nxt

            def seen(c: Candidate, m: int = tc.m) -> None:
                if on_progress is not None:
                    with lock:
                        on_progress(Progress(m, len(results), len(todo), gpu, candidate=c))

            try:
                res = search_size(tc.m, shape, timer, settings=search, deadline=deadline,
                                  warm=warm[-1:], on_candidate=seen, costs=costs, clock=clock)
            except BaseException as exc:  # noqa: BLE001 - re-raised once results are saved
                with lock:
                    errors.append(exc)
                return
            warm.append(res.best)
            with lock:
                results.append(res)
                if on_progress is not None:
                    on_progress(Progress(tc.m, len(results), len(todo), gpu, done=res))

    threads = [threading.Thread(target=worker, args=(i, t), daemon=True)
               for i, t in enumerate(timers)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    return sorted(results, key=lambda r: r.m), dict(sorted(skipped.items())), errors


def _write_outputs(out: Path, file_name: str, result: MoeTuneResult, settings: MoeTuneSettings,
                   search: SearchSettings, prev: dict[int, SizeRow],
                   versions: dict[str, str]) -> None:
    best: dict[int, KernelConfig] = {}
    rows: dict[int, SizeRow] = {}
    for m, row in prev.items():
        rows[m], best[m] = _earlier_row(row, search.min_gain)
    for r in result.results:
        best[r.m] = r.chosen
        rows[r.m] = r.summary()
    for m, why in result.skipped.items():  # no "best": the next run into OUT tunes them
        best[m] = default_config(m, result.shape)
        rows[m] = {"m": m, "skipped": why, "best": None}
    reasons = {tc.m: tc.as_dict() for tc in result.sizes}
    if settings.guard_keys:
        best, result.guard_keys = with_guard_keys(best, result.shape,
                                                  limit=max(settings.max_batched_tokens))
    write_moe_config(result.path, best, versions.get("triton"))
    meta = {
        "file": file_name, "gpu": result.gpu_name, "moe_shape": asdict(result.shape),
        "search": asdict(search), "versions": versions,
        "settings": settings.model_dump(mode="json"),
        "written": datetime.now(UTC).isoformat(timespec="seconds"),
        "seconds": round(result.seconds, 1), "reused": result.reused,
        "skipped": {str(m): why for m, why in result.skipped.items()},
        "min_gain": search.min_gain,
        # keys holding vLLM's default config (not tuned, no row in "sizes"): nearest-key
        # lookup would otherwise serve them a far-away count's tiles
        "guard_keys": result.guard_keys,
        "sizes": [{**rows[m], **({"traffic": reasons[m]} if m in reasons else {})}
                  for m in sorted(rows)],
    }
    _atomic_write(result.results_path, json.dumps(meta, indent=2) + "\n")
    buf = io.StringIO()
    writer = csv.DictWriter(buf, fieldnames=["m", "phase", *KEYS, "us", "reason", "message"])
    writer.writeheader()
    for r in result.results:
        for c in r.candidates:
            writer.writerow(c.row())
    if result.csv_path.exists() and prev:  # keep the earlier run's candidates
        old = result.csv_path.read_text().splitlines()[1:]
        buf.write("".join(line + "\n" for line in old))
    _atomic_write(result.csv_path, buf.getvalue())


def _start_workers(shape: MoeShape, gpus: list[int], logs: Path, seed: int, file_name: str,
                   *, budget_left_s: float | None = None, **timer_kw: Unpack[TimerOptions]
                   ) -> tuple[list[KernelTimer], list[WorkerTimer], dict[str, str]]:
    """One worker per GPU, all started at once; each checks that vLLM itself names the file
    as autotune does. ``budget_left_s``: what is left of the budget now (a timing's
    timeout is cut to it); ``timer_kw``: more :class:`~autotune.kernels._timer.WorkerTimer`
    options (tests: a fake ``python``, short timeouts)."""
    from autotune.kernels._timer import WorkerTimer, start_workers

    deadline = None if budget_left_s is None else time.monotonic() + budget_left_s
    own = [WorkerTimer(shape, gpu=g, log_path=logs / f"worker-gpu{g}.log", seed=seed,
                       deadline=deadline, **timer_kw) for g in gpus]
    hellos = start_workers(own)
    vllm_name = hellos[0].get("file_name")
    if vllm_name and vllm_name != file_name:
        for w in own:
            w.close(kill=True)
        raise AutotuneError(
            f"vLLM on this GPU reads {vllm_name}, but autotune would write {file_name}; "
            "report this (autotune/kernels/_moe_shape.py config_file_name)")
    return list(own), own, dict(hellos[0].get("versions") or {})


def tune_moe(settings: MoeTuneSettings, *, timers: Sequence[KernelTimer] | None = None,
             gpu_name: str | None = None,
             on_progress: Callable[[Progress], None] | None = None,
             clock: Callable[[], float] = time.monotonic) -> MoeTuneResult:
    """Tune the fused-MoE config of ``settings.model`` for ``settings.shape``'s token counts.

    ``timers`` (one per GPU) default to worker processes on the present GPUs; without a
    CUDA GPU that raises :class:`KernelsUnavailable`. Tests pass pure timers, a
    ``gpu_name`` and a simulated ``clock``. Failures of single configs are recorded, never
    raised; token counts the budget has no time for are skipped (``result.skipped``)."""
    from autotune.traffic import load_shape

    t0 = clock()
    end = t0 + settings.budget_s if settings.budget_s else None
    shape = moe_shape_from_model(settings.model, tp=settings.tp)
    traffic = load_shape(settings.shape)
    sizes = token_counts(traffic, mtp_depths=settings.mtp_depths,
                         max_batched_tokens=settings.max_batched_tokens,
                         max_num_seqs=settings.max_num_seqs, concurrency=settings.concurrency,
                         extra=settings.sizes)
    if shape.config_dtype == "fp8_w8a8" and timers is None:
        raise ConfigError(f"{settings.model}: FP8 MoE weights are named but not yet timed by "
                          "'autotune kernels moe'; use vLLM's benchmarks/kernels/benchmark_moe.py")
    search = SearchSettings(trials=settings.trials, recheck=settings.recheck, seed=settings.seed,
                            min_gain=settings.min_gain)
    gpus: list[int] = []
    if timers is None:
        from autotune.hardware import gpu_type

        gpus = check_cuda()[: settings.gpus]
        gpu_name = gpu_name or gpu_type()
    name = gpu_name or "unknown"
    file_name = config_file_name(shape, name)
    stem = file_name.removesuffix(".json")
    out = settings.out
    out.mkdir(parents=True, exist_ok=True)
    result = MoeTuneResult(path=out / file_name, results_path=out / f"{stem}.results.json",
                           csv_path=out / f"{stem}.candidates.csv", shape=shape,
                           gpu_name=name, sizes=sizes)
    prev = _previous(result.results_path, shape, name, search) if settings.reuse else {}
    todo = [tc for tc in sizes if tc.m not in prev]
    result.reused = sorted(tc.m for tc in sizes if tc.m in prev)
    own: list[WorkerTimer] = []
    versions: dict[str, str] = _old_versions(result.results_path) if prev else {}
    try:
        if timers is None and todo:
            timers, own, versions = _start_workers(
                shape, gpus, out / "logs", settings.seed, file_name,
                budget_left_s=None if end is None else end - clock())
            result.gpus = list(gpus)
        elif todo:
            result.gpus = list(range(len(timers or [])))
        result.results, result.skipped, errors = _run_workers(
            todo, timers or [], shape, search, end, on_progress, clock)
        result.seconds = clock() - t0
        if result.results or prev:  # what finished is kept, even when a GPU's loop broke
            _write_outputs(out, file_name, result, settings, search, prev, versions)
        if errors:
            raise errors[0]
        return result
    finally:
        for w in own:
            w.close()

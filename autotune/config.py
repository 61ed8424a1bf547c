"""Validated settings of a tuning study (built once at the edge by the CLI or the caller)."""

from __future__ import annotations

import json
import math
import re
from pathlib import Path
from typing import Any, Literal

from pydantic import (
    BaseModel,
    ConfigDict,
    Field,
    SerializerFunctionWrapHandler,
    field_validator,
    model_serializer,
    model_validator,
)
from pydantic.json_schema import JsonDict

from autotune.credentials import redact
from autotune.errors import ConfigError

__all__ = ["CAPACITY_DEFAULT_SLO", "DEFAULT_CACHE_DIR", "DEFAULT_OUT_ROOT", "DEFAULT_STORAGE",
           "SLO_KEYS", "STORAGE_FILE", "TRACKING_FILE", "MeasureSettings", "TuneSettings",
           "folder_storage",
           "folder_tracking", "parse_slo", "storage_url", "store_where", "tracking_url"]

DEFAULT_OUT_ROOT = Path("experiments")
DEFAULT_STORAGE = "sqlite:///experiments/autotune.db"
#: the stores' files in a study's --out folder (where its stores are unless --storage and
#: --tracking-uri say otherwise)
STORAGE_FILE = "autotune.db"
TRACKING_FILE = "mlflow.db"
_SQLITE_SUFFIXES = (".db", ".sqlite", ".sqlite3")
#: compile/JIT caches shared by every trial, study and bench (``--cache-dir``)
DEFAULT_CACHE_DIR = Path("~/.cache/autotune")

# --slo keys -> the Measurement.flat() metric they bound (seconds).
SLO_KEYS = {
    f"{m}_{p}": f"{m}_{p}_s" for m in ("ttft", "tpot", "itl", "e2e") for p in ("p50", "p90", "p99")
}


#: the SLOs ``--objective capacity`` judges against when --slo is not given (seconds): an
#: interactive chat endpoint's usual bar (first token within 2 s, 10 tokens/s per stream)
CAPACITY_DEFAULT_SLO = {"ttft_p99": 2.0, "tpot_p99": 0.1}

#: closed loop: each request's output length times U(1 - j, 1 + j) unless told otherwise
#: (``--output-jitter``, docs/measurement.md section 4)
OUTPUT_JITTER = 0.1


_BUDGET = re.compile(r"^\s*(\d+(?:\.\d*)?|\.\d+)\s*(h|m|s)?\s*$", re.IGNORECASE)
_BUDGET_UNITS = {"h": 3600.0, "m": 60.0, "s": 1.0}


def parse_budget(text: str | float) -> tuple[Literal["wall", "gpu"], float]:
    """``--budget``: ``2h``, ``90m`` or ``5400s`` is GPU time (GPU-seconds: a trial on two
    GPUs spends two a second), a bare number seconds of wall time (as ``--timeout``).
    A :class:`ConfigError` that says both ways for anything else."""
    m = _BUDGET.match(str(text))
    value = float(m.group(1)) if m else math.nan
    if not m or not math.isfinite(value) or value <= 0:
        raise ConfigError(
            f"--budget {text!r}: give GPU time with a unit (2h, 90m, 5400s: GPU-hours, "
            "-minutes or -seconds) or seconds of wall time as a bare number (3600), > 0")
    unit = (m.group(2) or "").lower()
    if not unit:
        return "wall", value
    return "gpu", value * _BUDGET_UNITS[unit]


def parse_slo(text: str | None) -> dict[str, float]:
    """Parse ``"ttft_p99=2.0,tpot_p99=0.05"`` (seconds) into ``{"ttft_p99": 2.0, ...}``."""
    if not text:
        return {}
    out: dict[str, float] = {}
    for part in text.split(","):
        part = part.strip()
        if not part:
            continue
        m = re.fullmatch(r"([a-z0-9_]+)\s*=\s*([^=]+)", part)
        if not m:
            raise ConfigError(
                f"--slo item {part!r} is not KEY=SECONDS; example: --slo ttft_p99=2.0,tpot_p99=0.05"
            )
        key, raw = m.group(1), m.group(2).strip()
        if key not in SLO_KEYS:
            raise ConfigError(
                f"--slo key {key!r} is unknown; use one of {', '.join(sorted(SLO_KEYS))}"
            )
        try:
            value = float(raw)
        except ValueError:
            raise ConfigError(
                f"--slo {key}={raw!r}: the limit must be a number of seconds") from None
        if not math.isfinite(value) or value <= 0:
            raise ConfigError(f"--slo {key}={raw}: the limit must be a positive, finite number")
        out[key] = value
    return out


def _sqlite_url(path: Path) -> str:
    return f"sqlite:///{path.expanduser().resolve()}"


def _recorded_store(folder: Path, key: str) -> str | None:
    """The store (``storage`` or ``tracking_uri``) that the study.json in ``folder`` names:
    a study that kept its stores elsewhere (``--storage``, or before stores followed
    ``--out``). None without one, or when it is redacted (a password was left out)."""
    try:
        data = json.loads((folder / "study.json").read_text())
    except (OSError, ValueError):
        return None
    value = data.get(key) if isinstance(data, dict) else None
    return value if isinstance(value, str) and value and "***" not in value else None


def _folder_store(folder: Path, file: str, key: str) -> str:
    folder = Path(folder).expanduser()
    if not (folder / file).exists():
        recorded = _recorded_store(folder, key)
        if recorded:
            return recorded
    return _sqlite_url(folder / file)


def folder_storage(folder: Path) -> str:
    """The Optuna storage of a study's output folder: its ``autotune.db``, else the storage
    its study.json names (a study that kept it elsewhere), else ``autotune.db`` there."""
    return _folder_store(folder, STORAGE_FILE, "storage")


def folder_tracking(folder: Path) -> str:
    """The MLflow store of a study's output folder, as :func:`folder_storage` finds it."""
    return _folder_store(folder, TRACKING_FILE, "tracking_uri")


def storage_url(value: str | Path) -> str:
    """A ``--storage`` value as an Optuna storage URL: a URL as it is, a SQLite file
    (``.db``, ``.sqlite``) as ``sqlite:///`` its absolute path, any other path as a study's
    output folder (:func:`folder_storage`)."""
    text = str(value)
    if "://" in text:
        return text
    path = Path(text)
    return _sqlite_url(path) if path.suffix in _SQLITE_SUFFIXES else folder_storage(path)


def tracking_url(value: str | Path) -> str:
    """A ``--tracking-uri`` value: a URL as it is, a SQLite file as ``sqlite:///`` its
    absolute path, a study's output folder (one with ``mlflow.db`` or ``study.json``) as
    its MLflow store; any other path as it is (MLflow reads it as a file store)."""
    text = str(value)
    if "://" in text:
        return text
    path = Path(text)
    if path.suffix in _SQLITE_SUFFIXES:
        return _sqlite_url(path)
    if (path / TRACKING_FILE).exists() or (path / "study.json").exists():
        return folder_tracking(path)
    return text


def store_where(url: str) -> str:
    """A store URL for a message: a SQLite file by its absolute path (a relative one is
    relative to this working directory, which a reader may not know), no password."""
    if url.startswith("sqlite:///") and url[len("sqlite:///"):] not in ("", ":memory:"):
        return _sqlite_url(Path(url[len("sqlite:///"):]))
    return redact(url)


def _cli(flag: str, group: str = "measure", metavar: str | None = None) -> JsonDict:
    """A settings field's command-line option: its flag, its help group and metavar
    (``autotune/cli/_options.py`` builds the rows of ``tune`` and ``bench`` from them)."""
    return {"flag": flag, "group": group, **({"metavar": metavar} if metavar else {})}


def _slo_limits(v: dict[str, float]) -> dict[str, float]:
    for k, x in v.items():
        if k not in SLO_KEYS:
            raise ValueError(f"unknown SLO key {k!r}; use one of {', '.join(sorted(SLO_KEYS))}")
        if not math.isfinite(x) or x <= 0:
            raise ValueError(f"SLO {k} must be a positive number of seconds")
    return v


class MeasureSettings(BaseModel):
    """How one trial is measured: the one home of every per-trial measurement setting and
    its default (docs/measurement.md). ``autotune tune`` nests it (``TuneSettings.measure``),
    ``autotune bench`` builds it from the same options, and every :class:`TrialSpec` carries
    it. Each field's ``description`` is its ``--help`` text; its ``json_schema_extra`` names
    the flag. Unknown keys are rejected; the value is frozen."""

    model_config = ConfigDict(frozen=True, extra="forbid")

    # -- the replay ---------------------------------------------------------------------
    num_requests: int | None = Field(
        default=None, ge=1, json_schema_extra=_cli("--num-requests"),
        description="requests per replay (default: the shape's load.requests)")
    concurrency: int | None = Field(
        default=None, ge=1, json_schema_extra=_cli("--concurrency"),
        description="closed-loop streams (default: the shape's load.concurrency; an open-loop "
                    "shape is then replayed as a closed loop of N streams, its lengths without "
                    "its arrivals: what --objective throughput needs); also the streams a "
                    "'tuned' kernel knob's token counts come from")
    api: Literal["completions", "chat"] = Field(
        default="completions", json_schema_extra=_cli("--api"),
        description="OpenAI endpoint the load generator uses")
    # closed loop: output lengths times U(1 - j, 1 + j) (streams out of lockstep for good)
    output_jitter: float = Field(
        default=OUTPUT_JITTER, ge=0, lt=1,
        json_schema_extra=_cli("--output-jitter", metavar="FRACTION"),
        description="closed loop: each request's output length times a factor drawn from "
                    "[1 - FRACTION, 1 + FRACTION] (0 replays the shape's lengths exactly): "
                    "streams of equal lengths otherwise lock into step again and the "
                    "throughput climbs for minutes (docs/measurement.md, section 4)")
    replay: Literal["auto", "sessions", "independent", "exact"] = Field(
        default="auto", json_schema_extra=_cli("--replay"),
        description="how a shape with a sessions section is replayed: 'sessions' turn by "
                    "turn (each turn sent its think time after the previous answer, its "
                    "prompt the previous prompt + the answer's token ids + new tokens: a "
                    "prefix cache hits as in production; completions API), 'independent' "
                    "as independent requests, 'auto' sessions when the shape has them and "
                    "the API is completions; 'exact' replays the hash-id trace --trace "
                    "request by request with its recorded blocks and times, then the "
                    "shape's fitted sessions on the same server, and reports both "
                    "prefix-cache hit rates (docs/traffic.md)")
    trace: str | None = Field(
        default=None, json_schema_extra=_cli("--trace", metavar="FILE"),
        description="--replay exact: the hash-id trace (Mooncake JSONL: timestamp in ms, "
                    "input_length, output_length, hash_ids) to replay exactly; the first "
                    "--num-requests of it when given")
    trace_block_tokens: int = Field(
        default=512, ge=1, json_schema_extra=_cli("--trace-block-tokens", metavar="N"),
        description="--replay exact: tokens one hash id stands for in the trace (512 in "
                    "Mooncake's traces)")
    exact_block_tokens: int | None = Field(
        default=None, ge=1, json_schema_extra=_cli("--exact-block-tokens", metavar="N"),
        description="--replay exact: tokens one hash id becomes in the replay (default "
                    "--trace-block-tokens: the recorded lengths); every length of both "
                    "replays is scaled by N / --trace-block-tokens (16 of 512: 1/32, for a "
                    "tiny model's context)")
    # -- warm-up and the adaptive stop (docs/measurement.md) ------------------------------
    warmup_requests: int | None = Field(
        default=None, ge=0, json_schema_extra=_cli("--warmup-requests"),
        description="open-loop shapes only: a fixed warm-up of N requests (closed loop) before "
                    "the measured replay (0: no warm-up; with a capacity search the warm-up is "
                    "segments of the levels' traffic unless N is given); by default an open "
                    "loop warms up on the shape's own arrivals until the server holds their "
                    "steady state (two request durations) and closed loops until two segments "
                    "agree")
    warmup_tolerance: float = Field(
        default=0.05, gt=0, lt=1, json_schema_extra=_cli("--warmup-tolerance"),
        description="warm-up segments agree when they differ by at most this fraction")
    warmup_max_s: float = Field(
        default=120.0, gt=0, json_schema_extra=_cli("--warmup-max-s", metavar="SECONDS"),
        description="warm up at most this long; the warm-up ends earlier when two consecutive "
                    "segments agree within --warmup-tolerance, the last three do not climb (or "
                    "fall) by more than 3x it, and the server logged no kernel JIT compilation "
                    "in the last one")
    precision: float = Field(
        default=0.02, gt=0, lt=1, json_schema_extra=_cli("--precision"),
        description="stop measuring a trial when the 95 % interval of its output tokens/s is "
                    "within this fraction of it (0.02 = 2 %)")
    # 3 let a few agreeing segments stop runs that then drifted by up to 4.6 %
    min_segments: int = Field(
        default=5, ge=2, le=40, json_schema_extra=_cli("--min-segments", metavar="N"),
        description="measured segments before --precision may stop a trial (with 3, a few "
                    "agreeing segments stopped runs that then drifted by up to 4.6 %)")
    measure_max_s: float = Field(
        default=180.0, gt=0, json_schema_extra=_cli("--measure-max-s", metavar="SECONDS"),
        description="measure a trial at most this long (an open loop's measured replay too: "
                    "its length comes from --precision and this cap, not from a number of "
                    "requests)")
    segment_requests: int | None = Field(
        default=None, ge=1, json_schema_extra=_cli("--segment-requests", metavar="N"),
        description="completed requests per segment (default max(concurrency, 16): about one "
                    "wave of the closed loop)")
    repeats: int = Field(
        default=1, ge=1, le=100, json_schema_extra=_cli("--repeats"),
        description="measured replays per trial on the same server, the median reported (1: "
                    "the interval over segments replaces repeats)")
    # -- what a request and a trial must meet -----------------------------------------------
    slo: dict[str, float] = Field(
        default_factory=dict, json_schema_extra=_cli("--slo", group="search"),
        description="latency SLOs in seconds, e.g. ttft_p99=2.0,tpot_p99=0.05; trials that "
                    "miss them are infeasible, requests that meet them count as goodput (a "
                    "capacity search judges each request of a load level by them, the "
                    "percentile suffix then ignored; without --slo it judges "
                    "ttft_p99=2.0,tpot_p99=0.1)")
    max_error_rate: float = Field(
        default=0.05, ge=0.0, le=1.0, json_schema_extra=_cli("--max-error-rate", group="search"),
        description="trials with a larger share of failed requests are infeasible (and a "
                    "capacity load level with more fails)")
    # -- a capacity search over the arrival rate (tune --objective capacity, bench
    # --capacity; autotune.trial.capacity_spec) ------------------------------------------------
    capacity_goodput: float = Field(
        default=0.99, gt=0, le=1,
        json_schema_extra=_cli("--capacity-goodput", group="capacity", metavar="SHARE"),
        description="a load level passes when at least this share of its offered requests "
                    "met every --slo (failed requests count as misses) and no more than "
                    "--max-error-rate failed; it fails only when its misses are credibly "
                    "above that share (binomial rule: at 0.99 a level of 56 may miss 2)")
    capacity_tolerance: float = Field(
        default=0.25, gt=0, lt=1,
        json_schema_extra=_cli("--capacity-tolerance", group="capacity", metavar="FRACTION"),
        description="search until the bracket [highest passing rate, lowest failing rate] is "
                    "within this fraction (0.25: the two ends at most 1.25x apart; each "
                    "halving of it costs about one more level)")
    capacity_level_s: float = Field(
        default=10.0, gt=0,
        json_schema_extra=_cli("--capacity-level-s", group="capacity", metavar="SECONDS"),
        description="seconds of open-loop arrivals per load level, at least (and at least 40 "
                    "requests, from the busiest stretch of the recorded arrivals that holds "
                    "them); stretched to 3 of the shape's request durations as the warm-up "
                    "measured them (at most 4x), so that a level judges a sustained rate, not "
                    "a burst; a level stops early once it cannot pass. A session level is "
                    "this long a window of the steady state, whatever the think times "
                    "(docs/traffic.md)")
    capacity_max_s: float | None = Field(
        default=None, gt=0,
        json_schema_extra=_cli("--capacity-max-s", group="capacity", metavar="SECONDS"),
        description="a time cap on the load levels of one trial: they stop once the next "
                    "would end after this many seconds. Default: none, the search runs until "
                    "its bracket is within --capacity-tolerance (or --capacity-max-levels are "
                    "spent). A cap that ends it sooner leaves a wider or open bracket (status "
                    "'time'): the trial says so and the verdict gives no ratio from it")
    capacity_start: float = Field(
        default=1.0, gt=0,
        json_schema_extra=_cli("--capacity-start", group="capacity", metavar="SCALE"),
        description="the warm-up's and the first level's rate, as a scale of the recorded "
                    "rate (a warm-up that fell behind moves the first level to just below "
                    "what the server served; then steps of 1.25x, 1.56x, then 2x up after a "
                    "pass, down after a fail, until bracketed)")
    capacity_max_levels: int = Field(
        default=10, ge=2, le=100,
        json_schema_extra=_cli("--capacity-max-levels", group="capacity", metavar="N"),
        description="load levels per trial at most")
    # -- the server -----------------------------------------------------------------------
    start_timeout_s: float = Field(
        default=600.0, gt=0, json_schema_extra=_cli("--start-timeout"),
        description="seconds a server may take to answer /health")
    request_timeout_s: float = Field(
        default=600.0, gt=0, json_schema_extra=_cli("--request-timeout"),
        description="seconds one request may take")
    cache_dir: Path | None = Field(
        default=None, json_schema_extra=_cli("--cache-dir", group="resources"),
        description=f"compile/JIT caches shared by every trial, study and bench (default "
                    f"{DEFAULT_CACHE_DIR}): a config started before starts warm")
    cpu_kv_cache_gib: float = Field(
        default=1.0, gt=0, json_schema_extra=_cli("--cpu-kv-cache-gib", group="resources"),
        description="KV cache GiB for the CPU build (VLLM_CPU_KVCACHE_SPACE)")

    @field_validator("slo")
    @classmethod
    def _slo_keys(cls, v: dict[str, float]) -> dict[str, float]:
        return _slo_limits(v)

    def cache_path(self) -> Path:
        """The compile/JIT cache folder: ``cache_dir``, else :data:`DEFAULT_CACHE_DIR`."""
        return (self.cache_dir or DEFAULT_CACHE_DIR).expanduser()


#: the keys of :class:`MeasureSettings` (a flat settings mapping's measurement keys)
MEASURE_KEYS = frozenset(MeasureSettings.model_fields)


class TuneSettings(BaseModel):
    """Everything ``autotune tune`` needs; unknown keys are rejected. The per-trial
    measurement settings are :attr:`measure` (a :class:`MeasureSettings`); the constructor
    also takes them as flat keys (``TuneSettings(..., precision=0.05)``, a config file's
    ``precision: 0.05``), and :meth:`model_dump` writes them flat, so a saved config,
    ``study.json`` and a study's stored settings keep one format."""

    model_config = ConfigDict(frozen=True, extra="forbid")

    model: Path
    shape: Path
    space: Path
    trials: int = Field(default=20, ge=1, le=100_000)
    # not given: in --out (OUT/autotune.db, OUT/mlflow.db), else the shared
    # experiments/autotune.db and experiments/mlflow.db (_stores)
    storage: str = DEFAULT_STORAGE
    tracking_uri: str | None = None  # None: sqlite:///<out root>/mlflow.db
    experiment: str = "autotune"
    study_name: str | None = None
    out: Path | None = None  # None: experiments/<study-name>/
    ray_address: str | None = None
    use_ray: bool = True
    seed: int = 0
    sampler: Literal["tpe", "random"] = "tpe"
    # auto: capacity for an open-loop shape, throughput for a closed loop (autotune.study)
    objective: Literal["auto", "throughput", "goodput", "pareto", "capacity"] = "auto"
    pareto_latency: str = "ttft_p99"  # the latency a Pareto study minimises
    baseline: bool = True
    recheck: int = Field(default=3, ge=0, le=50)  # re-measure the top k before the verdict
    # at least (a config's TP x PP x DP raises it); None: 1 on GPU hosts, 0 on CPU
    gpus_per_trial: int | None = Field(default=None, ge=0)
    parallel: int | None = Field(default=None, ge=1)  # None: one trial per GPU slot
    # servers fork from an interpreter that imported vLLM once (autotune/engine/_launcher.py)
    preload: bool = True
    resume: bool = False
    enqueue: list[dict[str, Any]] = Field(default_factory=list)  # configs to try first
    quality: str | None = None  # thresholds, e.g. "min_agreement=0.95" (a constraint)
    quality_probe: bool = True  # probe trials that set a lossy knob (figures logged)
    # the study's time budget (re-check included)
    timeout_s: float | None = Field(default=None, gt=0)
    # --budget as given: "2h", "90m", "5400s" (GPU time: gpu_budget_s) or a bare number
    # (seconds of wall time: timeout_s); autotune.study plans the trials to it
    budget: str | None = None
    gpu_budget_s: float | None = Field(default=None, gt=0, exclude=True)  # from budget
    pruner: Literal["interval", "none"] = "interval"
    # steer samples away from configs the store's start failures predict (autotune.study)
    failure_model: bool = True
    # a new study learns from the trials of earlier studies of the model and hardware in
    # its store, weighted by shape distance (autotune.results.learn_from_store)
    learn: bool = True
    # screen, then refine: each search trial is read at a coarse fidelity first and only
    # the leaders are measured to full resolution (autotune.study._rungs)
    screen: bool = True
    # kernels tuned before trial 0 for a knob with `tuned:` (docs/kernels.md): device time
    # for the whole tuning (split over token counts) and configs timed per token count
    kernel_budget_s: float | None = Field(default=1200.0, gt=0)
    kernel_trials: int = Field(default=48, ge=1, le=2000)
    recheck_starts: int = Field(default=2, ge=1, le=20)  # fresh starts per re-checked config
    # how each trial is measured (warm-up, adaptive stop, SLOs, capacity search, timeouts):
    # given nested or as flat keys (``precision=0.05``: :meth:`_nest`)
    measure: MeasureSettings = Field(default_factory=MeasureSettings)
    # what it is worth (autotune.cost): no price is built in; None leaves cost out
    gpu_hour_price: float | None = Field(default=None, gt=0)  # USD per GPU-hour
    api_price: list[float] | None = None  # USD per million input, output tokens
    growth: float = Field(default=1.0, gt=0)  # traffic multiplier (2 = it doubles)

    @model_validator(mode="before")
    @classmethod
    def _stores(cls, data: Any) -> Any:
        """The stores follow ``--out``: a study given ``--out DIR`` and no ``--storage`` /
        ``--tracking-uri`` keeps them in DIR (:func:`folder_storage`), so that whatever
        reads DIR finds them; a folder or file given as a store is its SQLite URL."""
        if not isinstance(data, dict):
            return data
        out, storage, tracking = data.get("out"), data.get("storage"), data.get("tracking_uri")
        folder = Path(out) if isinstance(out, (str, Path)) else None
        if storage is None:
            storage = folder_storage(folder) if folder is not None else DEFAULT_STORAGE
        elif isinstance(storage, (str, Path)):
            storage = storage_url(storage)
        if tracking is None:
            tracking = folder_tracking(folder) if folder is not None else None
        elif isinstance(tracking, (str, Path)):
            tracking = tracking_url(tracking)
        return {**data, "storage": storage, "tracking_uri": tracking}

    @model_validator(mode="before")
    @classmethod
    def _budget(cls, data: Any) -> Any:
        """``budget`` sets ``gpu_budget_s`` (with a unit) or ``timeout_s`` (a bare number);
        given beside a different value of that field, it is refused."""
        if not isinstance(data, dict) or data.get("budget") in (None, ""):
            return data
        kind, seconds = parse_budget(data["budget"])
        key = "gpu_budget_s" if kind == "gpu" else "timeout_s"
        given = data.get(key)
        if given is not None and not math.isclose(float(given), seconds):
            flag = "--timeout" if key == "timeout_s" else "gpu_budget_s"
            raise ValueError(f"--budget {data['budget']} and {flag} {given} disagree; keep one")
        return {**data, "budget": str(data["budget"]).strip(), key: seconds}

    @model_validator(mode="before")
    @classmethod
    def _nest(cls, data: Any) -> Any:
        """Flat measurement keys move into ``measure`` (a given ``measure`` mapping or model
        is their base; a key given both ways is refused); a capacity study with no SLOs
        judges against :data:`CAPACITY_DEFAULT_SLO`."""
        if not isinstance(data, dict):
            return data
        base = data.get("measure") or {}
        measure = dict(base.model_dump() if isinstance(base, MeasureSettings) else base)
        flat = {k: v for k, v in data.items() if k in MEASURE_KEYS}
        if both := sorted(set(flat) & set(base if isinstance(base, dict) else ())):
            raise ValueError(f"{', '.join(both)} given both flat and under 'measure'; keep one")
        measure.update(flat)
        if data.get("objective") == "capacity" and not measure.get("slo"):
            measure["slo"] = dict(CAPACITY_DEFAULT_SLO)
        rest = {k: v for k, v in data.items() if k not in MEASURE_KEYS}
        return {**rest, "measure": measure}

    @model_serializer(mode="wrap")
    def _flat(self, handler: SerializerFunctionWrapHandler) -> dict[str, object]:
        """Dumped flat: the measurement keys beside the others, as a config file and the
        stored settings of every study (old ones too) have them."""
        data: dict[str, object] = handler(self)
        measure = data.pop("measure", None)
        return {**data, **(measure if isinstance(measure, dict) else {})}

    @field_validator("api_price", mode="before")
    @classmethod
    def _api_price(cls, v: Any) -> Any:
        from autotune.cost import parse_api_price

        return parse_api_price(v)

    @field_validator("pareto_latency")
    @classmethod
    def _latency_key(cls, v: str) -> str:
        if v not in SLO_KEYS:
            raise ValueError(f"unknown latency {v!r}; use one of {', '.join(sorted(SLO_KEYS))}")
        return v

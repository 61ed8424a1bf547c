"""Validated settings of a tuning study (built once at the edge by the CLI or the caller)."""

from __future__ import annotations

import json
import math
import re
from pathlib import Path
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, field_validator, model_validator

from autotune.credentials import redact
from autotune.errors import ConfigError

__all__ = ["CAPACITY_DEFAULT_SLO", "DEFAULT_OUT_ROOT", "DEFAULT_STORAGE", "SLO_KEYS",
           "STORAGE_FILE", "TRACKING_FILE", "TuneSettings", "folder_storage",
           "folder_tracking", "parse_slo", "storage_url", "store_where", "tracking_url"]

DEFAULT_OUT_ROOT = Path("experiments")
DEFAULT_STORAGE = "sqlite:///experiments/autotune.db"
#: the stores' files in a study's --out folder (where its stores are unless --storage and
#: --tracking-uri say otherwise)
STORAGE_FILE = "autotune.db"
TRACKING_FILE = "mlflow.db"
_SQLITE_SUFFIXES = (".db", ".sqlite", ".sqlite3")

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


class TuneSettings(BaseModel):
    """Everything ``autotune tune`` needs; unknown keys are rejected."""

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
    slo: dict[str, float] = Field(default_factory=dict)
    max_error_rate: float = Field(default=0.05, ge=0.0, le=1.0)
    baseline: bool = True
    repeats: int = Field(default=1, ge=1, le=100)
    recheck: int = Field(default=3, ge=0, le=50)  # re-measure the top k before the verdict
    warmup_requests: int | None = Field(default=None, ge=0)
    num_requests: int | None = Field(default=None, ge=1)
    concurrency: int | None = Field(default=None, ge=1)
    api: Literal["completions", "chat"] = "completions"
    start_timeout_s: float = Field(default=600.0, gt=0)
    request_timeout_s: float = Field(default=600.0, gt=0)
    # at least (a config's TP x PP x DP raises it); None: 1 on GPU hosts, 0 on CPU
    gpus_per_trial: int | None = Field(default=None, ge=0)
    parallel: int | None = Field(default=None, ge=1)  # None: one trial per GPU slot
    cache_dir: Path | None = None  # None: ~/.cache/autotune (shared compile/JIT caches)
    cpu_kv_cache_gib: float = Field(default=1.0, gt=0)
    # servers fork from an interpreter that imported vLLM once (autotune/engine/_launcher.py)
    preload: bool = True
    resume: bool = False
    enqueue: list[dict[str, Any]] = Field(default_factory=list)  # configs to try first
    quality: str | None = None  # thresholds, e.g. "min_agreement=0.95" (a constraint)
    quality_probe: bool = True  # probe trials that set a lossy knob (figures logged)
    # the study's time budget (re-check included)
    timeout_s: float | None = Field(default=None, gt=0)
    # measurement (docs/measurement.md): adaptive stop, warm-up, pruner, re-check starts
    precision: float = Field(default=0.02, gt=0, lt=1)  # 95 % interval half-width / value
    min_segments: int = Field(default=5, ge=2, le=40)  # measured segments before a precise stop
    warmup_tolerance: float = Field(default=0.05, gt=0, lt=1)
    warmup_max_s: float = Field(default=120.0, gt=0)
    measure_max_s: float = Field(default=180.0, gt=0)
    segment_requests: int | None = Field(default=None, ge=1)  # None: max(concurrency, 16)
    # closed loop: output lengths times U(1 - j, 1 + j) (streams out of lockstep for good)
    output_jitter: float = Field(default=OUTPUT_JITTER, ge=0, lt=1)
    pruner: Literal["interval", "none"] = "interval"
    # kernels tuned before trial 0 for a knob with `tuned:` (docs/kernels.md): device time
    # for the whole tuning (split over token counts) and configs timed per token count
    kernel_budget_s: float | None = Field(default=1200.0, gt=0)
    kernel_trials: int = Field(default=48, ge=1, le=2000)
    recheck_starts: int = Field(default=2, ge=1, le=20)  # fresh starts per re-checked config
    # --objective capacity (autotune.capacity): the bracketing search over the arrival rate
    capacity_goodput: float = Field(default=0.99, gt=0, le=1)  # share within the SLOs
    capacity_tolerance: float = Field(default=0.25, gt=0, lt=1)  # bracket high/low - 1
    capacity_level_s: float = Field(default=10.0, gt=0)  # seconds of arrivals per level
    # the load levels of one trial stop once the next would end after this many seconds
    # (None: no time cap; the search runs until its bracket is within the tolerance)
    capacity_max_s: float | None = Field(default=None, gt=0)
    capacity_start: float = Field(default=1.0, gt=0)  # first scale of the recorded rate
    capacity_max_levels: int = Field(default=10, ge=2, le=100)
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
    def _capacity_slo(cls, data: Any) -> Any:
        """A capacity study with no --slo judges against CAPACITY_DEFAULT_SLO."""
        if isinstance(data, dict) and data.get("objective") == "capacity" and not data.get("slo"):
            data = {**data, "slo": dict(CAPACITY_DEFAULT_SLO)}
        return data

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

    @field_validator("slo")
    @classmethod
    def _slo_keys(cls, v: dict[str, float]) -> dict[str, float]:
        for k, x in v.items():
            if k not in SLO_KEYS:
                raise ValueError(f"unknown SLO key {k!r}")
            if not math.isfinite(x) or x <= 0:
                raise ValueError(f"SLO {k} must be a positive number of seconds")
        return v

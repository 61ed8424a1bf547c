"""The start-to-start spread remembered: what a study with repeated server starts measured,
kept on the study (``autotune.start_spread``) with what it depends on (the host class, the
engine version, the model, the device), and pooled for a later study of one start each on
the same store, whose interval holds no spread of its own (docs/measurement.md, section 9).
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import TYPE_CHECKING, TypedDict

from autotune.store._keys import A

if TYPE_CHECKING:
    from optuna.storages import BaseStorage
    from optuna.study import Study

__all__ = ["CPU_DEFAULT_DF", "CPU_DEFAULT_SOURCE", "CPU_DEFAULT_SPREAD", "SpreadRecord",
           "StoredSpread", "keep_spread", "prior_spread_of", "record_spread", "stored_spread"]

#: with nothing stored, a CPU study of one start each takes this start-to-start spread (the
#: SD of a reading, exp(s) - 1) with :data:`CPU_DEFAULT_DF` degrees of freedom: what the
#: store's own estimator gives for the 8 A/A studies of experiments/aa_verdict (results/
#: recheck0.jsonl: the tiny hybrid model on the demo's shape, vLLM's defaults started twice,
#: as trial 0 and as its own flags written out). Their log ratios (true value 0) have an
#: RMS of 0.170 over 8 pairs, i.e. a log SD of 0.170 / sqrt(2) = 0.120 per start, 12.8 %.
#: Like a stored spread it holds each reading's within-run noise too (the intervals put
#: the start-only share at about 10 %), on a shared 2-core machine (load 4.4-20.5). It
#: replaced 17.1 %, the CV of 3 repeats on one server: no between-start figure.
CPU_DEFAULT_SPREAD = 0.128
#: the degrees of freedom of :data:`CPU_DEFAULT_SPREAD`: 8 pairs with a known mean
CPU_DEFAULT_DF = 8
#: where the CPU default comes from, in the words a verdict prints
CPU_DEFAULT_SOURCE = "8 A/A studies of one start each, experiments/aa_verdict"


class SpreadRecord(TypedDict):
    """``autotune.start_spread``: the pooled SD of log readings between starts, its degrees
    of freedom, and the host class it was measured on (model, engine and device are the
    study's own ``autotune.model``, ``autotune.engine_version``, ``autotune.gpu_type``)."""

    log_sd: float
    df: int
    host: str


@dataclass(frozen=True)
class StoredSpread:
    """A start-to-start spread a one-start study uses: ``log_sd`` (pooled), ``df`` (its
    degrees of freedom; None for a figure without any) and where it came from, in words."""

    log_sd: float
    df: int | None
    source: str

    @property
    def relative(self) -> float:
        return math.expm1(self.log_sd)


def record_spread(study: Study, log_sd: float | None, df: int | None, host: str) -> None:
    """Keep the spread a study's repeated starts measured (nothing without one)."""
    if log_sd is None or not df or not math.isfinite(log_sd) or log_sd < 0:
        return
    study.set_user_attr(A.START_SPREAD, SpreadRecord(log_sd=float(log_sd), df=int(df),
                                                     host=host))


def stored_spread(storage: BaseStorage, *, model: str, engine: str, device: str, host: str,
                  exclude: str | None = None) -> StoredSpread | None:
    """The spread earlier studies on ``storage`` of the same model, engine, device and host
    class recorded, pooled (degrees of freedom as weights); on the CPU build with none,
    :data:`CPU_DEFAULT_SPREAD`; else None. ``exclude``: the asking study's name."""
    import optuna

    from autotune.hardware import is_cpu

    ss = dfs = 0.0
    n = 0
    for summary in optuna.get_all_study_summaries(storage, include_best_trial=False):
        attrs = summary.user_attrs
        rec = attrs.get(A.START_SPREAD)
        if (summary.study_name == exclude or not isinstance(rec, dict)
                or rec.get("host") != host or attrs.get(A.MODEL) != model
                or attrs.get(A.ENGINE) != engine or attrs.get(A.GPU) != device):
            continue
        sd, df = rec.get("log_sd"), rec.get("df")
        if isinstance(sd, (int, float)) and isinstance(df, int) and df > 0:
            ss += df * float(sd) ** 2
            dfs += df
            n += 1
    if n:
        log_sd = math.sqrt(ss / dfs)
        return StoredSpread(log_sd, int(dfs), (
            f"start-to-start spread {math.expm1(log_sd) * 100:.1f} % from {n} earlier "
            f"stud{'y' if n == 1 else 'ies'} on this host"))
    if is_cpu(device):
        return StoredSpread(math.log1p(CPU_DEFAULT_SPREAD), CPU_DEFAULT_DF, (
            f"start-to-start spread {CPU_DEFAULT_SPREAD * 100:.1f} %, the CPU build's default "
            f"from {CPU_DEFAULT_SOURCE} (no earlier study of this model on this host "
            "stored one)"))
    return None


def prior_spread_of(study: Study) -> StoredSpread | None:
    """:func:`stored_spread` for ``study``: its model, engine and device (the study's own
    attributes) on this host, other studies of its storage only."""
    from autotune.hardware import host_class

    attrs = study.user_attrs
    device = str(attrs.get(A.GPU) or "")
    return stored_spread(study._storage, model=str(attrs.get(A.MODEL) or ""),
                         engine=str(attrs.get(A.ENGINE) or ""), device=device,
                         host=host_class(device), exclude=study.study_name)


def keep_spread(study: Study, log_sd: float | None, df: int | None) -> None:
    """:func:`record_spread` on this host (the study's device decides the host class)."""
    from autotune.hardware import host_class

    record_spread(study, log_sd, df, host_class(str(study.user_attrs.get(A.GPU) or "")))

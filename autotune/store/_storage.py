"""Opening a study's storage (SQLite or an RDB URL, with retry while several tuners
create its tables at once) and finding the latest study in it.
"""

from __future__ import annotations

import logging
import time
from pathlib import Path
from typing import TYPE_CHECKING, Literal, TypedDict, overload

from autotune.credentials import redact
from autotune.errors import StudyError
from autotune.store._heartbeats import Heartbeat

if TYPE_CHECKING:
    from optuna.storages import BaseStorage, RDBStorage

logger = logging.getLogger(__name__)


def sqlite_path(url: str) -> Path | None:
    """The file of a ``sqlite:///PATH`` URL; None for other databases and in-memory SQLite."""
    if not url.startswith("sqlite:///"):
        return None
    path = url[len("sqlite:///"):]
    return None if path in ("", ":memory:") else Path(path)


class _StorageArgs(TypedDict, total=False):
    """Keyword arguments of ``optuna.storages.RDBStorage``."""

    heartbeat_interval: int
    grace_period: int
    engine_kwargs: dict[str, object]


@overload
def open_storage(url: str, *, create: Literal[True] = True,
                 heartbeat: Heartbeat | None = None) -> RDBStorage: ...
@overload
def open_storage(url: str, *, create: bool,
                 heartbeat: Heartbeat | None = None) -> RDBStorage | None: ...
def open_storage(url: str, *, create: bool = True,
                 heartbeat: Heartbeat | None = None) -> RDBStorage | None:
    """An Optuna RDB storage; SQLite files get their folder and a generous lock timeout.

    ``create=False``: a SQLite file that does not exist is not created and None is returned
    (looking something up must not leave files behind). ``heartbeat``: the storage a tuner
    runs trials on records Optuna heartbeats (:class:`Heartbeats`, :func:`fail_stale_trials`)."""
    kwargs: _StorageArgs = {}
    if heartbeat is not None:
        kwargs["heartbeat_interval"] = heartbeat.interval_s
        kwargs["grace_period"] = heartbeat.grace_s
    if url.startswith("sqlite:///"):
        path = sqlite_path(url)
        if path is not None:
            if not create and not path.exists():
                return None
            path.parent.mkdir(parents=True, exist_ok=True)
        kwargs["engine_kwargs"] = {"connect_args": {"timeout": 60}}
    else:
        # A database server restarted mid-study leaves every pooled connection dead: each
        # is tested when taken, and replaced, so the study goes on (docs/faults.md).
        kwargs["engine_kwargs"] = {"pool_pre_ping": True}
    try:
        return _rdb_storage(url, kwargs)
    except Exception as exc:
        raise StudyError(
            f"cannot open the Optuna storage {redact(url)!r}: {type(exc).__name__}: "
            f"{redact(str(exc).splitlines()[0]) if str(exc) else ''}; use sqlite:///PATH or a "
            "reachable database URL"
        ) from exc


def _rdb_storage(url: str, kwargs: _StorageArgs, attempts: int = 5) -> RDBStorage:
    """Optuna's RDB storage, opened again when another process created its schema at the
    same moment. Two processes opening a fresh storage at once (two tuners joining one
    study, a status next to a starting tune) both create the tables and one fails ("table
    studies already exists", alembic's version row); the schema is whole by then."""
    import warnings

    import optuna

    def open_it() -> RDBStorage:
        with warnings.catch_warnings():  # the heartbeat arguments are "experimental"
            warnings.simplefilter("ignore", optuna.exceptions.ExperimentalWarning)
            return optuna.storages.RDBStorage(url, **kwargs)

    for attempt in range(1, attempts):
        try:
            return open_it()
        except Exception as exc:
            if not schema_race(exc):
                raise
            time.sleep(0.2 * attempt)
    return open_it()


def schema_race(exc: BaseException) -> bool:
    """Whether opening a storage failed because another process created its schema at the
    same moment (SQLite and server databases word it alike)."""
    text = str(exc).lower()
    return "already exist" in text or (
        "alembic_version" in text and ("unique" in text or "duplicate" in text))


def latest_study(storage: str | BaseStorage) -> str | None:
    """The name of the study started last in ``storage`` (None when it holds none)."""
    import optuna

    summaries = optuna.get_all_study_summaries(storage, include_best_trial=False)
    started = [(s.datetime_start, s.study_name) for s in summaries
               if s.datetime_start is not None]
    return max(started)[1] if started else None

"""Tuners sharing a study: who owns a running trial, Optuna heartbeats, and failing the
trials whose tuner is gone.
"""

from __future__ import annotations

import logging
import os
import socket
import threading
import uuid
from dataclasses import asdict, dataclass
from datetime import datetime
from typing import TYPE_CHECKING, TypedDict, cast

if TYPE_CHECKING:
    import optuna
    from optuna.storages import BaseStorage
    from optuna.storages._heartbeat import BaseHeartbeat
from autotune.store._keys import A, FailureReason, State

logger = logging.getLogger(__name__)


@dataclass(frozen=True)
class Heartbeat:
    """Optuna's heartbeat settings (``RDBStorage(heartbeat_interval=, grace_period=)``):
    a tuner records a heartbeat for each trial it runs every ``interval_s``; a RUNNING trial
    without one for ``grace_s`` is stale, and any tuner of the study fails it."""

    interval_s: int = 10
    grace_s: int = 120


class OwnerRecord(TypedDict):
    """``Owner.record()``: the ``autotune.owner`` attribute of a running trial."""

    host: str
    pid: int
    started: int | None
    token: str


@dataclass(frozen=True)
class Owner:
    """The tuner running a trial (``autotune.owner``). ``started`` (the process's start in
    clock ticks) tells a reused pid from the tuner; ``token`` tells two tuners of one
    process apart."""

    host: str
    pid: int
    started: int | None
    token: str

    @classmethod
    def this_process(cls) -> Owner:
        """A new tuner session of this process."""
        from autotune.hardware import process_start_ticks

        pid = os.getpid()
        return cls(socket.gethostname(), pid, process_start_ticks(pid), uuid.uuid4().hex[:12])

    def record(self) -> OwnerRecord:
        return cast(OwnerRecord, asdict(self))

    @classmethod
    def of(cls, t: optuna.trial.FrozenTrial) -> Owner | None:
        """The owner a trial records; None for trials written before owners were."""
        raw = t.user_attrs.get(A.OWNER)
        if not isinstance(raw, dict):
            return None
        try:
            return cls(str(raw["host"]), int(raw["pid"]),
                       None if raw.get("started") is None else int(raw["started"]),
                       str(raw.get("token", "")))
        except (KeyError, TypeError, ValueError, AttributeError):
            return None

    def gone(self, *, host: str) -> bool:
        """Known to be gone: it ran on ``host`` (this machine) and its process is no more
        (or its pid now belongs to another process). A tuner on another host: False."""
        from autotune.hardware import process_start_ticks

        if self.host != host:
            return False
        now = process_start_ticks(self.pid)
        return now is None or (self.started is not None and now != self.started)

    def __str__(self) -> str:
        return f"{self.host} pid {self.pid}"


def _beating(storage: BaseStorage) -> BaseHeartbeat | None:
    """The storage's heartbeat contract; None where heartbeats are off or not supported."""
    from optuna.storages._heartbeat import BaseHeartbeat

    if isinstance(storage, BaseHeartbeat) and storage.get_heartbeat_interval() is not None:
        return storage
    return None


class Heartbeats:
    """Records Optuna heartbeats for the trials this tuner runs: at once on :meth:`add`,
    then every interval from a daemon thread (Optuna starts its own heartbeat thread only
    inside ``Study.optimize``; an ask/tell loop needs this one). Does nothing on a storage
    without heartbeats. Use :meth:`start` and :meth:`stop` (in a ``finally``)."""

    def __init__(self, storage: BaseStorage) -> None:
        self.storage = _beating(storage)
        self.interval_s = None if self.storage is None else self.storage.get_heartbeat_interval()
        self._ids: set[int] = set()
        self._lock = threading.Lock()
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self._failing = False

    def add(self, trial_id: int) -> None:
        with self._lock:
            self._ids.add(trial_id)
        self._beat(trial_id)

    def discard(self, trial_id: int) -> None:
        with self._lock:
            self._ids.discard(trial_id)

    def start(self) -> None:
        if self.interval_s is None or self._thread is not None:
            return
        self._stop.clear()
        self._thread = threading.Thread(target=self._run, name="autotune-heartbeats",
                                        daemon=True)
        self._thread.start()

    def stop(self) -> None:
        self._stop.set()
        if self._thread is not None:
            self._thread.join(timeout=30)
            self._thread = None

    def _run(self) -> None:
        assert self.interval_s is not None
        while not self._stop.wait(self.interval_s):
            with self._lock:
                ids = sorted(self._ids)
            for trial_id in ids:
                self._beat(trial_id)

    def _beat(self, trial_id: int) -> None:
        if self.storage is None:
            return
        try:
            self.storage.record_heartbeat(trial_id)
        except Exception as exc:  # noqa: BLE001 - the loop meets a broken storage itself
            if not self._failing:  # and stops with its error; this thread must not die
                logger.warning("cannot record the heartbeat of trial id %d (%s: %s); other "
                               "tuners of the study fail it as stale if this lasts",
                               trial_id, type(exc).__name__, str(exc)[:200])
            self._failing = True
        else:
            self._failing = False


def _fail_running(storage: BaseStorage, trial_id: int, reason: str, message: str) -> bool:
    """Reason first, then FAIL (a finished trial's attributes can no longer be written).
    False when the trial finished meanwhile (its tuner told it, or another tuner failed it)."""
    from optuna.exceptions import UpdateFinishedTrialError
    from optuna.trial import TrialState

    try:
        storage.set_trial_user_attr(trial_id, A.STATE, State.FAILED)
        storage.set_trial_user_attr(trial_id, A.REASON, reason)
        storage.set_trial_user_attr(trial_id, A.MESSAGE, message)
        return bool(storage.set_trial_state_values(trial_id, state=TrialState.FAIL))
    except UpdateFinishedTrialError:
        return False


def _gone_at_once(t: optuna.trial.FrozenTrial, me: Owner, grace_s: float) -> str | None:
    """Why a RUNNING trial's tuner is known to be gone now (None: not known)."""
    owner = Owner.of(t)
    if owner is None:  # written before owners were recorded, or asked a moment ago
        age = (datetime.now() - t.datetime_start).total_seconds() if t.datetime_start else 0
        return "the tuner stopped while this trial was running" if age > grace_s else None
    if owner.token != me.token and owner.gone(host=me.host):
        return f"the tuner running this trial ({owner}) is gone"
    return None


def fail_stale_trials(study: optuna.Study, *, me: Owner, heartbeat: Heartbeat) -> dict[int, str]:
    """RUNNING trials whose tuner is gone become FAIL, with the reason recorded first.

    * At once, reason ``tuner_died``: the trial's owner ran on this host and its process is
      gone (so a study resumed right after a kill retries the trial at once), or the trial
      records no owner (written by an older autotune) and started over
      ``heartbeat.grace_s`` ago.
    * After the grace period, reason ``stale``: no heartbeat for ``heartbeat.grace_s``
      (the storage's ``heartbeat_interval``/``grace_period``) - a tuner on another host,
      or a hung one. The stale ids come from the storage's heartbeat contract, as in
      ``optuna.storages.fail_stale_trials``; that function sets FAIL before its
      ``heartbeat_stale_trial_callback`` runs, when the trial's reason can no longer be
      written, so the reason is set here first and the storage's callback (if any) runs
      after, as Optuna does.

    This tuner's own trials (``me``) and those of live tuners with fresh heartbeats are
    left alone. Returns {trial number: reason} of the trials this call failed."""
    import copy

    from optuna.trial import TrialState

    storage = study._storage
    running = {t._trial_id: t for t in study.get_trials(deepcopy=False,
                                                          states=(TrialState.RUNNING,))}
    out: dict[int, str] = {}
    for trial_id, t in running.items():
        why = _gone_at_once(t, me, heartbeat.grace_s)
        if why is not None and _fail_running(storage, trial_id, FailureReason.TUNER_DIED, why):
            out[t.number] = FailureReason.TUNER_DIED
            logger.warning("trial %d: %s; marked failed", t.number, why)
    stale: list[int] = []
    beating = _beating(storage)  # the heartbeat contract is not on BaseStorage
    if beating is not None:
        stale = beating._get_stale_trial_ids(study._study_id)
    for trial_id in stale:
        if trial_id not in running:  # started after the list above: its tuner is alive
            continue
        t = running[trial_id]
        owner = Owner.of(t)
        if t.number in out or (owner is not None and owner.token == me.token):
            continue
        why = (f"no heartbeat from the tuner running this trial ({owner or 'unknown'}) for "
               f"over {heartbeat.grace_s} s: it died or hangs")
        if _fail_running(storage, trial_id, FailureReason.STALE, why):
            out[t.number] = FailureReason.STALE
            logger.warning("trial %d: %s; marked failed", t.number, why)
            callback = None if beating is None else beating.get_heartbeat_stale_trial_callback()
            if callback is not None:
                callback(study, copy.deepcopy(storage.get_trial(trial_id)))
    return out

"""Several tuners on one study: Optuna heartbeats and stale trials, on each storage a team
uses: a SQLite file, and a real PostgreSQL server (``tests/_postgres.py``, one cluster for
the session; marked slow).

Real parts: the Optuna storage, the real ``tune()`` loop, tuners in their own processes
(``tests/_sim_tuner.py``: a simulated executor, no server) that are really SIGKILLed or
SIGSTOPped. Short heartbeats (1 s) and grace periods keep it to seconds.
"""

from __future__ import annotations

import json
import os
import signal
import sqlite3
import subprocess
import sys
import time
from collections.abc import Callable, Iterator
from contextlib import closing
from datetime import datetime
from pathlib import Path
from typing import Any

import optuna
import pandas as pd
import pytest
from optuna.trial import TrialState

from autotune.config import TuneSettings
from autotune.store import (
    A,
    FailureReason,
    Heartbeat,
    Heartbeats,
    Owner,
    fail_stale_trials,
    n_finished,
    open_storage,
)
from autotune.study import tune
from autotune.testing import SimulatedExecutor
from tests._sim_tuner import value
from tests.conftest import REPO, at_once

STORES = ["sqlite", pytest.param("postgres", marks=pytest.mark.slow)]


@pytest.fixture(params=STORES)
def store_kind(request: pytest.FixtureRequest) -> str:
    return str(request.param)


def _pg(request: pytest.FixtureRequest, monkeypatch: pytest.MonkeyPatch) -> Any:
    """The session's PostgreSQL, its password in PGPASSWORD (tuner processes inherit it)."""
    pg = request.getfixturevalue("postgres")
    monkeypatch.setenv("PGPASSWORD", pg.password)
    return pg


@pytest.fixture
def storage(store_kind: str, request: pytest.FixtureRequest, tmp_path: Path,
            monkeypatch: pytest.MonkeyPatch) -> str:
    """The study's storage URL: a SQLite file, or a fresh database of the session's
    PostgreSQL (no password in the URL)."""
    if store_kind == "sqlite":
        return f"sqlite:///{tmp_path}/optuna.db"
    return str(_pg(request, monkeypatch).create_db(f"t_{tmp_path.name.lower()[-40:]}"))


def _settings(model: Path, tmp_path: Path, out: str, storage: str = "",
              **kw: Any) -> dict[str, Any]:
    base: dict[str, Any] = {
        "model": str(model), "shape": str(REPO / "traffic" / "example-chat.json"),
        "space": str(REPO / "search_spaces" / "cpu.yaml"), "trials": 1, "seed": 1,
        "recheck": 0, "storage": storage or f"sqlite:///{tmp_path}/optuna.db",
        "study_name": "shared",
        "out": str(tmp_path / out), "quality_probe": False, "use_ray": False}
    base.update(kw)
    return base


class _Tuner:
    """A tuner in its own process whose trials wait for ``self.hold`` to exist."""

    def __init__(self, tmp_path: Path, settings: dict[str, Any], hb: Heartbeat, *,
                 name: str = "a", hold: bool = True, sleep_s: float = 0.0) -> None:
        self.hold = tmp_path / "release"
        self.log = tmp_path / f"tuner-{name}.log"
        self.ran = tmp_path / f"ran-{name}.txt"  # the trial numbers it evaluated
        args = {"settings": settings, "heartbeat": {"interval_s": hb.interval_s,
                                                    "grace_s": hb.grace_s},
                "hold": str(self.hold) if hold else None, "sleep_s": sleep_s,
                "ran": str(self.ran)}
        env = {**os.environ, "PYTHONPATH": str(REPO)}
        with self.log.open("wb") as log:
            self.proc = subprocess.Popen([sys.executable, "-m", "tests._sim_tuner",
                                          json.dumps(args)], cwd=REPO, env=env,
                                         stdout=log, stderr=subprocess.STDOUT)

    def output(self) -> str:
        return self.log.read_text(errors="replace")[-3000:]

    def kill(self) -> None:
        if self.proc.poll() is None:
            os.kill(self.proc.pid, signal.SIGCONT)
            self.proc.kill()
        self.proc.wait(30)


@pytest.fixture
def tuners() -> Iterator[list[_Tuner]]:
    started: list[_Tuner] = []
    yield started
    for t in started:
        t.kill()


def _trials(storage: str) -> list[optuna.trial.FrozenTrial]:
    return optuna.load_study(study_name="shared", storage=storage).get_trials()


def _study_created(storage: str) -> bool:
    """Whether the tuner has created its study, asked of the database directly (SQLite
    read-only). Not through Optuna: its storage creates the schema when the database has
    none, and a second process doing so while the tuner does fails one of the two on
    alembic's version row (seen in CI: UNIQUE constraint failed:
    alembic_version.version_num)."""
    if storage.startswith("postgresql"):
        import psycopg

        try:
            with psycopg.connect(storage) as db:
                return bool(db.execute(
                    "SELECT 1 FROM studies WHERE study_name = 'shared'").fetchall())
        except psycopg.Error:  # no table yet
            return False
    path = storage.removeprefix("sqlite:///")
    try:
        with closing(sqlite3.connect(f"file:{path}?mode=ro", uri=True, timeout=5)) as db:
            rows = db.execute("SELECT 1 FROM studies WHERE study_name = 'shared'").fetchall()
    except sqlite3.Error:  # no file yet, no table yet, or locked
        return False
    return bool(rows)


def _wait_running(storage: str, tuner: _Tuner, timeout_s: float = 180.0
                  ) -> optuna.trial.FrozenTrial:
    """The first tuner's trial 0, once it runs: its owner, its params and its launch flags
    recorded (it was asked, sampled and submitted). Not earlier: a tuner killed between
    the ask and the sample leaves a trial without params, and one stopped mid-write holds
    SQLite's lock (both seen on a loaded CI machine)."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        assert tuner.proc.poll() is None, tuner.output()
        running = [t for t in _trials(storage) if t.state == TrialState.RUNNING
                   and A.OWNER in t.user_attrs and A.FLAGS in t.user_attrs
                   ] if _study_created(storage) else []
        if running:
            time.sleep(0.5)  # past the launch's last writes (its phase events)
            return running[0]
        time.sleep(0.2)
    raise AssertionError(f"no running trial after {timeout_s} s:\n{tuner.output()}")


def _start_first(tmp_path: Path, model: Path, tuners: list[_Tuner], hb: Heartbeat,
                 storage: str) -> tuple[_Tuner, str, optuna.trial.FrozenTrial]:
    """Tuner A (its own process), the storage URL, and A's trial once it runs."""
    a = _Tuner(tmp_path, _settings(model, tmp_path, "out-a", storage), hb)
    tuners.append(a)
    first = _wait_running(storage, a)
    assert first.user_attrs[A.OWNER]["pid"] == a.proc.pid
    return a, storage, first


def _sleeping(seconds: float) -> Callable[[dict[str, Any], Any], dict[str, float]]:
    def evaluate(params: dict[str, Any], spec: Any) -> dict[str, float]:
        time.sleep(seconds)
        return value(params)
    return evaluate


def _resume(model: Path, tmp_path: Path, hb: Heartbeat, storage: str, *, trials: int,
            sleep_s: float) -> float:
    """A second tuner (this process) joins the study with --resume; returns its seconds."""
    sim = SimulatedExecutor(_sleeping(sleep_s))
    settings = TuneSettings(**_settings(model, tmp_path, "out-b", storage, trials=trials,
                                        resume=True))
    t0 = time.monotonic()
    tune(settings, executor=sim, tracker=False, callbacks=[sim], heartbeat=hb)
    return time.monotonic() - t0


def test_a_second_tuner_leaves_the_first_tuners_live_trial_alone(
        fake_model: Path, tmp_path: Path, tuners: list[_Tuner], storage: str) -> None:
    # SQLite stores heartbeat times to the second: a grace of 3 intervals, not 2
    hb = Heartbeat(interval_s=1, grace_s=3)
    a, storage, first = _start_first(tmp_path, fake_model, tuners, hb, storage)

    # Tuner B resumes the study and runs 4 trials of 1.2 s (it looks for stale trials
    # before each): past the grace period, which A's heartbeats keep at bay.
    took = _resume(fake_model, tmp_path, hb, storage, trials=4, sleep_s=1.2)
    assert took > hb.grace_s + 1
    trials = _trials(storage)
    assert trials[first.number].state == TrialState.RUNNING, trials[first.number].user_attrs
    assert not [t.number for t in trials if t.state == TrialState.FAIL]
    assert sum(1 for t in trials if t.state == TrialState.COMPLETE) == 4

    a.hold.touch()  # A's trial finishes and is told normally
    assert a.proc.wait(120) == 0, a.output()
    t0 = _trials(storage)[first.number]
    assert t0.state == TrialState.COMPLETE and t0.user_attrs[A.STATE] == "ok"
    assert t0.value == value(t0.params)["output_tokens_per_s"]


def test_a_killed_tuners_trial_is_failed_at_once_on_resume(
        fake_model: Path, tmp_path: Path, tuners: list[_Tuner], storage: str) -> None:
    a, storage, first = _start_first(tmp_path, fake_model, tuners, Heartbeat(1, 3), storage)
    os.kill(a.proc.pid, signal.SIGKILL)
    assert a.proc.wait(30) == -signal.SIGKILL

    # A grace period of 10 minutes: only the owner check can fail the trial this soon.
    took = _resume(fake_model, tmp_path, Heartbeat(interval_s=1, grace_s=600), storage,
                   trials=1, sleep_s=0.0)
    assert took < 60
    trials = _trials(storage)
    dead = trials[first.number]
    assert dead.state == TrialState.FAIL
    assert dead.user_attrs[A.REASON] == FailureReason.TUNER_DIED
    assert f"pid {a.proc.pid}) is gone" in dead.user_attrs[A.MESSAGE]
    retry = [t for t in trials if t.user_attrs.get(A.RETRY_OF) == first.number]
    assert len(retry) == 1 and retry[0].state == TrialState.COMPLETE
    assert retry[0].params == dead.params
    assert n_finished(optuna.load_study(study_name="shared", storage=storage)) == 1
    csv = pd.read_csv(tmp_path / "out-b" / "trials.csv")
    row = csv[csv["number"] == first.number].iloc[0]
    assert row["reason"] == "tuner_died" and "is gone" in row["message"]


def test_a_hung_tuners_trial_is_failed_as_stale_after_the_grace_period(
        fake_model: Path, tmp_path: Path, tuners: list[_Tuner], storage: str) -> None:
    hb = Heartbeat(interval_s=1, grace_s=3)
    a, storage, first = _start_first(tmp_path, fake_model, tuners, hb, storage)
    os.kill(a.proc.pid, signal.SIGSTOP)  # alive, but its heartbeats stop
    stopped_at = datetime.now()
    try:
        study = optuna.load_study(study_name="shared", storage=open_storage(storage,
                                                                           heartbeat=hb))
        assert fail_stale_trials(study, me=Owner.this_process(), heartbeat=hb) == {}

        # B looks before each of its trials: the last look comes >= 5.8 s after the SIGSTOP,
        # past the grace (3 s) + one interval + SQLite's one-second heartbeat times
        _resume(fake_model, tmp_path, hb, storage, trials=5, sleep_s=1.2)
        trials = _trials(storage)
        hung = trials[first.number]
        assert hung.state == TrialState.FAIL
        assert hung.user_attrs[A.REASON] == FailureReason.STALE
        assert f"pid {a.proc.pid}) for over 3 s" in hung.user_attrs[A.MESSAGE]
        assert hung.datetime_complete is not None
        # not before the grace period (less the interval and the heartbeat times' rounding)
        assert (hung.datetime_complete - stopped_at).total_seconds() >= hb.grace_s - 2
        retry = [t for t in trials if t.user_attrs.get(A.RETRY_OF) == first.number]
        assert len(retry) == 1 and retry[0].state == TrialState.COMPLETE
        row = pd.read_csv(tmp_path / "out-b" / "trials.csv").set_index("number").loc[
            first.number]
        assert row["reason"] == "stale"
    finally:
        os.kill(a.proc.pid, signal.SIGCONT)

    # The hung tuner wakes up: its result is dropped, the stale verdict stands.
    a.hold.touch()
    assert a.proc.wait(120) == 0, a.output()
    assert "failed by another tuner" in a.output()
    t0 = _trials(storage)[first.number]
    assert t0.state == TrialState.FAIL and t0.user_attrs[A.REASON] == FailureReason.STALE


def test_fail_stale_trials_by_owner_and_heartbeat(tmp_path: Path, storage: str) -> None:
    """Who fails at once, who after the grace period, who never (storage level)."""
    hb = Heartbeat(interval_s=1, grace_s=3)
    storage = open_storage(storage, heartbeat=hb)
    study = optuna.create_study(storage=storage, study_name="s")
    me = Owner.this_process()
    done = subprocess.Popen([sys.executable, "-c", "pass"])
    done.wait()
    owners = {
        "other_host": Owner("node-b.example", 4242, 1, "b"),  # liveness unknown here
        "dead": Owner(me.host, done.pid, None, "d"),  # this host, process gone
        "hung": Owner(me.host, me.pid, me.started, "h"),  # alive, no more heartbeats
        "beating": Owner(me.host, me.pid, me.started, "x"),  # alive, heartbeats go on
        "me": me,  # this tuner's own trial: never failed by itself
        "none": None,  # an older autotune's trial (no owner recorded)
    }
    ids: dict[str, int] = {}
    beats = Heartbeats(study._storage)
    for name, owner in owners.items():
        with pytest.warns(UserWarning, match="Heartbeat of storage"):
            trial = study.ask()
        if owner is not None:
            trial.set_user_attr(A.OWNER, owner.record())
        ids[name] = trial.number
        if name != "none":
            study._storage.record_heartbeat(trial._trial_id)
        if name == "beating":
            beats.add(trial._trial_id)
    beats.start()
    try:
        assert fail_stale_trials(study, me=me, heartbeat=hb) == {
            ids["dead"]: FailureReason.TUNER_DIED}
        time.sleep(hb.grace_s + 2.0)  # SQLite stores heartbeat times to the second
        assert fail_stale_trials(study, me=me, heartbeat=hb) == {
            ids["other_host"]: FailureReason.STALE, ids["hung"]: FailureReason.STALE,
            ids["none"]: FailureReason.TUNER_DIED}
    finally:
        beats.stop()
    by_number = {t.number: t for t in study.get_trials()}
    assert {n for n, t in by_number.items() if t.state == TrialState.RUNNING} == {
        ids["beating"], ids["me"]}
    for name in ("dead", "other_host", "hung", "none"):
        t = by_number[ids[name]]
        assert t.user_attrs[A.STATE] == "failed" and t.user_attrs[A.MESSAGE], name
    assert "node-b.example pid 4242" in by_number[ids["other_host"]].user_attrs[A.MESSAGE]
    assert n_finished(study) == 0  # stopped trials say nothing about their configs
    # again: nothing left to do; another tuner fails the trial whose heartbeats stopped
    assert fail_stale_trials(study, me=me, heartbeat=hb) == {}
    assert fail_stale_trials(study, me=Owner.this_process(), heartbeat=hb) == {
        ids["me"]: FailureReason.STALE}


def _open(url: str) -> str:
    open_storage(url)
    return "ok"


def test_tuners_opening_a_fresh_storage_at_once_all_open_it(
        tmp_path: Path, request: pytest.FixtureRequest, store_kind: str,
        monkeypatch: pytest.MonkeyPatch) -> None:
    # Every process that opens a fresh storage creates its schema; before the retry, 4 at
    # once failed 12 rounds of 20 on SQLite ("table studies already exists", alembic's
    # version row), so 8 rounds all passing cannot be luck (PostgreSQL:
    # experiments/store-races/).
    pg = _pg(request, monkeypatch) if store_kind == "postgres" else None
    for round_ in range(8):
        url = (pg.create_db(f"race_{round_}") if pg
               else f"sqlite:///{tmp_path}/r{round_}/optuna.db")
        got = at_once(_open, url, 4)
        assert got == ["ok"] * 4, got
    optuna.create_study(study_name="after", storage=url)  # and the schema is whole


def test_two_tuners_at_once_share_the_trials_and_run_none_twice(
        fake_model: Path, tmp_path: Path, tuners: list[_Tuner], storage: str) -> None:
    """Two tuners on one study at once (the first creates it, the second joins it with
    --resume): every trial is run by one of them, once, and the study gets its trials."""
    hb = Heartbeat(interval_s=1, grace_s=5)
    both = [_Tuner(tmp_path, _settings(fake_model, tmp_path, "out-a", storage, trials=6), hb,
                   name="a", sleep_s=0.3)]
    tuners.extend(both)
    deadline = time.monotonic() + 180
    while not _study_created(storage) and time.monotonic() < deadline:
        assert both[0].proc.poll() is None, both[0].output()
        time.sleep(0.3)
    both.append(_Tuner(tmp_path, _settings(fake_model, tmp_path, "out-b", storage, trials=6,
                                           resume=True), hb, name="b", sleep_s=0.3))
    tuners.append(both[1])
    while time.monotonic() < deadline:  # both hold a trial: then all trials go on
        assert all(t.proc.poll() is None for t in both), [t.output() for t in both]
        running = [t for t in _trials(storage) if t.state == TrialState.RUNNING
                   and A.FLAGS in t.user_attrs] if _study_created(storage) else []
        if len({t.user_attrs[A.OWNER]["pid"] for t in running}) == 2:
            break
        time.sleep(0.3)
    both[0].hold.touch()
    for t in both:
        assert t.proc.wait(180) == 0, t.output()
    trials = _trials(storage)
    done = [t for t in trials if t.state == TrialState.COMPLETE]
    assert 6 <= len(done) <= 7, [(t.number, t.state) for t in trials]  # each stops at 6
    # a sample the space's rules forbid is stored rejected (PRUNED, never run): which ones
    # TPE draws depends on how the two tuners' trials interleave, so it may happen here
    assert not [(t.number, t.state, t.user_attrs.get(A.STATE), t.user_attrs.get(A.REASON))
                for t in trials if t.state != TrialState.COMPLETE
                and t.user_attrs.get(A.REASON) != "rejected"], [t.output() for t in both]
    ran = [int(n) for t in both for n in t.ran.read_text().split()]
    assert sorted(ran) == sorted(t.number for t in done)  # none twice, none lost
    owners = {t.user_attrs[A.OWNER]["pid"] for t in done}
    assert owners == {t.proc.pid for t in both}, owners  # both tuners ran trials

"""A team's setup, for real: a study on PostgreSQL logged to an MLflow tracking server
(PostgreSQL backend store, an artifact destination, MLflow's basic-auth app), read back by
``autotune best``, browsed in ``optuna-dashboard``; each server stopped mid-study.

One PostgreSQL cluster for the session (``tests/_postgres.py``) and one MLflow server for
the module (``tests/_mlflow_server.py``, restarted by the tests that stop it). Studies run
the real ``tune()`` loop with a simulated executor (no vLLM: the stores are the subject).
"""

from __future__ import annotations

import json
import logging
import os
import subprocess
import sys
import threading
import time
import urllib.error
import urllib.request
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import optuna
import pytest
from optuna.trial import TrialState

from autotune.config import TuneSettings
from autotune.errors import StudyError, TrackingError
from autotune.store import A, FailureReason
from autotune.study import tune
from autotune.testing import SimulatedExecutor
from autotune.results import EXPERIMENT_KIND, MlflowTracker
from tests._mlflow_server import MlflowServer, wait_http
from tests._sim_tuner import value
from tests.conftest import REPO

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module", autouse=True)
def _patient_reads() -> Iterator[None]:
    """MLflow clients here wait up to 2 minutes for an answer (autotune's default, 10 s,
    is for a server that went away; a loaded test machine can be that slow to answer)."""
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("MLFLOW_HTTP_REQUEST_TIMEOUT", "120")
        yield


@pytest.fixture(scope="module")
def mlflow_server(postgres: Any, tmp_path_factory: pytest.TempPathFactory
                  ) -> Iterator[MlflowServer]:
    pytest.importorskip("flask_wtf", reason="MLflow's basic-auth app needs mlflow[auth] "
                        "(pip install -e '.[team]')")
    server = MlflowServer(tmp_path_factory.mktemp("mlflow"),
                          backend_uri=postgres.create_db("mlflow"),
                          auth_db_uri=postgres.create_db("mlflow_auth"),
                          pg_password=postgres.password)
    server.start()
    try:
        yield server
    finally:
        server.stop()


@pytest.fixture
def team_env(postgres: Any, mlflow_server: MlflowServer, monkeypatch: pytest.MonkeyPatch
             ) -> dict[str, str]:
    """The credentials a team member's shell holds: the MLflow user in the environment;
    the database password in PGPASSWORD."""
    env = {**mlflow_server.client_env(), "PGPASSWORD": postgres.password,
           "MLFLOW_HTTP_REQUEST_TIMEOUT": "120"}  # as _patient_reads, for the CLI's
    for k, v in env.items():
        monkeypatch.setenv(k, v)
    return env


def _settings(model: Path, out: Path, storage: str, tracking: str, **kw: Any) -> TuneSettings:
    return TuneSettings(**{
        "model": str(model), "shape": str(REPO / "traffic" / "example-chat.json"),
        "space": str(REPO / "search_spaces" / "cpu.yaml"), "trials": 3, "seed": 1,
        "recheck": 0, "storage": storage, "tracking_uri": tracking, "study_name": out.name,
        "out": str(out), "quality_probe": False, "use_ray": False, **kw})


def _tune(settings: TuneSettings, *, on_trial: Any = None, sleep_s: float = 0.0) -> Any:
    def evaluate(params: dict[str, Any], spec: Any) -> dict[str, float]:
        time.sleep(sleep_s)
        return value(params)

    def on_event(e: Any) -> None:
        if e.kind == "trial_finished" and on_trial is not None:
            on_trial(e.trial_number)

    sim = SimulatedExecutor(evaluate)
    return tune(settings, executor=sim, callbacks=[sim], on_event=on_event)


def _runs(server: MlflowServer, study: str) -> tuple[Any, list[Any]]:
    """The study run and its trial runs (as the admin)."""
    from mlflow.tracking import MlflowClient

    client = MlflowClient(server.url)
    exp = client.get_experiment_by_name("autotune")
    runs = client.search_runs([exp.experiment_id],
                              filter_string=f"tags.`autotune.study` = '{study}'")
    parent = [r for r in runs if r.data.tags.get("autotune.kind") == "study"]
    assert len(parent) == 1, [r.data.tags for r in runs]
    return parent[0], [r for r in runs if r.data.tags.get("autotune.kind") == "trial"]


def _cli(*args: str, env: dict[str, str]) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-m", "autotune", *args], capture_output=True,
                          text=True, timeout=300, cwd=REPO,
                          env={**os.environ, **env, "PYTHONPATH": str(REPO)})


@dataclass
class TeamStudy:
    result: Any
    out: Path
    storage: str  # the URL as the user gave it: with the database password
    logs: str


@pytest.fixture(scope="module")
def team_study(postgres: Any, mlflow_server: MlflowServer, fake_model: Path,
               tmp_path_factory: pytest.TempPathFactory) -> Iterator[TeamStudy]:
    """One study of 3 trials on PostgreSQL (the password in the URL: the hardest case for
    "written nowhere"), logged to the MLflow server with credentials from the environment,
    every log record kept."""
    out = tmp_path_factory.mktemp("team") / "team-study"
    storage = postgres.url(postgres.create_db("team").rsplit("/", 1)[1], with_password=True)
    records: list[str] = []
    handler = logging.Handler(logging.DEBUG)
    handler.emit = lambda r: records.append(f"{r.getMessage()} {r.exc_text or ''}")
    root = logging.getLogger()
    root.addHandler(handler)
    old = {k: os.environ.get(k) for k in ("MLFLOW_TRACKING_USERNAME",
                                          "MLFLOW_TRACKING_PASSWORD")}
    os.environ.update(mlflow_server.client_env())
    try:
        result = _tune(_settings(fake_model, out, storage, mlflow_server.url))
    finally:
        root.removeHandler(handler)
        for k, v in old.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v
    yield TeamStudy(result=result, out=out, storage=storage, logs="\n".join(records))


def test_a_study_on_postgresql_logs_to_the_mlflow_server_over_http(
        team_study: TeamStudy, mlflow_server: MlflowServer, team_env: dict[str, str]) -> None:
    res = team_study.result
    assert res.best is not None and res.n_trials == 3 and not res.mlflow_unlogged
    parent, trials = _runs(mlflow_server, "team-study")
    assert parent.info.status == "FINISHED"
    assert sorted(int(r.data.tags["autotune.trial_number"]) for r in trials) == [0, 1, 2]
    assert {r.info.status for r in trials} == {"FINISHED"}
    best = [r for r in trials if r.data.tags.get("autotune.best") == "true"]
    assert [r.data.tags["autotune.trial_number"] for r in best] == [str(res.best.trial)]
    # artifacts went to the server's artifact destination, not to this machine's disk
    from mlflow.tracking import MlflowClient

    names = {a.path for a in MlflowClient(mlflow_server.url).list_artifacts(parent.info.run_id)}
    assert {"best.json", "trials.csv"} <= names
    assert list(mlflow_server.artifacts.rglob("best.json"))
    # the experiment opens on its runs in MLflow 3's UI, not on GenAI traces
    exp = MlflowClient(mlflow_server.url).get_experiment_by_name("autotune")
    assert exp.tags.get(EXPERIMENT_KIND[0]) == EXPERIMENT_KIND[1]


def test_autotune_best_answers_from_the_tracking_server(
        team_study: TeamStudy, mlflow_server: MlflowServer, team_env: dict[str, str]) -> None:
    out = _cli("best", "--shape", str(REPO / "traffic" / "example-chat.json"),
               "--tracking-uri", mlflow_server.url, "--json", env=team_env)
    assert out.returncode == 0, out.stderr
    hit = json.loads(out.stdout)
    assert hit["study"] == "team-study" and hit["params"] == team_study.result.best.params


def test_an_unauthenticated_client_is_refused(
        team_study: TeamStudy, mlflow_server: MlflowServer) -> None:
    url = f"{mlflow_server.url}/api/2.0/mlflow/experiments/get-by-name?experiment_name=autotune"
    with pytest.raises(urllib.error.HTTPError) as err:
        urllib.request.urlopen(url, timeout=10)
    assert err.value.code == 401
    env = {k: v for k, v in os.environ.items() if not k.startswith("MLFLOW_TRACKING_")}
    code = ("from autotune.results import MlflowTracker\n"
            f"MlflowTracker({mlflow_server.url!r})\n")
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                          env=env, timeout=120, cwd=REPO)
    assert proc.returncode != 0
    assert "set MLFLOW_TRACKING_USERNAME and MLFLOW_TRACKING_PASSWORD" in proc.stderr
    with pytest.raises(TrackingError):  # and a wrong password is refused too
        os.environ["MLFLOW_TRACKING_USERNAME"] = "admin"
        os.environ["MLFLOW_TRACKING_PASSWORD"] = "wrong"
        try:
            MlflowTracker(mlflow_server.url)
        finally:
            os.environ.pop("MLFLOW_TRACKING_USERNAME")
            os.environ.pop("MLFLOW_TRACKING_PASSWORD")


def test_no_password_in_any_file_a_study_writes(
        team_study: TeamStudy, postgres: Any, mlflow_server: MlflowServer,
        team_env: dict[str, str]) -> None:
    secrets = {"database": postgres.password, "mlflow": mlflow_server.password}
    assert postgres.password in team_study.storage  # the study was given it
    files = [p for p in team_study.out.rglob("*") if p.is_file()]
    files += [p for p in mlflow_server.artifacts.rglob("*") if p.is_file()]
    assert {"config.yaml", "study.json", "best.json", "trials.csv"} <= {p.name for p in files}
    found = [f"{p} holds the {what} password" for p in files for what, pw in secrets.items()
             if pw.encode() in p.read_bytes()]
    assert not found, found
    # nor the log lines, the study's attributes in the storage, or MLflow's params and tags
    assert postgres.password not in team_study.logs
    assert "***@127.0.0.1" in (team_study.out / "config.yaml").read_text()
    study = optuna.load_study(study_name="team-study", storage=team_study.storage)
    attrs = json.dumps([study.user_attrs, [t.user_attrs for t in study.trials]], default=str)
    assert postgres.password not in attrs
    parent, trials = _runs(mlflow_server, "team-study")
    for run in [parent, *trials]:
        text = json.dumps([run.data.params, run.data.tags])
        for what, pw in secrets.items():
            assert pw not in text, f"{what} password in MLflow run {run.info.run_name}"
    assert parent.data.params["storage"].startswith("postgresql://autotune:***@")


def test_the_dashboard_shows_the_study_and_its_trials(
        team_study: TeamStudy, postgres: Any, team_env: dict[str, str], tmp_path: Path) -> None:
    from tests._browser import CHROMIUM, require_browser

    require_browser()
    pytest.importorskip("optuna_dashboard", reason="pip install -e '.[team]'")
    from autotune.engine import free_port

    port = free_port()
    storage = postgres.url("team")  # no password: PGPASSWORD (team_env)
    log = (tmp_path / "dashboard.log").open("wb")
    proc = subprocess.Popen([str(Path(sys.executable).parent / "optuna-dashboard"), storage,
                             "--host", "127.0.0.1", "--port", str(port)],
                            stdout=log, stderr=log, start_new_session=True)
    try:
        wait_http(f"http://127.0.0.1:{port}/api/studies", proc, tmp_path / "dashboard.log", 120)
        study = optuna.load_study(study_name="team-study", storage=team_study.storage)
        from playwright.sync_api import sync_playwright

        from tests._browser import ARGS

        with sync_playwright() as p:
            browser = p.chromium.launch(executable_path=CHROMIUM, args=ARGS)
            try:
                page = browser.new_page(viewport={"width": 1400, "height": 1000})
                page.goto(f"http://127.0.0.1:{port}/dashboard")
                page.get_by_text("team-study").first.wait_for(timeout=30000)
                page.goto(f"http://127.0.0.1:{port}/dashboard/studies/"
                          f"{study._study_id}/trials")
                page.get_by_text("Trial 2").first.wait_for(timeout=30000)
                page.get_by_text("Trial 0").first.click()
                text = page.inner_text("body")
            finally:
                browser.close()
    finally:
        proc.terminate()
        proc.wait(20)
        log.close()
    # autotune's trial attributes are readable there
    for key in (A.STATE, A.METRICS, A.FLAGS):
        assert key in text, text[:3000]


# -- each server stopped mid-study (docs/faults.md) -----------------------------------------


def test_mlflow_server_restarted_mid_study_then_every_run_is_logged(
        postgres: Any, mlflow_server: MlflowServer, team_env: dict[str, str],
        fake_model: Path, tmp_path: Path) -> None:
    """The tracking server stops after trial 0 is logged and is back after trial 1: the
    study finishes, and the trials it could not log are logged once it answers."""
    def on_trial(number: int) -> None:
        if number == 0:
            mlflow_server.stop()
        elif number == 1:
            mlflow_server.start()

    out = tmp_path / "restart-study"
    res = _tune(_settings(fake_model, out, postgres.create_db("restart"), mlflow_server.url,
                          trials=3), on_trial=on_trial)
    assert res.n_trials == 3 and res.best is not None
    assert res.mlflow_late and not res.mlflow_unlogged, (res.mlflow_late, res.mlflow_unlogged)
    parent, trials = _runs(mlflow_server, "restart-study")
    assert parent.info.status == "FINISHED"
    assert sorted(int(r.data.tags["autotune.trial_number"]) for r in trials) == [0, 1, 2]
    assert parent.data.tags.get("autotune.best_run_id") in {r.info.run_id for r in trials}


def test_mlflow_server_down_to_the_end_then_autotune_sync_logs_it(
        postgres: Any, mlflow_server: MlflowServer, team_env: dict[str, str],
        fake_model: Path, tmp_path: Path) -> None:
    """Down from trial 1 to after the study: the study finishes, its summary names what is
    not logged; ``autotune sync OUT`` logs it once the server is back, and again nothing."""
    out = tmp_path / "sync-study"
    storage = postgres.create_db("sync")

    def on_trial(number: int) -> None:
        if number == 0:
            mlflow_server.stop()

    try:
        res = _tune(_settings(fake_model, out, storage, mlflow_server.url, trials=3),
                    on_trial=on_trial)
    finally:
        mlflow_server.start()
    assert res.mlflow_unlogged == ["trial 1", "trial 2", "the study run's results"]
    from autotune.cli._tune import _mlflow_lines

    assert f"autotune sync {out}" in "\n".join(_mlflow_lines(res))
    parent, trials = _runs(mlflow_server, "sync-study")
    assert parent.info.status == "RUNNING" and len(trials) == 1

    synced = _cli("sync", str(out), env=team_env)
    assert synced.returncode == 0, synced.stderr
    assert "trial runs logged now: 1, 2" in synced.stdout
    parent, trials = _runs(mlflow_server, "sync-study")
    assert parent.info.status == "FINISHED"
    assert sorted(int(r.data.tags["autotune.trial_number"]) for r in trials) == [0, 1, 2]
    assert parent.data.tags.get("autotune.best_run_id") in {r.info.run_id for r in trials}
    again = _cli("sync", str(out), env=team_env)
    assert again.returncode == 0 and "logged now: none" in again.stdout, again.stdout


def test_postgresql_restarted_mid_trial_the_study_goes_on(
        postgres: Any, mlflow_server: MlflowServer, team_env: dict[str, str],
        fake_model: Path, tmp_path: Path) -> None:
    """A restart of the database server while a trial runs (the tuner's pooled
    connections all die): the study goes on, every trial in the storage."""
    storage = postgres.create_db("pgrestart")
    restarted = threading.Event()

    def on_trial(number: int) -> None:
        if number == 0:
            postgres.restart()
            restarted.set()

    res = _tune(_settings(fake_model, tmp_path / "pg-restart", storage, mlflow_server.url,
                          trials=3), on_trial=on_trial, sleep_s=0.5)
    assert restarted.is_set() and res.n_trials == 3
    trials = optuna.load_study(study_name="pg-restart", storage=storage).trials
    assert [t.state for t in trials] == [TrialState.COMPLETE] * 3


def test_postgresql_down_mid_study_stops_clean_and_resume_finishes(
        postgres: Any, mlflow_server: MlflowServer, team_env: dict[str, str],
        fake_model: Path, tmp_path: Path) -> None:
    """The database server stops while trial 1 runs: the study stops with one clear line
    (no password in it); once it is back, --resume finishes with trial 0 kept."""
    storage = postgres.create_db("pgdown")
    given = postgres.url("pgdown", with_password=True)
    out = tmp_path / "pg-down"

    def evaluate_stop(number: int) -> None:
        if number == 0:
            postgres.stop()

    try:
        with pytest.raises(StudyError) as err:
            _tune(_settings(fake_model, out, given, mlflow_server.url, trials=3),
                  on_trial=evaluate_stop)
    finally:
        postgres.start()
    msg = str(err.value)
    assert "failed mid-study" in msg and "--resume" in msg, msg
    assert postgres.password not in msg
    before = optuna.load_study(study_name="pg-down", storage=storage).trials
    assert before[0].state == TrialState.COMPLETE
    res = _tune(_settings(fake_model, out, storage, mlflow_server.url, trials=3,
                          resume=True))
    trials = optuna.load_study(study_name="pg-down", storage=storage).trials
    assert res.n_ok == 3 and trials[0].value == before[0].value
    stopped = [t for t in trials if t.state == TrialState.FAIL]
    assert all(t.user_attrs.get(A.REASON) in (FailureReason.TUNER_DIED, FailureReason.STALE)
               for t in stopped), [t.user_attrs for t in stopped]

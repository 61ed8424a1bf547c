from __future__ import annotations

import pytest

from autotune.config import parse_slo
from autotune.errors import ConfigError


def test_parse_slo() -> None:
    assert parse_slo("ttft_p99=2.0, tpot_p99=0.05") == {"ttft_p99": 2.0, "tpot_p99": 0.05}
    assert parse_slo(None) == {} and parse_slo("") == {}


@pytest.mark.parametrize("text, fragment", [
    ("ttft=2", "unknown"), ("ttft_p99", "KEY=SECONDS"), ("ttft_p99=abc", "number"),
    ("ttft_p99=-1", "positive"), ("ttft_p99=nan", "positive"), ("ttft_p99=inf", "positive"),
])
def test_parse_slo_errors(text: str, fragment: str) -> None:
    with pytest.raises(ConfigError, match=fragment):
        parse_slo(text)


def _settings(**kw: object) -> object:
    from autotune.config import TuneSettings

    return TuneSettings(model="m", shape="s.json", space="x.yaml", **kw)  # type: ignore[arg-type]


def test_the_stores_follow_out_unless_given(tmp_path, monkeypatch) -> None:
    from autotune.config import DEFAULT_STORAGE

    monkeypatch.chdir(tmp_path)
    s = _settings(out="runs/a")
    out = (tmp_path / "runs" / "a").resolve()
    assert s.storage == f"sqlite:///{out}/autotune.db"
    assert s.tracking_uri == f"sqlite:///{out}/mlflow.db"
    # without --out: the shared stores under experiments/, as before
    s = _settings()
    assert s.storage == DEFAULT_STORAGE and s.tracking_uri is None
    # given, they win over --out; a folder or a .db file is its SQLite URL
    s = _settings(out="runs/a", storage="postgresql://u@h/db", tracking_uri="http://h:5000")
    assert s.storage == "postgresql://u@h/db" and s.tracking_uri == "http://h:5000"
    s = _settings(storage="runs/b", tracking_uri="t.db")
    assert s.storage == f"sqlite:///{(tmp_path / 'runs' / 'b').resolve()}/autotune.db"
    assert s.tracking_uri == f"sqlite:///{(tmp_path / 't.db').resolve()}"
    # the resolved settings build the same settings again (config.yaml, study.json)
    again = _settings(**{k: v for k, v in s.model_dump().items()
                         if k not in ("model", "shape", "space")})
    assert again.storage == s.storage and again.tracking_uri == s.tracking_uri


def test_an_out_folder_whose_study_kept_its_stores_elsewhere_points_there(tmp_path) -> None:
    """A study run with --storage elsewhere (or before the stores followed --out) names its
    stores in OUT/study.json: --out OUT finds them (--resume, readers pointed at OUT)."""
    import json

    from autotune.config import folder_storage, folder_tracking, storage_url

    out = tmp_path / "old"
    out.mkdir()
    (out / "study.json").write_text(json.dumps(
        {"storage": "sqlite:////shared/optuna.db", "tracking_uri": "http://mlflow:5000"}))
    assert folder_storage(out) == "sqlite:////shared/optuna.db" == storage_url(str(out))
    assert folder_tracking(out) == "http://mlflow:5000"
    assert _settings(out=out).storage == "sqlite:////shared/optuna.db"
    # a redacted URL (its password left out) cannot be used: the folder's own file then
    (out / "study.json").write_text(json.dumps({"storage": "postgresql://u:***@h/db"}))
    assert folder_storage(out) == f"sqlite:///{out.resolve()}/autotune.db"
    # the folder's own store wins over what study.json names
    (out / "autotune.db").write_bytes(b"")
    (out / "study.json").write_text(json.dumps({"storage": "sqlite:////shared/optuna.db"}))
    assert folder_storage(out) == f"sqlite:///{out.resolve()}/autotune.db"


def test_store_where_names_a_sqlite_file_by_its_absolute_path(tmp_path, monkeypatch) -> None:
    from autotune.config import DEFAULT_STORAGE, store_where

    monkeypatch.chdir(tmp_path)
    assert store_where(DEFAULT_STORAGE) == \
        f"sqlite:///{tmp_path.resolve()}/experiments/autotune.db"
    assert store_where("postgresql://u:secret@h/db") == "postgresql://u:***@h/db"

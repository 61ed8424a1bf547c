"""Passwords in store URLs are redacted wherever autotune writes or prints them; the servers
autotune starts listen on loopback. (The study end to end: tests/integration/test_team_setup.py.)"""

from __future__ import annotations

import logging

import pytest

from autotune.credentials import has_password, redact, redact_settings, warn_if_password


@pytest.mark.parametrize(("url", "shown"), [
    ("postgresql://autotune:s3cr%40t@db:5432/optuna", "postgresql://autotune:***@db:5432/optuna"),
    ("postgresql+psycopg://u:p@h/d", "postgresql+psycopg://u:***@h/d"),
    ("http://admin:pw@127.0.0.1:5000", "http://admin:***@127.0.0.1:5000"),
    ("postgresql://autotune@db/optuna", "postgresql://autotune@db/optuna"),  # none to hide
    ("postgresql://u:@db/optuna", "postgresql://u:@db/optuna"),  # an empty one
    ("sqlite:////tmp/a:b@c/optuna.db", "sqlite:////tmp/a:b@c/optuna.db"),  # a path, no user
    ("http://127.0.0.1:5000", "http://127.0.0.1:5000"),
])
def test_redact_hides_only_the_password(url: str, shown: str) -> None:
    assert redact(url) == shown
    assert has_password(url) == (url != shown)


def test_redact_inside_a_message_and_a_settings_record() -> None:
    msg = "cannot open 'postgresql://a:pw1@h/d' (tried postgresql://b:pw2@h2/d2 too)"
    assert "pw1" not in redact(msg) and "pw2" not in redact(msg)
    rec = redact_settings({"storage": "postgresql://a:pw@h/d", "trials": 3,
                           "tracking_uri": None})
    assert rec == {"storage": "postgresql://a:***@h/d", "trials": 3, "tracking_uri": None}


def test_a_url_with_a_password_is_warned_about_once(caplog: pytest.LogCaptureFixture) -> None:
    caplog.set_level(logging.WARNING)
    for _ in range(2):
        warn_if_password("--storage", "postgresql://a:topsecret@h/once", env="PGPASSWORD")
    lines = [r.getMessage() for r in caplog.records]
    assert len(lines) == 1 and "PGPASSWORD" in lines[0] and "topsecret" not in lines[0]


def test_the_cli_redacts_its_error_line_and_log_lines(capsys: pytest.CaptureFixture[str]
                                                      ) -> None:
    from autotune.cli import main

    url = "postgresql://autotune:topsecret@127.0.0.1:1/none"
    rc = main(["best", "--shape", "traffic/example-chat.json", "--storage", url])
    err = capsys.readouterr().err
    assert rc == 2 and "autotune: error:" in err, err
    assert "topsecret" not in err and "autotune:***@127.0.0.1" in err


def test_a_vllm_server_listens_on_loopback_by_default() -> None:
    from autotune.engine import VllmServer

    argv = VllmServer(model="m", port=8000).command()
    assert argv[argv.index("--host") + 1] == "127.0.0.1"

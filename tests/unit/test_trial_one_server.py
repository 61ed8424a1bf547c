"""Several trials on one server start (``run_trials_on_one_server``): each shape measured in (the pure part: no server, no subprocess; the rest is tests/integration/test_trial_one_server.py)"""

from __future__ import annotations

import dataclasses
from pathlib import Path

import pytest

from autotune.errors import ConfigError
from autotune.trial import run_trials_on_one_server
from tests._trial_one_server import _fake


def test_trials_that_disagree_on_the_server_are_a_one_line_error(tmp_path: Path) -> None:
    a = _fake(tmp_path, "ok")
    for change in ({"flags": ("--max-model-len", "2048")}, {"env": {}}, {"gpus": (1,)},
                   {"log_path": str(tmp_path / "other.log")}):
        with pytest.raises(ConfigError) as err:
            run_trials_on_one_server([a, dataclasses.replace(a, number=1, **change)])
        msg = str(err.value)
        assert "\n" not in msg and "cannot share one server" in msg and next(iter(change)) in msg
    with pytest.raises(ConfigError, match="no trial given"):
        run_trials_on_one_server([])
    assert not (tmp_path / "launches").exists()  # nothing started

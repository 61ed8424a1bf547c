"""The Prometheus client and the from-prometheus options: pure logic, no Prometheus. (the pure part: no server, no subprocess; the rest is tests/integration/test_traffic_prometheus.py)"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

from autotune.cli._from_prometheus import parse_time, resolve_range
from autotune.errors import ConfigError
from autotune.traffic import (
    LoadSpec,
    PrometheusAuth,
    PrometheusClient,
    PrometheusRange,
    SourceInfo,
    auth_from_env,
    constant_shape,
    diff_shapes,
    normalize_selector,
)


@pytest.mark.parametrize(("text", "inner"), [
    (None, ""), ("", ""), ("{}", ""),
    ('{model_name="m"}', 'model_name="m"'),
    ('{ model_name = "m" , namespace=~"prod-.*" }', 'model_name = "m",namespace=~"prod-.*"'),
    ('job!="x",pod!~"a\\"b"', 'job!="x",pod!~"a\\"b"'),
])
def test_selectors_are_normalized(text: str | None, inner: str) -> None:
    assert normalize_selector(text) == inner


@pytest.mark.parametrize("bad", ['{model_name="m"', 'model_name=m', '{a="b" c="d"}',
                                 '{__name__="vllm:x"}', "up{}", '{a="b",}x'])
def test_bad_selectors_say_how_to_write_one(bad: str) -> None:
    with pytest.raises(ConfigError, match="--selector"):
        normalize_selector(bad)


def test_credentials_come_from_the_environment_or_files(tmp_path: Path) -> None:
    assert auth_from_env({}) is None
    a = auth_from_env({"AUTOTUNE_PROMETHEUS_BEARER_TOKEN": "tok"})
    assert a is not None and a.header() == "Bearer tok" and "tok" not in repr(a)
    f = tmp_path / "token"
    f.write_text("from-file\n")
    a = auth_from_env({"AUTOTUNE_PROMETHEUS_BEARER_TOKEN_FILE": str(f)})
    assert a is not None and a.header() == "Bearer from-file"
    a = auth_from_env({"AUTOTUNE_PROMETHEUS_USERNAME": "u",
                       "AUTOTUNE_PROMETHEUS_PASSWORD_FILE": str(f)})
    assert a == PrometheusAuth(username="u", password="from-file")
    assert a.header() == "Basic dTpmcm9tLWZpbGU="
    pair = tmp_path / "basic"
    pair.write_text("user:p:w\n")
    assert auth_from_env({}, basic_auth_file=pair) == PrometheusAuth(username="user",
                                                                     password="p:w")
    assert auth_from_env({"AUTOTUNE_PROMETHEUS_BEARER_TOKEN": "x"},
                         bearer_token_file=f) == PrometheusAuth(bearer_token="from-file")
    with pytest.raises(ConfigError, match="unset one"):
        auth_from_env({"AUTOTUNE_PROMETHEUS_BEARER_TOKEN": "t",
                       "AUTOTUNE_PROMETHEUS_USERNAME": "u"})
    with pytest.raises(ConfigError, match="user:password"):
        auth_from_env({}, basic_auth_file=f)
    with pytest.raises(ConfigError, match="cannot read"):
        auth_from_env({}, bearer_token_file=tmp_path / "missing")
    (tmp_path / "empty").write_text("\n")
    with pytest.raises(ConfigError, match="empty"):
        auth_from_env({}, bearer_token_file=tmp_path / "empty")


def test_a_url_with_credentials_is_refused() -> None:
    with pytest.raises(ConfigError, match="AUTOTUNE_PROMETHEUS_USERNAME"):
        PrometheusClient("http://me:secret@prom:9090")
    with pytest.raises(ConfigError, match="http"):
        PrometheusClient("prom:9090")
    assert PrometheusClient("https://h/prometheus/api/v1/query").url == "https://h/prometheus"


def test_times_and_ranges() -> None:
    now = 1_800_012_345.0
    assert parse_time("now", now=now, what="--until") == now
    assert parse_time("90s", now=now, what="x") == now - 90
    assert parse_time("7d", now=now, what="x") == now - 7 * 86400
    assert parse_time("2w", now=now, what="x") == now - 14 * 86400
    assert parse_time("1700000000", now=now, what="x") == 1_700_000_000.0
    assert parse_time("2027-01-15T08:00:00Z", now=now, what="x") == 1_800_000_000.0
    assert parse_time("2027-01-15T08:00:00", now=now, what="x") == 1_800_000_000.0
    with pytest.raises(ConfigError, match="--since 'yesterday' is not a time"):
        parse_time("yesterday", now=now, what="--since")
    assert resolve_range("1h", "30m", now=now) == (now - 5400, now - 1800)
    assert resolve_range("2027-01-15T08:00:00Z", "now", now=now) == (1_800_000_000.0, now)
    with pytest.raises(ConfigError, match="must be before"):
        resolve_range("2027-01-15T08:00:00Z", "2027-01-14T08:00:00Z", now=now)


def _from(selector: str, url: str = "http://p:9090") -> Any:
    rng = PrometheusRange(url=url, selector=selector, start=0, end=60, start_iso="a",
                          end_iso="b", window_s=60)
    shape = constant_shape(100, 10, load=LoadSpec(mode="closed", concurrency=1), requests=5)
    return shape.model_copy(update={"source": SourceInfo(format="prometheus",
                                                         prometheus=rng)})


def test_diff_notes_shapes_of_different_replicas() -> None:
    a, b = _from('{model_name="m"}'), _from('{model_name="n"}', url="http://q:9090")
    d = diff_shapes(a, b)
    assert d.verdict == "same" and len(d.notes) == 2
    assert 'different replicas: ' in d.notes[0] and '{model_name="n"}' in d.notes[0]
    assert diff_shapes(a, a).notes == []

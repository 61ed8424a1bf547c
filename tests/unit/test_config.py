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

"""autotune.cost: the arithmetic against hand-computed cases (intervals, GPUs, the API)."""

from __future__ import annotations

import json
from pathlib import Path
from types import SimpleNamespace

import pytest

from autotune.config import TuneSettings
from autotune.cost import (
    Prices,
    Rate,
    TrafficLoad,
    best_cost,
    config_cost,
    cost_from_best,
    cost_line,
    cost_metrics,
    no_price_line,
    parse_api_price,
    rate_of,
    study_cost,
)
from autotune.errors import AutotuneError
from tests._cost import PRICES, TRAFFIC

ROOT = Path(__file__).resolve().parents[2]


def test_throughput_config_by_hand() -> None:
    c = config_cost(rate=Rate("throughput", 1000.0, 800.0, 1250.0), prices=PRICES,
                    traffic=TRAFFIC)
    # 2.5 USD / (1000 tok/s x 3600 s) x 1e6
    assert c.usd_per_m_output_tokens == pytest.approx(0.694444, rel=1e-5)
    # the interval: the high throughput is the low price
    assert c.usd_per_m_output_tokens_low == pytest.approx(2.5 / 1250 / 3600 * 1e6)
    assert c.usd_per_m_output_tokens_high == pytest.approx(2.5 / 800 / 3600 * 1e6)
    # mean: 2 req/s x 250 out tok = 500 tok/s of 1000 per GPU
    mean = c.gpus["mean"]["now"]
    assert (mean.gpus, mean.gpus_low, mean.gpus_high, mean.whole) == pytest.approx(
        (0.5, 0.4, 0.625, 1))
    # mean with growth x2: exactly 1.0 GPU is one GPU, not two; its interval 0.8-1.25
    g = c.gpus["mean"]["growth"]
    assert (g.gpus, g.whole, g.whole_low, g.whole_high) == (pytest.approx(1.0), 1, 1, 2)
    peak = c.gpus["peak"]
    assert peak["now"].gpus == pytest.approx(0.75) and peak["now"].whole == 1
    assert peak["growth"].gpus == pytest.approx(1.5) and peak["growth"].whole == 2
    assert c.usd_per_month == pytest.approx(1 * 2.5 * 730)
    assert c.usd_per_month_growth == pytest.approx(2 * 2.5 * 730)
    # API: 500/250 x 0.3 + 1.2 = 1.8 USD per million output tokens of this traffic
    assert c.api_discount == pytest.approx(1 - 0.694444 / 1.8, rel=1e-5)
    assert c.break_even_utilisation == pytest.approx(0.694444 / 1.8, rel=1e-5)
    assert c.api_discount_low == pytest.approx(1 - (2.5 / 800 / 3600 * 1e6) / 1.8)
    assert c.api_discount_high == pytest.approx(1 - (2.5 / 1250 / 3600 * 1e6) / 1.8)


def test_study_saving_and_api_month_by_hand() -> None:
    s = study_cost(best=Rate("throughput", 1000.0, 800.0, 1250.0),
                   defaults=Rate("throughput", 500.0, 450.0, 550.0), prices=PRICES,
                   traffic=TRAFFIC)
    assert s.defaults is not None
    assert s.defaults.gpus["peak"]["now"].whole == 2  # 750 / 500 = 1.5
    assert s.defaults.gpus["peak"]["growth"].whole == 3  # 1500 / 500 = 3.0
    assert s.saving == pytest.approx({
        "gpus_peak_now": 1.0, "gpus_peak_growth": 1.0, "usd_per_month": 1825.0,
        "usd_per_month_growth": 1825.0, "usd_per_m_output_tokens": 2.5 / 500 / 3600 * 1e6
        - 2.5 / 1000 / 3600 * 1e6, "fraction": 0.5})
    assert s.api is not None
    # 2 req/s x 3600 x 730 h x 250 tokens = 1,314 M output tokens x 1.8 USD
    assert s.api["usd_per_month"] == pytest.approx(2365.2)
    assert s.api["usd_per_month_growth"] == pytest.approx(4730.4)
    text = cost_line(s.to_dict())  # the summary reads best.json's dict back
    assert "$0.694/M out tok ($0.556-$0.868)" in text
    assert "saving of the best over the defaults: 1 GPU(s) now" in text
    assert "discount 61% at full use" in text and "breaks even at 39% utilisation" in text
    assert json.loads(json.dumps(s.to_dict()))["best"]["gpus"]["peak"]["now"]["whole"] == 1


def test_capacity_with_two_gpus_per_server() -> None:
    c = config_cost(rate=Rate("capacity", 10.0, 8.0, 12.0, output_tokens_per_request=100.0),
                    prices=Prices(gpu_hour_usd=2.0), gpus_per_server=2,
                    traffic=TrafficLoad(mean_rps=5.0, peak_rps=25.0, mean_input_tokens=1.0,
                                        mean_output_tokens=1.0))
    assert c.output_tokens_per_s == pytest.approx(1000.0)
    assert c.usd_per_m_output_tokens == pytest.approx(2.0 * 2 / 1000 / 3600 * 1e6)
    mean = c.gpus["mean"]["now"]
    assert mean.gpus == pytest.approx(1.0) and mean.whole == 2  # half a server is one server
    peak = c.gpus["peak"]["now"]
    assert peak.gpus == pytest.approx(5.0) and peak.whole == 6  # 2.5 servers -> 3 x 2 GPUs
    assert (peak.whole_low, peak.whole_high) == (6, 8)  # 25/12 -> 3 servers, 25/8 -> 4
    assert c.usd_per_month == pytest.approx(6 * 2.0 * 730)
    assert c.usd_per_month_interval == pytest.approx((6 * 2.0 * 730, 8 * 2.0 * 730))
    assert c.api_discount is None and c.break_even_utilisation is None  # no API price


def test_premium_when_the_api_is_cheaper() -> None:
    c = config_cost(rate=Rate("throughput", 100.0, 90.0, 110.0),
                    prices=Prices(gpu_hour_usd=4.0, api_input_usd_per_m=0.1,
                                  api_output_usd_per_m=0.4), traffic=TRAFFIC)
    assert c.api_discount is not None and c.api_discount < 0  # 11.1 USD/M against 0.6
    assert c.break_even_utilisation == pytest.approx((4.0 / 100 / 3600 * 1e6) / 0.6)
    assert "premium" in cost_line(study_cost(
        best=Rate("throughput", 100.0, 90.0, 110.0), defaults=None,
        prices=Prices(gpu_hour_usd=4.0, api_input_usd_per_m=0.1, api_output_usd_per_m=0.4),
        traffic=TRAFFIC))


def test_no_recorded_rate_leaves_the_fleet_out() -> None:
    s = study_cost(best=Rate("throughput", 1000.0, 900.0, 1100.0), defaults=None,
                   prices=PRICES, traffic=TrafficLoad(0.0, 0.0, 512.0, 512.0))
    assert s.best.gpus == {} and s.best.usd_per_month is None
    assert s.best.usd_per_m_output_tokens == pytest.approx(0.694444, rel=1e-5)
    assert s.api is not None and "usd_per_month" not in s.api
    assert any("no arrival rate" in n for n in s.notes)


def test_rate_interval_spans_the_readings_and_the_reading_interval() -> None:
    r = rate_of({"output_tokens_per_s_ci_low": 6439.76, "output_tokens_per_s_ci_high": 7240.31},
                [7051.89, 6840.03], 6945.96, capacity=False)
    assert (r.value, r.low, r.high) == (6945.96, 6439.76, 7240.31)
    cap = rate_of({"capacity_rps": 18.6, "capacity_rps_ci_low": 18.6,
                   "capacity_rps_ci_high": 20.29, "output_tokens_per_s_at_capacity": 2212.2},
                  [18.6, 24.12], 21.36, capacity=True)
    assert (cap.low, cap.high) == (18.6, 24.12)  # the start-to-start spread is wider
    assert cap.output_tokens_per_request == pytest.approx(2212.2 / 18.6)


def test_a_study_without_a_price_has_no_cost() -> None:
    settings = SimpleNamespace(gpu_hour_price=None, api_price=[0.3, 1.2], growth=2.0)
    best = {"objective": {"name": "throughput", "value": 1.0}, "readings": [1.0]}
    assert best_cost(best, settings=settings, shape=None, device="cpu") is None
    assert "--gpu-hour-price" in no_price_line()


def test_committed_capacity_study_by_hand() -> None:
    """The H200 capacity study of experiments/h200-shapes (azure shape): the README's
    worked example."""
    from autotune.traffic import load_shape

    best = json.loads((ROOT / "experiments/h200-shapes/results/study-azure/best.json")
                      .read_text())
    shape = load_shape(ROOT / "traffic/azure-conv-2k.json")
    settings = TuneSettings(model=Path("m"), shape=Path("s"), space=Path("x"),
                            gpu_hour_price=2.5, api_price="0.3,1.2", growth=2)
    cost = best_cost(best, settings=settings, shape=shape, device="cuda")
    assert cost is not None
    per_req = 2212.1848297690667 / 18.602041411389795
    tok = 21.362952255468088 * per_req
    assert cost["best"]["usd_per_m_output_tokens"] == pytest.approx(2.5 / tok / 3600 * 1e6)
    assert cost["best"]["gpus"]["peak"]["now"]["gpus"] == pytest.approx(8.45 / 21.362952255468)
    assert cost["best"]["gpus"]["peak"]["growth"]["whole"] == 1  # 16.9 req/s < 21.4
    assert cost["defaults"]["gpus"]["peak"]["growth"]["whole"] == 2  # 16.9 > 13.2 req/s
    assert cost["saving"]["gpus_peak_growth"] == 1.0
    assert cost["saving"]["usd_per_month_growth"] == pytest.approx(2.5 * 730)
    assert cost["basis"] == "capacity" and cost["unit"] == "GPU"
    metrics = cost_metrics(cost)
    assert metrics["cost.saving.gpus_peak_growth"] == 1.0
    assert "cost.best.usd_per_m_output_tokens" in metrics


@pytest.mark.parametrize("text", ["0.3", "a,b", "0.3,-1", "1,2,3", "nan,1"])
def test_bad_api_price(text: str) -> None:
    with pytest.raises(AutotuneError, match="--api-price"):
        parse_api_price(text)


def test_api_price_parses_and_bad_prices_fail() -> None:
    assert parse_api_price("0.3, 1.2") == [0.3, 1.2]
    assert parse_api_price(None) is None
    with pytest.raises(AutotuneError):
        Prices(gpu_hour_usd=0.0)
    with pytest.raises(AutotuneError):
        Prices(gpu_hour_usd=float("inf"))
    assert cost_from_best({"objective": {"name": "throughput", "value": 10.0}},
                          prices=PRICES, traffic=TRAFFIC).defaults is None


def test_tune_options_and_config_file(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    from autotune.cli import main
    from autotune.cli._tune import settings_from_args, tune_parser

    base = ["--model", "m", "--shape", "s", "--space", "x"]
    args = tune_parser().parse_args([*base, "--gpu-hour-price", "2.5", "--api-price", "0.3,1.2",
                                     "--growth", "2"])
    s = settings_from_args(args)
    assert (s.gpu_hour_price, s.api_price, s.growth) == (2.5, [0.3, 1.2], 2.0)
    cfg = tmp_path / "study.yaml"
    cfg.write_text("gpu_hour_price: 3\napi_price: [0.1, 0.4]\n")
    s = settings_from_args(tune_parser().parse_args([*base, "--config", str(cfg)]))
    assert (s.gpu_hour_price, s.api_price, s.growth) == (3.0, [0.1, 0.4], 1.0)
    assert settings_from_args(tune_parser().parse_args(base)).gpu_hour_price is None
    assert main(["tune", *base, "--api-price", "0.3"]) == 2
    assert "--api-price '0.3' is not IN,OUT" in capsys.readouterr().err
    assert main(["tune", *base, "--gpu-hour-price", "-1"]) == 2
    assert "--gpu-hour-price" in capsys.readouterr().err


def test_cli_cost_prices_a_committed_study(capsys: pytest.CaptureFixture[str]) -> None:
    from autotune.cli import main

    study = str(ROOT / "experiments/h200-shapes/results/study-azure")
    assert main(["cost", study, "--gpu-hour-price", "2.5", "--api-price", "0.3,1.2",
                 "--growth", "2"]) == 0
    out = capsys.readouterr().out
    # a capacity's cost rests on a passing level's rate: an upper bound for its start
    assert "best at most $0.273/M out tok (starts and brackets: $0.242-$0.314)" in out
    assert "vLLM defaults at most $0.444/M out tok" in out and "at most 1 with growth" in out
    assert "discount at least 89% at full use" in out
    assert "breaks even at 11% utilisation or less" in out
    assert main(["cost", study, "--gpu-hour-price", "2.5", "--json"]) == 0
    doc = json.loads(capsys.readouterr().out)
    assert doc["api"] is None and doc["best"]["api_discount"] is None
    assert main(["cost", study]) == 2
    assert "--gpu-hour-price is required" in capsys.readouterr().err
    with pytest.raises(SystemExit) as exc:
        main(["cost", study, "--gpu-hour-price", "1", "--api-price", "1"])
    assert exc.value.code == 2 and "is not IN,OUT" in capsys.readouterr().err


def test_a_noisy_reading_says_its_cost_is_unbounded_and_a_premium_reads_as_one() -> None:
    r = rate_of({"output_tokens_per_s_ci_low": -55.4, "output_tokens_per_s_ci_high": 171.8},
                [58.2], 58.2, capacity=False)
    assert r.open_low and (r.low, r.high) == (58.2, 171.8)
    s = study_cost(best=r, defaults=None, prices=PRICES, traffic=TRAFFIC, unit="server")
    text = cost_line(s.to_dict())
    assert "unbounded" in text and "server(s) at peak" in text
    # 2.5 / 58.2 tok/s = $11.9/M against the API's $1.8: a premium, never breaking even
    assert "premium 563% at full use (125% to 563%)" in text
    assert "never breaks even (it would need 663% utilisation)" in text


def test_bench_cost_of_its_one_config() -> None:
    from autotune.cli._bench import parse_bench
    from autotune.cli._cost import bench_cost

    args = parse_bench(["--model", "m", "--shape", str(ROOT / "traffic/example-chat.json"),
                        "--gpu-hour-price", "2.5", "--api-price", "0.3,1.2"])
    m = {"output_tokens_per_s": 1000.0, "output_tokens_per_s_ci_low": 900.0,
         "output_tokens_per_s_ci_high": 1100.0}
    cost = bench_cost(args, m, capacity=False)
    assert cost is not None and cost["defaults"] is None
    assert cost["best"]["usd_per_m_output_tokens_high"] == pytest.approx(2.5 / 900 / 3600 * 1e6)
    # example-chat: 5.53 req/s x 65.76 output tokens = 363.7 tok/s of 1000
    assert cost["best"]["gpus"]["mean"]["now"]["gpus"] == pytest.approx(5.53042 * 65.7567 / 1000)
    no_price = parse_bench(["--model", "m", "--shape", "s"])
    assert bench_cost(no_price, m, capacity=False) is None


@pytest.mark.parametrize("kw, words", [
    ({"gpu_hour_usd": -1.0}, "--gpu-hour-price -1: give a positive number"),
    ({"gpu_hour_usd": 2.0, "growth": 0.0}, "--growth 0: give a positive number"),
    ({"gpu_hour_usd": 2.0, "api_output_usd_per_m": -2.0},
     "--api-price: the output price -2 must be a number >= 0"),
])
def test_a_bad_price_is_named_by_its_option(kw: dict[str, float], words: str) -> None:
    with pytest.raises(AutotuneError) as info:
        Prices(**kw)
    assert str(info.value) == words
    assert "usd" not in str(info.value)  # the field's name is nothing the user typed


def test_a_growth_of_0_is_refused_not_taken_for_unset() -> None:
    from autotune.cost import prices_of

    with pytest.raises(AutotuneError, match="--growth 0"):
        prices_of(SimpleNamespace(gpu_hour_price=2.0, api_price=None, growth=0.0))
    assert prices_of(SimpleNamespace(gpu_hour_price=2.0, growth=None)).growth == 1.0

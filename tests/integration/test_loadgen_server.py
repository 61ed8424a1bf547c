"""The load generator and measurement against a real CPU vLLM server (slow).

Agreement with the server's own counters: our output-token count must equal the growth of
``vllm:generation_tokens_total`` exactly, and our mean TTFT must sit within
``TTFT_TOL_S + TTFT_TOL_REL x server mean`` of the server's
``vllm:time_to_first_token_seconds`` (_sum/_count growth). The server starts its clock
when the request reaches the engine and stops it when the first token is produced; we
also count HTTP, request parsing and detokenisation, so ours is the larger, by a few ms
on an idle machine and by tens of ms when the two shared cores are busy.
"""

from __future__ import annotations

import random
from typing import Any

import pytest

from autotune.load import RunResult, replay
from autotune.measure import measure, server_figures, snapshot_metrics
from autotune.traffic import RequestSpec, Schedule

pytestmark = pytest.mark.slow

TTFT_TOL_S = 0.05  # absolute part of the TTFT tolerance
TTFT_TOL_REL = 0.25  # relative part (of the server's mean TTFT)
RATE_TOL_REL = 0.15  # window tokens/s vs the server's generation tokens/s


def schedule(
    n: int, *, conc: int, prompt_len: int = 32, max_tokens: int = 24, seed: int = 0
) -> Schedule:
    rng = random.Random(seed)
    reqs = tuple(
        RequestSpec(i, tuple(rng.randrange(10, 4000) for _ in range(prompt_len)), max_tokens)
        for i in range(n)
    )
    return Schedule(mode="closed", requests=reqs, concurrency=conc, seed=seed)


def check_complete(run: RunResult, prompt_len: int, max_tokens: int) -> None:
    for r in run.records:
        assert r.ok, (r.error, r.detail)
        assert r.output_tokens == max_tokens == sum(r.chunk_tokens)
        assert r.prompt_tokens == prompt_len
        assert r.first_token_s is not None and r.send_s < r.first_token_s <= r.end_s  # type: ignore[operator]


def test_completions_stream_and_agree_with_the_server(tiny_server: Any) -> None:
    url, model = tiny_server.base_url, tiny_server.model_name
    replay(schedule(2, conc=2, seed=99), base_url=url, model=model)  # warm the server up
    # Token and request counts must agree exactly every time. The TTFT check compares a
    # client's clock with the server's: on a 2-core host a CPU server busy with 4 streams can
    # starve the client's event loop and the server's own front end, whose time the server's
    # histogram leaves out (in full suites: ours 129, 175 and 210 ms vs the server's 9-11 ms,
    # alone typically 2 ms apart). So the mean must agree in one of two runs, or else the
    # fastest of our 24 readings must: a client that timed first tokens wrongly (from the
    # schedule, or after the whole chunk) would be off in every reading.
    fastest_runs: list[float] = []
    for _attempt in range(2):
        before = snapshot_metrics(url)
        run = replay(schedule(24, conc=4), base_url=url, model=model)
        after = snapshot_metrics(url)
        check_complete(run, 32, 24)

        server = server_figures(before, after)
        ours_tokens = sum(r.output_tokens for r in run.records)
        assert ours_tokens == server["generation_tokens"] == 24 * 24  # exact: 0 tokens off
        assert server["requests_success"] == 24
        # engine steps: 24 requests x 24 tokens at 4 streams take at least 24 x 24 / 4 steps
        # (one token per stream and step), each step computed its prompt chunks and decodes
        assert server["engine_steps"] >= 24 * 24 / 4
        assert 1.0 <= server["generated_tokens_per_step"] <= 4.0
        assert server["tokens_per_step"] >= server["generated_tokens_per_step"]
        assert server["step_ms"] * server["engine_steps"] == pytest.approx(
            server["interval_s"] * 1000.0)

        m = measure(run, server_before=before, server_after=after)
        assert m.server["ttft_mean_s"] == server["ttft_mean_s"]
        assert m.output_tokens_per_s is not None and m.output_tokens_per_s > 0
        assert m.n_errors == 0 and m.cv is not None

        ttft_ours = sum(r.first_token_s - r.send_s for r in run.records) / 24  # type: ignore[operator]
        ttft_server = server["ttft_mean_s"]
        print(f"mean TTFT ours {ttft_ours * 1e3:.1f} ms, server {ttft_server * 1e3:.1f} ms")
        assert ttft_ours >= ttft_server - 0.005  # the client's wait includes the server's
        tol = TTFT_TOL_S + TTFT_TOL_REL * ttft_server
        fastest = min(r.first_token_s - r.send_s for r in run.records)  # type: ignore[operator]
        if abs(ttft_ours - ttft_server) <= tol:
            break
        fastest_runs.append(fastest)
    else:
        assert min(fastest_runs) <= ttft_server + tol, (
            f"mean TTFT ours {ttft_ours * 1e3:.1f} ms vs the server's {ttft_server * 1e3:.1f} "
            f"ms in both runs, and our fastest reading {min(fastest_runs) * 1e3:.1f} ms")


def test_chat_prompts_of_t_words_have_the_intended_length(tiny_server: Any) -> None:
    url, model = tiny_server.base_url, tiny_server.model_name
    run = replay(
        schedule(6, conc=3, prompt_len=20, max_tokens=8), base_url=url, model=model, api="chat"
    )
    for r in run.records:
        assert r.ok, (r.error, r.detail)
        assert r.output_tokens == 8 == sum(r.chunk_tokens)
        assert r.prompt_tokens is not None and r.prompt_tokens >= 20


def test_measurement_with_metrics_sampled_during_the_run(tiny_server: Any) -> None:
    url, model = tiny_server.base_url, tiny_server.model_name
    # 48 x 48 tokens (~3 s on the CPU build) sampled every 0.25 s: a 1-s run sampled every
    # 0.5 s left the bracket's edges a large share of the window (once 16 % apart in a full
    # suite on 2 busy cores)
    run = replay(
        schedule(48, conc=8, max_tokens=48, seed=1),
        base_url=url,
        model=model,
        metrics_interval_s=0.25,
    )
    assert len(run.snapshots) >= 2
    m = measure(run)
    assert m.n_errors == 0 and m.window_rule == "steady"
    for key in ("generation_tokens_per_s", "kv_cache_usage", "requests_running", "preemptions"):
        assert key in m.server, key
    assert 0 <= m.server["kv_cache_usage"] <= 1
    # the server's token rate over the samples that bracket the window (<= 0.25 s wider on
    # each side) agrees with ours inside the window: 1-2 % apart when this was written
    ours, theirs = m.output_tokens_per_s, m.server["generation_tokens_per_s"]
    assert ours is not None and abs(ours - theirs) <= RATE_TOL_REL * theirs
    agreed = {"output_tokens_per_s", "requests_per_s", "goodput_rps", "error_rate", "cv"}
    assert agreed <= set(m.flat()) and "server_kv_cache_usage" in m.flat()


def test_unknown_model_is_an_http_4xx_record(tiny_server: Any) -> None:
    run = replay(schedule(2, conc=2), base_url=tiny_server.base_url, model="no-such-model")
    assert [r.error for r in run.records] == ["http_4xx", "http_4xx"]
    assert all(r.status == 404 or r.status == 400 for r in run.records)


def test_prompt_longer_than_the_context_is_an_http_4xx_record(tiny_server: Any) -> None:
    run = replay(
        schedule(1, conc=1, prompt_len=1100, max_tokens=8),
        base_url=tiny_server.base_url,
        model=tiny_server.model_name,
    )
    assert run.records[0].error == "http_4xx" and "1024" in (run.records[0].detail or "")

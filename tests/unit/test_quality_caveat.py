"""What a verdict says of a lossy winner's accuracy (autotune.quality.quality_caveat)."""

from __future__ import annotations

from autotune.quality import caveat_line, quality_caveat

FIG = {"agreement": 0.97, "max_logprob_diff": 0.04}


def test_no_lossy_knob_no_caveat() -> None:
    assert quality_caveat([], {"max_num_seqs": 64}, probe=True, gated=True,
                          real_weights=True) is None
    assert caveat_line(None) == ""


def test_random_weights_are_never_judged_even_when_probed_and_gated() -> None:
    q = quality_caveat(["quantization"], {"quantization": "fp8", "max_num_seqs": 64},
                       probe=True, gated=True, real_weights=False, figures=FIG)
    assert q is not None and q["judged"] is False
    assert q["lossy_knobs"] == {"quantization": "fp8"} and "random weights" in q["reason"]
    assert q["figures"] == FIG and "real weights" in q["check"]
    line = caveat_line(q)
    assert line.startswith("quality: NOT JUDGED") and "quantization=fp8" in line


def test_probe_off_and_no_thresholds_are_named_as_the_reason() -> None:
    off = quality_caveat(["kv_cache_dtype"], {"kv_cache_dtype": "fp8"}, probe=False,
                         gated=False, real_weights=True)
    assert off is not None and not off["judged"] and "--no-quality-probe" in off["reason"]
    failed = quality_caveat(["kv_cache_dtype"], {"kv_cache_dtype": "fp8"}, probe=True,
                            gated=True, real_weights=True, note="quality probe failed: boom")
    assert failed is not None and not failed["judged"] and failed["reason"].endswith("boom")
    ungated = quality_caveat(["kv_cache_dtype"], {"kv_cache_dtype": "fp8"}, probe=True,
                             gated=False, real_weights=True, figures=FIG)
    assert ungated is not None and not ungated["judged"] and "--quality" in ungated["reason"]


def test_real_weights_probed_within_thresholds_is_judged() -> None:
    q = quality_caveat(["kv_cache_dtype"], {"kv_cache_dtype": "fp8"}, probe=True, gated=True,
                       real_weights=True, figures=FIG)
    assert q is not None and q["judged"] is True and q["check"] is None
    assert caveat_line(q).startswith("quality: lossy knobs (kv_cache_dtype=fp8) judged")


def test_the_caveat_gives_the_probe_s_figure_and_whose_it_is() -> None:
    from autotune.quality import quality_figure

    probe = {"n_prompts": 32, "exact_match_rate": 1 / 32, "first_divergence_mean": 3.25}
    assert quality_figure(probe) == ("1 of 32 greedy outputs unchanged (first divergence "
                                     "after 3.2 tokens on average)")
    assert quality_figure({**probe, "exact_match_rate": 1.0}) == \
        "32 of 32 greedy outputs unchanged"
    assert quality_figure(None) == "" and quality_figure(FIG) == ""  # no probe's figures
    q = quality_caveat(["kv_cache_dtype"], {"kv_cache_dtype": "fp8_e4m3"}, probe=True,
                       gated=False, real_weights=True, figures=probe,
                       subject="the best other config (trial 4)")
    line = caveat_line(q)
    assert line.startswith("quality: NOT JUDGED: the best other config (trial 4) sets lossy "
                           "knobs (kv_cache_dtype=fp8_e4m3)")
    assert "its probe: 1 of 32 greedy outputs unchanged" in line
    judged = quality_caveat(["kv_cache_dtype"], {"kv_cache_dtype": "fp8_e4m3"}, probe=True,
                            gated=True, real_weights=True, figures=probe)
    assert caveat_line(judged).endswith("; 1 of 32 greedy outputs unchanged (first divergence "
                                        "after 3.2 tokens on average)")


def test_a_capacity_studys_caveat_calls_its_figure_a_capacity_result() -> None:
    # issue 66: a capacity study's caveat said "its figure is a throughput result"
    from autotune.quality import caveat_line

    q = quality_caveat(["kv_cache_dtype"], {"kv_cache_dtype": "fp8"}, probe=False, gated=False,
                       real_weights=True, result="capacity")
    line = caveat_line(q)
    assert "its figure is a capacity result, not a recommendation" in line, line
    assert "throughput" not in line
    old = dict(q or {})
    old.pop("result")  # a verdict recorded before the caveat named its result
    assert "its figure is a throughput result" in caveat_line(old)

"""What a verdict says of a lossy winner's accuracy: judged, or plainly not."""

from __future__ import annotations

from collections.abc import Mapping, Sequence

__all__ = ["caveat_line", "quality_caveat", "quality_figure", "result_of"]

_CHECK = ("check accuracy with real weights on real tasks before serving it "
          "(docs/quality.md: an lm-evaluation-harness run against its server)")


def quality_caveat(lossy_knobs: Sequence[str], params: Mapping[str, object], *,
                   probe: bool, gated: bool, real_weights: bool,
                   figures: Mapping[str, object] | None = None,
                   note: str = "", subject: str = "the winner",
                   result: str = "throughput") -> dict[str, object] | None:
    """The ``quality`` part of a verdict for a config that sets lossy knobs (None when it
    sets none): which knobs, whether its accuracy cost was judged, and why not.

    ``probe``: the study probed lossy trials; ``gated``: ``--quality`` thresholds bounded
    them; ``real_weights``: the model is a real checkpoint (random weights make any probe
    figure say nothing of a real model's accuracy); ``figures``: the trial's probe figures;
    ``note``: why the trial has none; ``subject``: the verdict's config in words (the
    winner, or the best other config when vLLM's defaults remain best); ``result``: what
    its figure is (``throughput``, ``capacity``, ``goodput``: the study's objective)."""
    if not lossy_knobs:
        return None
    knobs = {k: params.get(k) for k in lossy_knobs}
    if not real_weights:
        judged, reason = False, (
            "the model has random weights (a stand-in): no probe can tell what a lossy "
            "setting costs a real checkpoint's accuracy")
    elif figures is None:
        judged, reason = False, (note or "no quality figures") if probe else (
            "the quality probe was off (--no-quality-probe)")
    elif not gated:
        judged, reason = False, (
            "probed (its drift from the full-precision reference is in the trial's "
            "figures) but not gated: no --quality thresholds bounded it")
    else:
        judged, reason = True, "probed and within the --quality thresholds"
    return {"lossy_knobs": knobs, "judged": judged, "reason": reason,
            "figures": dict(figures) if figures is not None else None,
            "check": None if judged else _CHECK, "subject": subject, "result": result}


def quality_figure(figures: Mapping[str, object] | None) -> str:
    """A probe's figures in words: '31 of 32 greedy outputs unchanged (the rest diverge
    after 12.5 tokens on average)' ('' without the figures)."""
    n, rate = (figures or {}).get("n_prompts"), (figures or {}).get("exact_match_rate")
    if not isinstance(n, int) or n <= 0 or not isinstance(rate, (int, float)):
        return ""
    same = round(rate * n)
    text = f"{same} of {n} greedy outputs unchanged"
    mean = (figures or {}).get("first_divergence_mean")
    if same < n and isinstance(mean, (int, float)):
        text += f" (first divergence after {mean:.1f} tokens on average)"
    return text


def caveat_line(q: Mapping[str, object] | None) -> str:
    """The caveat in one line for the summary, with the probe's figure where there is one
    ('' when there is nothing to say)."""
    if not q:
        return ""
    lossy, figures = q.get("lossy_knobs"), q.get("figures")
    knobs = ", ".join(f"{k}={v}" for k, v in lossy.items()) if isinstance(lossy, Mapping) else ""
    figure = quality_figure(figures if isinstance(figures, Mapping) else None)
    if q.get("judged"):
        return (f"quality: lossy knobs ({knobs}) judged: {q.get('reason')}"
                + (f"; {figure}" if figure else ""))
    who = q.get("subject") or "the winner"
    return (f"quality: NOT JUDGED: {who} sets lossy knobs ({knobs}) and {q.get('reason')}"
            + (f"; its probe: {figure}" if figure else "")
            + f"; its figure is {result_of(q)}, not a recommendation: {q.get('check')}")


def result_of(q: Mapping[str, object]) -> str:
    """What a caveat's figure is, in words: "a throughput result", "a capacity result"."""
    return f"a {q.get('result') or 'throughput'} result"

"""Can a config serve a traffic shape? Its context (``--max-model-len``, else the model's
own) against the shape's prompt and output lengths, checked before any command is printed."""

from __future__ import annotations

import json
import re
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from autotune.traffic import TrafficShape

__all__ = ["Fit", "check_fit", "context_of"]


def _tokens(text: str) -> int | None:
    """``2048``, ``32k``, ``1M`` (vLLM's human-readable --max-model-len) -> tokens."""
    m = re.fullmatch(r"\s*(\d+(?:\.\d+)?)\s*([kKmM]?)\s*", text)
    if not m:
        return None
    scale = {"": 1, "k": 1000, "K": 1024, "m": 1_000_000, "M": 1024 * 1024}[m.group(2)]
    return int(float(m.group(1)) * scale)


def context_of(flags: Sequence[str], model: str | Path | None) -> tuple[int | None, str]:
    """(context in tokens, where it comes from): ``--max-model-len`` of the flags, else the
    model's ``max_position_embeddings`` (its config.json, where the folder is here), else
    (None, why it is unknown)."""
    items = list(flags)
    for i, f in enumerate(items):
        name, eq, inline = f.partition("=")
        if name == "--max-model-len":
            value = inline if eq else (items[i + 1] if i + 1 < len(items) else "")
            n = _tokens(value)
            if n is not None and n > 0:
                return n, f"--max-model-len {value}"
    if model:
        try:
            cfg: dict[str, object] = json.loads((Path(model) / "config.json").read_text())
        except (OSError, ValueError):
            return None, f"no --max-model-len and no readable {model}/config.json"
        for src in (cfg, cfg.get("text_config") or {}):
            n = src.get("max_position_embeddings") if isinstance(src, dict) else None
            if isinstance(n, int) and n > 0:
                return n, f"the model's max_position_embeddings ({model}/config.json)"
    return None, "no --max-model-len and no model folder to read its context from"


@dataclass(frozen=True)
class Fit:
    """``ok`` False: most of the shape's requests do not fit the context (``message`` says
    by how much and how to fix it); ``share_over``: share of prompts that cannot fit with a
    median output; ``warning``: some do not (the config still serves most)."""

    ok: bool
    context: int | None
    needed_p50: float
    needed_p99: float
    share_over: float
    message: str
    warning: str = ""

    def to_dict(self) -> dict[str, object]:
        return {"ok": self.ok, "context": self.context, "needed_p50": self.needed_p50,
                "needed_p99": self.needed_p99, "share_over": self.share_over,
                "message": self.message, "warning": self.warning}


#: more than this share of the shape's prompts beyond the context: the config cannot serve
#: the shape (the study's preflight refuses the same share: study.MAX_CLIPPED_FRACTION)
MAX_OVER = 0.05


def check_fit(shape: TrafficShape, context: int | None, source: str = "",
              shape_path: str | Path | None = None) -> Fit:
    """Whether a context of ``context`` tokens serves ``shape``: a request needs its prompt
    plus its output; the median request must fit, and no more than :data:`MAX_OVER` of the
    prompts (with a median output) may be longer. ``shape_path``: the shape's file, named in
    the clip command the message gives (so that it runs as printed)."""
    import shlex

    inp, out = shape.input_tokens, shape.output_tokens
    p50, p99 = float(inp.p50 + out.p50), float(inp.p99 + out.p99)
    if context is None:
        return Fit(True, None, p50, p99, 0.0, f"context unknown ({source}): not checked")
    over = sum(1 for q in inp.quantiles if q + out.p50 > context) / len(inp.quantiles)
    what = (f"shape {shape.name}: median prompt {inp.p50:,.0f} + median output {out.p50:,.0f} "
            f"= {p50:,.0f} tokens")
    clip = (f"autotune shape clip {shlex.quote(str(shape_path))} --max-total-tokens {context} "
            f"-o {shlex.quote(f'{shape.name}-{context}.json')}" if shape_path is not None
            else "autotune shape clip")
    fix = ("Tune for this shape with a context that holds it ('autotune tune --shape ...' "
           f"with a space whose --max-model-len is at least {int(p99):,}), or clip the "
           f"shape ({clip})")
    if p50 > context or over > MAX_OVER:
        why = (f"{what}" if p50 > context else
               f"{over:.0%} of its prompts with a median output (more than {MAX_OVER:.0%}) "
               f"are longer, up to p99 prompt + p99 output = {p99:,.0f} tokens; vLLM "
               "rejects those requests")
        return Fit(False, context, p50, p99, over,
                   f"this config cannot serve this traffic: its context is {context:,} tokens "
                   f"({source}) but {why}; about {over:.0%} of its prompts do not fit. {fix}")
    warning = ""
    if p99 > context:
        warning = (f"p99 prompt + p99 output = {p99:,.0f} tokens exceeds the context of "
                   f"{context:,} ({source}): about {over:.0%} of prompts (with a median "
                   "output) are longer; vLLM rejects those requests")
    return Fit(True, context, p50, p99, over, f"fits: {what} within {context:,}", warning)

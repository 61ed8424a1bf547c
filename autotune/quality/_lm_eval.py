"""An lm-evaluation-harness command to score a config on real tasks (real weights only)."""

from __future__ import annotations

import logging
from collections.abc import Mapping, Sequence

from autotune.errors import ConfigError

logger = logging.getLogger(__name__)



# ---------------------------------------------------------------------------------------------
# lm-evaluation-harness (real weights)


def lm_eval_command(
    base_url: str,
    model: str,
    tasks: Sequence[str],
    *,
    tokenizer: str | None = None,
    num_concurrent: int = 8,
    max_retries: int = 3,
    limit: float | None = None,
    num_fewshot: int | None = None,
    batch_size: int = 1,
    max_length: int | None = None,
    output_path: str | None = None,
    seed: int = 0,
    extra_model_args: Mapping[str, object] | None = None,
    executable: str = "lm_eval",
) -> list[str]:
    """An ``lm_eval`` argv scoring the server at ``base_url`` (serving ``model``) on ``tasks``
    through its OpenAI-compatible ``/v1/completions`` endpoint.

    ``tokenizer`` is a local tokenizer path or hub name for lm-eval's own token counting
    (default: ``model``; use the model directory the server loaded). ``limit`` caps samples
    per task (an int, or a fraction < 1) for a quick comparison; ``max_length`` is the
    context lm-eval may fill (its default is 2048; give the server's --max-model-len). Requests
    go as token ids (lm-eval's default), so both sides tokenize alike. lm-eval is not a dependency:
    ``pip install 'lm-eval[api]'``. See docs/quality.md.
    """
    if not tasks or any(not t or "," in t or t.strip() != t for t in tasks):
        raise ConfigError(
            f"lm_eval tasks {list(tasks)!r}: give one or more task names without commas or "
            "spaces, e.g. ['gsm8k', 'arc_easy']"
        )
    if num_concurrent < 1 or max_retries < 0 or batch_size < 1:
        raise ConfigError(
            f"lm_eval: num_concurrent ({num_concurrent}) and batch_size ({batch_size}) must be "
            f">= 1 and max_retries ({max_retries}) >= 0"
        )
    args: dict[str, object] = {
        "base_url": base_url.rstrip("/") + "/v1/completions",
        "model": model,
        "tokenizer": tokenizer or model,
        "tokenizer_backend": "huggingface",
        "num_concurrent": num_concurrent,
        "max_retries": max_retries,
    }
    if max_length is not None:
        args["max_length"] = max_length
    for k, v in (extra_model_args or {}).items():
        args[str(k)] = v
    for k, v in args.items():
        if any(c in str(v) for c in ",="):
            raise ConfigError(
                f"lm_eval model arg {k}={v!r} contains ',' or '=', which lm-eval's "
                "--model_args cannot carry; use a path or name without them"
            )
    model_args = ",".join(f"{k}={_arg(v)}" for k, v in args.items())
    cmd = [executable, "--model", "local-completions", "--model_args", model_args,
           "--tasks", ",".join(tasks), "--batch_size", str(batch_size), "--seed", str(seed)]
    if limit is not None:
        if not (limit > 0):
            raise ConfigError(f"lm_eval limit {limit!r} must be > 0 (a count, or a fraction < 1)")
        cmd += ["--limit", f"{limit:g}" if isinstance(limit, float) else str(limit)]
    if num_fewshot is not None:
        if num_fewshot < 0:
            raise ConfigError(f"lm_eval num_fewshot {num_fewshot} must be >= 0")
        cmd += ["--num_fewshot", str(num_fewshot)]
    if output_path is not None:
        cmd += ["--output_path", output_path]
    return cmd


def _arg(v: object) -> str:
    if isinstance(v, bool):
        return "True" if v else "False"
    return str(v)

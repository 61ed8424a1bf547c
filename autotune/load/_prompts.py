"""Prompts of exact token lengths for any model, built with the model's own tokenizer.

A replay schedule says how many prompt tokens each request has and which leading tokens
requests of one group share (:func:`autotune.traffic.build_schedule`). This module turns
that into what the server must receive so that *its* count of prompt tokens equals the
shape's:

* The ids are drawn from the tokenizer's *unit words*: vocabulary entries ``w`` such that
  ``" w"`` is exactly one token and ``" w w"`` two (whole words after a space; the
  pre-tokenizer splits at spaces, so words never merge across a boundary). Any sequence of
  unit words therefore tokenizes to exactly one token per word, whatever the model.
* Completions API: the ids are sent as a token-id prompt (no special tokens are added).
* Chat API: the words are joined into the user message; the model's chat template adds
  its own tokens (role markers, generation prompt), so the message holds the shape's
  length minus that overhead. Every rendered prompt is tokenized the way vLLM does it
  (template text, ``add_special_tokens=False``) and corrected until the count is exact.

Requests that share a prefix in the schedule share the same leading words, hence the same
leading token ids after the template's header: a prefix cache sees the recorded sharing.
All of it runs before a measured run (a few hundred ms per thousand prompts), never in the
load generator's hot path.

Tokenizers come from the model folder only (``tokenizer.json`` with ``tokenizers`` and
the chat template from ``tokenizer_config.json``, ``chat_template.jinja`` or
``chat_template.json``); nothing is downloaded.
"""

from __future__ import annotations

import dataclasses
import json
import logging
from collections.abc import Sequence
from datetime import datetime
from functools import lru_cache
from pathlib import Path
from typing import TYPE_CHECKING, Any, Literal

if TYPE_CHECKING:
    from jinja2 import Template

    from autotune.traffic import Schedule, TrafficShape

from autotune.errors import AutotuneError

__all__ = [
    "ModelPrompts",
    "PromptError",
    "build_prompts",
    "model_prompts",
    "model_vocab_size",
    "text_prompts",
]

logger = logging.getLogger(__name__)

Api = Literal["completions", "chat"]

#: At most this many unit words are kept (a real vocabulary has ~100k; a few thousand
#: distinct words are plenty and keep the start-up check fast).
MAX_WORDS = 16_384
_MIN_WORDS = 16
_FIX_ROUNDS = 6


class PromptError(AutotuneError):
    """The model's tokenizer cannot give prompts of exact lengths (with the fix)."""


def model_vocab_size(model: str | Path) -> int:
    """The vocabulary size from the model's config.json (token ids must stay below it)."""
    cfg = json.loads((Path(model) / "config.json").read_text())
    vocab = cfg.get("vocab_size") or cfg.get("text_config", {}).get("vocab_size")
    if not vocab:
        raise AutotuneError(f"{model}/config.json has no vocab_size; cannot build prompts")
    return int(vocab)


def _read_json(path: Path) -> dict[str, object]:
    try:
        data = json.loads(path.read_text())
    except FileNotFoundError:
        return {}
    except (OSError, json.JSONDecodeError) as exc:
        raise PromptError(f"{path} cannot be read as JSON: {exc}") from exc
    return data if isinstance(data, dict) else {}


def _token_text(value: object) -> str | None:
    if isinstance(value, str):
        return value
    if isinstance(value, dict) and isinstance(value.get("content"), str):
        return str(value["content"])
    return None


def chat_template(model_dir: Path) -> str | None:
    """The model's chat template (the default one when the folder names several)."""
    jinja = model_dir / "chat_template.jinja"
    if jinja.exists():
        return jinja.read_text()
    for source in (model_dir / "chat_template.json", model_dir / "tokenizer_config.json"):
        tmpl = _read_json(source).get("chat_template")
        if isinstance(tmpl, str):
            return tmpl
        if isinstance(tmpl, list):  # [{"name": "default", "template": ...}, ...]
            named = {t.get("name"): t.get("template") for t in tmpl if isinstance(t, dict)}
            found = named.get("default") or next(iter(named.values()), None)
            if isinstance(found, str):
                return found
    return None


def _compile_template(source: str, where: Path) -> Template:
    """Compile a chat template the way transformers does (sandboxed, same options)."""
    try:
        from jinja2 import TemplateError
        from jinja2.ext import loopcontrols
        from jinja2.sandbox import ImmutableSandboxedEnvironment
    except ImportError as exc:  # pragma: no cover - jinja2 is a core dependency
        raise PromptError("the 'jinja2' package is missing; pip install jinja2") from exc

    def raise_exception(message: str) -> None:
        raise TemplateError(message)

    def tojson(x: object, ensure_ascii: bool = False, indent: int | str | None = None,
               separators: tuple[str, str] | None = None, sort_keys: bool = False) -> str:
        return json.dumps(x, ensure_ascii=ensure_ascii, indent=indent,
                          separators=separators, sort_keys=sort_keys)

    env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True,
                                        extensions=[loopcontrols])
    env.filters["tojson"] = tojson
    env.globals["raise_exception"] = raise_exception
    env.globals["strftime_now"] = lambda fmt: datetime.now().strftime(fmt)
    try:
        return env.from_string(source)
    except TemplateError as exc:
        raise PromptError(f"{where}: the chat template does not compile: {exc}") from exc


class ModelPrompts:
    """Exact-length prompts for one model folder and one API.

    ``token_ids`` are the unit words' ids (draw prompt ids from them); :meth:`fit` makes a
    schedule drawn that way exact for the API (see the module docstring); ``overhead`` is
    the number of tokens the chat template adds around one user message (0 for
    completions).
    """

    def __init__(self, model_dir: str | Path, *, api: Api = "completions") -> None:
        if api not in ("completions", "chat"):
            raise PromptError(f"api is {api!r}; use 'completions' or 'chat'")
        self.model_dir = Path(model_dir)
        self.api: Api = api
        self.overhead = 0
        self._template: Template | None = None
        self._vars: dict[str, str] = {}
        path = self.model_dir / "tokenizer.json"
        if not path.exists():
            self._no_tokenizer()
            return
        try:
            from tokenizers import Tokenizer
        except ImportError as exc:  # pragma: no cover - tokenizers is a core dependency
            raise PromptError("the 'tokenizers' package is missing; pip install tokenizers") \
                from exc
        try:
            self._tok = Tokenizer.from_file(str(path))
        except Exception as exc:
            raise PromptError(f"{path} cannot be loaded by 'tokenizers': {exc}") from exc
        self._words = self._unit_words()
        self.token_ids: tuple[int, ...] = tuple(sorted(self._words))
        if api == "chat":
            self._init_chat()

    def _no_tokenizer(self) -> None:
        fix = ("save the model's fast tokenizer there (transformers: "
               "AutoTokenizer.from_pretrained(DIR).save_pretrained(DIR))")
        if self.api == "chat":
            raise PromptError(
                f"{self.model_dir} has no tokenizer.json, so chat prompts of exact lengths "
                f"cannot be built; {fix}, or use --api completions"
            )
        # Token-id prompts are exact whatever the tokenizer: draw ids from the vocabulary
        # above the usual special ids (0-3).
        vocab = model_vocab_size(self.model_dir)
        self._words = {}
        self.token_ids = tuple(range(min(4, vocab - 2), vocab))
        logger.warning("%s has no tokenizer.json: prompt ids are drawn from the whole "
                       "vocabulary (some may be special tokens); %s", self.model_dir, fix)

    # -- the vocabulary ---------------------------------------------------------------------
    def _unit_words(self) -> dict[int, str]:
        tok = self._tok
        special = {int(i) for i, t in tok.get_added_tokens_decoder().items() if t.special}
        ids = sorted(i for i in tok.get_vocab(with_added_tokens=False).values()
                     if i not in special)
        texts = tok.decode_batch([[i] for i in ids], skip_special_tokens=False)
        cand: dict[int, str] = {}
        seen: set[str] = set()
        for i, text in zip(ids, texts, strict=True):
            word = text.strip()
            if word and word.isascii() and word.isalnum() and word not in seen:
                seen.add(word)
                cand[i] = " " + word
        order = list(cand)
        singles = tok.encode_batch([cand[i] for i in order], add_special_tokens=False)
        doubles = tok.encode_batch([cand[i] * 2 for i in order], add_special_tokens=False)
        words: dict[int, str] = {}
        for i, one, two in zip(order, singles, doubles, strict=True):
            if one.ids == [i] and two.ids == [i, i]:
                words[i] = cand[i]
                if len(words) >= MAX_WORDS:
                    break
        if len(words) < _MIN_WORDS:
            raise PromptError(
                f"the tokenizer of {self.model_dir} has only {len(words)} whole-word tokens "
                f"(' word' = one token); exact prompts need at least {_MIN_WORDS}"
            )
        return words

    # -- chat -------------------------------------------------------------------------------
    def _init_chat(self) -> None:
        source = chat_template(self.model_dir)
        if source is None:
            raise PromptError(
                f"{self.model_dir} has no chat template (tokenizer_config.json "
                "'chat_template' or chat_template.jinja), so vLLM cannot serve the chat API "
                "for it; use --api completions or add a template"
            )
        self._template = _compile_template(source, self.model_dir)
        cfg = _read_json(self.model_dir / "tokenizer_config.json")
        for name in ("bos_token", "eos_token", "unk_token", "pad_token"):
            text = _token_text(cfg.get(name))
            if text is not None:
                self._vars[name] = text
        word = self._words[self.token_ids[len(self.token_ids) // 2]]
        n = 8
        self.overhead = len(self._encode([self._render(word * n)])[0]) - n

    def _render(self, content: str) -> str:
        if self._template is None:
            raise PromptError(f"{self.model_dir}: no chat template to render a message with")
        try:
            return str(self._template.render(
                messages=[{"role": "user", "content": content}],
                add_generation_prompt=True, **self._vars,
            ))  # fmt: skip
        except Exception as exc:
            raise PromptError(
                f"{self.model_dir}: the chat template fails on a plain user message: {exc}"
            ) from exc

    def _encode(self, texts: list[str]) -> list[list[int]]:
        # What vLLM does with a rendered chat prompt: the template placed the special
        # tokens itself, so none are added.
        return [e.ids for e in self._tok.encode_batch(texts, add_special_tokens=False)]

    def chat_prompt(self, ids: Sequence[int]) -> tuple[str, tuple[int, ...]]:
        """The user message for a prompt of ``len(ids)`` tokens and the ids vLLM will see."""
        return self._fit_chat([tuple(ids)])[0]

    def _fit_chat(self, prompts: list[tuple[int, ...]]) -> list[tuple[str, tuple[int, ...]]]:
        words = self._words
        target = [len(p) for p in prompts]
        keep = [max(1, n - self.overhead) for n in target]
        out: list[tuple[str, tuple[int, ...]]] = [("", ())] * len(prompts)
        todo = list(range(len(prompts)))
        filler = self.token_ids
        for _ in range(_FIX_ROUNDS):
            contents = []
            for i in todo:
                src = prompts[i]
                ids = src[: keep[i]] if keep[i] <= len(src) else (
                    src + tuple(filler[j % len(filler)] for j in range(keep[i] - len(src))))
                contents.append("".join(words[t] for t in ids))
            encoded = self._encode([self._render(c) for c in contents])
            left = []
            for i, content, toks in zip(todo, contents, encoded, strict=True):
                out[i] = (content, tuple(toks))
                diff = target[i] - len(toks)
                if diff and not (diff < 0 and keep[i] == 1):
                    keep[i] = max(1, keep[i] + diff)
                    left.append(i)
            todo = left
            if not todo:
                break
        if todo:
            i = todo[0]
            raise PromptError(
                f"{self.model_dir}: cannot make a chat prompt of exactly {target[i]} tokens "
                f"with this tokenizer and chat template (got {len(out[i][1])}); "
                "use --api completions"
            )
        return out

    # -- schedules --------------------------------------------------------------------------
    def fit(self, schedule: Schedule) -> Schedule:
        """``schedule`` with every request made exact for this API.

        Its prompt ids must come from :attr:`token_ids` (``build_schedule(token_ids=...)``).
        Completions: returned as is. Chat: each request gets its ``prompt`` text and the
        ids the server will count. A prompt shorter than the template's overhead cannot
        be exact: it gets one word (a warning says how many).
        """
        if self.api == "completions":
            return schedule
        reqs = schedule.requests
        fitted = self._fit_chat([r.prompt_token_ids for r in reqs])
        short = sum(1 for r in reqs if len(r.prompt_token_ids) <= self.overhead)
        if short:
            logger.warning(
                "%d of %d prompts are shorter than the chat template's %d tokens of overhead; "
                "they are sent with a one-word message (longer than the shape says)",
                short, len(reqs), self.overhead,
            )
        new = tuple(
            dataclasses.replace(r, prompt=text, prompt_token_ids=ids)
            for r, (text, ids) in zip(reqs, fitted, strict=True)
        )
        return dataclasses.replace(schedule, requests=new)


@lru_cache(maxsize=8)
def _cached(model_dir: str, api: Api, stamp: tuple[float, ...]) -> ModelPrompts:
    return ModelPrompts(model_dir, api=api)


def model_prompts(model_dir: str | Path, *, api: Api = "completions") -> ModelPrompts:
    """A (cached) :class:`ModelPrompts` for a model folder; reloaded when its files change."""
    d = Path(model_dir).resolve()
    stamp = tuple(
        (d / f).stat().st_mtime if (d / f).exists() else 0.0
        for f in ("tokenizer.json", "tokenizer_config.json", "chat_template.jinja")
    )
    return _cached(str(d), api, stamp)


def build_prompts(shape: TrafficShape, *, model: str | Path, api: str = "completions",
                  **kwargs: Any) -> Schedule:
    """:func:`autotune.traffic.build_schedule` with prompts exact for ``model`` and ``api``.

    ``kwargs`` go to ``build_schedule`` (seed, mode, concurrency, lengths...).
    """
    from autotune.traffic import build_schedule

    if api not in ("completions", "chat"):
        raise PromptError(f"api is {api!r}; use 'completions' or 'chat'")
    prompts = model_prompts(model, api=api)  # type: ignore[arg-type]
    return prompts.fit(build_schedule(shape, token_ids=prompts.token_ids, **kwargs))


def _markdown_prose(text: str) -> str:
    """The running text of a markdown page: code blocks, indented code and tables left out
    (a window of flags and JSON is not what a real prompt looks like)."""
    keep: list[str] = []
    fenced = False
    for line in text.splitlines():
        if line.lstrip().startswith("```"):
            fenced = not fenced
            continue
        if fenced or line.startswith(("    ", "\t", "|")):
            continue
        keep.append(line)
    return "\n".join(keep)


def _prose() -> str:
    """English prose to cut real-text prompts from: autotune's own documentation (its
    docstrings when the docs are not installed). Deterministic for a given autotune."""
    import ast

    root = Path(__file__).resolve().parent
    docs = sorted((root.parent / "docs").glob("*.md")) if (root.parent / "docs").is_dir() else []
    readme = root.parent / "README.md"
    parts = [_markdown_prose(p.read_text(encoding="utf-8", errors="replace"))
             for p in ([readme] if readme.is_file() else []) + docs]
    if not parts:
        for f in sorted(root.rglob("*.py")):
            tree = ast.parse(f.read_text(encoding="utf-8"))
            for node in ast.walk(tree):
                doc = (ast.get_docstring(node, clean=True)
                       if isinstance(node, (ast.Module, ast.ClassDef, ast.FunctionDef,
                                            ast.AsyncFunctionDef)) else None)
                if doc:
                    parts.append(doc)
    return "\n\n".join(parts)


def text_prompts(model_dir: str | Path, lengths: Sequence[int], *,
                 seed: int = 0) -> tuple[tuple[int, ...], ...]:
    """Prompts of real text, tokenized with the model's tokenizer: for each length, a window
    of that many tokens of English prose at a seeded position (for a real checkpoint, whose
    outputs on random ids say little about its outputs on text)."""
    import numpy as np

    path = Path(model_dir) / "tokenizer.json"
    if not path.exists():
        raise PromptError(f"{model_dir} has no tokenizer.json; real-text prompts need it")
    from tokenizers import Tokenizer

    ids = Tokenizer.from_file(str(path)).encode(_prose(), add_special_tokens=False).ids
    if not ids:
        raise PromptError("no prose to build real-text prompts from")
    rng = np.random.default_rng(seed)
    out = []
    for n in lengths:
        reps = -(-n // len(ids)) + 1
        pool = ids * reps if reps > 1 else ids
        start = int(rng.integers(0, max(1, len(pool) - n + 1)))
        out.append(tuple(pool[start : start + n]))
    return tuple(out)

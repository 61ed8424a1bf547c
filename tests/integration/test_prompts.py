"""Exact prompts with the model's own tokenizer (autotune.prompts); no server here."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from autotune.engine import write_bpe_tokenizer, write_tokenizer
from autotune.load import ModelPrompts, PromptError, _prose, build_prompts
from autotune.traffic import LoadSpec, build_schedule, clip_shape, constant_shape, load_shape

REPO = Path(__file__).resolve().parents[2]
_LOAD = LoadSpec(mode="closed", concurrency=2, requests=5)


def _folder(tmp: Path, kind: str, vocab: int = 2048) -> Path:
    tmp.mkdir(parents=True, exist_ok=True)
    (tmp / "config.json").write_text(json.dumps({"vocab_size": vocab,
                                                 "max_position_embeddings": 4096}))
    if kind == "bpe":
        write_bpe_tokenizer(tmp, vocab_size=vocab)
    elif kind == "words":
        write_tokenizer(tmp, vocab_size=vocab)
    return tmp


@pytest.fixture(scope="module")
def bpe(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return _folder(tmp_path_factory.mktemp("bpe"), "bpe")


def _shared_shape() -> object:
    # mooncake's prefix sharing (one group, 37 % shared tokens), lengths cut to test size
    shape = load_shape(REPO / "traffic" / "mooncake-conv.json")
    return clip_shape(shape, max_input_tokens=700, max_output_tokens=16)


def _lcp(a: tuple[int, ...], b: tuple[int, ...]) -> int:
    n = 0
    for x, y in zip(a, b, strict=False):
        if x != y:
            break
        n += 1
    return n


def test_word_tokenizer_keeps_the_old_schedules(tmp_path: Path) -> None:
    model = _folder(tmp_path, "words")
    shape = constant_shape(50, 8, name="c", load=_LOAD)
    old = build_schedule(shape, vocab_size=2048, seed=3, mode="closed", concurrency=2,
                         num_requests=5)
    for api in ("completions", "chat"):
        new = build_prompts(shape, model=model, api=api, seed=3, mode="closed", concurrency=2,
                            num_requests=5)
        assert [r.prompt_token_ids for r in new.requests] == [
            r.prompt_token_ids for r in old.requests]
    chat = ModelPrompts(model, api="chat")
    assert chat.overhead == 0
    text, ids = chat.chat_prompt((5, 6, 7))
    assert text == " t5 t6 t7" and ids == (5, 6, 7)


def test_bpe_chat_prompts_are_exact_and_match_transformers(bpe: Path) -> None:
    shape = load_shape(REPO / "traffic" / "example-chat.json")
    sched = build_prompts(shape, model=bpe, api="chat", seed=1, num_requests=40)
    mp = ModelPrompts(bpe, api="chat")
    assert mp.overhead > 0  # ChatML adds role markers
    plain = build_schedule(shape, vocab_size=2048, seed=1, num_requests=40)
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(str(bpe), local_files_only=True)
    for r, p in zip(sched.requests, plain.requests, strict=True):
        want = max(len(p.prompt_token_ids), mp.overhead + 1)
        assert len(r.prompt_token_ids) == want
        # what vLLM does: transformers renders the template, tokenizes without specials
        text = tok.apply_chat_template([{"role": "user", "content": r.prompt}],
                                       add_generation_prompt=True, tokenize=False)
        assert tuple(tok(text, add_special_tokens=False)["input_ids"]) == r.prompt_token_ids


def test_bpe_completion_ids_are_single_words(bpe: Path) -> None:
    mp = ModelPrompts(bpe, api="completions")
    from tokenizers import Tokenizer

    tok = Tokenizer.from_file(str(bpe / "tokenizer.json"))
    sched = build_prompts(constant_shape(64, 4, name="c", load=_LOAD), model=bpe, seed=0,
                          mode="closed", concurrency=1, num_requests=3)
    for r in sched.requests:
        assert len(r.prompt_token_ids) == 64 and set(r.prompt_token_ids) <= set(mp.token_ids)
        text = tok.decode(list(r.prompt_token_ids))
        assert tok.encode(text, add_special_tokens=False).ids == list(r.prompt_token_ids)


def test_shared_prefixes_share_token_ids_through_the_chat_template(bpe: Path) -> None:
    shape = _shared_shape()
    kw = {"seed": 2, "num_requests": 30, "mode": "closed", "concurrency": 4}
    mp = ModelPrompts(bpe, api="chat")
    words = build_prompts(shape, model=bpe, api="completions", **kw).requests
    chat = build_prompts(shape, model=bpe, api="chat", **kw).requests
    keep = [len(w.prompt_token_ids) - mp.overhead for w in words]
    header = None
    shared_pairs = 0
    for i in range(len(words)):
        for j in range(i):
            lw = _lcp(words[i].prompt_token_ids[: keep[i]], words[j].prompt_token_ids[: keep[j]])
            lc = _lcp(chat[i].prompt_token_ids, chat[j].prompt_token_ids)
            if lw < min(keep[i], keep[j]):
                header = lc - lw if header is None else header
                assert lc - lw == header, (i, j, lw, lc)
                shared_pairs += lw >= 16
    assert header is not None and 0 < header < mp.overhead
    assert shared_pairs > 0  # the shape does share prefixes


def test_missing_tokenizer_or_template_is_one_clear_error(tmp_path: Path) -> None:
    bare = _folder(tmp_path / "bare", "none")
    with pytest.raises(PromptError, match=r"no tokenizer.json.*--api completions"):
        ModelPrompts(bare, api="chat")
    ids = ModelPrompts(bare, api="completions").token_ids  # ids are exact anyway
    assert ids[0] == 4 and ids[-1] == 2047
    model = _folder(tmp_path / "notmpl", "words")
    cfg = json.loads((model / "tokenizer_config.json").read_text())
    del cfg["chat_template"]
    (model / "tokenizer_config.json").write_text(json.dumps(cfg))
    with pytest.raises(PromptError, match="no chat template"):
        ModelPrompts(model, api="chat")


def test_token_table_and_context_clip() -> None:
    shape = constant_shape(900, 300, name="c", load=_LOAD)
    s = build_schedule(shape, token_ids=[11, 22, 33], seed=0, mode="closed", concurrency=1,
                       num_requests=4, max_total_tokens=1000)
    for r in s.requests:
        assert set(r.prompt_token_ids) <= {11, 22, 33}
        assert len(r.prompt_token_ids) + r.max_tokens == 1000 and r.max_tokens == 300


def test_quality_probe_on_real_text_for_a_real_checkpoint(bpe: Path) -> None:
    from tokenizers import Tokenizer

    from autotune.quality import QualitySpec, build_probe

    spec = QualitySpec(n_prompts=6)
    rand = build_probe(vocab_size=2048, spec=spec)
    text = build_probe(vocab_size=2048, spec=spec, text_model=bpe)
    assert [len(p) for p in text.prompts] == [len(p) for p in rand.prompts]
    assert text.digest != rand.digest
    tok = Tokenizer.from_file(str(bpe / "tokenizer.json"))
    # prose, not random ids: the words are the prose's own (cut from autotune's docs). Not
    # "mostly alphabetic": a window of the docs may be mostly figures and flags, and random
    # ids of a word tokenizer decode to 60 % alphabetic pieces; here about 99 % against 19 %
    vocab = set(_prose().split())

    def own(probe: object) -> float:
        words = [w for p in probe.prompts for w in tok.decode(list(p)).split()]  # type: ignore[attr-defined]
        return sum(w in vocab for w in words) / len(words)

    assert own(text) > 0.9 and own(rand) < 0.5, (own(text), own(rand))
    assert build_probe(vocab_size=2048, spec=spec, text_model=bpe).digest == text.digest

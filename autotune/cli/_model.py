"""``autotune model tiny``: generate a tiny local model (no model hub)."""

from __future__ import annotations

import argparse
import json


def register(sub: argparse._SubParsersAction) -> None:  # type: ignore[type-arg]
    model = sub.add_parser("model", help="generate tiny local models for CPU runs and tests")
    msub = model.add_subparsers(dest="model_command", metavar="SUBCOMMAND", required=True)
    tiny = msub.add_parser(
        "tiny",
        help="write config.json, a local tokenizer and random weights of a tiny model",
        description=(
            "Write a tiny model (< 50 M parameters) with random but peaked weights and a local "
            "tokenizer (by default WordLevel: token i is 't<i>'; --tokenizer bpe trains a "
            "BPE), small enough to serve with the CPU build of vLLM. No model hub is used."
        ),
    )
    tiny.add_argument("out_dir", metavar="OUT_DIR", help="directory to write the model to")
    tiny.add_argument(
        "--arch",
        choices=("nemotron_h", "llama"),
        default="nemotron_h",
        help="nemotron_h: hybrid Mamba2 + attention + MLP layers (default); llama: dense",
    )
    tiny.add_argument("--vocab-size", type=int, default=4096, help="vocabulary size (default 4096)")
    tiny.add_argument(
        "--mtp", action="store_true", help="add one MTP layer (nemotron_h) for speculative runs"
    )
    tiny.add_argument(
        "--mtp-pattern",
        choices=("*E", "*"),
        default="*E",
        help="the MTP block's layers: '*E' attention + MoE like the real checkpoints (GPU; "
        "default), '*' attention only: the CPU build of vLLM serves it (MoE it cannot), so "
        "MTP depth can be searched on CPU with search_spaces/cpu.yaml",
    )
    tiny.add_argument("--seed", type=int, default=0, help="weight seed (default 0)")
    tiny.add_argument(
        "--tokenizer",
        choices=("words", "bpe"),
        default="words",
        help="words: token i is 't<i>', one token per word (default); bpe: a byte-level BPE "
        "trained here on autotune's own text with a ChatML chat template, like a real "
        "model's tokenizer (multi-token words, template overhead)",
    )
    tiny.set_defaults(func=_tiny)


def _tiny(args: argparse.Namespace) -> int:
    from autotune.engine import generate_tiny_model

    out = generate_tiny_model(
        args.out_dir, arch=args.arch, vocab_size=args.vocab_size, mtp=args.mtp,
        mtp_pattern=args.mtp_pattern, seed=args.seed, tokenizer=args.tokenizer,
    )
    info = json.loads((out / "autotune-model.json").read_text())
    print(f"wrote {info['arch']} model ({info['parameters'] / 1e6:.1f} M parameters) to {out}")
    return 0

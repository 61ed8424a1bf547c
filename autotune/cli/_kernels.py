"""``autotune kernels moe``: tune vLLM's fused-MoE kernel config for a traffic shape."""

from __future__ import annotations

import argparse
import sys
from pathlib import Path


def _ints(text: str) -> tuple[int, ...]:
    try:
        return tuple(int(x) for x in text.split(",") if x.strip())
    except ValueError:
        raise argparse.ArgumentTypeError(
            f"{text!r} is not a comma-separated list of whole numbers, e.g. 0,1") from None


def register(sub: argparse._SubParsersAction) -> None:  # type: ignore[type-arg]
    kernels = sub.add_parser("kernels", help="tune kernel configs below the engine flags (GPU)")
    ksub = kernels.add_subparsers(dest="kernels_command", metavar="SUBCOMMAND", required=True)
    moe = ksub.add_parser(
        "moe",
        help="tune the fused-MoE Triton config for the token counts a traffic shape makes",
        description=(
            "Tune vLLM's fused-MoE Triton kernel (BLOCK_SIZE_M/N/K, GROUP_SIZE_M, num_warps, "
            "num_stages) for the model's expert shape on this GPU, only at the token counts "
            "the traffic shape produces (min(streams, max-num-seqs) x (1 + MTP depth) per "
            "decode step, mixed steps, prefill chunks), with Optuna over vLLM's tuning "
            "grid, timing vLLM's own fused_experts in one worker process per GPU. Writes "
            "OUT/<the file name vLLM looks up>, e.g. "
            "E=128,N=1856,device_name=NVIDIA_H200.json, plus every candidate's time; serve "
            "with VLLM_TUNED_CONFIG_FOLDER=OUT. Needs a CUDA GPU and the 'gpu' extra. See "
            "docs/kernels.md."
        ),
    )
    moe.add_argument("--model", required=True, type=Path, help="local model directory")
    moe.add_argument("--shape", required=True, type=Path, help="traffic shape JSON")
    moe.add_argument("--out", required=True, type=Path, help="folder to write the config to")
    moe.add_argument("--gpus", type=int, default=1, help="GPUs to time on at once (default 1)")
    moe.add_argument("--mtp-depth", type=_ints, default=(0,), metavar="D[,D...]",
                     help="MTP depths the server will run (decode steps carry 1 + D tokens "
                     "per stream); default 0")
    moe.add_argument("--max-batched-tokens", type=_ints, default=(8192,), metavar="N[,N...]",
                     help="the server's --max-num-batched-tokens (prefill chunk); default 8192")
    moe.add_argument("--max-num-seqs", type=_ints, default=(1024,), metavar="N[,N...]",
                     help="the server's --max-num-seqs: a step holds at most N of the streams "
                     "(decode steps carry min(streams, N) x (1 + D) tokens); default 1024 "
                     "(vLLM's on a large GPU)")
    moe.add_argument("--concurrency", type=int, default=None, metavar="N",
                     help="concurrent streams the server will run, as 'autotune tune "
                     "--concurrency N' replays (decode steps carry N x (1 + D) tokens); "
                     "default: the shape's closed-loop concurrency, or its open-loop "
                     "estimate")
    moe.add_argument("--sizes", type=_ints, default=(), metavar="M[,M...]",
                     help="more token counts to tune besides the shape's")
    moe.add_argument("--trials", type=int, default=48,
                     help="configs timed per token count before the re-check (default 48 "
                     "of vLLM's 1,920-point grid)")
    moe.add_argument("--budget", type=float, default=None, metavar="SECONDS",
                     help="wall time for the whole tuning, the GPU workers' start included "
                     "(they start at once): decode token counts go first, each gets its share "
                     "of what is left, and a count that no longer fits is skipped (its key "
                     "gets vLLM's default config; a later run into OUT tunes it); a config "
                     "that hangs is stopped when the budget runs out (at least 30 s after it "
                     "began)")
    moe.add_argument("--min-gain", type=float, default=0.03, metavar="FRACTION",
                     help="a token count keeps vLLM's default config unless the re-check "
                     "times the winner at least this much faster (default_us / best_us >= "
                     "1 + FRACTION); default 0.03: a gain of a few percent is within what "
                     "the model's own run can reverse. The measured speed-up is reported "
                     "either way")
    moe.add_argument("--no-guard-keys", action="store_true",
                     help="write only the tuned token counts. By default the file also "
                     "holds vLLM's own default config at guard keys (where the default "
                     "changes, and a geometric grid up to the largest count), so vLLM's "
                     "nearest-key lookup never serves a token count with tiles tuned for a "
                     "far-away one")
    moe.add_argument("--tp", type=int, default=1, help="tensor-parallel size of the server")
    moe.add_argument("--seed", type=int, default=0)
    moe.add_argument("--fresh", action="store_true",
                     help="tune every token count again (default: keep those already in OUT)")
    moe.set_defaults(func=_moe)


def _moe(args: argparse.Namespace) -> int:
    from pydantic import ValidationError

    from autotune.errors import ConfigError
    from autotune.kernels import MoeTuneSettings, Progress, tune_moe

    try:
        settings = MoeTuneSettings(
            model=args.model, shape=args.shape, out=args.out, gpus=args.gpus,
            mtp_depths=args.mtp_depth, max_batched_tokens=args.max_batched_tokens,
            max_num_seqs=args.max_num_seqs, concurrency=args.concurrency, sizes=args.sizes,
            trials=args.trials,
            budget_s=args.budget, tp=args.tp, seed=args.seed, reuse=not args.fresh,
            min_gain=args.min_gain, guard_keys=not args.no_guard_keys)
    except ValidationError as exc:
        # the flag a field came from, where it is not the field's name
        flags = {"mtp_depths": "--mtp-depth", "budget_s": "--budget"}
        problems = "; ".join(
            f"{flags.get(str(e['loc'][0]), '--' + str(e['loc'][0]).replace('_', '-'))}: "
            f"{e['msg']}" if e["loc"] else e["msg"] for e in exc.errors())
        raise ConfigError(f"autotune kernels moe: {problems}") from None

    def show(p: Progress) -> None:
        if p.done is not None:
            r = p.done
            speed = f"{r.speedup:.2f}x" if r.speedup else "n/a"
            kept = f", kept vLLM's default: {r.kept_default}" if r.kept_default else ""
            best, default = r.best_us or float("nan"), r.default_us or float("nan")
            print(f"[{p.sizes_done}/{p.sizes_total}] M={r.m}: best {best:.1f} us, "
                  f"default {default:.1f} us ({speed}{kept}); {r.timed} timed, "
                  f"{r.failed} failed, {r.pruned} pruned, {r.seconds:.0f} s", flush=True)
        elif p.candidate is not None and p.candidate.us is None:
            c = p.candidate
            print(f"  M={c.m} gpu {p.gpu}: {c.reason} ({c.message[:80]})", file=sys.stderr,
                  flush=True)

    result = tune_moe(settings, on_progress=show)
    if result.reused:
        print(f"kept from an earlier run: M={','.join(map(str, result.reused))}")
    for m, why in result.skipped.items():
        print(f"skipped M={m}: {why} (vLLM's default config at this key; run again with a "
              "larger --budget to tune it)")
    if result.skipped and not result.results and not result.reused:
        print(f"autotune: no token count fit --budget {args.budget:g} s; nothing written: "
              "give it more time", file=sys.stderr)
        return 1
    kept = sum(1 for r in result.results if r.kept_default)
    notes = [f"{len(result.results)} token count(s) tuned"]
    if kept:
        notes.append(f"{kept} of them kept vLLM's default (--min-gain)")
    if result.skipped:
        notes.append(f"{len(result.skipped)} skipped")
    if result.guard_keys:
        notes.append(f"{len(result.guard_keys)} guard keys")
    print(f"wrote {result.path} ({', '.join(notes)}, {result.seconds:.0f} s); all "
          f"candidates: {result.csv_path}")
    print(f"serve with: VLLM_TUNED_CONFIG_FOLDER={result.path.parent.resolve()} vllm serve ...")
    return 0

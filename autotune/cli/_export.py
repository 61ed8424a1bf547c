"""``autotune export``: a study's config as Kubernetes objects, a compose file or the
``vllm serve`` command."""

from __future__ import annotations

import argparse
import shlex
import sys
from pathlib import Path

from autotune.config import DEFAULT_STORAGE, storage_url


def register(sub: argparse._SubParsersAction) -> None:  # type: ignore[type-arg]
    p = sub.add_parser(
        "export",
        help="write deployment files for a study's config (Kubernetes, compose, vllm serve)",
        description=(
            "Write what runs a study's declared config: --format k8s a Deployment and a "
            "Service (vLLM's image of the version the study ran, the args and environment "
            "as the trial ran them, GPU resources, the model folder as a volume, /health "
            "probes, Prometheus scrape annotations, replicas = the GPUs the traffic needs / "
            "the GPUs of one server, the study's verdict and ratio as annotations); "
            "--format compose a compose file; --format serve the 'vllm serve' command. "
            "Settings only a stand-in model needs (--load-format dummy, the MoE routing "
            "simulation, synthetic MTP acceptance) are dropped and the files say the "
            "figures came from a stand-in. Refused without --force when the config cannot "
            "serve the traffic shape or was never measured feasible. See docs/cost.md."
        ),
        formatter_class=argparse.ArgumentDefaultsHelpFormatter,
    )
    p.add_argument("source", nargs="?", type=Path, default=None,
                   help="a study's best.json or its output folder (or give --study-name)")
    p.add_argument("--study-name", default=None,
                   help="export from the Optuna storage instead: this study's declared config")
    p.add_argument("--storage", default=DEFAULT_STORAGE,
                   help="Optuna storage URL, or a study's output folder (its stores are there)")
    p.add_argument("--trial", type=int, default=None,
                   help="with --study-name: this trial's config instead of the declared one")
    p.add_argument("--format", dest="fmt", choices=("k8s", "compose", "serve"), default="k8s")
    p.add_argument("-o", "--output", type=Path, default=None,
                   help="write here instead of standard output")
    p.add_argument("--shape", type=Path, default=None,
                   help="check the config against this traffic shape (default: the study's)")
    p.add_argument("--force", action="store_true",
                   help="export a config never measured feasible, or one whose context "
                        "cannot hold the shape (the files say so)")
    p.add_argument("--name", default="vllm", help="Kubernetes object / compose service name")
    p.add_argument("--namespace", default=None, help="Kubernetes namespace")
    p.add_argument("--image", default=None,
                   help="container image (default: vLLM's image of the study's version)")
    p.add_argument("--replicas", type=int, default=None,
                   help="replicas (default: the GPUs the traffic needs at its peak, with "
                        "--growth, / the GPUs of one server; 1 when the study has no figure)")
    p.add_argument("--model-pvc", default=None, metavar="CLAIM",
                   help="mount the model from this PersistentVolumeClaim (default: the "
                        "study's model folder as a hostPath volume)")
    p.add_argument("--served-model-name", default=None,
                   help="the model name clients ask for (default: the model folder's name)")
    p.set_defaults(func=_export)


def _export(args: argparse.Namespace) -> int:
    from autotune.deploy import ExportOptions, export, from_best_json, from_study
    from autotune.errors import ConfigError

    if (args.source is None) == (args.study_name is None):
        raise ConfigError("give a best.json (or a study's output folder) or --study-name "
                          "(with --storage), one of them: "
                          + (f"e.g. autotune export {shlex.quote(str(args.source))} --format "
                             f"{args.fmt}" if args.source is not None else
                             "'autotune export --help' shows both"))
    if args.trial is not None and args.study_name is None:
        raise ConfigError("--trial needs --study-name (best.json holds one config)")
    if args.replicas is not None and args.replicas < 0:
        raise ConfigError(f"--replicas {args.replicas}: give 0 or more")
    src = (from_best_json(args.source) if args.source is not None else
           from_study(storage=storage_url(args.storage), study_name=args.study_name,
                      trial=args.trial))
    shape = None
    if args.shape is not None:
        from autotune.traffic import load_shape

        shape = load_shape(args.shape)
    opts = ExportOptions(name=args.name, image=args.image, namespace=args.namespace,
                         replicas=args.replicas, model_pvc=args.model_pvc,
                         served_model_name=args.served_model_name)
    out = export(src, fmt=args.fmt, options=opts, shape=shape, force=args.force)
    for note in out.notes:
        print(f"autotune export: note: {note}", file=sys.stderr)
    if out.deployable.stand_in:
        print("autotune export: note: the figures came from a stand-in (random weights); "
              f"dropped: {', '.join(out.deployable.dropped)}", file=sys.stderr)
    if args.output is None:
        sys.stdout.write(out.text)
        return 0
    from autotune.results import write_atomic

    write_atomic(args.output, lambda tmp: tmp.write_text(out.text))
    if args.fmt == "serve":
        args.output.chmod(0o755)
    print(f"written: {args.output} ({args.fmt}; study {src.study}, trial {src.trial})",
          file=sys.stderr)
    return 0

"""Regenerate the committed example shapes in traffic/ from the public traces.

    python traffic/make_examples.py [--traces ../shared/traces]

Writes:
- azure-conv.json       Azure LLM inference trace 2023, conversation (fitted as is)
- mooncake-conv.json    Mooncake FAST'25 conversation trace (fitted as is)
- example-chat.json     the Azure conversation shape scaled down for a tiny model on a CPU:
                        input lengths / 8 and output lengths / 3 (rounded up), clipped to
                        input <= 512 and output <= 128; closed loop, 8 streams, 48 requests
- casestudy-512x512.json  fixed 512 in / 512 out, closed loop, 256 streams, 2,560 requests

Only derived statistics are written (see traffic/README.md for the attribution); the traces
themselves are not needed at run time.
"""

from __future__ import annotations

import argparse
import dataclasses
from pathlib import Path

import numpy as np

from autotune.traffic import (
    LoadSpec,
    SourceInfo,
    TraceRecords,
    constant_shape,
    fit_shape,
    read_trace,
    save_shape,
)

HERE = Path(__file__).resolve().parent
DEFAULT_TRACES = HERE.parent.parent / "shared" / "traces"

INPUT_DIVISOR = 8
OUTPUT_DIVISOR = 3
MAX_INPUT = 512
MAX_OUTPUT = 128


def scale_lengths(records: TraceRecords) -> TraceRecords:
    """Lengths divided by the stated factors (rounded up, so >= 1), then clipped."""
    return dataclasses.replace(
        records,
        input_tokens=np.minimum(-(-records.input_tokens // INPUT_DIVISOR), MAX_INPUT),
        output_tokens=np.minimum(-(-records.output_tokens // OUTPUT_DIVISOR), MAX_OUTPUT),
    )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument(
        "--traces",
        type=Path,
        default=DEFAULT_TRACES,
        help="folder with the public trace files (default: ../shared/traces)",
    )
    parser.add_argument("--out", type=Path, default=HERE, help="where to write (default: traffic/)")
    args = parser.parse_args()

    azure = read_trace(args.traces / "azure2023_conv.csv", format="azure")
    shape = fit_shape(azure, name="azure-conv")
    save_shape(shape, args.out / "azure-conv.json")

    mooncake = read_trace(args.traces / "mooncake_fast25_conversation.jsonl", format="mooncake")
    save_shape(fit_shape(mooncake, name="mooncake-conv"), args.out / "mooncake-conv.json")

    small = fit_shape(
        scale_lengths(azure),
        name="example-chat",
        load=LoadSpec(mode="closed", concurrency=8, requests=48),
    )
    small = small.model_copy(
        update={
            "source": SourceInfo(
                path="azure2023_conv.csv",
                format="azure",
                note=(
                    f"Azure conversation trace with input lengths / {INPUT_DIVISOR} and output "
                    f"lengths / {OUTPUT_DIVISOR} (rounded up), clipped to input <= {MAX_INPUT} and "
                    f"output <= {MAX_OUTPUT}: cheap on a CPU with a tiny model"
                ),
            )
        }
    )
    save_shape(small, args.out / "example-chat.json")

    case = constant_shape(
        512,
        512,
        name="casestudy-512x512",
        load=LoadSpec(mode="closed", concurrency=256, requests=2560),
    )
    save_shape(case, args.out / "casestudy-512x512.json")
    for name in ("azure-conv", "mooncake-conv", "example-chat", "casestudy-512x512"):
        print(f"wrote {args.out / (name + '.json')}")


if __name__ == "__main__":
    main()

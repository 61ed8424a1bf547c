"""How many GPUs one server of a config uses: read from its engine flags.

vLLM starts ``tensor x pipeline x data`` parallel ranks, one GPU each (expert parallelism
reuses those ranks; it adds none). The flags are the truth of a config: knobs, fixed and
derived flags alike end up there, so the count is read from them, never from knob names.
"""

from __future__ import annotations

from collections.abc import Sequence

__all__ = ["PARALLEL_FLAGS", "flag_value", "parallel_sizes", "server_gpus"]

#: every spelling vLLM's parser accepts for each size (``-tp 2``, ``--tensor-parallel-size=2``)
PARALLEL_FLAGS = {
    "tensor": ("--tensor-parallel-size", "-tp"),
    "pipeline": ("--pipeline-parallel-size", "-pp"),
    "data": ("--data-parallel-size", "-dp"),
}
_EP_ON = ("--enable-expert-parallel", "-ep")
_EP_OFF = ("--no-enable-expert-parallel", "--disable-expert-parallel")


def flag_value(flags: Sequence[str], *names: str) -> str | None:
    """The value ``flags`` give one of ``names`` (``--x V`` or ``--x=V``; the last one
    wins, as in vLLM's argument parser), None when they do not set it."""
    value = None
    for i, arg in enumerate(flags):
        name, eq, inline = arg.partition("=")
        if name in names and (eq or i + 1 < len(flags)):
            value = inline if eq else flags[i + 1]
    return value


def _value(flags: Sequence[str], names: tuple[str, ...]) -> int:
    """The size ``flags`` give (one of ``names``); 1 when absent or not a positive integer
    (vLLM rejects those itself)."""
    try:
        return max(1, int(flag_value(flags, *names) or 1))
    except ValueError:
        return 1


def parallel_sizes(flags: Sequence[str]) -> dict[str, int | bool]:
    """``{"tensor": TP, "pipeline": PP, "data": DP, "expert": EP on}`` of a server's flags."""
    sizes: dict[str, int | bool] = {k: _value(flags, names) for k, names in PARALLEL_FLAGS.items()}
    ep = False
    for arg in flags:
        if arg in _EP_ON:
            ep = True
        elif arg in _EP_OFF:
            ep = False
    sizes["expert"] = ep
    return sizes


def server_gpus(flags: Sequence[str]) -> int:
    """GPUs one server with these engine flags uses: tensor x pipeline x data parallel
    size (1 without any). The per-GPU objective, the placement of its trial and the GPUs
    the traffic needs all divide or multiply by this."""
    s = parallel_sizes(flags)
    return int(s["tensor"]) * int(s["pipeline"]) * int(s["data"])

"""The GPU side: a worker process that times vLLM's own fused-MoE call, one config at a time.

Run as ``python -m autotune.kernels._worker`` with one GPU visible. It reads JSON lines on
stdin and answers one JSON line per request on stdout (everything else goes to stderr):

* first line ``{"shape": {...MoeShape...}, "seed": 0}``: answers ``{"ok": true, "device":
  "NVIDIA H200", "file_name": <vLLM's own get_config_file_name(...)>, "versions": {...}}``;
* then ``{"m": 256, "config": {...}, "iters": 20}``: answers ``{"ok": true, "us": 41.2}``
  or ``{"ok": false, "reason": "out_of_resources"|"compile_error"|"error", "message": ...}``.

Timing is vLLM's benchmark's (``benchmarks/kernels/benchmark_moe.py``,
``benchmark_config``): top-k routing plus ``fused_experts`` under ``override_config``, ten
calls captured in one CUDA graph, five warm-up replays, then ``iters`` replays timed with
CUDA events, each with fresh router logits; the mean per call in microseconds. A CUDA
error (illegal address, ...) leaves the context unusable: the worker answers and exits, and
the driver starts a new one.
"""

from __future__ import annotations

import json
import sys
from typing import NotRequired, TextIO, TypedDict

__all__ = ["GRAPH_CALLS", "WARMUP_REPLAYS", "main"]

#: fused-MoE calls captured in the one CUDA graph a timing replays
GRAPH_CALLS = 10
#: replays before the timed ones
WARMUP_REPLAYS = 5


class WorkerShape(TypedDict):
    """The MoE shape the driver sends a worker (``MoeShape`` with its activation)."""

    experts: int
    intermediate: int
    hidden: int
    topk: int
    gated: bool
    torch_dtype: str
    config_dtype: str | None
    block_shape: tuple[int, int] | list[int] | None
    activation: str


class Answer(TypedDict):
    """One line a worker writes: its greeting (``device``, ``file_name``, ``versions``), a
    timing (``us``), or why it has neither (``reason``, ``message``)."""

    ok: bool
    device: NotRequired[str]
    file_name: NotRequired[str]
    versions: NotRequired[dict[str, str]]
    us: NotRequired[float]
    reason: NotRequired[str]
    message: NotRequired[str]


class _Bench:
    """The tensors of one MoE layer on the GPU, made once per worker."""

    def __init__(self, shape: WorkerShape, seed: int) -> None:
        import torch

        self.torch = torch
        torch.manual_seed(seed)
        torch.set_default_device("cuda")
        self.dtype = getattr(torch, shape["torch_dtype"])
        self.shape = shape
        e, k, n = shape["experts"], shape["hidden"], shape["intermediate"]
        rows = 2 * n if shape["gated"] else n
        scale = 1.0 / k ** 0.5
        self.w1 = (torch.randn(e, rows, k, dtype=torch.float32) * scale).to(self.dtype)
        self.w2 = (torch.randn(e, k, n, dtype=torch.float32) * (1.0 / n ** 0.5)).to(self.dtype)

    def time(self, config: dict[str, int], m: int, iters: int) -> float:
        torch = self.torch
        from vllm.model_executor.layers.fused_moe import (
            fused_experts,
            fused_topk,
            override_config,
        )
        from vllm.model_executor.layers.fused_moe.activation import MoEActivation

        e, k, topk = self.shape["experts"], self.shape["hidden"], self.shape["topk"]
        activation = MoEActivation(self.shape["activation"])
        x = torch.randn(m, k, dtype=self.dtype)
        logits = torch.randn(iters, m, e, dtype=torch.float32)
        gating = torch.empty(m, e, dtype=torch.float32)
        gating.copy_(logits[0])

        def run() -> object:
            with override_config(dict(config)):
                weights, ids, _ = fused_topk(x, gating, topk, renormalize=True)
                return fused_experts(x, self.w1, self.w2, weights, ids, activation=activation)

        run()  # compile (a failure to compile or to launch raises here)
        torch.cuda.synchronize()
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            for _ in range(GRAPH_CALLS):
                run()
        torch.cuda.synchronize()
        for _ in range(WARMUP_REPLAYS):
            graph.replay()
        torch.cuda.synchronize()
        start = torch.cuda.Event(enable_timing=True)
        end = torch.cuda.Event(enable_timing=True)
        total_ms = 0.0
        for i in range(iters):
            gating.copy_(logits[i])
            torch.cuda.synchronize()
            start.record()
            graph.replay()
            end.record()
            end.synchronize()
            total_ms += start.elapsed_time(end)
        graph.reset()
        return total_ms / (iters * GRAPH_CALLS) * 1000.0


def _classify(exc: BaseException) -> str:
    name = type(exc).__name__
    text = f"{name}: {exc}"
    if name == "OutOfResources" or "out of resource" in text.lower() or "shared memory" in text:
        return "out_of_resources"
    if (name in ("CompilationError", "CompileTimeAssertionFailure", "PTXASError")
            or "compil" in text.lower() or "ptxas" in text.lower()):
        return "compile_error"
    if "CUDA error" in text or "cudaError" in text or "illegal" in text.lower():
        return "cuda_error"
    return "error"


def _hello(shape: WorkerShape) -> Answer:
    import torch
    import triton
    import vllm
    from vllm.model_executor.layers.fused_moe.fused_moe import get_config_file_name

    block = shape.get("block_shape")
    return {
        "ok": True,
        "device": torch.cuda.get_device_name(0),
        "file_name": get_config_file_name(shape["experts"], shape["intermediate"],
                                          shape.get("config_dtype"),
                                          list(block) if block else None),
        "versions": {"vllm": vllm.__version__, "torch": torch.__version__,
                     "triton": triton.__version__},
    }


def _serve(inp: TextIO, out: TextIO) -> int:
    def send(obj: Answer) -> None:
        out.write(json.dumps(obj) + "\n")
        out.flush()

    first = inp.readline()
    if not first:
        return 1
    setup = json.loads(first)
    try:
        import torch

        if not torch.cuda.is_available():
            send({"ok": False, "reason": "no_cuda",
                  "message": "torch sees no CUDA GPU in this worker"})
            return 2
        hello = _hello(setup["shape"])
        bench = _Bench(setup["shape"], int(setup.get("seed", 0)))
    except Exception as exc:  # noqa: BLE001 - any set-up failure goes to the driver
        send({"ok": False, "reason": "setup", "message": f"{type(exc).__name__}: {exc}"})
        return 2
    send(hello)
    for line in inp:
        req = json.loads(line)
        try:
            us = bench.time(req["config"], int(req["m"]), int(req["iters"]))
        except Exception as exc:  # noqa: BLE001 - a config that fails is data
            reason = _classify(exc)
            send({"ok": False, "reason": reason, "message": f"{type(exc).__name__}: {exc}"[:2000]})
            if reason == "cuda_error":
                return 3  # the CUDA context is lost: the driver starts a new worker
            continue
        send({"ok": True, "us": us})
    return 0


def main() -> int:
    out = sys.stdout
    sys.stdout = sys.stderr  # vLLM and Triton print; the protocol owns the real stdout
    return _serve(sys.stdin, out)


if __name__ == "__main__":
    sys.exit(main())

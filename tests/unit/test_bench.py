"""``autotune bench``'s own decisions before any server starts (pure: a model folder with a
config.json, no server)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest


def _model(tmp_path: Path, model_type: str) -> Path:
    d = tmp_path / model_type
    d.mkdir()
    (d / "config.json").write_text(json.dumps({"model_type": model_type, "vocab_size": 64}))
    return d


def test_bench_of_a_hybrid_on_the_cpu_build_turns_prefix_caching_off_and_says_so(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    # issue 66: `bench -- --max-model-len 2048 -O0` of the demo's tiny hybrid crashed the CPU
    # server (IndexError in mamba_mixer2), which tune's CPU space already works around
    import autotune.hardware
    from autotune.cli._bench import CPU_HYBRID_FLAG, cpu_hybrid_workaround

    monkeypatch.setattr(autotune.hardware, "gpu_names", lambda: [])  # the CPU build
    hybrid, llama = _model(tmp_path, "nemotron_h"), _model(tmp_path, "llama")
    flags, note = cpu_hybrid_workaround(hybrid, ["--max-model-len", "2048", "-O0"])
    assert flags == ["--max-model-len", "2048", "-O0", CPU_HYBRID_FLAG]
    assert note.startswith(f"note: added {CPU_HYBRID_FLAG}: the CPU build of vLLM crashes "
                           "hybrid (Mamba) models with prefix caching") and "\n" not in note
    # the user's own choice stands; a model without Mamba layers needs nothing
    assert cpu_hybrid_workaround(hybrid, ["--enable-prefix-caching"]) == (
        ["--enable-prefix-caching"], "")
    assert cpu_hybrid_workaround(llama, ["-O0"]) == (["-O0"], "")
    monkeypatch.setattr(autotune.hardware, "gpu_names", lambda: ["NVIDIA H100"])
    assert cpu_hybrid_workaround(hybrid, []) == ([], "")  # a GPU build serves it

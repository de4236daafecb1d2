"""``scripts/bench-comfy encode-memory`` end to end on its smallest setting, so it cannot rot between the runs that
refresh its section of docs/BENCHMARKS.md: it once passed Encode Dataset an input the node had renamed
(``dataset`` → ``dataset_name``) and failed at once. It runs in a process of its own, as it measures that process's
memory; nothing here is timed, and no figure is checked, only that each phase ran and the section renders."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

from support.comfy_env import find_comfyui
from support.paths import PACK_ROOT

PHASES = ("ComfyUI and the pack imported", "VAE and CLIP-L loaded", "Encode Dataset: 1 images of 64 px",
          "tiny Flux diffusion model loaded", "Train LoRA: 1 steps")


def test_the_encode_memory_bench_runs_every_phase_and_renders_its_section(tmp_path: Path) -> None:
    install = find_comfyui()
    assert install is not None  # the suite is skipped without ComfyUI
    env = {**os.environ, "COMFYUI_PATH": str(install.path), "COMFYUI_PYTHON": sys.executable,
           "TMPDIR": str(tmp_path)}
    done = subprocess.run([sys.executable, "bench/run_comfyui.py", "encode-memory", "--images", "1", "--size", "64",
                           "--steps", "1"], cwd=PACK_ROOT, env=env, capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stderr[-2000:]
    out = done.stdout
    assert out.count("<!-- bench-encode-memory:") == 2, out[-2000:]
    for phase in PHASES:
        assert f"| {phase}" in out, (phase, out[-2000:])
    assert "Loaded models (ComfyUI's `current_loaded_models`) when the encode ended:" in out
    # its folders (about 20 MiB a run) are removed: every run once left them in the temporary folder
    assert not list(tmp_path.glob("bench_encode_memory_*")), sorted(p.name for p in tmp_path.iterdir())

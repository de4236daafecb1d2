"""``scripts/bench-comfy saves`` end to end on the GPU harness's tiny stand-in models, so it cannot rot between the
runs that refresh its part of docs/BENCHMARKS.md. It runs in a process of its own (as the command does); nothing
here is timed: only that both arms trained and the saving arm's files were found."""

from __future__ import annotations

import os
import subprocess
import sys

from support.comfy_env import find_comfyui
from support.paths import PACK_ROOT


def test_the_saves_bench_trains_both_arms_and_measures_a_save() -> None:
    install = find_comfyui()
    assert install is not None  # the suite is skipped without ComfyUI
    env = {**os.environ, "COMFYUI_PATH": str(install.path), "COMFYUI_PYTHON": sys.executable}
    done = subprocess.run([sys.executable, "bench/run_comfyui.py", "saves", "--tiny", "--only", "sd15",
                           "--runs", "1", "--steps", "2"], cwd=PACK_ROOT, env=env, capture_output=True, text=True,
                          timeout=600)
    assert done.returncode == 0, (done.stdout[-2000:], done.stderr[-2000:])
    (row,) = [x for x in done.stdout.splitlines() if x.startswith("| SD1.5")]
    cells = [c.strip() for c in row.strip("|").split("|")]
    assert len(cells) == 8 and "—" not in cells  # both arms measured, the saves timed by the trainer
    lora_mib, state_mib = float(cells[6]), float(cells[7])
    assert lora_mib > 0 and state_mib > lora_mib  # AdamW's two moments, each the LoRA's size (fp32 here)
    assert "Arms without figures" not in done.stdout

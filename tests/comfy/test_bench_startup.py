"""``scripts/bench-comfy startup`` end to end on the GPU harness's tiny stand-in models, so it cannot rot between the
runs that refresh its part of docs/BENCHMARKS.md. It runs in a process of its own (as the command does); nothing
here is timed: only that both trainers ran and the table names every phase ours timed."""

from __future__ import annotations

import os
import subprocess
import sys

from support.comfy_env import find_comfyui
from support.paths import PACK_ROOT

PHASES = ("data", "model", "memory plan", "loader", "model to device", "garbage collection", "first batch",
          "first step")


def test_the_startup_bench_runs_both_trainers_and_lists_ours_phases() -> None:
    install = find_comfyui()
    assert install is not None  # the suite is skipped without ComfyUI
    env = {**os.environ, "COMFYUI_PATH": str(install.path), "COMFYUI_PYTHON": sys.executable}
    done = subprocess.run([sys.executable, "bench/run_comfyui.py", "startup", "--tiny", "--only", "sd15",
                           "--runs", "1"], cwd=PACK_ROOT, env=env, capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, (done.stdout[-2000:], done.stderr[-2000:])
    lines = done.stdout.splitlines()
    header = next(x for x in lines if x.startswith("| family |"))
    assert [c.strip() for c in header.strip("|").split("|")][4:] == [f"ours: {p}" for p in PHASES]
    (row,) = [x for x in lines if x.startswith("| SD1.5")]
    cells = [c.strip() for c in row.strip("|").split("|")]
    assert len(cells) == 4 + len(PHASES) and "—" not in cells  # both arms measured, every phase timed
    assert "Arms without figures" not in done.stdout

"""``scripts/bench-comfy dropout`` (``bench/dropout_cost.py``) on the real ComfyUI, at its smallest setting (one
narrow family, one timed and one counted step per arm), so the command cannot rot between runs: every arm trains,
and what the counts must show holds (exact counts, the same on any machine). It runs in a process of its own, as
the benchmark sets ComfyUI's folders up for itself."""

from __future__ import annotations

import os
import subprocess
import sys

from support.comfy_env import find_comfyui
from support.paths import PACK_ROOT

ARMS = ("plain", "module", "rank", "bypass", "bypass + all")


def test_every_arm_runs_and_a_skip_costs_the_step_no_op() -> None:
    install = find_comfyui()
    assert install is not None  # the suite is skipped without ComfyUI
    env = {**os.environ, "COMFYUI_PATH": str(install.path), "COMFYUI_PYTHON": sys.executable}
    done = subprocess.run([sys.executable, "bench/run_comfyui.py", "dropout", "--only", "sd15", "--timed", "1",
                           "--counted", "1", "--no-doc"], cwd=PACK_ROOT, env=env, capture_output=True, text=True,
                          timeout=600)
    assert done.returncode == 0, done.stderr[-2000:]
    rows = {cells[1]: cells for cells in ([c.strip() for c in line.strip("|").split("|")]
                                          for line in done.stdout.splitlines() if line.startswith("| SD1.5 |"))}
    assert list(rows) == list(ARMS), done.stdout[-2000:]
    ops = {arm: int(cells[2].replace(",", "")) for arm, cells in rows.items()}
    syncs = {arm: float(cells[4]) for arm, cells in rows.items()}
    assert set(syncs.values()) == {syncs["plain"]}  # no draw reads a value back
    assert ops["module"] < ops["plain"]  # a skipped layer adds nothing; choosing it is no op of the step
    assert ops["rank"] > ops["plain"] and ops["bypass + all"] > ops["bypass"]  # the masks are drawn on the device

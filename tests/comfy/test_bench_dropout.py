"""``scripts/bench-comfy dropout`` (``bench/dropout_cost.py``) on the real ComfyUI, at its smallest setting (one
narrow family, one timed and one counted step per arm), so the command cannot rot between runs: every arm trains,
and what the counts must show holds (exact counts, the same on any machine)."""

from __future__ import annotations

from pathlib import Path

from support.pack import import_bench

import_bench()

from bench import dropout_cost  # noqa: E402


def test_every_arm_runs_and_a_skip_costs_the_step_no_op(comfy_folders: Path) -> None:
    results = dropout_cost.measure(["sd15"], timed=1, counted=1, say=lambda _line: None)
    assert [arm for arm, _ in results] == list(dropout_cost.ARMS)
    by_arm = {arm: r for arm, r in results}
    assert not [r.error for r in by_arm.values() if r.error]
    ops = {arm: r.counts.per_step() for arm, r in by_arm.items()}
    syncs = {arm: r.counts.per_step(kind="sync") for arm, r in by_arm.items()}
    assert set(syncs.values()) == {syncs["plain"]}  # no draw reads a value back
    assert ops["module"] < ops["plain"]  # a skipped layer adds nothing; choosing it is no op of the step
    assert ops["rank"] > ops["plain"] and ops["bypass + all"] > ops["bypass"]  # the masks are drawn on the device
    text = dropout_cost.render(results, "scripts/bench-comfy dropout --only sd15")
    assert text.count("| SD1.5 |") == len(dropout_cost.ARMS) and "failed" not in text

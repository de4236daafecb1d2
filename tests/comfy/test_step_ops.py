"""``scripts/bench-step-ops``' counting harness on tiny models with the real ComfyUI: what one training step of ours
and of ComfyUI's ``TrainLoraNode`` dispatches, counted on the CPU as a GPU would see it (bench/step_ops.py).

Counts on the CPU are deterministic for a given torch and ComfyUI, so each arm's two counted steps must be equal op
for op; the assertions compare the arms (no count is written down here). Nothing is timed.
"""

from __future__ import annotations

from pathlib import Path
from types import ModuleType
from typing import Any

import pytest
from support.pack import import_bench

import_bench()

from bench.gpu import context_from_pack, device_info, tiny_specs  # noqa: E402
from bench.step_ops import ArmCounts, measure  # noqa: E402
from bench.step_ops_report import TITLE, render  # noqa: E402

FAMILIES = ("sd15", "flux")


@pytest.fixture(scope="module")
def counted(pack: ModuleType, comfy_folders: Path, tmp_path_factory: pytest.TempPathFactory
            ) -> tuple[dict[tuple[str, str], ArmCounts], str]:
    """Every arm of tiny SD1.5 and Flux at batch 1, timed (2 steps) and counted (2 steps), and the rendered
    section."""
    work = tmp_path_factory.mktemp("step_ops")
    lines: list[str] = []
    ctx = context_from_pack(pack, work, work / "out", lines.append)
    families = {k: v for k, v in tiny_specs()[0].items() if k in FAMILIES}
    results = measure(ctx, families, {k: (1,) for k in families}, timed=2, counted=2, say=lines.append)
    section = render(results, families, device_info(ctx.device, "test"), "scripts/bench-step-ops --test", 1.0,
                     timed=2, counted=2)
    return {(r.family, r.arm): r for r in results}, section


def _both(counted: Any, family: str) -> tuple[ArmCounts, ArmCounts]:
    arms = counted[0]
    for arm in ("bound", "ours", "lean", "builtin"):
        res = arms[(family, arm)]
        assert not res.error, (family, arm, res.error)
        c = res.counts
        assert c.steps == 2 and c.totals[0] > 0
        assert c.windows[0] == c.windows[1], f"{family}/{arm}: two steps counted differently"
    return arms[(family, "ours")], arms[(family, "builtin")]


@pytest.mark.parametrize("family", FAMILIES)
def test_ours_launches_no_more_kernels_than_the_builtin_and_never_waits_for_the_device(counted: Any,
                                                                                      family: str) -> None:
    ours, builtin = _both(counted, family)
    o, b = ours.counts, builtin.counts
    assert o.per_step(kind="kernel") <= b.per_step(kind="kernel")
    # the built-in's per-parameter `param.grad.data = ...` loop: two detaches a parameter, ours has none
    assert o.per_step(phase="loop") + 2 * ours.params <= b.per_step(phase="loop")
    # no host sync in ours: losses read a step late, noise and sigmas drawn by the loader, what ComfyUI's
    # extra_conds make on the host (Flux's guidance) copied without blocking; the built-in's `.item()` calls and
    # pageable copies are seen, so a sync of ours would be too
    assert o.per_step(kind="sync") == 0
    assert b.per_step(kind="sync", phase="loop") >= 2
    # the same AdamW in both, in its foreach form as on CUDA (far fewer kernels than tensors; `.item()` of its
    # step counters on the host)
    assert o.per_step(phase="optimizer") == b.per_step(phase="optimizer")
    assert 0 < o.per_step(phase="optimizer", kind="kernel") < ours.params / 10
    assert o.per_step(phase="optimizer", kind="host") >= ours.params
    # every op of a step falls in some phase and place; the model's own layers and autograd do most of the work
    for res in (ours, builtin):
        assert sum(res.counts.windows[0].values()) == res.counts.totals[0]
        assert res.counts.per_step(category="model") > 0 and res.counts.per_step(phase="backward") > 0
        assert res.counts.calls_per_step() > res.counts.per_step() / 10


def test_the_bound_and_ours_run_the_same_step(counted: Any) -> None:
    """The bound is ours with every batch already in memory: the model, backward and optimizer ops are the same."""
    arms = counted[0]
    for family in FAMILIES:
        _both(counted, family)
        bound, ours = arms[(family, "bound")].counts, arms[(family, "ours")].counts
        for phase in ("forward", "recompute", "backward", "optimizer"):
            assert bound.per_step(phase=phase) == ours.per_step(phase=phase), (family, phase)


@pytest.mark.parametrize("family", FAMILIES)
def test_blocks_kept_whole_are_not_recomputed(counted: Any, family: str) -> None:
    """On a CPU the memory free is its RAM, so ours keeps every block whole: no recompute, fewer ops and Python
    calls a step than ``lean`` (every block checkpointed), the same optimizer; lean recomputes what ours ran once."""
    ours, _ = _both(counted, family)
    lean = counted[0][(family, "lean")]
    o, n = ours.counts, lean.counts
    assert o.per_step(phase="recompute") == 0 < n.per_step(phase="recompute")
    assert o.per_step() < n.per_step() and o.calls_per_step() < n.calls_per_step()
    assert o.per_step(phase="optimizer") == n.per_step(phase="optimizer")
    assert o.per_step(category="checkpoint") == 0 < n.per_step(category="checkpoint")
    # every block kept whole: the runners come off where no block needs copies of its inputs (Flux's do)
    assert (o.calls_per_step(category="runner") == 0) == (family == "sd15")


@pytest.mark.parametrize("family", FAMILIES)
def test_ours_collects_garbage_once_a_step_between_steps(counted: Any, family: str) -> None:
    """Ours' training thread runs no collector pass inside a step: exactly one young pass at each step's end."""
    ours, _ = _both(counted, family)
    assert len(ours.step_s) == 2
    assert [generation for generation, _ in ours.gc_passes] == [1, 1]


def test_the_section_has_every_table(counted: Any) -> None:
    section = counted[1]
    assert section.startswith(TITLE)
    for heading in ("### S1.", "### S2.", "### S3.", "### S4.", "### S5.", "### S6."):
        assert heading in section
    assert "| SD1.5 (tiny) | 1 | ours |" in section and "| Flux (tiny) | 1 | builtin |" in section
    assert "every arm's counted steps equal op for op" in section

"""``scripts/bench-gpu``'s harness on the CPU with the real ComfyUI, so it cannot rot between GPU runs.

The full-size families are built on ``meta`` only (ComfyUI's detection must name each one from the shapes, and the
parameter counts must be those the report states); the harness itself (model construction from a random state dict,
the clone factory, the cache, the bound / ours / built-in arms, Encode Dataset against ``MakeTrainingDataset``, the
profiler breakdown, the one-line skips of #25/#26's arms, the files written as it goes) runs on tiny configs of the
same classes. Nothing here is timed: the figures' presence and shape are checked, not their values.
"""

from __future__ import annotations

import json
import math
from pathlib import Path
from types import ModuleType

import pytest
import torch
from support.pack import import_bench

import_bench()

from bench.gpu import STANDIN_SETTINGS, Options, context_from_pack, device_info, measure, tiny_specs  # noqa: E402
from bench.gpu_figures import load_run  # noqa: E402
from bench.gpu_models import FULL_FAMILIES, diffusion_shapes, param_count  # noqa: E402


@pytest.mark.parametrize("name", list(FULL_FAMILIES))
def test_full_size_families_are_named_by_comfyuis_detection(name: str) -> None:
    import comfy.model_detection

    spec = FULL_FAMILIES[name]
    shapes = diffusion_shapes(spec)
    meta = {k: torch.empty(s, dtype=torch.bfloat16, device="meta") for k, s in shapes.items()}
    config = comfy.model_detection.model_config_from_unet(meta, "")
    assert config is not None
    assert type(config.get_model({}, device=torch.device("meta"))).__name__ == spec.model_class
    assert param_count(shapes) / 1e9 == pytest.approx(spec.params_b, rel=0.02)


def test_the_harness_runs_every_part_on_tiny_models(pack: ModuleType, comfy_folders: Path, tmp_path: Path) -> None:
    lines: list[str] = []
    out = tmp_path / "out"
    ctx = context_from_pack(pack, tmp_path / "work", out, lines.append)
    ctx.work.mkdir()
    families, vaes = tiny_specs()
    only = ["sd15/b1", "wan21/b1/builtin", "encode/sd15", "cap", "devices"]
    opts = Options(steps=2, warmup=1, budget_s=3600.0, only=only,
                   profile=True, profile_steps=1, encode_images=2, extras=False, settings=STANDIN_SETTINGS,
                   batches={"sd15": (1,), "wan21": (1,)}, command="scripts/bench-gpu --cpu-standin")
    run = measure(ctx, opts, families, vaes, device_info(ctx.device, "test"), torch.float32)

    assert run.finished and run.device.kind == "cpu"
    by_id = {f.id: f for f in run.train}
    assert list(by_id) == ["sd15/b1/bound", "sd15/b1/ours", "sd15/b1/builtin", "wan21/b1/builtin"]
    for fig in by_id.values():
        assert fig.ok, (fig.id, fig.error, fig.skipped)
        assert len(fig.step_s) == 2 and fig.first_s is not None and fig.peak_gib is None  # no device memory here
        assert len(fig.losses) == 3 and all(math.isfinite(x) for x in fig.losses)
        assert fig.settings["rank"] == 16 and fig.settings["training_dtype"] == "fp32"
    assert by_id["sd15/b1/ours"].data_wait_pct is not None and by_id["sd15/b1/builtin"].data_wait_pct is None
    assert set(run.builds) == {"sd15", "wan21"}

    (row,) = run.encode
    assert not row.error and row.ours_s and row.builtin_s and row.images == 2

    assert [p.id for p in run.profile] == ["profile/sd15/b1/bound", "profile/sd15/b1/ours"]
    for prof in run.profile:
        assert not prof.error and prof.steps == 1 and prof.step_ms > 0 and prof.top_ops
        assert "streamcache.model_call" in prof.labels_ms
    assert "streamcache.next_batch" in run.profile[1].labels_ms

    # #25's and #26's arms: selected, and skipped with one line each (no `memory` setting yet, or no CUDA device
    # to cap; one device here)
    assert sum(n.startswith("Memory-capped arms (#25") and "skipped" in n for n in run.notes) == 1
    assert any(n.startswith("Multi-GPU arms (#26): skipped") for n in run.notes)
    assert any(n.startswith("Page cache before ours: ") for n in run.notes)

    saved = load_run(out / "results.json")
    assert [f.id for f in saved.train] == list(by_id) and saved.finished
    section = (out / "section.md").read_text()
    assert section.startswith("## GPU benchmarks (`scripts/bench-gpu`)") and "| SD1.5 (tiny) | 64², b1 | 1 |" in section
    assert json.loads((out / "results.json").read_text())["device"]["kind"] == "cpu"
    assert any(line.startswith("sd15/b1/ours (depth 1): median") for line in lines)

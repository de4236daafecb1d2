"""Datasets of two caches trained together over HTTP: a project's folder encoded into its own cache, a style folder
and a regularization folder into a shared cache (kohya-style reg folders kept for many projects) → Combine Datasets
(the project ×2 + the style, two caches) → Train LoRA with the shared cache's reg set → Save LoRA, on the session's
real server; then Clean Cache cleans the shared cache (the run's read locks are gone).
"""

from __future__ import annotations

import math
from typing import Any

from support.client import ComfyClient
from support.datasets import Subset, make_kohya_folder
from support.examples import encode_prompt, train_inputs
from support.server import ComfyServer
from support.tiny_models import TinyModels

from dataset_cache.format.reader import open_cache

MAIN, SHARED = "e2e_multi_project", "e2e_multi_shared"
STEPS = 6
TRAIN = train_inputs(batch_size=2, steps=STEPS, seed=3)



def _encode(tiny_models: TinyModels, ids: tuple[str, str, str], folder: str, cache: str, name: str
            ) -> dict[str, Any]:
    """Encode Dataset of ``folder`` into ``cache`` as dataset ``name``, its loaders renumbered to ``ids``."""
    prompt = encode_prompt(tiny_models.name("vae"), tiny_models.name("clip"), folder, cache, dataset_name=name)
    vae, clip, encode = ids
    prompt["3"]["inputs"].update(vae=[vae, 0], clip=[clip, 0])
    return {vae: prompt["1"], clip: prompt["2"], encode: prompt["3"]}


def test_datasets_of_two_caches_train_together_and_leave_both_unlocked(
        comfy_server: ComfyServer, client: ComfyClient, tiny_models: TinyModels) -> None:
    make_kohya_folder(comfy_server.input_dir / MAIN, (Subset(1, "ohwx", ((64, 64),) * 4),))
    make_kohya_folder(comfy_server.input_dir / "e2e_multi_style", (Subset(1, "style", ((64, 64),) * 2),))
    make_kohya_folder(comfy_server.input_dir / "e2e_multi_reg", (Subset(1, "square", ((64, 64), (96, 64))),))
    prompt = {
        **_encode(tiny_models, ("1", "2", "10"), MAIN, MAIN, "project"),
        **_encode(tiny_models, ("1", "2", "11"), "e2e_multi_style", SHARED, "style"),
        **_encode(tiny_models, ("1", "2", "12"), "e2e_multi_reg", SHARED, "reg"),
        "13": {"class_type": "StreamCache_CombineDatasets", "inputs": {
            "dataset_a": ["10", 0], "repeats_a": 2, "dataset_b": ["11", 0], "repeats_b": 1}},
        "14": {"class_type": "UNETLoader", "inputs": {"unet_name": tiny_models.name("unet"),
                                                      "weight_dtype": "default"}},
        "15": {"class_type": "StreamCache_TrainLoRA", "inputs": {
            "model": ["14", 0], "dataset": ["13", 0], "reg_dataset": ["12", 0], "reg_ratio": 0.5,
            "reg_weight": 0.5, **TRAIN}},
        "16": {"class_type": "SaveLoRA", "inputs": {"lora": ["15", 0], "steps": ["15", 2],
                                                    "prefix": "loras/e2e_multi_cache"}},
    }
    result = client.run(prompt, timeout=900)
    assert result.status == "success"
    (combined,) = result.outputs["13"]["text"]
    main_root, shared_root = comfy_server.streamcache_dir / MAIN, comfy_server.streamcache_dir / SHARED
    assert combined == f"project×2 + style (caches at {main_root} (project); {shared_root} (style))"
    losses = result.outputs["15"]["loss"]
    assert len(losses) == STEPS and all(math.isfinite(x) for x in losses)
    (summary,) = result.outputs["15"]["text"]
    assert "dataset 'project×2 + style' (6 samples), regularization 'reg' (2 samples" in summary
    assert " regularization" in summary.split("rows: ")[1]  # regularization rows of the shared cache trained
    saved = sorted((comfy_server.output_dir / "loras").glob(f"e2e_multi_cache_{STEPS}_steps_*.safetensors"))
    assert saved
    with open_cache(main_root) as reader:  # each dataset stayed in its own cache: nothing was copied
        assert sorted(reader.datasets()) == ["project"]
    with open_cache(shared_root) as reader:
        assert sorted(reader.datasets()) == ["reg", "style"]

    clean = client.run({"20": {"class_type": "StreamCache_CleanCache",
                               "inputs": {"cache": SHARED, "dry_run": False}}})
    assert clean.status == "success"  # the run's shared read locks were released when it ended
    (report,) = clean.outputs["20"]["text"]
    assert "unreferenced: 0 entries" in report and "removed 0 entries" in report

"""Datasets of two caches trained together over HTTP: a project's folder encoded into its own cache, a style folder
and a regularization folder into a shared cache (kohya-style reg folders kept for many projects) → Combine Datasets
(the project ×2 + the style, two caches) → Train LoRA with the shared cache's reg set → Save LoRA, on the session's
real server; then Clean Cache cleans the shared cache (the run's read locks are gone).
"""

from __future__ import annotations

import json
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


def _check_metadata(server: ComfyServer, result: Any, images: list[Any]) -> None:
    """Save LoRA (Stream Cache)'s file holds the tensors Save LoRA Weights wrote and the run's metadata: the tags
    each folder's captions hold (counted by the encodes over HTTP, summed over the combined datasets), the
    folders' repeats, the family, the steps; the node says where it saved."""
    import safetensors

    (path,) = (server.output_dir / "loras").glob(f"e2e_meta_{STEPS}_steps_00001_.safetensors")
    (plain,) = (server.output_dir / "loras").glob(f"e2e_multi_cache_{STEPS}_steps_*.safetensors")
    with safetensors.safe_open(str(path), "pt") as f, safetensors.safe_open(str(plain), "pt") as g:
        meta = f.metadata()
        assert set(f.keys()) == set(g.keys()) and all(f.get_tensor(k).equal(g.get_tensor(k)) for k in f.keys())
    want: dict[str, dict[str, int]] = {}
    for image in images:
        tags = {t.strip() for line in image.caption.splitlines() for t in line.split(",") if t.strip()}
        for tag in tags:
            want.setdefault(image.path.parent.name, {}).setdefault(tag, 0)
            want[image.path.parent.name][tag] += 1
    assert json.loads(meta["ss_tag_frequency"]) == want
    assert json.loads(meta["ss_dataset_dirs"]) == {"1_ohwx": {"n_repeats": 2, "img_count": 4},
                                                   "1_style": {"n_repeats": 1, "img_count": 2}}
    assert (meta["ss_steps"], meta["ss_num_reg_images"], meta["modelspec.architecture"]) == (
        str(STEPS), "2", "stable-diffusion-v1/lora")
    shown = [e["data"]["text"] for e in result.events if e["type"] == "progress_text" and e["data"]["node"] == "17"]
    assert shown == [f"saved output/loras/{path.name}"] and result.outputs["17"]["text"] == shown


def test_datasets_of_two_caches_train_together_and_leave_both_unlocked(
        comfy_server: ComfyServer, client: ComfyClient, tiny_models: TinyModels) -> None:
    project = make_kohya_folder(comfy_server.input_dir / MAIN, (Subset(1, "ohwx", ((64, 64),) * 4),))
    style = make_kohya_folder(comfy_server.input_dir / "e2e_multi_style", (Subset(1, "style", ((64, 64),) * 2),))
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
        "17": {"class_type": "StreamCache_SaveLoRA", "inputs": {"lora": ["15", 0], "save_prefix": "loras/e2e_meta"}},
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
    _check_metadata(comfy_server, result, [*project.images, *style.images])
    with open_cache(main_root) as reader:  # each dataset stayed in its own cache: nothing was copied
        assert sorted(reader.datasets()) == ["project"]
    with open_cache(shared_root) as reader:
        assert sorted(reader.datasets()) == ["reg", "style"]

    clean = client.run({"20": {"class_type": "StreamCache_CleanCache",
                               "inputs": {"cache": SHARED, "dry_run": False}}})
    assert clean.status == "success"  # the run's shared read locks were released when it ended
    (report,) = clean.outputs["20"]["text"]
    assert "unreferenced: 0 entries" in report and "removed 0 entries" in report

"""Node "Save LoRA (Stream Cache)" and the training metadata Train LoRA gives its LoRA, on the real ComfyUI (CPU,
the tiny SD1.5).

The metadata is what kohya's trainers write into a LoRA (``ss_*``, ``modelspec.*``, content hashes): checked here
as the file holds it, against the run's settings, its dataset (a kohya folder's repeats and its tag counts, as
Encode Dataset stores them) and the file's own bytes.
"""

from __future__ import annotations

import dataclasses
import hashlib
import importlib
import json
import struct
from pathlib import Path
from types import ModuleType
from typing import Any

import pytest
import safetensors
import torch
from support.encoded import write_comfy_encoded

RUN = {  # Train LoRA's required inputs
    "batch_size": 2, "grad_accumulation_steps": 1, "steps": 2, "learning_rate": 1e-2, "rank": 4,
    "optimizer": "AdamW", "loss_function": "MSE", "seed": 7, "training_dtype": "fp32", "lora_dtype": "fp32",
    "algorithm": "LoRA", "gradient_checkpointing": False, "checkpoint_depth": 1, "offloading": False,
    "existing_lora": "[None]", "prefetch_batches": 2, "loader_threads": 0,
}
SIZES = [(64, 64)] * 4
ADAM_STEP = 3.2 * RUN["learning_rate"]
"""The most one AdamW step moves a parameter: the learning rate times (1 - β1) / √(1 - β2) = 3.16 for torch's
betas (Kingma & Ba, §2.1), plus the weight decay's 1e-2 × rate × |value|. ComfyUI's adapters train their alpha."""
CAPTIONS = ["cat, sitting", "cat, outdoors", "cat", "dog, sitting"]


def _module(pack: ModuleType, name: str) -> ModuleType:
    return importlib.import_module(f"{pack.__name__}.{name}")


@pytest.fixture(scope="module")
def tags(pack: ModuleType) -> dict[str, dict[str, int]]:
    """The tag counts Encode Dataset keeps for a ``10_cat`` folder of :data:`CAPTIONS`."""
    count_tags = _module(pack, "dataset_cache.tag_frequency").count_tags
    return count_tags(("10_cat", (caption,)) for caption in CAPTIONS)


@pytest.fixture(scope="module")
def dataset(pack: ModuleType, comfy_nodes: ModuleType, models: tuple, handles: ModuleType,
            tags: dict[str, dict[str, int]], tmp_path_factory: pytest.TempPathFactory) -> Any:
    """Dataset "cats": four samples of a kohya folder ``10_cat`` (10 repeats), stored with an encode's info (its
    bucket resolution and tag counts)."""
    _, clip, vae = models
    root = tmp_path_factory.mktemp("save_lora") / "cache"
    samples = write_comfy_encoded(pack, comfy_nodes, clip, vae, root, SIZES, seed=0)
    writer_cls = _module(pack, "dataset_cache.format.writer").CacheWriter
    with writer_cls(root) as writer:
        writer.set_dataset("cats", [dataclasses.replace(s, source=f"10_cat/{s.source}", repeats=10)
                                    for s in samples],
                           info={"settings": {"bucket": {"resolution": 64}}, "tag_frequency": tags})
        writer.set_dataset("flat", samples, info={"folder": "C:\\Users\\me\\my photos"})  # sources at the top
        writer.commit()
    return handles.StreamDatasetHandle(str(root), "cats")


def _train(pack: ModuleType, model: Any, dataset: Any, **options: Any) -> Any:
    node = _module(pack, "nodes.train_lora").TrainLoRA
    with torch.inference_mode():  # ComfyUI executes every node under inference mode
        return node.execute(model, dataset, **{**RUN, **options})


def _save(pack: ModuleType, lora: Any, **options: Any) -> Any:
    with torch.inference_mode():
        return _module(pack, "nodes.save_lora").SaveLoRA.execute(lora, **options)


def _read(path: Path) -> tuple[dict[str, torch.Tensor], dict[str, str], bytes]:
    """A safetensors file's tensors, metadata and data section (the bytes after its header)."""
    with safetensors.safe_open(str(path), "pt") as f:
        tensors = {k: f.get_tensor(k) for k in f.keys()}
        metadata = f.metadata()
    raw = path.read_bytes()
    (header,) = struct.unpack("<Q", raw[:8])
    return tensors, metadata, raw[8 + header:]


@pytest.fixture(scope="module")
def trained(pack: ModuleType, models: tuple, dataset: Any) -> Any:
    return _train(pack, models[0], dataset, rank=4, lora_alpha=2.0)


def test_the_trained_lora_carries_its_training_and_is_still_a_lora_model(trained: Any, dataset: Any,
                                                                         tags: dict[str, dict[str, int]]) -> None:
    lora, _, steps = trained.result[:3]
    assert isinstance(lora, dict) and all(isinstance(v, torch.Tensor) for v in lora.values())
    meta = lora.metadata
    assert meta["modelspec.architecture"] == "stable-diffusion-v1/lora" and meta["ss_base_model_version"] == "sd_v1"
    assert (meta["ss_steps"], meta["ss_max_train_steps"]) == (str(steps), str(steps)) and steps == 2
    assert (meta["ss_network_dim"], meta["ss_seed"]) == ("4", "7")
    assert abs(float(meta["ss_network_alpha"]) - 2.0) <= steps * ADAM_STEP
    assert meta["ss_num_train_images"] == "40" and meta["ss_resolution"] == "(64, 64)"
    assert json.loads(meta["ss_dataset_dirs"]) == {"10_cat": {"n_repeats": 10, "img_count": 4}}
    assert json.loads(meta["ss_tag_frequency"]) == tags == {"10_cat": {"cat": 3, "sitting": 2, "dog": 1,
                                                                       "outdoors": 1}}
    assert json.loads(meta["streamcache.settings"])["learning_rate"] == RUN["learning_rate"]


def test_sources_at_a_folders_top_count_under_its_name_and_an_older_dataset_gives_no_tags(
        pack: ModuleType, models: tuple, dataset: Any, handles: ModuleType) -> None:
    flat = handles.StreamDatasetHandle(dataset.cache_root, "flat")
    meta = _train(pack, models[0], flat, steps=1).result[0].metadata
    assert json.loads(meta["ss_dataset_dirs"]) == {"my photos": {"n_repeats": 1, "img_count": 4}}
    assert "ss_tag_frequency" not in meta and meta["ss_resolution"] == "(512, 512)"  # SD1.5's usual, unstated


def test_save_lora_writes_the_tensors_with_the_metadata_named_as_save_lora_weights(
        pack: ModuleType, trained: Any, lora_folder: Path) -> None:
    lora, _, steps = trained.result[:3]
    out = _save(pack, lora, save_prefix="loras/cat")
    path = lora_folder / "loras" / f"cat_{steps}_steps_00001_.safetensors"  # the LoRA's own steps name it
    tensors, meta, data = _read(path)
    assert set(tensors) == set(lora) and all(torch.equal(tensors[k], lora[k]) for k in lora)
    assert {k: v for k, v in meta.items() if k in lora.metadata} == lora.metadata
    assert meta["ss_output_name"] == meta["modelspec.title"] == "cat"
    assert meta["sshs_model_hash"] == hashlib.sha256(data).hexdigest()
    assert out.ui.as_dict()["text"] == (f"saved output/loras/{path.name}",)
    _save(pack, lora, save_prefix="loras/cat", steps=9)  # connected steps name it, the counter goes on
    assert (lora_folder / "loras" / "cat_9_steps_00002_.safetensors").is_file()


def test_a_saved_lora_continues_from_its_file_name_and_training_state(pack: ModuleType, models: tuple,
                                                                      dataset: Any, trained: Any,
                                                                      lora_folder: Path) -> None:
    _save(pack, trained.result[0], save_prefix="loras/cat")
    more = _train(pack, models[0], dataset, steps=1, existing_lora="cat_2_steps_00001_.safetensors", lora_alpha=1.0)
    assert more.result[2] == 3 and more.result[0].metadata["ss_steps"] == "3"
    # a continued LoRA keeps its own alpha (2, moved by its 3 steps), not this run's lora_alpha
    assert abs(float(more.result[0].metadata["ss_network_alpha"]) - 2.0) <= 3 * ADAM_STEP


def test_save_every_writes_each_save_with_the_metadata_of_its_step(pack: ModuleType, models: tuple,
                                                                   dataset: Any, lora_folder: Path) -> None:
    _train(pack, models[0], dataset, steps=2, save_every=1, save_prefix="loras/every")
    for steps in (1, 2):
        _, meta, data = _read(lora_folder / "loras" / f"every_{steps}_steps_0000{steps}_.safetensors")
        assert (meta["ss_steps"], meta["ss_max_train_steps"], meta["ss_output_name"]) == (str(steps), "2", "every")
        assert meta["modelspec.architecture"] == "stable-diffusion-v1/lora"
        assert meta["sshs_model_hash"] == hashlib.sha256(data).hexdigest()


def test_a_lora_from_elsewhere_is_saved_with_its_name_and_hashes_only(pack: ModuleType, lora_folder: Path) -> None:
    theirs = {"diffusion_model.x.lora_up.weight": torch.ones(4, 2), "diffusion_model.x.alpha": torch.tensor(1.0)}
    _save(pack, theirs, save_prefix="loras/theirs")
    tensors, meta, _ = _read(lora_folder / "loras" / "theirs_00001_.safetensors")
    assert set(meta) == {"ss_output_name", "sshs_model_hash", "sshs_legacy_hash"}
    assert all(torch.equal(tensors[k], theirs[k]) for k in theirs)


@pytest.mark.parametrize(("options", "named"), [
    ({"lora": None}, "lora: expected a LORA_MODEL"),
    ({"lora": {}}, "lora: expected a LORA_MODEL (Train LoRA's lora output), got dict (empty)"),
    ({"lora": {"w": 1.0}}, "lora: entry 'w' is not a named tensor"),
    ({"save_prefix": "../outside"}, "save_prefix"),
    ({"save_prefix": ""}, "save_prefix must be a file name prefix"),
    ({"steps": -1}, "steps must be a whole number from 0"),
])
def test_bad_inputs_are_refused_by_name_and_write_nothing(pack: ModuleType, lora_folder: Path,
                                                          options: dict[str, Any], named: str) -> None:
    call = {"lora": {"w": torch.ones(2)}, "save_prefix": "loras/bad", **options}
    with pytest.raises(ValueError) as error:
        _save(pack, call.pop("lora"), **call)
    assert named in str(error.value)
    assert not list(lora_folder.rglob("*.safetensors"))


def test_the_schema_is_save_lora_weights_with_this_packs_names(pack: ModuleType) -> None:
    schema = _module(pack, "nodes.save_lora").SaveLoRA.define_schema()
    assert (schema.node_id, schema.category, schema.is_output_node) == ("StreamCache_SaveLoRA", "StreamCache", True)
    assert [i.id for i in schema.inputs] == ["lora", "save_prefix", "steps"]
    assert schema.inputs[1].default == "loras/streamcache_lora" and schema.inputs[2].optional

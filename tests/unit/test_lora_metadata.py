"""Tests of dataset_cache.tag_frequency and dataset_cache.lora_metadata: the training tags a dataset's info keeps and
the metadata a saved LoRA carries (kohya's ss_* keys, the model spec's modelspec.* keys, A1111's content hashes)."""

from __future__ import annotations

import datetime
import hashlib
import json
import struct
from pathlib import Path

import pytest
import safetensors
import safetensors.torch
import torch

from dataset_cache.buckets import BucketConfig
from dataset_cache.encode_settings import EncodeSettings
from dataset_cache.encode_plan import plan_encode
from dataset_cache.encode_run import run_encode
from dataset_cache.format.reader import open_cache
from dataset_cache.format.writer import CacheWriter
from dataset_cache.lora_metadata import (ARCHITECTURES, addnet_hashes, architecture_of, file_metadata,
                                         network_shape, training_metadata)
from dataset_cache.tag_frequency import (MAX_FOLDERS, MAX_TAGS, MAX_TAGS_PER_FOLDER, count_tags, merge_tag_frequency,
                                         read_tag_frequency)
from support.datasets import make_kohya_folder
from support.fake_encoders import FakeEncoders

SETTINGS = EncodeSettings(bucket=BucketConfig(resolution=64, step=16, min_side=32), batch_size=2)


# ------------------------------------------------------------------------------------------------ tag frequency
def test_a_tag_counts_once_per_image_whatever_its_lines_hold() -> None:
    counts = count_tags([("10_cat", ("cat, sitting", "cat,  outdoors ")), ("10_cat", ("cat",)),
                         ("dogs", ("dog, , sitting",)), ("dogs", ("",))])
    assert counts == {"10_cat": {"cat": 2, "outdoors": 1, "sitting": 1}, "dogs": {"dog": 1, "sitting": 1}}
    assert list(counts["10_cat"]) == ["cat", "outdoors", "sitting"]  # most images first, then by name


def test_counts_are_bounded_per_folder_and_in_folders_and_long_tags_are_not_tags() -> None:
    many = [("f", (", ".join(f"tag{i:05}" for i in range(MAX_TAGS_PER_FOLDER + 50)),))]
    assert len(count_tags(many)["f"]) == MAX_TAGS_PER_FOLDER
    folders = [(f"{n}_x{n}", ("a",)) for n in range(MAX_FOLDERS + 5)]
    assert len(count_tags(folders)) == MAX_FOLDERS
    crowded = count_tags((f"{n}_f", (", ".join(f"t{i}" for i in range(MAX_TAGS_PER_FOLDER)),)) for n in range(10))
    assert len(crowded) == 10 and all(len(tags) == MAX_TAGS // 10 for tags in crowded.values())
    assert count_tags([("f", ("x" * 201 + ", short",))]) == {"f": {"short": 1}}


@pytest.mark.parametrize("stored", [None, [], {"f": []}, {"f": {"a": "1"}}, {"f": {"a": 0}}, {"f": {"": 1}},
                                    {"f": {"a": True}}, {str(i): {"a": 1} for i in range(MAX_FOLDERS + 1)},
                                    {"f": {f"t{i}": 1 for i in range(MAX_TAGS_PER_FOLDER + 1)}},
                                    {str(n): {f"t{i}": 1 for i in range(MAX_TAGS_PER_FOLDER)} for n in range(5)}])
def test_a_stored_count_that_is_not_what_this_pack_writes_reads_as_none(stored: object) -> None:
    assert read_tag_frequency(stored) == {}


def test_counts_read_back_and_merge_across_datasets() -> None:
    one = read_tag_frequency(json.loads(json.dumps(count_tags([("a", ("x, y",)), ("a", ("x",))]))))
    assert one == {"a": {"x": 2, "y": 1}}
    assert merge_tag_frequency([one, {"a": {"y": 3}, "b": {"z": 1}}]) == {"a": {"y": 4, "x": 2}, "b": {"z": 1}}


def _words(caption: str) -> set[str]:
    return {t.strip() for line in caption.splitlines() for t in line.split(",") if t.strip()}


def test_an_encode_keeps_the_tag_counts_of_each_kohya_folder_in_the_datasets_info(tmp_path: Path) -> None:
    written = make_kohya_folder(tmp_path / "data")
    plan = plan_encode(tmp_path / "data", tmp_path / "cache", dataset="ds", settings=SETTINGS,
                       vae_fingerprint="vae-1", text_fingerprint="te-1")
    run_encode(plan, **FakeEncoders().kw())
    want: dict[str, dict[str, int]] = {}
    for image in written.images:
        for tag in _words(image.caption):
            folder = want.setdefault(image.path.parent.name, {})
            folder[tag] = folder.get(tag, 0) + 1
    with open_cache(tmp_path / "cache") as reader:
        assert reader.datasets()["ds"].info["tag_frequency"] == want


def test_a_dataset_stored_before_the_counts_gains_them_on_its_next_encode_without_encoding(tmp_path: Path) -> None:
    make_kohya_folder(tmp_path / "data")
    cache = tmp_path / "cache"

    def plan() -> object:
        return plan_encode(tmp_path / "data", cache, dataset="ds", settings=SETTINGS, vae_fingerprint="vae-1",
                           text_fingerprint="te-1")

    run_encode(plan(), **FakeEncoders().kw())
    with open_cache(cache) as reader:
        info, samples = dict(reader.datasets()["ds"].info), reader.dataset("ds")
    counts = info.pop("tag_frequency")
    with CacheWriter(cache) as writer:  # as an encode before the counts existed stored it
        writer.set_dataset("ds", samples, info=info)
        writer.commit()
    again = plan()
    assert not again.tags_current and not again.needs_vae and not again.needs_text_encoder
    report = run_encode(again, encode_images=None, encode_texts=None)
    assert report.encoded == 0
    with open_cache(cache) as reader:
        assert reader.datasets()["ds"].info["tag_frequency"] == counts
    assert plan().tags_current


def test_the_plan_of_an_unchanged_folder_counts_no_tag_and_an_edited_caption_counts_again(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    import dataset_cache.encode_plan as encode_plan

    written = make_kohya_folder(tmp_path / "data")
    cache = tmp_path / "cache"
    counted: list[int] = []
    real = encode_plan.count_tags
    monkeypatch.setattr(encode_plan, "count_tags", lambda captions: counted.append(1) or real(captions))

    def plan() -> object:
        return plan_encode(tmp_path / "data", cache, dataset="ds", settings=SETTINGS, vae_fingerprint="vae-1",
                           text_fingerprint="te-1")

    run_encode(plan(), **FakeEncoders().kw())
    assert len(counted) == 1
    warm = plan()
    assert len(counted) == 1 and warm.tags_current and warm.up_to_date  # the stored counts are the samples'
    caption = written.images[-1].path.with_suffix(".txt")
    caption.write_text("a new tag, another", encoding="utf-8")
    edited = plan()
    assert len(counted) == 2 and not edited.tags_current
    assert edited.tag_frequency[written.images[-1].path.parent.name]["a new tag"] == 1


# ----------------------------------------------------------------------------------------------------- metadata
def _training(**overrides: object) -> dict[str, str]:
    settings = {"rank": 8, "lora_alpha": 4.0, "learning_rate": 1e-4, "optimizer": "AdamW", "batch_size": 2,
                "grad_accumulation_steps": 1, "gradient_checkpointing": True, "training_dtype": "bf16",
                "seed": 7, "loss_function": "MSE", "algorithm": "LoHa", "min_timestep": 0, "max_timestep": 1000}
    settings.update(overrides)
    return training_metadata(arch=architecture_of("SDXL", False), v_prediction=False, settings=settings,
                             resolution=(1024, 1024), dataset_dirs={"10_cat": {"n_repeats": 10, "img_count": 3}},
                             train_images=30, reg_images=0, tag_frequency={"10_cat": {"cat": 3}},
                             started_at=1700000000.5, version="0.1.0")


def test_the_training_keys_are_kohyas_with_kohyas_value_formats() -> None:
    meta = _training()
    assert all(isinstance(k, str) and isinstance(v, str) for k, v in meta.items())
    assert meta["ss_base_model_version"] == "sdxl_base_v1-0"
    assert meta["modelspec.architecture"] == "stable-diffusion-xl-v1-base/lora"
    assert meta["modelspec.resolution"] == "1024x1024" and meta["ss_resolution"] == "(1024, 1024)"
    assert (meta["ss_network_dim"], meta["ss_network_alpha"]) == ("8", "4.0")
    assert json.loads(meta["ss_network_args"]) == {"algo": "loha"}
    assert meta["ss_loss_type"] == "l2" and meta["ss_gradient_checkpointing"] == "True"
    assert json.loads(meta["ss_tag_frequency"]) == {"10_cat": {"cat": 3}}
    assert json.loads(meta["ss_dataset_dirs"]) == {"10_cat": {"n_repeats": 10, "img_count": 3}}
    assert meta["modelspec.prediction_type"] == "epsilon" and "modelspec.timestep_range" not in meta
    assert json.loads(meta["streamcache.settings"])["rank"] == 8
    assert _training(min_timestep=875)["modelspec.timestep_range"] == "875,1000"


def test_families_are_named_as_kohyas_trainers_name_them() -> None:
    assert architecture_of("SD15", False).base_version == "sd_v1"
    assert architecture_of("SD20", True).modelspec == "stable-diffusion-v2-768-v"
    assert architecture_of("Flux", False) == ARCHITECTURES["Flux"]
    unknown = architecture_of("HunyuanVideo", False)
    assert unknown.modelspec == "hunyuanvideo" and unknown.base_version is None


def _data_section(path: Path) -> bytes:
    raw = path.read_bytes()
    (header,) = struct.unpack("<Q", raw[:8])
    return raw[8 + header:]


def test_the_content_hash_is_the_sha256_of_the_files_tensor_bytes_whatever_its_metadata(tmp_path: Path) -> None:
    tensors = {"a.lora_up.weight": torch.arange(300_000, dtype=torch.float32).reshape(600, 500),
               "a.alpha": torch.tensor(4.0)}
    meta = file_metadata(tensors, _training(), title="cat", saved_at=1700000100.0, steps=50)
    path = tmp_path / "cat.safetensors"
    safetensors.torch.save_file(tensors, str(path), metadata=meta)
    assert meta["sshs_model_hash"] == hashlib.sha256(_data_section(path)).hexdigest()
    assert meta["modelspec.hash_sha256"] == "0x" + meta["sshs_model_hash"]
    only_training = tmp_path / "ss.safetensors"  # the legacy hash: A1111's of the file with its ss_* keys alone
    safetensors.torch.save_file(tensors, str(only_training),
                                metadata={k: v for k, v in meta.items() if k.startswith("ss_")})
    assert meta["sshs_legacy_hash"] == hashlib.sha256(
        only_training.read_bytes()[0x100000:0x110000]).hexdigest()[:8]
    assert (meta["ss_steps"], meta["ss_output_name"], meta["modelspec.title"]) == ("50", "cat", "cat")
    assert datetime.datetime.fromisoformat(meta["modelspec.date"]).timestamp() == 1700000100.0
    with safetensors.safe_open(str(path), "pt") as f:
        assert f.metadata() == meta
    assert addnet_hashes(tensors, {"other": "x"})[0] == meta["sshs_model_hash"]


def test_the_files_rank_and_alpha_are_the_tensors_own() -> None:
    lora = {"a.lora_down.weight": torch.zeros(16, 8), "a.lora_up.weight": torch.zeros(8, 16),
            "a.alpha": torch.tensor(8.0), "b.lora_down.weight": torch.zeros(16, 4), "b.alpha": torch.tensor(8.0),
            "c.diff": torch.zeros(3)}
    assert network_shape(lora) == {"ss_network_dim": "16", "ss_network_alpha": "8.0"}
    meta = file_metadata(lora, _training(), title="t", saved_at=0.0)  # _training says rank 8, alpha 4
    assert (meta["ss_network_dim"], meta["ss_network_alpha"]) == ("16", "8.0")
    trained = {**lora, "b.alpha": torch.tensor(8.0125)}  # ComfyUI's adapters train their alpha: the mean
    assert network_shape(trained) == {"ss_network_dim": "16", "ss_network_alpha": "8.006"}


def test_a_lora_trained_elsewhere_gets_its_name_and_hashes_only() -> None:
    meta = file_metadata({"w": torch.ones(2)}, {}, title="theirs", saved_at=0.0, steps=10)
    assert set(meta) == {"ss_output_name", "sshs_model_hash", "sshs_legacy_hash"}

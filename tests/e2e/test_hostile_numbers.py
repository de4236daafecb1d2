"""Numeric inputs at their allowed maximum, over HTTP, on a server whose address space is capped.

The server of this module runs under ``RLIMIT_AS`` (a few GiB above what it needs), so a prompt that tries to
allocate without bound fails inside that server instead of taking the machine down; each test then checks the
prompt's outcome and that the server still answers.

* Train LoRA with ``batch_size`` 10000 (its maximum) on a 2-image cache: trains with the batch clamped to the
  dataset's largest bucket, and the node's text says so.
* Encode Dataset at ``resolution`` 8192 and ``batch_size`` 256 (both maxima) on 64 px images: small images keep
  their size (no upscale by default), so the encode finishes with 8×8 latents.
* A dataset file edited to say ``repeats`` 10^12: Load Lazy Cache → Train LoRA fails naming the file and the
  limit, before the sampler allocates anything.
* The variety inputs (#16) at their maxima: 64 tag shuffles keeping 64 tags, every variant on; caption dropout 1,
  a regularization set at ratio 16 and weight 16, unmasked weight 1: encodes and trains; Combine Datasets at
  10000 repeats chained twice is refused naming the limit.
"""

from __future__ import annotations

import json
import shutil
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from PIL import Image
from support.client import ComfyClient, PromptError
from support.comfy_env import ComfyInstall
from support.datasets import Subset, make_kohya_folder
from support.examples import encode_prompt, train_inputs
from support.server import ComfyServer
from support.tiny_models import TinyModels

HEADROOM = 8 << 30  # what the tiny models' encode and training need above the idle server, and more

TRAIN = train_inputs(steps=2)


@pytest.fixture(scope="module")
def capped_server(comfy_install: ComfyInstall, tiny_models: TinyModels, comfy_server: ComfyServer,
                  tmp_path_factory: pytest.TempPathFactory) -> Iterator[ComfyServer]:
    """A second server, capped at the session server's peak virtual memory plus :data:`HEADROOM`."""
    peak = comfy_server.peak_virtual_memory_bytes()
    if peak is None:
        pytest.skip("no /proc/<pid>/status here to size the address-space limit from")
    server = ComfyServer(comfy_install, tmp_path_factory.mktemp("capped"), models_dir=tiny_models.root,
                         address_space_limit_bytes=peak + HEADROOM)
    server.start()
    try:
        yield server
    finally:
        server.stop()


@pytest.fixture(scope="module")
def small_cache(capped_server: ComfyServer, tiny_models: TinyModels) -> str:
    make_kohya_folder(capped_server.input_dir / "hostile_src", (Subset(1, "ok", ((64, 64), (64, 64)), "png"),))
    capped_server.client().run(encode_prompt(tiny_models.name("vae"), tiny_models.name("clip"), "hostile_src",
                                             "hostile"))
    return "hostile"


def _train(tiny_models: TinyModels, cache: str, **options: Any) -> dict[str, Any]:
    return {
        "1": {"class_type": "StreamCache_LoadLazyCache", "inputs": {"cache": cache, "dataset_name": "default"}},
        "2": {"class_type": "UNETLoader", "inputs": {"unet_name": tiny_models.name("unet"),
                                                     "weight_dtype": "default"}},
        "3": {"class_type": "StreamCache_TrainLoRA", "inputs": {"model": ["2", 0], "dataset": ["1", 0],
                                                                **{**TRAIN, **options}}},
        "4": {"class_type": "LossGraphNode", "inputs": {"loss": ["3", 1], "filename_prefix": "hostile"}},
    }


def _alive(client: ComfyClient) -> None:
    assert client.run({"9": {"class_type": "StreamCache_CacheInfo", "inputs": {"cache": "hostile"}}}
                      ).status == "success"


def test_batch_size_at_its_maximum_trains_clamped_and_says_so(capped_server: ComfyServer, small_cache: str,
                                                              tiny_models: TinyModels) -> None:
    client = capped_server.client()
    result = client.run(_train(tiny_models, small_cache, batch_size=10_000), timeout=600)
    (text,) = result.outputs["3"]["text"]
    assert "batch_size 10000 is larger than this dataset's largest bucket (2 images × repeats per epoch): " \
           "trained with batch_size 2" in text
    _alive(client)
    assert Path(capped_server.log_path).read_text(errors="replace").count("Traceback") == 0


def test_a_dataset_file_that_says_repeats_10_12_is_refused_naming_it(capped_server: ComfyServer, small_cache: str,
                                                                     tiny_models: TinyModels) -> None:
    hostile = capped_server.streamcache_dir / "hostile_repeats"
    shutil.copytree(capped_server.streamcache_dir / small_cache, hostile)
    from dataset_cache.format.manifest import read_state

    file = hostile / read_state(hostile).datasets["default"].file
    doc = json.loads(file.read_text())
    doc["repeats"] = [10**12] * len(doc["repeats"])
    file.write_text(json.dumps(doc))
    client = capped_server.client()
    with pytest.raises(PromptError) as info:
        client.run(_train(tiny_models, "hostile_repeats"), timeout=600)
    text = json.dumps(info.value.details)
    assert "repeats 1000000000000 times, above the limit of 10000" in text and file.name in text
    _alive(client)


def test_resolution_and_batch_size_at_their_maximum_do_not_blow_small_images_up(
        capped_server: ComfyServer, small_cache: str, tiny_models: TinyModels) -> None:
    from dataset_cache.format.reader import open_cache

    client = capped_server.client()
    result = client.run(encode_prompt(tiny_models.name("vae"), tiny_models.name("clip"), "hostile_src",
                                      "hostile_8192", resolution=8192, bucket_step=64, batch_size=256),
                        timeout=600)
    assert result.status == "success"
    with open_cache(capped_server.streamcache_dir / "hostile_8192") as reader:
        shapes = {tuple(reader.tensor_shapes(s.latent)["samples"]) for s in reader.dataset("default")}
    assert shapes == {(1, 4, 8, 8)}  # 64 px images keep their size: not 8192 px buckets
    _alive(client)


def test_frame_inputs_at_their_maximum_refuse_a_clip_by_name_or_take_what_it_has(
        capped_server: ComfyServer, comfy_install: ComfyInstall, tiny_models: TinyModels) -> None:
    """Clips: frame_count 4097, frame_step 4097 and fps 1000 (the maxima) at resolution 8192 with upscale on: the
    7-frame clip gives 5 frames (WAN's VAE takes 1 + 4m) of 8192², 3.8 GiB of pixels, so it is refused before
    anything is decoded, naming the clip and the limit. At a small resolution the same frame_count takes the 5."""
    from support.clips import make_frames_folder
    from support.tiny_wan import ensure_wan_models

    from dataset_cache.format.reader import open_cache

    wan_vae, _ = ensure_wan_models(tiny_models.root, comfy_install.path, comfy_install.python)
    make_frames_folder(capped_server.input_dir / "hostile_clips" / "jump.frames", 7, width=64, height=64)
    client = capped_server.client()
    hostile = {"frame_count": 4097, "frame_sampling": "first", "frame_step": 4097, "fps": 1000.0}
    with pytest.raises(PromptError) as info:
        client.run(encode_prompt(wan_vae, tiny_models.name("clip"), "hostile_clips", "hostile_clips",
                                 resolution=8192, bucket_step=64, upscale=True, **hostile), timeout=600)
    text = json.dumps(info.value.details)
    assert "jump.frames" in text and "GiB of pixels" in text
    _alive(client)
    result = client.run(encode_prompt(wan_vae, tiny_models.name("clip"), "hostile_clips", "hostile_clips_small",
                                      frame_count=4097, frame_sampling="first"), timeout=600)
    assert result.status == "success"
    with open_cache(capped_server.streamcache_dir / "hostile_clips_small") as reader:
        shapes = {tuple(reader.tensor_shapes(s.latent)["samples"]) for s in reader.dataset("default")}
    assert shapes == {(1, 16, 2, 8, 8)}
    _alive(client)


def test_variety_inputs_at_their_maximum_encode_and_train_or_are_refused_by_name(
        capped_server: ComfyServer, tiny_models: TinyModels) -> None:
    from dataset_cache.format.reader import open_cache

    client = capped_server.client()
    log = Path(capped_server.log_path)
    tracebacks = log.read_text(errors="replace").count("Traceback")  # the refusals of the tests before this one
    folder = make_kohya_folder(capped_server.input_dir / "hostile_variety", (Subset(2, "v", ((64, 64), (96, 64))),))
    with Image.open(folder.images[0].path) as img:  # an alpha channel for the first image; the second has none
        img.convert("RGBA").save(folder.images[0].path)
    encode = encode_prompt(tiny_models.name("vae"), tiny_models.name("clip"), "hostile_variety", "hostile_variety",
                           flip="random", shuffle_variants=64, keep_tokens=64, empty_caption=True, masks="alpha")
    assert client.run(encode, timeout=600).status == "success"
    with open_cache(capped_server.streamcache_dir / "hostile_variety") as reader:
        samples = reader.dataset("default")
    assert all(s.mirror and s.empty_caption for s in samples)
    assert sorted(s.mask is not None for s in samples) == [False, True]  # no alpha channel, no mask (#27 item 3)
    # 64 kept tags leave nothing to shuffle: each line is its own single variant
    assert sorted(len(s.captions) for s in samples) == [1, 2]

    train = _train(tiny_models, "hostile_variety", caption_dropout=1.0, unmasked_weight=1.0, reg_ratio=16.0,
                   reg_weight=16.0, reg_dataset=["1", 0])
    result = client.run(train, timeout=600)
    assert result.status == "success" and len(result.outputs["3"]["loss"]) == TRAIN["steps"]
    assert log.read_text(errors="replace").count("Traceback") == tracebacks

    combine = {"5": {"class_type": "StreamCache_CombineDatasets", "inputs": {
                   "dataset_a": ["1", 0], "repeats_a": 10_000, "dataset_b": ["1", 0], "repeats_b": 10_000}},
               "6": {"class_type": "StreamCache_CombineDatasets", "inputs": {"dataset_a": ["5", 0],
                                                                            "repeats_a": 10_000}}}
    chained = _train(tiny_models, "hostile_variety")
    chained.update(combine)
    chained["3"]["inputs"]["dataset"] = ["6", 0]
    with pytest.raises(PromptError) as info:
        client.run(chained, timeout=600)
    # refused at the first Combine Datasets, naming its input (the folder's 2 repeats × 10000; #27 item 8)
    details = json.dumps(info.value.details, ensure_ascii=False)
    assert '"node_type": "StreamCache_CombineDatasets"' in details and '"node_id": "5"' in details
    assert ("repeats_a 10000: dataset 'default' has images repeated 2 times by their folder (kohya's "
            "<repeats>_<name>), so they would repeat 20000 times per epoch, above the limit of 10000; set repeats_a "
            "to at most 5000") in details
    _alive(client)

"""A cache in a bucket through the real nodes, in-process: ``remote.json`` lists it, Load Lazy Cache opens it, Train
LoRA trains 3 steps from it (the same LoRA as from the local copy; on two CPU ranks too, sharing one fetch cache
and fetching each block once), Save Streamable Cache publishes to it.

The bucket is moto's S3 server on 127.0.0.1 (``support.s3server``); skipped with one line without moto/obstore.
"""

from __future__ import annotations

import importlib
import json
import os
import shutil
from collections.abc import Iterator
from pathlib import Path
from types import ModuleType
from typing import Any

import pytest
import torch
from support.encoded import write_comfy_encoded
from support.processes import PROC_READABLE, wait_gone
from support.s3server import S3Server, start_s3

BUCKET = "team"
TRAIN = {  # a short fp32 run (bf16 convolutions are emulated on most CPUs: slow)
    "batch_size": 2, "grad_accumulation_steps": 1, "steps": 3, "learning_rate": 3e-3, "rank": 4,
    "optimizer": "AdamW", "loss_function": "MSE", "seed": 7, "training_dtype": "fp32", "lora_dtype": "fp32",
    "algorithm": "LoRA", "gradient_checkpointing": False, "checkpoint_depth": 1, "offloading": False,
    "existing_lora": "[None]", "prefetch_batches": 2, "loader_threads": 0,
}


def _module(pack: ModuleType, name: str) -> ModuleType:
    return importlib.import_module(f"{pack.__name__}.{name}")


@pytest.fixture(scope="module")
def s3() -> Iterator[S3Server]:
    with start_s3(BUCKET) as server:
        yield server


@pytest.fixture(scope="module")
def local_cache(pack: ModuleType, comfy_nodes: ModuleType, models: tuple,
                tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A cache encoded with ComfyUI's own VAEEncode and CLIPTextEncode: dataset "train", 4 samples, 2 buckets."""
    _, clip, vae = models
    root = tmp_path_factory.mktemp("remote_nodes") / "cache"
    write_comfy_encoded(pack, comfy_nodes, clip, vae, root, [(64, 64), (64, 96), (64, 64), (64, 96)], seed=0)
    return root


@pytest.fixture(scope="module")
def remote(pack: ModuleType, s3: S3Server, local_cache: Path, cache_root: Path) -> Iterator[str]:
    """The cache published to the bucket and listed in models/streamcache/remote.json as "cats" (with one bad
    entry, which is left out and named); removed after the module."""
    push = _module(pack, "dataset_cache.remote.publish").push
    url = f"s3://{BUCKET}/caches/cats"
    push(local_cache, url)
    config = cache_root / "remote.json"
    config.write_text(json.dumps({"cats": url, "team-upload": f"s3://{BUCKET}/caches/upload",
                                  "broken": "ftp://example.com/x"}))
    try:
        yield url
    finally:
        config.unlink()


def test_remote_caches_are_listed_and_a_bad_entry_is_named(pack: ModuleType, remote: str) -> None:
    load = _module(pack, "nodes.load_cache").LoadLazyCache
    options = load.GET_SCHEMA().inputs[0].options
    assert "remote:cats" in options and "remote:team-upload" in options
    assert not any("broken" in o for o in options)
    assert load.validate_inputs(cache="remote:cats") is True
    message = load.validate_inputs(cache="remote:broken")
    assert isinstance(message, str) and "remote.json" in message and "'broken'" in message and "scheme" in message
    message = load.validate_inputs(cache="remote:nope")
    assert isinstance(message, str) and "remote:cats" in message and "remote.json" in message


def test_load_lazy_cache_opens_a_bucket_and_train_lora_trains_from_it(pack: ModuleType, models: tuple,
                                                                      remote: str, local_cache: Path,
                                                                      s3: S3Server, cache_root: Path) -> None:
    load = _module(pack, "nodes.load_cache").LoadLazyCache
    train = _module(pack, "nodes.train_lora").TrainLoRA
    handles = _module(pack, "nodes.handles")
    s3.clear()
    out = load.execute(cache="remote:cats", dataset_name="train")
    handle, info = out.result
    assert handle.cache_root == remote and handle.name == "train"
    assert f"dataset 'train' in {remote}" in info and "samples: 4" in info
    assert load.fingerprint_inputs(cache="remote:cats", dataset_name="train") == \
        load.fingerprint_inputs(cache="remote:cats", dataset_name="train")

    with torch.inference_mode():  # as ComfyUI runs nodes
        from_bucket = train.execute(models[0], handle, **TRAIN)
        from_disk = train.execute(models[0], handles.StreamDatasetHandle(str(local_cache), "train"), **TRAIN)
    assert from_bucket.result[2] == 3 and len(from_bucket.result[1]["loss"]) == 3
    # the same batches (bytes, order) and the same seed: the same computation, so the same LoRA exactly
    lora_b, lora_d = from_bucket.result[0], from_disk.result[0]
    assert lora_b.keys() == lora_d.keys() and all(torch.equal(lora_b[k], lora_d[k]) for k in lora_b)
    assert from_bucket.result[1]["loss"] == from_disk.result[1]["loss"]
    assert s3.seen("GET", ".safetensors") and not [r for r in s3.seen("GET") if r.range and "," in r.range]
    assert any((cache_root / ".fetched").rglob("*.blk"))  # fetched bytes kept next to the local caches
    assert not Path("s3:").exists()  # no lock or folder was made from the URL

    s3.clear()
    with torch.inference_mode():  # a second run: every shard byte is on the local disk already
        train.execute(models[0], handle, **TRAIN)
    assert not [r for r in s3.seen("GET", ".safetensors") if r.range]


@pytest.mark.skipif(not PROC_READABLE, reason="the no-orphan check reads /proc (Linux)")
def test_two_ranks_train_from_a_bucket_what_they_train_from_the_disk_through_one_fetch_cache(
        pack: ModuleType, models: tuple, remote: str, local_cache: Path, s3: S3Server, cache_root: Path,
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    train = _module(pack, "nodes.train_lora").TrainLoRA
    handles = _module(pack, "nodes.handles")
    bucket, disk = handles.StreamDatasetHandle(remote, "train"), handles.StreamDatasetHandle(str(local_cache), "train")
    # where a process without the run's fetch settings keeps its blocks (the library's default; the worker inherits
    # the variable): it must stay empty
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "xdg"))
    default = tmp_path / "xdg"
    shutil.rmtree(cache_root / ".fetched", ignore_errors=True)  # nothing fetched yet: both ranks fetch
    s3.clear()
    options = {**TRAIN, "batch_size": 1, "devices": "cpu:2"}
    with torch.inference_mode():  # as ComfyUI runs nodes
        from_bucket = train.execute(models[0], bucket, **options).result
    assert wait_gone(os.getpid(), timeout=30) == []
    gets = [(r.path, r.range) for r in s3.seen("GET", ".safetensors")]
    assert gets and any((cache_root / ".fetched").rglob("*.blk"))
    assert len(gets) == len(set(gets)), f"two ranks fetched the same bytes: {sorted(gets)}"  # claims: once each
    assert not default.exists()  # the worker fetched into the run's fetch cache, not into a folder of its own
    with torch.inference_mode():
        from_disk = train.execute(models[0], disk, **options).result
    # the same rows on each rank, the same seed: the same computation, so the same LoRA exactly
    assert from_bucket[0].keys() == from_disk[0].keys()
    assert all(torch.equal(from_bucket[0][k], from_disk[0][k]) for k in from_bucket[0])
    assert from_bucket[1]["loss"] == from_disk[1]["loss"] and from_bucket[2] == 3

    s3.clear()
    with torch.inference_mode():  # again: every rank reads every block from the one fetch cache
        train.execute(models[0], bucket, **options)
    assert not [r for r in s3.seen("GET", ".safetensors") if r.range]


def test_save_streamable_cache_publishes_to_a_remote_cache(pack: ModuleType, remote: str, local_cache: Path,
                                                           handles: ModuleType, s3: S3Server,
                                                           cache_root: Path) -> None:
    save = _module(pack, "nodes.save_cache")
    schema = save.SaveCache.GET_SCHEMA()
    publish_to = {i.id: i for i in schema.inputs}["publish_to"]
    assert publish_to.optional and publish_to.default == save.NOT_PUBLISHED  # old workflows: nothing published
    assert "remote:team-upload" in publish_to.options
    source = handles.StreamDatasetHandle(str(local_cache), "train")
    out = save.SaveCache.execute(cache=["uploaded"], dataset_name=["train"], dataset=[source],
                                 publish_to=["remote:team-upload"])
    text = out.ui.as_dict()["text"][0]
    assert f"to s3://{BUCKET}/caches/upload" in text and "published 1 dataset(s) (train)" in text
    reader = _module(pack, "dataset_cache.format.reader").open_cache(f"s3://{BUCKET}/caches/upload")
    with reader:
        assert len(reader.dataset("train")) == 4
    puts = s3.seen("PUT", "")
    assert puts[-1].path.endswith("/caches/upload/manifest.json")  # the manifest last
    # the other way round (pull): a bucket's dataset saved into a local cache
    bucket = _module(pack, "nodes.load_cache").LoadLazyCache.execute(cache="remote:cats", dataset_name="train")
    out = save.SaveCache.execute(cache=["pulled"], dataset_name=["train"], dataset=[bucket.result[0]])
    assert f"from {remote} (dataset 'train')" in out.ui.as_dict()["text"][0]
    with _module(pack, "dataset_cache.format.reader").open_cache(cache_root / "pulled") as pulled:
        assert len(pulled.dataset("train")) == 4
    with pytest.raises(ValueError, match="remote:nowhere"):
        save.SaveCache.execute(cache=["uploaded"], dataset_name=["train"], dataset=[source],
                               publish_to=["remote:nowhere"])


def test_a_dead_store_fails_the_node_naming_the_url(pack: ModuleType, remote: str, cache_root: Path) -> None:
    load = _module(pack, "nodes.load_cache").LoadLazyCache
    errors = _module(pack, "dataset_cache.errors")
    url = "http://127.0.0.1:9/caches/gone"  # the discard port: nothing listens
    config = cache_root / "remote.json"
    before = config.read_text()
    config.write_text(json.dumps({**json.loads(before), "gone": url}))
    try:
        with pytest.raises(errors.RemoteUnreachableError) as err:
            load.execute(cache="remote:gone", dataset_name="train")
        assert f"{url}/manifest.json" in str(err.value)
    finally:
        config.write_text(before)


@pytest.mark.skipif(not PROC_READABLE, reason="the no-orphan check reads /proc (Linux)")
def test_a_rank_on_another_machine_reads_the_bucket_into_its_own_fetch_cache(
        pack: ModuleType, models: tuple, remote: str, local_cache: Path, s3: S3Server, tiny_models: Any,
        comfy_install: Any, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """That machine has the model file and no copy of the cache: it opens the bucket at rank 0's version into its
    own fetch folder (``models/streamcache/.fetched`` of its own ComfyUI), and trains what a local worker trains."""
    from support.joining import KEY, free_port, other_machine, start_joiner

    train = _module(pack, "nodes.train_lora").TrainLoRA
    handles = _module(pack, "nodes.handles")
    bucket = handles.StreamDatasetHandle(remote, "train")
    port = free_port()
    monkeypatch.setenv("STREAMCACHE_JOIN_ADDRESS", f"127.0.0.1:{port}")
    monkeypatch.setenv("STREAMCACHE_JOIN_KEY", KEY)
    monkeypatch.delenv("STREAMCACHE_FETCH_CACHE", raising=False)
    options = {**TRAIN, "batch_size": 1}
    with torch.inference_mode():  # as ComfyUI runs nodes
        local = train.execute(models[0], bucket, **options, devices="cpu:2").result
    other = other_machine(tmp_path / "other", tiny_models.unet)
    joiner = start_joiner(comfy_install.path, other, port)
    try:
        with torch.inference_mode():
            joined = train.execute(models[0], bucket, **options, devices="cpu:1 + 1 remote").result
        code, output = joiner.ended()
        assert code == 0, output
    finally:
        joiner.stop()
    assert any((other / "models" / "streamcache" / ".fetched").rglob("*.blk"))  # its own fetch cache
    assert all(torch.equal(joined[0][k], local[0][k]) for k in local[0]) and joined[0].keys() == local[0].keys()
    assert joined[1]["loss"] == local[1]["loss"]
    assert wait_gone(os.getpid(), timeout=30) == []

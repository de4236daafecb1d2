"""The dataset nodes over HTTP on the session's real server: encode, warm re-queues, load, save, bad inputs.

Prompts are in API format. Which nodes ran is read from the websocket's ``executing`` events and from the
``execution_cached`` message that ``/history`` keeps.
"""

from __future__ import annotations

import shutil
from typing import Any

import pytest
from support.client import ComfyClient, PromptError, PromptResult
from support.datasets import Subset, make_kohya_folder
from support.server import ComfyServer
from support.tiny_models import TinyModels

SMALL = (Subset(3, "red", ((64, 64), (96, 64)), "png"), Subset(1, "blue", ((64, 64),), "jpg"))
"""Three images, three distinct caption texts (two variants of one caption): a few seconds of CPU encoding."""


def _encode_prompt(tiny_models: TinyModels, folder: str, cache: str, **settings: Any) -> dict[str, Any]:
    inputs = {"folder": folder, "cache": cache, "dataset_name": "default", "vae": ["1", 0], "clip": ["2", 0],
              "resolution": 64, "bucket_step": 32, "crop": "center", "caption_prefix": "", "caption_suffix": "",
              "batch_size": 4, "on_failure": "skip", **settings}
    return {
        "1": {"class_type": "VAELoader", "inputs": {"vae_name": tiny_models.name("vae")}},
        "2": {"class_type": "CLIPLoader", "inputs": {"clip_name": tiny_models.name("clip"),
                                                     "type": "stable_diffusion", "device": "default"}},
        "3": {"class_type": "StreamCache_EncodeDataset", "inputs": inputs},
    }


def _executed(result: PromptResult) -> set[str]:
    return {e["node"] for e in result.events_of("executing") if e.get("node") is not None}


def _cached(result: PromptResult) -> set[str]:
    messages = result.history.get("status", {}).get("messages", [])
    return {n for kind, data in messages if kind == "execution_cached" for n in data.get("nodes", [])}


def _text(result: PromptResult, node: str) -> str:
    (text,) = result.outputs[node]["text"]
    return text


def _error(result: PromptResult) -> str:
    assert result.status == "error", result.history.get("status")
    messages = result.history["status"]["messages"]
    (data,) = [d for kind, d in messages if kind == "execution_error"]
    return f"{data['exception_type']}: {data['exception_message']}"


@pytest.fixture(scope="module")
def encoded(comfy_server: ComfyServer, tiny_models: TinyModels) -> dict[str, Any]:
    """One first encode of a small kohya folder (shared by the tests that need a filled cache)."""
    make_kohya_folder(comfy_server.input_dir / "e2e_kohya", SMALL)
    client = comfy_server.client()
    prompt = _encode_prompt(tiny_models, "e2e_kohya", "e2e_cache")
    return {"prompt": prompt, "result": client.run(prompt)}


def test_encode_then_requeues_load_no_model(encoded: dict[str, Any], client: ComfyClient,
                                            comfy_server: ComfyServer) -> None:
    first = encoded["result"]
    assert first.status == "success"
    assert "encoded 3 latents and 3 conditionings" in _text(first, "3")
    if first.events:
        assert {"1", "2", "3"} <= _executed(first)

    # Nothing changed: ComfyUI's cache answers (although the encode itself changed the cache's files). Queued
    # right away: this ComfyUI's default RAM-pressure cache evicts a prompt's outputs once another prompt runs.
    same = client.run(encoded["prompt"])
    assert "3" in _cached(same)
    assert not {"1", "2", "3"} & _executed(same)

    info = client.run({"9": {"class_type": "StreamCache_CacheInfo", "inputs": {"cache": "e2e_cache"}}})
    assert "entries: 6" in _text(info, "9")
    assert "'default': 3" in _text(info, "9") or "default: 3" in _text(info, "9")

    client.post("/free", {"unload_models": True, "free_memory": True})  # drop ComfyUI's node cache
    warm = client.run(encoded["prompt"])
    report = _text(warm, "3")
    assert "encoded 0 latents and 0 conditionings" in report
    assert "VAE not loaded" in report and "text encoder not loaded" in report
    if warm.events:
        assert "3" in _executed(warm) and not {"1", "2"} & _executed(warm)  # the loaders never ran


def test_second_prompt_loads_the_cache_lazily(encoded: dict[str, Any], client: ComfyClient,
                                              comfy_server: ComfyServer) -> None:
    assert encoded["result"].status == "success"
    spec = client.get("/object_info/StreamCache_LoadLazyCache")["StreamCache_LoadLazyCache"]
    assert "e2e_cache" in spec["input"]["required"]["cache"][1]["options"]  # the list is rebuilt per request
    result = client.run({
        "1": {"class_type": "StreamCache_LoadLazyCache", "inputs": {"cache": "e2e_cache", "dataset_name": "default"}},
        "2": {"class_type": "StreamCache_SaveCache", "inputs": {"dataset": ["1", 0], "cache": "e2e_copy",
                                                                "dataset_name": "default"}},
    })
    text = _text(result, "2")
    assert "3 samples" in text and "copied 6 entries" in text
    assert (comfy_server.streamcache_dir / "e2e_copy" / "manifest.json").is_file()


def test_builtin_dataset_nodes_feed_save_cache(client: ComfyClient, comfy_server: ComfyServer,
                                               tiny_models: TinyModels) -> None:
    make_kohya_folder(comfy_server.input_dir / "e2e_flat_src", (Subset(1, "x", ((64, 64), (64, 64)), "png"),))
    flat = comfy_server.input_dir / "e2e_flat"
    flat.mkdir()
    for p in (comfy_server.input_dir / "e2e_flat_src" / "1_x").iterdir():
        shutil.move(str(p), flat / p.name)
    prompt = _encode_prompt(tiny_models, "unused", "unused")
    del prompt["3"]
    prompt.update({
        "4": {"class_type": "LoadImageTextDataSetFromFolder", "inputs": {"folder": "e2e_flat"}},
        "5": {"class_type": "MakeTrainingDataset", "inputs": {"images": ["4", 0], "texts": ["4", 1],
                                                              "vae": ["1", 0], "clip": ["2", 0]}},
        "6": {"class_type": "StreamCache_SaveCache", "inputs": {"latents": ["5", 0], "conditioning": ["5", 1],
                                                                "cache": "e2e_builtin", "dataset_name": "default"}},
    })
    text = _text(client.run(prompt), "6")
    assert "saved dataset 'default' (2 samples)" in text and "stored 4 new entries" in text


def test_bad_inputs_are_node_errors_and_the_server_survives(client: ComfyClient, comfy_server: ComfyServer,
                                                            tiny_models: TinyModels) -> None:
    with pytest.raises(PromptError, match=r"value_not_in_list[\s\S]*folder: '\.\./\.\./etc' not in"):
        client.queue_prompt(_encode_prompt(tiny_models, "../../etc", "c"))  # folder is a list of input/'s folders
    with pytest.raises(PromptError, match="must not contain '..'"):
        client.queue_prompt(_encode_prompt(tiny_models, "x", "../c"))
    with pytest.raises(PromptError, match="cache 'no_such_cache': unknown cache"):
        client.queue_prompt({"1": {"class_type": "StreamCache_LoadLazyCache",
                                   "inputs": {"cache": "no_such_cache", "dataset_name": "default"}},
                             "2": {"class_type": "StreamCache_SaveCache",
                                   "inputs": {"dataset": ["1", 0], "cache": "x", "dataset_name": "d"}}})

    with pytest.raises(PromptError, match="folder: 'e2e_missing' not in"):
        client.queue_prompt(_encode_prompt(tiny_models, "e2e_missing", "e2e_bad"))
    (comfy_server.input_dir / "e2e_empty").mkdir()
    empty = client.run(_encode_prompt(tiny_models, "e2e_empty", "e2e_bad"), check=False)
    assert "no images found" in _error(empty)
    bad = make_kohya_folder(comfy_server.input_dir / "e2e_broken", (Subset(1, "x", ((64, 64),), "png"),))
    (bad.root / "1_x" / "broken.png").write_bytes(b"\x89PNG\r\n\x1a\ngarbage")
    broken = client.run(_encode_prompt(tiny_models, "e2e_broken", "e2e_bad", on_failure="stop"), check=False)
    assert "SourceError" in _error(broken) and "broken.png" in _error(broken)
    (bad.root / "1_x" / "broken.png").unlink()
    bad.images[0].path.with_suffix(".txt").write_bytes(b"caf\xe9")
    caption = client.run(_encode_prompt(tiny_models, "e2e_broken", "e2e_bad", on_failure="stop"), check=False)
    assert "img_000.txt" in _error(caption)

    src = comfy_server.streamcache_dir / "e2e_cache"
    damaged = comfy_server.streamcache_dir / "e2e_damaged"
    if src.is_dir():  # filled by the module's first encode
        shutil.copytree(src, damaged)
        shard = next((damaged / "shards").glob("*.safetensors"))
        with open(shard, "r+b") as f:
            f.truncate(64)
        corrupt = client.run({
            "1": {"class_type": "StreamCache_LoadLazyCache", "inputs": {"cache": "e2e_damaged",
                                                                        "dataset_name": "default"}},
            "2": {"class_type": "StreamCache_SaveCache", "inputs": {"dataset": ["1", 0], "cache": "x",
                                                                    "dataset_name": "d"}},
        }, check=False)
        assert "CacheCorruptError" in _error(corrupt) and shard.name in _error(corrupt)

    alive = client.run({"9": {"class_type": "StreamCache_CacheInfo", "inputs": {"cache": "still_alive"}}})
    assert alive.status == "success"

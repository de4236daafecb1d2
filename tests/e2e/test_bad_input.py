"""Bad input over HTTP, beyond what test_nodes_flow.py covers (escaping names, a missing or empty folder, a
corrupt PNG and a non-UTF-8 caption with ``on_failure=stop``, a truncated shard read by Save Streamable Cache):

* a corrupt PNG and a non-UTF-8 caption with ``on_failure=skip``: the encode succeeds and its report counts and
  names both;
* a shard whose bytes were flipped, found while *training*: a node error naming ``CacheCorruptError`` and the
  shard;
* a dataset name that the cache does not hold: a node error naming it and listing what the cache holds.

Every error lands in ``/history`` as the node's error, the server keeps serving, and the caches that were not
damaged on purpose still verify.
"""

from __future__ import annotations

import shutil
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
from support.client import ComfyClient, PromptResult
from support.datasets import Subset, make_kohya_folder
from support.examples import encode_prompt, train_inputs
from support.paths import PACK_ROOT
from support.server import ComfyServer
from support.tiny_models import TinyModels

TRAIN = train_inputs()



def _train_from_cache(tiny_models: TinyModels, cache: str, dataset: str = "default") -> dict[str, Any]:
    return {
        "1": {"class_type": "StreamCache_LoadLazyCache", "inputs": {"cache": cache, "dataset_name": dataset}},
        "2": {"class_type": "UNETLoader", "inputs": {"unet_name": tiny_models.name("unet"),
                                                     "weight_dtype": "default"}},
        "3": {"class_type": "StreamCache_TrainLoRA", "inputs": {"model": ["2", 0], "dataset": ["1", 0], **TRAIN}},
        "4": {"class_type": "LossGraphNode", "inputs": {"loss": ["3", 1], "filename_prefix": "e2e_bad"}},
    }


def _error(result: PromptResult) -> dict[str, Any]:
    assert result.status == "error", result.history.get("status")
    messages = result.history["status"]["messages"]
    (data,) = [d for kind, d in messages if kind == "execution_error"]
    return data


def _verify(cache: Path) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-m", "dataset_cache", "verify", str(cache)], cwd=PACK_ROOT,
                          capture_output=True, text=True, timeout=300)


def _alive(client: ComfyClient) -> None:
    assert client.run({"9": {"class_type": "StreamCache_CacheInfo", "inputs": {"cache": "alive"}}}).status == "success"


@pytest.fixture(scope="module")
def good_cache(comfy_server: ComfyServer, tiny_models: TinyModels) -> Path:
    """A small healthy cache (2 images) that the tests copy and damage."""
    make_kohya_folder(comfy_server.input_dir / "e2e_bad_src", (Subset(1, "ok", ((64, 64), (64, 64)), "png"),))
    comfy_server.client().run(encode_prompt(tiny_models.name("vae"), tiny_models.name("clip"),
                                            "e2e_bad_src", "e2e_bad_src"))
    return comfy_server.streamcache_dir / "e2e_bad_src"


def test_corrupt_png_and_non_utf8_caption_are_skipped_and_counted(comfy_server: ComfyServer, client: ComfyClient,
                                                                 tiny_models: TinyModels) -> None:
    folder = make_kohya_folder(comfy_server.input_dir / "e2e_skip",
                               (Subset(1, "x", ((64, 64), (64, 64), (64, 64)), "png"),))
    (folder.root / "1_x" / "broken.png").write_bytes(b"\x89PNG\r\n\x1a\ngarbage")
    (folder.root / "1_x" / "broken.txt").write_text("a caption whose image is broken", encoding="utf-8")
    folder.images[2].path.with_suffix(".txt").write_bytes(b"caf\xe9 au lait")  # Latin-1, not UTF-8
    result = client.run(encode_prompt(tiny_models.name("vae"), tiny_models.name("clip"), "e2e_skip", "e2e_skip"))
    (report,) = result.outputs["3"]["streamcache_report"]
    assert report["failed"] == 2, report
    failures = "\n".join(report["failures"])
    assert "broken.png" in failures and "img_002.txt" in failures, failures
    assert report["samples"] == 2 and report["skipped"] == 2, report  # the two good images are the dataset
    (text,) = result.outputs["3"]["text"]
    assert "broken.png" in text or "2 failed" in text or "failed" in text
    check = _verify(comfy_server.streamcache_dir / "e2e_skip")
    assert check.returncode == 0, check.stdout + check.stderr


def test_corrupted_shard_fails_training_naming_it(comfy_server: ComfyServer, client: ComfyClient,
                                                  tiny_models: TinyModels, good_cache: Path) -> None:
    damaged = comfy_server.streamcache_dir / "e2e_bad_shard"
    shutil.copytree(good_cache, damaged)
    shards = sorted((damaged / "shards").glob("*.safetensors"))
    assert shards
    for shard in shards:  # flip tensor bytes (the end of the file): headers still parse, checksums do not match
        data = bytearray(shard.read_bytes())
        for i in range(1, 257):
            data[-i] ^= 0xFF
        shard.write_bytes(bytes(data))
    result = client.run(_train_from_cache(tiny_models, "e2e_bad_shard"), check=False)
    error = _error(result)
    assert error["node_type"] == "StreamCache_TrainLoRA", error["node_type"]
    message = f"{error['exception_type']}: {error['exception_message']}"
    assert "CacheCorruptError" in message, message
    assert any(s.name in message for s in shards), message
    _alive(client)
    check = _verify(good_cache)  # the source of the copy is untouched
    assert check.returncode == 0, check.stdout + check.stderr
    assert _verify(damaged).returncode == 1  # and verify does see the damage


def test_unknown_dataset_name_is_a_node_error(client: ComfyClient, tiny_models: TinyModels,
                                              good_cache: Path) -> None:
    result = client.run(_train_from_cache(tiny_models, good_cache.name, dataset="no_such_dataset"), check=False)
    error = _error(result)
    assert error["node_type"] == "StreamCache_LoadLazyCache"
    assert "no_such_dataset" in error["exception_message"] and "default" in error["exception_message"]
    _alive(client)
    check = _verify(good_cache)
    assert check.returncode == 0, check.stdout + check.stderr

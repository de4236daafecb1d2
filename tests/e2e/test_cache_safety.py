"""Links and nesting over HTTP: what a copied cache with links in it, or a cache name inside a cache, does to a
real server (docs/FORMAT.md §2.1).

* a cache whose ``shards/`` is a link to a folder outside it: Clean Cache and Load Lazy Cache refuse it naming
  the link, and not one file in the folder the link points to changes;
* an Encode Dataset into ``<cache>/shards`` or ``<cache>/inner``: refused at validation, naming the folder or the
  outer cache, which still verifies;
* after both, the server still runs prompts.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
from support.client import ComfyClient, PromptError
from support.datasets import Subset, make_kohya_folder
from support.examples import encode_prompt
from support.paths import PACK_ROOT
from support.server import ComfyServer
from support.tiny_models import TinyModels


def _snapshot(folder: Path) -> dict[str, bytes]:
    return {str(p.relative_to(folder)): p.read_bytes() for p in folder.rglob("*") if p.is_file()}


def _verify(cache: Path) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-m", "dataset_cache", "verify", str(cache)], cwd=PACK_ROOT,
                          capture_output=True, text=True, timeout=300)


@pytest.fixture(scope="module")
def cache(comfy_server: ComfyServer, tiny_models: TinyModels) -> Path:
    make_kohya_folder(comfy_server.input_dir / "e2e_links_src", (Subset(1, "ok", ((64, 64), (64, 64)), "png"),))
    comfy_server.client().run(encode_prompt(tiny_models.name("vae"), tiny_models.name("clip"),
                                            "e2e_links_src", "e2e_links"))
    return comfy_server.streamcache_dir / "e2e_links"


def _refused(client: ComfyClient, prompt: dict, needle: str) -> None:
    with pytest.raises(PromptError) as info:
        client.run(prompt)
    assert needle in json.dumps(info.value.details), info.value.details


def test_a_cache_with_a_linked_shards_folder_is_refused_and_the_target_is_untouched(
        comfy_server: ComfyServer, client: ComfyClient, cache: Path, tmp_path: Path) -> None:
    linked = comfy_server.streamcache_dir / "e2e_linked"
    shutil.copytree(cache, linked)
    outside = tmp_path / "someone_elses_folder"
    shutil.move(str(linked / "shards"), str(outside))
    (outside / "precious.txt").write_text("not a cache file")
    (outside / "0123456789abcdef.safetensors").write_bytes(b"a file of a shard's name, not referenced")
    os.symlink(outside, linked / "shards", target_is_directory=True)
    before = _snapshot(outside)

    _refused(client, {"1": {"class_type": "StreamCache_CleanCache",
                            "inputs": {"cache": "e2e_linked", "dry_run": False}}}, "shards is a symbolic link")
    _refused(client, {"1": {"class_type": "StreamCache_LoadLazyCache",
                            "inputs": {"cache": "e2e_linked", "dataset_name": "default"}},
                      "2": {"class_type": "StreamCache_CacheInfo", "inputs": {"cache": "e2e_linked"}}},
             "symbolic link")
    assert _snapshot(outside) == before
    assert _verify(cache).returncode == 0  # the cache it was copied from is untouched too


def test_an_encode_into_a_cache_s_internal_folder_is_refused(comfy_server: ComfyServer, client: ComfyClient,
                                                             cache: Path, tiny_models: TinyModels) -> None:
    before = _snapshot(cache)
    _refused(client, encode_prompt(tiny_models.name("vae"), tiny_models.name("clip"), "e2e_links_src",
                                   "e2e_links/shards"), "'shards' is the name of a folder inside every cache")
    _refused(client, encode_prompt(tiny_models.name("vae"), tiny_models.name("clip"), "e2e_links_src",
                                   "e2e_links/inner"), "lies inside the cache 'e2e_links'")
    after = _snapshot(cache)
    assert {k: v for k, v in after.items() if not k.startswith(".")} == \
        {k: v for k, v in before.items() if not k.startswith(".")}
    assert _verify(cache).returncode == 0
    assert client.run({"9": {"class_type": "StreamCache_CacheInfo", "inputs": {"cache": "e2e_links"}}}
                      ).status == "success"

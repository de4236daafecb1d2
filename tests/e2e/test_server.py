"""The pack inside a real ComfyUI server: registration, web extension, Cache Info over HTTP."""

from __future__ import annotations

import re
import urllib.request

import pytest
from support.client import ComfyClient, PromptError
from support.pack import import_library
from support.paths import PACK_ROOT
from support.server import PACK_LINK_NAME, ComfyServer


def _declared_node_ids() -> set[str]:
    """Every ``node_id="StreamCache_..."`` written in nodes/ (read from source: no ComfyUI in this process)."""
    ids: set[str] = set()
    for path in (PACK_ROOT / "nodes").glob("*.py"):
        ids |= set(re.findall(r'node_id\s*=\s*"(StreamCache_\w+)"', path.read_text(encoding="utf-8")))
    return ids


def test_object_info_lists_every_pack_node(client: ComfyClient) -> None:
    info = client.object_info()
    declared = _declared_node_ids()
    assert declared, "no node_id found in nodes/"
    assert {k for k in info if k.startswith("StreamCache_")} == declared
    for node_id in declared:
        assert info[node_id]["category"] == "StreamCache"
        assert info[node_id]["python_module"] == f"custom_nodes.{PACK_LINK_NAME}"


def test_web_extension_is_served_once(comfy_server: ComfyServer, client: ComfyClient) -> None:
    ours = [url for url in client.get("/extensions") if url.startswith(f"/extensions/{PACK_LINK_NAME}/")]
    assert ours == [f"/extensions/{PACK_LINK_NAME}/js/streamcache.js"]
    with urllib.request.urlopen(comfy_server.url + ours[0], timeout=10) as resp:
        assert "app.registerExtension" in resp.read().decode()


def test_cache_info_runs_and_lands_in_history(comfy_server: ComfyServer, client: ComfyClient) -> None:
    result = client.run({"7": {"class_type": "StreamCache_CacheInfo", "inputs": {"cache": "not_encoded_yet"}}})
    expected = f"no cache at {comfy_server.streamcache_dir / 'not_encoded_yet'}"
    assert result.status == "success"
    assert result.outputs["7"]["text"] == [expected]
    assert client.history(result.prompt_id)["outputs"]["7"]["text"] == [expected]
    if result.events:  # websocket-client installed: the node's UI output was pushed live too
        executed = next(e for e in result.events_of("executed") if e["node"] == "7")
        assert executed["output"]["text"] == [expected]
        root = str(comfy_server.streamcache_dir / "not_encoded_yet")
        assert executed["output"]["streamcache_info"] == [{"kind": "cache", "root": root, "exists": False,
                                                           "problems": []}]


def test_escaping_name_is_refused_when_queued(client: ComfyClient) -> None:
    with pytest.raises(PromptError, match="must not contain '..'"):
        client.queue_prompt({"1": {"class_type": "StreamCache_CacheInfo", "inputs": {"cache": "../../etc"}}})


_HAS_FORMAT = all((PACK_ROOT / "dataset_cache" / "format" / f).is_file() for f in ("reader.py", "writer.py"))


@pytest.mark.skipif(not _HAS_FORMAT, reason="dataset_cache/format/{reader,writer}.py not written yet")
def test_cache_info_describes_a_real_cache(comfy_server: ComfyServer, client: ComfyClient) -> None:
    import hashlib

    import torch

    import_library()
    from dataset_cache.format.writer import CacheWriter

    path = comfy_server.streamcache_dir / "e2e_set"
    with CacheWriter(path) as writer:
        for i in range(2):
            writer.add(hashlib.md5(f"e2e{i}".encode()).hexdigest(), {"samples": torch.zeros(1, 4, 8, 8)},
                       kind="latent")
    result = client.run({"1": {"class_type": "StreamCache_CacheInfo", "inputs": {"cache": "e2e_set"}}})
    (text,) = result.outputs["1"]["text"]
    assert text.startswith(f"StreamCache cache at {path}")

"""A cache in object storage over HTTP: ``remote.json`` lists it in the real server's cache dropdown, and a store
that does not answer fails Load Lazy Cache with a message naming the URL while ComfyUI keeps running.

The dead store is an ``http://`` URL on the discard port of 127.0.0.1 (nothing listens), so the server needs no
credentials or endpoint in its environment. Skipped with one line when the server's python lacks obstore.
"""

from __future__ import annotations

import json
import subprocess
from collections.abc import Iterator
from typing import Any

import pytest
from support.client import SEEN_NODE_ERRORS
from support.server import ComfyServer

DEAD = "http://127.0.0.1:9/caches/gone"


@pytest.fixture(scope="module")
def remote_json(comfy_server: ComfyServer) -> Iterator[None]:
    probe = subprocess.run([str(comfy_server.install.python), "-c", "import obstore"], capture_output=True)
    if probe.returncode:
        pytest.skip("the remote-cache e2e test needs obstore in ComfyUI's python (scripts/bootstrap installs it)")
    config = comfy_server.streamcache_dir / "remote.json"
    config.write_text(json.dumps({"gone": DEAD, "bad": "ftp://example.com/x"}))
    try:
        yield
    finally:
        config.unlink()


def _options(spec: list[Any]) -> list[str]:
    """A combo's options in /object_info: ``["COMBO", {"options": [...]}]`` or ``[[...], {...}]``."""
    return spec[0] if isinstance(spec[0], list) else spec[1]["options"]


def test_remote_caches_are_in_the_dropdown(comfy_server: ComfyServer, remote_json: None) -> None:
    info = comfy_server.client().get("/object_info/StreamCache_LoadLazyCache")["StreamCache_LoadLazyCache"]
    options = _options(info["input"]["required"]["cache"])
    assert "remote:gone" in options and "remote:bad" not in options


def test_a_dead_store_fails_the_node_naming_the_url_and_the_server_keeps_running(
        comfy_server: ComfyServer, remote_json: None) -> None:
    client = comfy_server.client()
    before = len(SEEN_NODE_ERRORS)
    prompt = {"1": {"class_type": "StreamCache_LoadLazyCache",
                    "inputs": {"cache": "remote:gone", "dataset_name": "default"}},
              "2": {"class_type": "StreamCache_SaveCache",
                    "inputs": {"dataset": ["1", 0], "cache": "e2e_remote_copy", "dataset_name": "copy"}}}
    result = client.run(prompt, check=False)
    assert result.status == "error"
    errors = SEEN_NODE_ERRORS[before:]
    assert errors, "the node's error should reach /history"
    message = errors[-1]["message"]
    assert f"{DEAD}/manifest.json" in message and "check the URL, the network and the credentials" in message
    alive = client.run({"9": {"class_type": "StreamCache_CacheInfo", "inputs": {"cache": "still_alive"}}})
    assert alive.status == "success"  # the server runs the next prompt

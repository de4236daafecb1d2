"""Train LoRA with a rank on another machine through ComfyUI's HTTP API: a server of its own (rank 0, started with
the join settings in its environment, as a user sets them) and ``scripts/join-training`` as the other machine, with
its own ComfyUI folders holding copies of the model file and of the cache the server encoded.

The run through the API trains what ``devices="cpu:2"`` trains on the same server, exactly (the same computation),
and its summary names the machine that joined; afterwards no process of the run is left and the server trains again.
"""

from __future__ import annotations

import socket
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from support.comfy_env import ComfyInstall
from support.datasets import Subset, make_kohya_folder
from support.examples import encode_prompt, train_inputs
from support.joining import KEY, free_port, other_machine, start_joiner
from support.processes import PROC_READABLE, wait_gone
from support.server import ComfyServer
from support.tiny_models import TinyModels

CACHE = "e2e_remote"

pytestmark = pytest.mark.skipif(not PROC_READABLE, reason="the no-orphan checks read /proc (Linux)")


@pytest.fixture(scope="module")
def server(comfy_install: ComfyInstall, tiny_models: TinyModels,
           tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[ComfyServer, int]]:
    port = free_port()
    env = {"STREAMCACHE_JOIN_KEY": KEY, "STREAMCACHE_JOIN_ADDRESS": f"127.0.0.1:{port}",
           "STREAMCACHE_JOIN_TIMEOUT_S": "240"}
    with ComfyServer(comfy_install, tmp_path_factory.mktemp("remote_server"), models_dir=tiny_models.root,
                     env=env) as started:
        yield started, port


def _prompt(server: ComfyServer, tiny_models: TinyModels, devices: str) -> dict[str, Any]:
    out = encode_prompt(tiny_models.name("vae"), tiny_models.name("clip"), CACHE, CACHE, batch_size=4)
    out["4"] = {"class_type": "UNETLoader", "inputs": {"unet_name": tiny_models.name("unet"),
                                                       "weight_dtype": "default"}}
    out["5"] = {"class_type": "StreamCache_TrainLoRA", "inputs": {
        "model": ["4", 0], "dataset": ["3", 0], **train_inputs(devices=devices, steps=3)}}
    out["6"] = {"class_type": "LossGraphNode", "inputs": {"loss": ["5", 1], "filename_prefix": "e2e_remote"}}
    return out


def test_a_rank_on_another_machine_trains_through_the_http_api(server: tuple[ComfyServer, int],
                                                               comfy_install: ComfyInstall, tiny_models: TinyModels,
                                                               tmp_path: Path) -> None:
    comfy, port = server
    client = comfy.client()
    make_kohya_folder(comfy.input_dir / CACHE, (Subset(1, "x", ((64, 64),) * 4, "png"),))
    local = client.run(_prompt(comfy, tiny_models, "cpu:2"))  # encodes the cache, then trains on 2 local ranks

    # the other machine's ComfyUI folders: copies of the model file and of the cache the server encoded
    other = other_machine(tmp_path / "other", tiny_models.unet, {CACHE: comfy.streamcache_dir / CACHE})
    joiner = start_joiner(comfy_install.path, other, port)
    try:
        joined = client.run(_prompt(comfy, tiny_models, "cpu:1 + 1 remote"))
        code, output = joiner.ended()
        assert code == 0, output
    finally:
        joiner.stop()
    assert joined.outputs["5"]["loss"] == local.outputs["5"]["loss"] and len(joined.outputs["5"]["loss"]) == 3
    (summary,) = joined.outputs["5"]["text"]
    assert f"trained on 2 ranks: cpu:0 and 1 rank on other machines (rank 1 on {socket.gethostname()} at " \
           "127.0.0.1)" in summary, summary
    events = joined.events_of("streamcache.train")  # rank 0 reports the ranks' mean loss, as on one machine
    assert events and events[-1]["step"] == 3
    assert comfy._proc is not None and wait_gone(comfy._proc.pid) == []
    again = client.run(_prompt(comfy, tiny_models, "auto"))  # the server trains again, on one device
    assert len(again.outputs["5"]["loss"]) == 3

"""Train LoRA on several devices over HTTP, on the session's real server (``--cpu``): ``devices="cpu:2"`` starts
one worker process beside the server (rank 0 is the server's own execution thread).

A run ends with the LoRA, the live loss curve and the step events as on one device; Cancel (``POST /interrupt``)
ends it as interrupted; a worker killed mid-run fails the node with an error naming its rank and its end. After
each, no worker process of the server is left, and the server keeps answering and trains again.
"""

from __future__ import annotations

import os
import signal
import time
from typing import Any

import pytest
from support.client import ComfyClient, PromptResult
from support.datasets import Subset, make_kohya_folder
from support.examples import encode_prompt, train_inputs
from support.processes import PROC_READABLE, wait_gone, workers_of
from support.server import ComfyServer
from support.tiny_models import TinyModels

websocket = pytest.importorskip("websocket", reason="websocket-client is needed to act at the right moment")
pytestmark = pytest.mark.skipif(not PROC_READABLE, reason="the no-orphan checks read /proc (Linux)")


@pytest.fixture(scope="module")
def prompt(comfy_server: ComfyServer, tiny_models: TinyModels) -> dict[str, Any]:
    """Encode 4 images, load the tiny UNet, Train LoRA on 2 CPU ranks (node "5") → Plot Loss Graph."""
    make_kohya_folder(comfy_server.input_dir / "e2e_devices", (Subset(1, "x", ((64, 64),) * 4, "png"),))
    out = encode_prompt(tiny_models.name("vae"), tiny_models.name("clip"), "e2e_devices", "e2e_devices",
                        batch_size=4)
    out["4"] = {"class_type": "UNETLoader", "inputs": {"unet_name": tiny_models.name("unet"),
                                                       "weight_dtype": "default"}}
    out["5"] = {"class_type": "StreamCache_TrainLoRA", "inputs": {
        "model": ["4", 0], "dataset": ["3", 0], **train_inputs(devices="cpu:2", steps=3)}}
    out["6"] = {"class_type": "LossGraphNode", "inputs": {"loss": ["5", 1], "filename_prefix": "e2e_devices"}}
    return out


def _server_pid(server: ComfyServer) -> int:
    assert server._proc is not None
    return server._proc.pid


def _training(event: dict[str, Any]) -> bool:
    data = event.get("data") or {}
    return event["type"] == "streamcache.train" and data.get("step", 0) >= 2


def _status(result: PromptResult, kind: str) -> dict[str, Any]:
    assert result.status == "error", result.history.get("status")
    (data,) = [d for k, d in result.history["status"]["messages"] if k == kind]
    return data


def _alive_and_training(client: ComfyClient, prompt: dict[str, Any]) -> None:
    again = client.run({**prompt, "5": {**prompt["5"], "inputs": {**prompt["5"]["inputs"], "steps": 2}}})
    assert len(again.outputs["5"]["loss"]) == 2


def test_two_ranks_train_through_the_node_with_progress_and_the_loss_curve(comfy_server: ComfyServer,
                                                                         client: ComfyClient,
                                                                         prompt: dict[str, Any]) -> None:
    result = client.run(prompt)
    assert len(result.outputs["5"]["loss"]) == 3
    events = result.events_of("streamcache.train")  # rank 0 reports the ranks' mean loss, every rank's rows
    assert events and events[-1]["step"] == 3 and all(e["total"] == 3 for e in events)
    assert events[-1]["loss"] == result.outputs["5"]["loss"][-1]
    assert wait_gone(_server_pid(comfy_server)) == []


def test_cancel_ends_every_rank_and_the_server_trains_again(comfy_server: ComfyServer, client: ComfyClient,
                                                            prompt: dict[str, Any]) -> None:
    long = {**prompt, "5": {**prompt["5"], "inputs": {**prompt["5"]["inputs"], "steps": 5000}}}
    t0 = time.monotonic()
    result = client.run_and_act(long, _training, lambda: client.post("/interrupt", {}))
    assert _status(result, "execution_interrupted")["node_id"] == "5"
    assert time.monotonic() - t0 < 300, "the interrupt did not stop the 5000-step training"
    assert wait_gone(_server_pid(comfy_server)) == []
    _alive_and_training(client, prompt)
    assert wait_gone(_server_pid(comfy_server)) == []


def test_a_killed_worker_fails_the_node_by_rank_and_the_server_trains_again(comfy_server: ComfyServer,
                                                                           client: ComfyClient,
                                                                           prompt: dict[str, Any]) -> None:
    server = _server_pid(comfy_server)
    killed: list[int] = []

    def kill() -> None:
        for pid in workers_of(server):
            os.kill(pid, signal.SIGKILL)
            killed.append(pid)
    long = {**prompt, "5": {**prompt["5"], "inputs": {**prompt["5"]["inputs"], "steps": 5000}}}
    result = client.run_and_act(long, _training, kill)
    error = _status(result, "execution_error")
    assert killed and error["node_id"] == "5", error
    assert "failed on rank 1" in error["exception_message"] and f"pid {killed[0]}" in error["exception_message"]
    assert "killed by SIGKILL" in error["exception_message"]
    assert wait_gone(server) == []
    _alive_and_training(client, prompt)
    assert wait_gone(server) == []

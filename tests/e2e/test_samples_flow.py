"""Sample images during training over ComfyUI's HTTP API: Train LoRA's ``samples`` output (LATENT) through VAE
Decode and Save Image, and what a VAE Decode wired to it gets when no samples were asked for.

Folder → Encode Dataset → Train LoRA (2 steps, ``sample_count`` 2) → VAE Decode → Save Image: 4 images on disk
(2 captions before the first step and after the last). With ``sample_count`` 0 the output blocks VAE Decode with
its message (ComfyUI reports it as an execution error of that node), the LoRA branch still runs, and the server
takes the next prompt.
"""

from __future__ import annotations

from typing import Any

from support.client import ComfyClient
from support.datasets import Subset, make_kohya_folder
from support.examples import encode_prompt, train_inputs
from support.server import ComfyServer
from support.tiny_models import TinyModels

FOLDER = "e2e_samples"


def _prompt(server: ComfyServer, tiny_models: TinyModels, **train: Any) -> dict[str, Any]:
    make_kohya_folder(server.input_dir / FOLDER, (Subset(1, "dot", ((64, 64), (64, 64), (64, 64)), "png"),))
    prompt = encode_prompt(tiny_models.name("vae"), tiny_models.name("clip"), FOLDER, FOLDER)
    prompt["4"] = {"class_type": "UNETLoader", "inputs": {"unet_name": tiny_models.name("unet"),
                                                          "weight_dtype": "default"}}
    prompt["5"] = {"class_type": "StreamCache_TrainLoRA",
                   "inputs": {"model": ["4", 0], "dataset": ["3", 0], **train_inputs(steps=2, **train)}}
    prompt["6"] = {"class_type": "VAEDecode", "inputs": {"samples": ["5", 3], "vae": ["1", 0]}}
    prompt["7"] = {"class_type": "SaveImage", "inputs": {"images": ["6", 0], "filename_prefix": "e2e_samples"}}
    prompt["8"] = {"class_type": "LossGraphNode", "inputs": {"loss": ["5", 1], "filename_prefix": "e2e_samples"}}
    return prompt


def test_the_samples_decode_and_save_through_comfyuis_nodes(comfy_server: ComfyServer, client: ComfyClient,
                                                            tiny_models: TinyModels) -> None:
    result = client.run(_prompt(comfy_server, tiny_models, sample_count=2, sample_steps=3), timeout=600)
    images = result.outputs["7"]["images"]
    assert len(images) == 4
    for image in images:
        assert (comfy_server.output_dir / image["subfolder"] / image["filename"]).is_file()
    (summary,) = result.outputs["5"]["text"]
    assert "sample images of 2 caption(s)" in summary and "at steps 0, 2: 3 euler steps (simple schedule)" in summary


def test_without_samples_a_wired_vae_decode_is_blocked_with_the_message(comfy_server: ComfyServer,
                                                                        client: ComfyClient,
                                                                        tiny_models: TinyModels) -> None:
    result = client.run(_prompt(comfy_server, tiny_models), timeout=600, check=False)
    assert "8" in result.outputs and "7" not in result.outputs  # the loss graph ran; Save Image did not
    if result.events:  # the websocket reports the block on VAE Decode
        (error,) = [e for e in result.events_of("execution_error") if e.get("node_id") == "6"]
        assert error["exception_message"] == ("Execution Blocked: Train LoRA made no sample images: set its "
                                              "sample_count above 0")
    again = client.run(_prompt(comfy_server, tiny_models, sample_count=1, sample_steps=2), timeout=600)
    assert len(again.outputs["7"]["images"]) == 2  # the server goes on

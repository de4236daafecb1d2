"""The shipped training workflows on the session's real server, over HTTP and the websocket.

* the main job, ``example_workflows/api/Train a LoRA from an image folder.json`` as shipped (the API twin of the UI
  template):
  folder → Encode Dataset → Train LoRA (30 steps on 4 images) → Save LoRA (Stream Cache) + Plot Loss Graph, then Load
  LoRA with the saved file → KSampler → VAE Decode → Save Image; the loss falls; progress reaches the websocket;
* ``example_workflows/api/Encode a folder into a cache then train from it.json``: Encode → Save Streamable Cache,
  then, in a second prompt,
  Load Lazy Cache → Train LoRA;
* incremental encoding over HTTP: one caption line edited and one image added → one latent and only the new
  caption lines are encoded (the unchanged re-queue is covered by test_nodes_flow.py).
"""

from __future__ import annotations

import copy
import json
import math
from typing import Any

import pytest
from support.client import ComfyClient, PromptResult
from support.datasets import MULTILINE_CAPTION, Subset, make_kohya_folder
from support.examples import (MAIN_TEMPLATE, SAVE_THEN_TRAIN_TEMPLATE, ExampleRun, encode_prompt,
                               make_example_folder, run_example, run_prompt)
from support.paths import PACK_ROOT
from support.server import ComfyServer
from support.tiny_models import TinyModels

API = PACK_ROOT / "example_workflows" / "api"
STEPS = 30



def _api(name: str) -> dict[str, Any]:
    return json.loads((API / f"{name}.json").read_text(encoding="utf-8"))


def _node(prompt: dict[str, Any], class_type: str) -> str:
    (node_id,) = [k for k, v in prompt.items() if v["class_type"] == class_type]
    return node_id


def _report(result: PromptResult | ExampleRun, node: str) -> dict[str, Any]:
    outputs = result.outputs() if isinstance(result, ExampleRun) else result.outputs
    (report,) = outputs[node]["streamcache_report"]
    return report


@pytest.fixture(scope="module")
def full_flow(comfy_server: ComfyServer) -> ExampleRun:
    """The main example, run as shipped (queued twice, like in the UI: the sampling branch needs the LoRA file)."""
    make_example_folder(comfy_server.input_dir)
    return run_example(comfy_server.client(), _api(MAIN_TEMPLATE), timeout=900)


def test_full_flow_trains_saves_and_samples(full_flow: ExampleRun, comfy_server: ComfyServer) -> None:
    prompt = full_flow.prompt
    assert all(r.status == "success" for r in full_flow.results)
    encode, train = _node(prompt, "StreamCache_EncodeDataset"), _node(prompt, "StreamCache_TrainLoRA")
    save_image, lora_loader = _node(prompt, "SaveImage"), _node(prompt, "LoraLoader")
    assert prompt[train]["inputs"]["steps"] == STEPS
    report = _report(full_flow, encode)
    assert report["samples"] == 4 and report["failed"] == 0
    losses = full_flow.outputs()[train]["loss"]
    assert len(losses) == STEPS and all(math.isfinite(x) for x in losses)

    # The sampling branch waited for the LoRA file: the first queue could not validate Load LoRA.
    assert full_flow.deferred == [save_image]
    (saved,) = full_flow.new_loras
    assert prompt[lora_loader]["inputs"]["lora_name"] == saved
    assert saved.startswith(f"streamcache_example_{STEPS}_steps_")
    path = comfy_server.output_dir / "loras" / saved
    from safetensors import safe_open
    from safetensors.torch import load_file

    weights = load_file(str(path))  # the LoRA file loads
    assert any("lora_up" in k for k in weights) and any("lora_down" in k for k in weights), sorted(weights)[:5]
    assert all(bool(v.float().isfinite().all()) for v in weights.values())
    with safe_open(str(path), "pt") as f:  # saved by Save LoRA (Stream Cache): with its training's metadata
        meta = f.metadata()
    assert meta["ss_steps"] == str(STEPS), sorted(meta)
    assert json.loads(meta["ss_tag_frequency"])["5_pattern"]["a box"] == 1  # the example folder's kohya subfolder
    if full_flow.results[1].events:
        assert lora_loader in {e["node"] for e in full_flow.results[1].events_of("executing") if e.get("node")}

    (image,) = full_flow.outputs()[save_image]["images"]
    assert (comfy_server.output_dir / image["subfolder"] / image["filename"]).is_file()
    loss_graph = full_flow.outputs()[_node(prompt, "LossGraphNode")]["images"]
    assert loss_graph and loss_graph[0]["filename"].endswith(".png")


def test_loss_falls(full_flow: ExampleRun, client: ComfyClient) -> None:
    """Raw losses swing by 100× because every step draws its own sigma, so the run is compared step by step with
    the same run at a learning rate of 1e-7 (same seed: same batches, sigmas and noise, on the base model): the
    ratio starts at 1 and must fall."""
    prompt = full_flow.prompt
    train = _node(prompt, "StreamCache_TrainLoRA")
    trained = full_flow.outputs()[train]["loss"]
    keep = {_node(prompt, c) for c in ("UNETLoader", "VAELoader", "CLIPLoader", "StreamCache_EncodeDataset")}
    baseline = {k: copy.deepcopy(v) for k, v in prompt.items() if k in keep | {train}}
    baseline[train]["inputs"]["learning_rate"] = 1e-7
    baseline["90"] = {"class_type": "LossGraphNode", "inputs": {"loss": [train, 1], "filename_prefix": "e2e_base"}}
    result, errors = run_prompt(client, baseline, timeout=900)
    assert not errors
    untrained = result.outputs[train]["loss"]
    assert len(untrained) == STEPS
    assert trained[0] == pytest.approx(untrained[0], rel=1e-3)  # step 1 runs before any update
    ratio = [a / b for a, b in zip(trained, untrained)]
    first, last = sum(ratio[:10]) / 10, sum(ratio[-10:]) / 10
    assert last < 0.8 * first, [round(r, 3) for r in ratio]


def test_progress_reaches_the_websocket(full_flow: ExampleRun) -> None:
    first = full_flow.results[0]
    if not first.events:
        pytest.skip("websocket-client is not installed: no events were recorded")
    train = _node(full_flow.prompt, "StreamCache_TrainLoRA")
    steps = [e for e in first.events_of("progress") if e["node"] == train]
    assert steps and steps[-1]["value"] == steps[-1]["max"] == STEPS
    custom = first.events_of("streamcache.train")
    assert custom and {e["node"] for e in custom} == {train}
    assert custom[-1]["step"] == custom[-1]["total"] == STEPS and math.isfinite(custom[-1]["loss"])
    assert {"loss_smooth", "samples_per_s", "data_wait_pct"} <= custom[-1].keys()


def test_the_memory_plan_shows_on_the_node_before_the_first_step(full_flow: ExampleRun) -> None:
    """The node's progress text names the memory plan and its estimate before any step's report (#25)."""
    first = full_flow.results[0]
    if not first.events:
        pytest.skip("websocket-client is not installed: no events were recorded")
    train = _node(full_flow.prompt, "StreamCache_TrainLoRA")
    kinds = [(e["type"], e["data"]) for e in first.events]
    shown = [i for i, (kind, data) in enumerate(kinds) if kind == "progress_text" and data["node"] == train
             and data["text"].startswith("memory: ")]
    steps = [i for i, (kind, _data) in enumerate(kinds) if kind == "streamcache.train"]
    assert shown and steps and shown[0] < steps[0]
    text = kinds[shown[0]][1]["text"]
    assert "all weights on the device, estimated " in text and " of " in text


def test_encode_save_then_load_lazy_cache_and_train(comfy_server: ComfyServer, client: ComfyClient) -> None:
    """Encode → Save Streamable Cache; then a second prompt: Load Lazy Cache (the saved cache) → Train LoRA."""
    make_example_folder(comfy_server.input_dir)
    prompt = _api(SAVE_THEN_TRAIN_TEMPLATE)
    save, load = _node(prompt, "StreamCache_SaveCache"), _node(prompt, "StreamCache_LoadLazyCache")
    train = _node(prompt, "StreamCache_TrainLoRA")
    saved = comfy_server.streamcache_dir / prompt[save]["inputs"]["cache"]
    assert not saved.exists(), "this test expects to create the saved cache"
    run = run_example(client, prompt, timeout=900)
    assert len(run.results) == 2 and all(r.status == "success" for r in run.results)
    assert (saved / "manifest.json").is_file()
    assert save in run.results[0].outputs and train not in run.results[0].outputs
    assert load in run.results[1].outputs and train in run.results[1].outputs
    (info,) = run.results[1].outputs[load]["text"]
    assert "samples: 4" in info
    losses = run.results[1].outputs[train]["loss"]
    assert len(losses) == prompt[train]["inputs"]["steps"] and all(math.isfinite(x) for x in losses)
    assert run.new_loras and all(n.startswith("streamcache_from_saved_cache_") for n in run.new_loras)


# --------------------------------------------------------------------------------------------- incremental
INCREMENTAL = (Subset(3, "red", ((64, 64), (64, 64)), "png"), Subset(1, "blue", ((64, 64),), "png"))


def test_edit_one_caption_line_and_add_one_image(comfy_server: ComfyServer, client: ComfyClient,
                                                 tiny_models: TinyModels) -> None:
    folder = make_kohya_folder(comfy_server.input_dir / "e2e_incremental", INCREMENTAL)
    prompt = encode_prompt(tiny_models.name("vae"), tiny_models.name("clip"), "e2e_incremental", "e2e_incremental")
    first = _report(client.run(prompt), "3")
    assert first["samples"] == 3 and first["encoded_latents"] == 3
    assert first["encoded_conditionings"] == 3  # the caption two images share, and the two variants of one

    multiline = next(img for img in folder.images if img.caption == MULTILINE_CAPTION)
    first_line, _second = MULTILINE_CAPTION.split("\n")
    multiline.path.with_suffix(".txt").write_text(f"{first_line}\nan edited second variant", encoding="utf-8")
    added = folder.images[0].path.parent / "img_new.png"
    from PIL import Image

    Image.new("RGB", (64, 64), (12, 200, 99)).save(added)
    added.with_suffix(".txt").write_text("a newly added green square", encoding="utf-8")

    second = client.run(prompt)
    report = _report(second, "3")
    assert report["samples"] == 4
    assert report["encoded_latents"] == 1  # the added image only: editing a caption keeps the latent
    assert report["encoded_conditionings"] == 2  # the edited line and the new caption, nothing else
    assert report["reused"] == 3 + 2 and report["failed"] == 0  # 3 latents; the shared caption, the kept line
    assert report["new"] == 2 and report["changed"] == 1  # new png + txt; the edited txt
    if second.events:  # the encode's progress reached the websocket, from the encode node
        assert [e for e in second.events_of("progress") if e["node"] == "3"]
        assert [e for e in second.events_of("streamcache.encode") if e.get("node") == "3"]

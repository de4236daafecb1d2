"""The pack's front-end extension in the real ComfyUI front end, driven in headless Chromium.

The session's server serves ComfyUI's real front end (the ``comfyui-frontend-package`` that ComfyUI's
requirements pin; no ``--front-end-root``). ``frontend/drive.mjs`` (Node + ``playwright-core`` + Debian's
``/usr/bin/chromium``) opens it, loads a small UI workflow with ``app.loadGraphData`` — tiny UNET/CLIP/VAE loaders
→ Encode Dataset → Train LoRA (Stream Cache) → Save LoRA Weights, plus Cache Info on a damaged cache — queues it
with ``app.queuePrompt`` and samples the Train LoRA panel while training runs. Checked:

* the extension registers and adds a panel to the pack's nodes, and the panels change neither the workflow's
  widget values nor the API prompt the page builds;
* the live loss curve appears and updates during the run (several distinct steps and losses seen), then shows the
  full curve from the node's UI output; a second, cached queue brings the curve back;
* the encode report shows the counts; Cache Info shows the warning badge for the damaged cache;
* every figure is also plain node output in ``/history``;
* no console error or page error mentions streamcache.

``frontend/layout.mjs`` adds every node fresh and loads workflows saved by earlier versions;
``frontend/templates.mjs`` loads every template with the classic canvas renderer and with Vue nodes and measures
where each node is drawn (none over another, none out of its group).

Screenshots go to ``tests/e2e/frontend/artifacts/`` (git-ignored; ``STREAMCACHE_ARTIFACTS`` overrides); their
paths are printed.
Skipped with one line when Chromium, Node or ``playwright-core`` is missing (``scripts/bootstrap`` installs
``playwright-core`` under ``tests/e2e/frontend``; ``apt-get install chromium`` provides the browser).
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import subprocess
import sys
import time
import urllib.request
from pathlib import Path
from typing import Any

import pytest
from support.client import ComfyClient
from support.datasets import Subset, make_kohya_folder
from support.examples import as_saved_before
from support.paths import PACK_ROOT
from support.renames import RENAMED, as_current
from support.server import ComfyServer
from support.tiny_models import TinyModels
from support.workflow import _widget_inputs, input_default, is_optional_input, ui_to_api

FRONTEND = Path(__file__).resolve().parent / "frontend"
DRIVER = FRONTEND / "drive.mjs"
ARTIFACTS = Path(os.environ.get("STREAMCACHE_ARTIFACTS", FRONTEND / "artifacts"))
STEPS = 12
"""Training steps: several live events (at most two a second) even on a fast machine; a step of the tiny model
takes ~0.5-5 s on a 2-core CPU, depending on what else runs."""

# node ids of the UI workflow
UNET, CLIP, VAE, ENCODE, TRAIN, SAVE, INFO = 1, 2, 3, 4, 5, 6, 7


def _chromium() -> str | None:
    for candidate in (os.environ.get("STREAMCACHE_CHROMIUM"), "/usr/bin/chromium", shutil.which("chromium"),
                      shutil.which("chromium-browser")):
        if candidate and Path(candidate).is_file():
            return candidate
    return None


def _missing_tools() -> str | None:
    missing = []
    if shutil.which("node") is None:
        missing.append("node")
    if not (FRONTEND / "node_modules" / "playwright-core" / "package.json").is_file():
        missing.append(f"playwright-core (cd {FRONTEND.relative_to(PACK_ROOT)} && npm ci)")
    if _chromium() is None:
        missing.append("chromium (apt-get install chromium)")
    return ", ".join(missing) or None


@pytest.fixture(scope="module")
def browser_tools() -> str:
    missing = _missing_tools()
    if missing:
        pytest.skip(f"front-end test skipped: missing {missing}")
    return _chromium() or ""


# ------------------------------------------------------------------------------------------------ the workflow


def _prompt(tiny_models: TinyModels, folder: str, cache: str, damaged: str) -> dict[str, Any]:
    """The API prompt the UI workflow must produce (node ids as strings)."""
    return {
        str(UNET): {"class_type": "UNETLoader", "inputs": {"unet_name": tiny_models.name("unet"),
                                                           "weight_dtype": "default"}},
        str(CLIP): {"class_type": "CLIPLoader", "inputs": {"clip_name": tiny_models.name("clip"),
                                                           "type": "stable_diffusion", "device": "default"}},
        str(VAE): {"class_type": "VAELoader", "inputs": {"vae_name": tiny_models.name("vae")}},
        str(ENCODE): {"class_type": "StreamCache_EncodeDataset", "inputs": {
            "folder": folder, "cache": cache, "dataset_name": "default", "vae": [str(VAE), 0],
            "clip": [str(CLIP), 0],
            "resolution": 64, "bucket_step": 32, "crop": "center", "caption_prefix": "", "caption_suffix": "",
            "batch_size": 2, "on_failure": "skip", "upscale": False, "frame_count": 17, "frame_sampling": "first",
            "frame_step": 2, "fps": 0.0, "flip": "none", "shuffle_variants": 0, "keep_tokens": 0,
            "empty_caption": False, "masks": "none", "missing_caption": "empty",
            "extra_resolutions": "", "tag_dropout": 0.0, "wildcards": False,
            "clips_per_video": 1, "keep_tokens_separator": "", "caption_extension": ".txt",
            "secondary_separator": "", "reference_folder": "none"}},
        str(TRAIN): {"class_type": "StreamCache_TrainLoRA", "inputs": {
            "model": [str(UNET), 0], "dataset": [str(ENCODE), 0], "batch_size": 1, "grad_accumulation_steps": 1,
            "steps": STEPS, "learning_rate": 0.0005, "rank": 4, "optimizer": "AdamW", "loss_function": "MSE",
            "seed": 0, "training_dtype": "fp32", "lora_dtype": "fp32", "algorithm": "LoRA",
            "gradient_checkpointing": False, "checkpoint_depth": 1, "offloading": False,
            "existing_lora": "[None]", "prefetch_batches": 2, "loader_threads": 0, "quantized_backward": False,
            "bypass_mode": False, "masked_loss": True, "unmasked_weight": 0.1,
            "caption_dropout": 0.0, "reg_ratio": 1.0, "reg_weight": 1.0, "memory": "auto", "stream_blocks": 0,
            "allow_fp8": False, "devices": "auto", "checkpoint_mode": "exact", "save_every": 0,
            "save_prefix": "loras/streamcache_lora", "lr_schedule": "constant", "warmup_steps": 0,
            "timestep_sampling": "uniform", "noise_offset": 0.0, "val_dataset": [str(ENCODE), 0], "val_every": 0,
            "max_grad_norm": 0.0, "ema_decay": 0.0, "min_snr_gamma": 0.0, "train_layers": "",
            "min_timestep": 0, "max_timestep": 1000, "lora_alpha": 1.0,
            "val_split": 0.0, "loss_target": "clean latent", "multires_noise_iterations": 0,
            "multires_noise_discount": 0.3, "sample_count": 0, "sample_every": 0, "sample_steps": 20,
            "sample_cfg": 1.0, "debiased_estimation": False, "sample_sampler": "euler",
            "sample_scheduler": "simple", "scale_v_pred_loss": False, "sample_width": 0, "sample_height": 0,
            "sample_texts": "", "sample_seed": -1, "network_dropout": 0.0,
            "rank_dropout": 0.0, "module_dropout": 0.0, "optimizer_args": "", "ip_noise_gamma": 0.0,
            "v_pred_like_loss": 0.0, "noise_offset_random_strength": False,
            "ip_noise_gamma_random_strength": False}},
        str(SAVE): {"class_type": "SaveLoRA", "inputs": {"lora": [str(TRAIN), 0], "prefix": "loras/streamcache_fe",
                                                         "steps": [str(TRAIN), 2]}},
        str(INFO): {"class_type": "StreamCache_CacheInfo", "inputs": {"cache": damaged}},
    }


LAYOUT = {UNET: (20, 470, 330, 90), CLIP: (20, 170, 330, 110), VAE: (20, 40, 330, 60),
          ENCODE: (380, 40, 360, 450), TRAIN: (770, 40, 420, 760), SAVE: (1220, 40, 330, 90),
          INFO: (1220, 200, 340, 190)}


def _input_spec(info: dict[str, Any], name: str) -> list[Any]:
    for section in ("required", "optional"):
        if name in info.get("input", {}).get(section, {}):
            return info["input"][section][name]
    raise KeyError(name)


def _frontend_adds_control(info: dict[str, Any], name: str) -> bool:
    """The front end also gives INT inputs named ``seed``/``noise_seed`` a control_after_generate widget (whose
    value follows the seed in ``widgets_values``) unless the node sets the option explicitly."""
    spec = _input_spec(info, name)
    options = spec[1] if len(spec) > 1 and isinstance(spec[1], dict) else {}
    return spec[0] == "INT" and name in ("seed", "noise_seed") and "control_after_generate" not in options


def api_to_ui(prompt: dict[str, Any], object_info: dict[str, Any]) -> dict[str, Any]:
    """A UI workflow (what the front end saves) for an API prompt: positional widget values, a link table."""
    links: list[list[Any]] = []
    nodes: dict[int, dict[str, Any]] = {}
    for node_id, entry in prompt.items():
        info = object_info[entry["class_type"]]
        x, y, w, h = LAYOUT[int(node_id)]
        values: list[Any] = []
        for name, has_control in _widget_inputs(info):
            values.append(entry["inputs"][name] if name in entry["inputs"] or not is_optional_input(info, name)
                          else input_default(info, name))
            if has_control or _frontend_adds_control(info, name):
                values.append("fixed")
        widget_names = {name for name, _ in _widget_inputs(info)}
        inputs = []
        for section in ("required", "optional"):
            for name in info.get("input_order", {}).get(section, []):
                kind = _input_spec(info, name)[0]
                slot: dict[str, Any] = {"name": name, "type": "COMBO" if isinstance(kind, list) else kind,
                                        "link": None}
                if name in widget_names:
                    slot["widget"] = {"name": name}
                elif name not in entry["inputs"] and section == "optional":
                    continue
                inputs.append(slot)
        outputs = [{"name": out_name, "type": out_type, "links": [], "slot_index": i}
                   for i, (out_name, out_type) in enumerate(zip(info["output_name"], info["output"]))]
        nodes[int(node_id)] = {"id": int(node_id), "type": entry["class_type"], "pos": [x, y], "size": [w, h],
                               "flags": {}, "order": 0, "mode": 0, "inputs": inputs, "outputs": outputs,
                               "properties": {"Node name for S&R": entry["class_type"]},
                               "widgets_values": values}
    for node_id, entry in prompt.items():
        for name, value in entry["inputs"].items():
            if not (isinstance(value, list) and len(value) == 2 and isinstance(value[0], str)):
                continue
            src, slot = int(value[0]), value[1]
            dst = nodes[int(node_id)]
            dst_slot = next(i for i, s in enumerate(dst["inputs"]) if s["name"] == name)
            link_id = len(links) + 1
            kind = nodes[src]["outputs"][slot]["type"]
            links.append([link_id, src, slot, int(node_id), dst_slot, kind])
            dst["inputs"][dst_slot]["link"] = link_id
            dst["inputs"][dst_slot]["type"] = kind
            nodes[src]["outputs"][slot]["links"].append(link_id)
    return {"last_node_id": max(nodes), "last_link_id": len(links), "nodes": list(nodes.values()),
            "links": links, "groups": [], "config": {}, "extra": {"ds": {"scale": 0.9, "offset": [70, 40]}},
            "version": 0.4}


def _damaged_cache(root: Path) -> Path:
    """A one-entry cache whose tensor bytes no longer match their checksum (headers intact)."""
    from support.pack import import_library

    import_library()
    import torch
    from dataset_cache.format.writer import CacheWriter

    with CacheWriter(root) as writer:
        writer.add(hashlib.sha256(b"fe").hexdigest(), {"samples": torch.ones(1, 4, 8, 8)}, kind="latent")
    (shard,) = (root / "shards").glob("*.safetensors")
    data = bytearray(shard.read_bytes())
    at = data.rfind(b"\x00\x00\x80\x3f" * 16)  # inside the 1.0 run
    assert at > 0, "tensor bytes not found in the shard"
    data[at + 2] ^= 0x01
    shard.write_bytes(bytes(data))
    return root


# ------------------------------------------------------------------------------------------------ the test


def _console_problems(result: dict[str, Any]) -> list[str]:
    bad = [f"{m['type']}: {m['text']} ({m.get('url', '')})" for m in result["console"]
           if m["type"] in ("error", "assert") and "streamcache" in (m["text"] + m.get("url", "")).lower()]
    bad += [e for e in result["pageErrors"] if "streamcache" in e.lower()]
    return bad


def test_live_loss_curve_and_panels_in_the_real_front_end(browser_tools: str, comfy_server: ComfyServer,
                                                          client: ComfyClient, tiny_models: TinyModels) -> None:
    with urllib.request.urlopen(comfy_server.url + "/", timeout=30) as resp:
        page = resp.read().decode(errors="replace")
    if "<title>ComfyUI" not in page:
        pytest.skip("front-end test skipped: the server serves no ComfyUI front end (comfyui-frontend-package)")
    make_kohya_folder(comfy_server.input_dir / "fe_kohya",
                      (Subset(2, "red", ((64, 64), (96, 64), (64, 64)), "png"), Subset(1, "blue", ((64, 64),), "jpg")))
    _damaged_cache(comfy_server.streamcache_dir / "fe_damaged")
    prompt = _prompt(tiny_models, "fe_kohya", "fe_cache", "fe_damaged")
    object_info = client.object_info()
    workflow = api_to_ui(prompt, object_info)
    assert {k: v["inputs"] for k, v in ui_to_api(workflow, object_info).items()} == \
        {k: v["inputs"] for k, v in prompt.items()}  # the converter reads what the front end reads (below)

    ARTIFACTS.mkdir(parents=True, exist_ok=True)
    (ARTIFACTS / "frontend-workflow.json").write_text(json.dumps(workflow, indent=1))
    # ComfyUI re-sends a cached node's UI only for output / intermediate-output nodes
    expect_cached_ui = bool(object_info["StreamCache_TrainLoRA"].get("has_intermediate_output"))
    config = {"url": comfy_server.url, "workflow": workflow, "out": str(ARTIFACTS), "chromium": browser_tools,
              "timeout_ms": 480_000, "train_node": TRAIN, "encode_node": ENCODE, "info_node": INFO,
              "cached_wait_ms": 60_000 if expect_cached_ui else 3_000}
    t0 = time.monotonic()
    proc = subprocess.run(["node", str(DRIVER), json.dumps(config)], cwd=FRONTEND, capture_output=True, text=True,
                          timeout=600)
    seconds = time.monotonic() - t0
    assert proc.returncode == 0, f"drive.mjs failed ({proc.returncode}):\n{proc.stderr[-4000:]}\n{proc.stdout[-2000:]}"
    result = json.loads(proc.stdout.strip().splitlines()[-1])
    assert not result.get("error"), f"drive.mjs: {result['error']}\nconsole: {result['console'][-20:]}"
    sys.stderr.write(f"\n[frontend] browser run {seconds:.1f} s, steps {result['steps']}; screenshots: "
                     f"{ARTIFACTS / 'frontend.png'}, {ARTIFACTS / 'frontend-loss-curve.png'}, "
                     f"{ARTIFACTS / 'frontend-live.png'}\n")

    # a freshly added Train LoRA keeps its seed: re-queueing reuses ComfyUI's cache instead of training again
    assert result["freshSeedControl"] == "fixed", result["freshSeedControl"]

    # the extension added its panels; the page's API prompt is the one intended (panels are not serialized)
    panels = {p["id"]: p for p in result["panels"]}
    assert all(panels[n]["panel"] for n in (ENCODE, TRAIN, INFO)), panels
    assert not any(panels[n]["panel"] for n in (UNET, CLIP, VAE, SAVE))
    page_prompt = {k: v["inputs"] for k, v in result["prompt"].items()}
    assert page_prompt == {k: v["inputs"] for k, v in prompt.items()}

    # the curve appeared and updated while training ran (checked right after each event, and by polling), then
    # showed the whole run
    seen = result["seen"]
    steps = [int(s["event"]["step"]) for s in seen]
    assert len(set(steps)) >= 2 and len({s["event"]["loss"] for s in seen}) >= 2, f"too few live events: {seen}"
    assert all(s["event"]["node"] == str(TRAIN) and int(s["event"]["total"]) == STEPS for s in seen)
    assert [int(s["panel"]["step"]) for s in seen] == steps, "the panel did not follow the events"
    # each step's learning rate reaches the panel's head (lr_schedule 'constant': the node's learning_rate)
    assert all(float(s["event"]["learning_rate"]) == float(s["panel"]["learningRate"]) == 0.0005 for s in seen), seen
    # and each step's gradient norm (measured whether or not max_grad_norm clips)
    assert all(float(s["event"]["grad_norm"]) == float(s["panel"]["gradNorm"]) > 0 for s in seen), seen
    points = [int(s["panel"]["points"]) for s in seen]
    assert points == list(range(1, len(seen) + 1)), points
    live = [s["train"] for s in result["samples"] if s["train"] and s["train"].get("final") == "false"
            and s["train"].get("step")]
    assert live, "the page never showed the live curve"
    final = result["final"]["train"]
    assert final["final"] == "true" and int(final["points"]) == STEPS and final["visible"], final
    # the validation loss (the training images themselves here: a NOTE says so) joins the chart: measured before the
    # first step (live from the first event on) and after the last (from the node's output)
    assert all(int(s["panel"]["valPoints"]) >= 1 and s["event"]["val_step"] == 0 for s in seen[:1]), seen[:1]
    assert int(final["valPoints"]) == 2, final
    assert int(final["step"]) == STEPS and float(final["loss"]) > 0
    if expect_cached_ui:
        assert result["cached"]["final"] == "true" and int(result["cached"]["points"]) == STEPS, result["cached"]

    # the encode report went live then final; Cache Info flags the damaged cache
    encode = result["final"]["encode"]
    assert encode["phase"] == "done" and int(encode["new"]) == 8 and int(encode["failed"]) == 0, encode
    assert int(encode["encoded"]) == 4 + 4 and int(encode["bytes_written"]) > 0  # 4 latents, 4 distinct caption texts
    assert any((s["encode"] or {}).get("phase") == "encoding" for s in result["samples"]), "no live encode report"
    info = result["final"]["info"]
    assert int(info["problems"]) >= 1 and "problem" in info["text"], info

    # every figure is plain node output in /history too
    (entry,) = [h for h in result["history"].values() if str(TRAIN) in h.get("outputs", {})
                and len(h["outputs"][str(TRAIN)].get("loss", [])) == STEPS][:1]
    outputs = entry["outputs"]
    assert outputs[str(TRAIN)]["text"][0].startswith("dataset 'default'")
    assert outputs[str(ENCODE)]["streamcache_report"][0]["new"] == 8  # images + caption files
    assert outputs[str(INFO)]["streamcache_info"][0]["problems"]

    assert not _console_problems(result), _console_problems(result)
    assert (ARTIFACTS / "frontend.png").stat().st_size > 10_000


def test_panel_data_reaches_the_websocket_and_history_without_a_browser(client: ComfyClient,
                                                                       comfy_server: ComfyServer,
                                                                       tiny_models: TinyModels) -> None:
    """What the panels draw is plain websocket events and node output: checked with no browser at all."""
    make_kohya_folder(comfy_server.input_dir / "fe_ws_kohya", (Subset(1, "x", ((64, 64), (64, 64)), "png"),))
    prompt = {k: v for k, v in _prompt(tiny_models, "fe_ws_kohya", "fe_ws_cache", "fe_ws_cache").items()
              if k in (str(CLIP), str(VAE), str(ENCODE))}
    result = client.run(prompt)
    (report,) = result.outputs[str(ENCODE)]["streamcache_report"]
    assert report["new"] == 4 and not report["failed"] and report["bytes_written"] > 0  # 2 images + 2 captions
    assert report["encoded_latents"] == 2 and report["encoded_conditionings"] == 3  # one two-line caption
    assert result.outputs[str(ENCODE)]["text"][0].startswith("dataset 'default': 2 samples")
    if result.events:  # websocket-client present
        live = result.events_of("streamcache.encode")
        assert live and all(e["node"] == str(ENCODE) and e["phase"] == "encoding" for e in live)
        assert live[-1]["done"] == live[-1]["total"] == 5 and live[-1]["samples"] == 2

    info = client.run({"9": {"class_type": "StreamCache_CacheInfo", "inputs": {"cache": "fe_ws_cache"}}})
    (fields,) = info.outputs["9"]["streamcache_info"]
    assert fields["samples"] == 2 and fields["entries"] == 5 and fields["problems"] == []
    assert fields["verified"] == "full"


# ------------------------------------------------------------------------------------------------ every node, fresh

LAYOUT_DRIVER = FRONTEND / "layout.mjs"
SAVED = Path(__file__).resolve().parent / "data"


def _overlaps(boxes: list[tuple[str, float, float]]) -> list[str]:
    """Names of vertically overlapping (name, top, bottom) boxes, in drawing order."""
    bad = []
    ordered = sorted(boxes, key=lambda b: b[1])
    for (a, _, a_bottom), (b, b_top, _) in zip(ordered, ordered[1:]):
        if b_top < a_bottom - 0.5:
            bad.append(f"{a} / {b}")
    return bad


def test_every_node_fresh_and_old_workflows_in_the_real_front_end(browser_tools: str, comfy_server: ComfyServer,
                                                                   client: ComfyClient) -> None:
    """Each node as a user adds it: one widget per widget input, in the schema's order, none hidden, none
    overlapping another or a socket, all inside the node; the same names on every node (``cache``,
    ``dataset_name``, the ``dataset`` socket). Workflows saved before the renames (by the front end itself, and the
    templates) load with the new input names, no stale slot, and the page queues the current templates' prompts."""
    object_info = client.object_info()
    types = sorted(k for k in object_info if k.startswith("StreamCache_"))
    assert len(types) >= 6
    workflows = {
        "front end": json.loads((SAVED / "saved_by_0.2.0-pre" / "front-end" / "Every node, saved by the front end.json")
                                .read_text(encoding="utf-8")),
        **{f"0.2.0-pre {p.stem}": json.loads(p.read_text(encoding="utf-8"))
           for p in sorted((SAVED / "saved_by_0.2.0-pre").glob("*.json"))},
        **{f"0.1.0 {p.stem}": json.loads(p.read_text(encoding="utf-8"))
           for p in sorted((SAVED / "saved_by_0.1.0").glob("*.json"))},
    }
    ARTIFACTS.mkdir(parents=True, exist_ok=True)
    config = {"url": comfy_server.url, "chromium": browser_tools, "out": str(ARTIFACTS), "types": types,
              "workflows": workflows}
    proc = subprocess.run(["node", str(LAYOUT_DRIVER), json.dumps(config)], cwd=FRONTEND, capture_output=True,
                          text=True, timeout=300)
    assert proc.returncode == 0, f"layout.mjs failed ({proc.returncode}):\n{proc.stderr[-4000:]}"
    result = json.loads(proc.stdout.strip().splitlines()[-1])
    assert not result.get("error"), f"layout.mjs: {result['error']}"
    sys.stderr.write(f"\n[frontend] every node fresh: {ARTIFACTS / 'frontend-every-node.png'}\n")

    for node in result["fresh"]:
        kind, info = node["type"], object_info[node["type"]]
        where = f"{kind} (fresh)"
        widgets = [w for w in node["widgets"] if w["serialize"]]
        expected = [name for name, has_control in _widget_inputs(info) for name in [name] + ["control"] * has_control]
        assert len(widgets) == len(expected) and \
            [w["name"] if n != "control" else "control" for w, n in zip(widgets, expected)] == expected, \
            f"{where}: widgets {[w['name'] for w in widgets]}"
        assert not [w["name"] for w in node["widgets"] if w["hidden"]], f"{where}: hidden widgets"
        width, height = node["size"]
        boxes = [(w["name"], w["y"], w["y"] + w["h"]) for w in node["widgets"]]
        assert all(y is not None and h for _, y, h in boxes), f"{where}: a widget was not laid out: {boxes}"
        assert not _overlaps(boxes), f"{where}: overlapping widgets {_overlaps(boxes)}"
        assert max(bottom for _, _, bottom in boxes) <= height + 0.5, f"{where}: a widget below the node's edge"
        assert all((w["width"] or width) <= width + 0.5 for w in node["widgets"]), f"{where}: a widget too wide"
        top = min(y for _, y, _ in boxes)
        sockets = [s for s in node["inputs"] if s["widget"] is None] + node["outputs"]
        assert all(s["pos"] and 0 < s["pos"][1] < top for s in sockets), \
            f"{where}: a socket is drawn over the widgets: {[(s['name'], s['pos']) for s in sockets]} (top {top})"
        for slot in node["inputs"]:  # a widget's own input dot sits on its widget's row
            if slot["widget"] is not None:
                (row,) = [b for b in boxes if b[0] == slot["widget"]]
                assert row[1] <= slot["pos"][1] <= row[2], f"{where}: {slot['name']} dot off its row"
        # every input of the schema is on the node: a widget or a socket
        declared = [n for section in ("required", "optional") for n in info["input_order"].get(section, [])]
        shown = {w["name"] for w in widgets} | {s["name"] for s in node["inputs"]}
        assert not [n for n in declared if n not in shown], f"{where}: inputs not shown"

    # one name per concept on every node
    names = {n["type"]: {s["name"] for s in n["inputs"]} for n in result["fresh"]}
    for kind, inputs in names.items():
        assert not inputs & {"name"}, f"{kind} still has an input called name"
    for kind in ("StreamCache_EncodeDataset", "StreamCache_SaveCache", "StreamCache_LoadLazyCache",
                 "StreamCache_CleanCache", "StreamCache_CacheInfo"):
        assert "cache" in names[kind], kind
    for kind in ("StreamCache_EncodeDataset", "StreamCache_SaveCache", "StreamCache_LoadLazyCache"):
        assert "dataset_name" in names[kind], kind
    widget_kind = {(n["type"], w["name"]): w["type"] for n in result["fresh"] for w in n["widgets"]}
    for kind in ("StreamCache_LoadLazyCache", "StreamCache_CleanCache", "StreamCache_CacheInfo"):
        assert widget_kind[(kind, "cache")] == "combo", f"{kind}: an existing cache is picked from a list"
    for kind in ("StreamCache_EncodeDataset", "StreamCache_SaveCache"):
        assert widget_kind[(kind, "cache")] == "text", f"{kind}: a cache to create is typed"
    assert widget_kind[("StreamCache_EncodeDataset", "folder")] == "combo"

    # old workflows: new names, no stale slot, and the page queues the current prompt
    for label, loaded in result["loaded"].items():
        for node in loaded["nodes"]:
            old = set(RENAMED.get(node["type"], {}))
            slots = [s["name"] for s in node["inputs"]]
            assert len(slots) == len(set(slots)), f"{label}: {node['type']} has a slot twice: {slots}"
            stale = [s for s in node["inputs"] if s["widget"] is not None and s["widget"] not in node["widgets"]]
            assert not stale, f"{label}: {node['type']} keeps slots of widgets it has no more: {stale}"
            assert not [s for s in node["inputs"] if s["widget"] in old], f"{label}: old names on {node['type']}"
        page = {k: {"class_type": v["class_type"], "inputs": v["inputs"]} for k, v in loaded["prompt"].items()}
        if label == "front end":
            queued = json.loads((SAVED / "saved_by_0.2.0-pre" / "front-end" /
                                 "Every node, queued by the front end (API).json").read_text(encoding="utf-8"))
            want = as_current(queued, object_info)
        else:
            stem = label.split(" ", 1)[1]
            want = as_saved_before(json.loads(
                (PACK_ROOT / "example_workflows" / "api" / f"{stem}.json").read_text(encoding="utf-8")))
        assert page == want, f"{label}: the page queues another prompt"

    assert not _console_problems(result), _console_problems(result)


# ------------------------------------------------------------------------------------------------ the templates

TEMPLATES_DRIVER = FRONTEND / "templates.mjs"


def _intersect(a: list[float], b: list[float]) -> bool:
    """Whether two ``[x0, y0, x1, y1]`` boxes share more than a touching edge (half a canvas unit: the renderers'
    rounding)."""
    return a[0] < b[2] - 0.5 and b[0] < a[2] - 0.5 and a[1] < b[3] - 0.5 and b[1] < a[3] - 0.5


def _inside(inner: list[float], outer: list[float]) -> bool:
    return (outer[0] <= inner[0] + 0.5 and outer[1] <= inner[1] + 0.5 and inner[2] <= outer[2] + 0.5
            and inner[3] <= outer[3] + 0.5)


def test_templates_lay_out_without_overlaps_in_both_renderers(browser_tools: str, comfy_server: ComfyServer,
                                                               client: ComfyClient) -> None:
    """Each template as the front end draws it — the classic canvas (every widget drawn, so Train LoRA is some
    2,000 units tall whatever size the file says) and Vue nodes — has no node over another, every node inside the
    group it is placed in, and no group over another; the renderer setting is put back afterwards."""
    templates = sorted((PACK_ROOT / "example_workflows").glob("*.json"))
    workflows = {p.stem: json.loads(p.read_text(encoding="utf-8")) for p in templates}
    setting = f"{comfy_server.url}/api/settings/Comfy.VueNodes.Enabled"
    with urllib.request.urlopen(setting, timeout=30) as resp:
        before = resp.read()
    ARTIFACTS.mkdir(parents=True, exist_ok=True)
    config = {"url": comfy_server.url, "chromium": browser_tools, "out": str(ARTIFACTS), "workflows": workflows}
    proc = subprocess.run(["node", str(TEMPLATES_DRIVER), json.dumps(config)], cwd=FRONTEND, capture_output=True,
                          text=True, timeout=300)
    assert proc.returncode == 0, f"templates.mjs failed ({proc.returncode}):\n{proc.stderr[-4000:]}"
    result = json.loads(proc.stdout.strip().splitlines()[-1])
    assert not result.get("error"), f"templates.mjs: {result['error']}"
    with urllib.request.urlopen(setting, timeout=30) as resp:
        assert resp.read() == before  # the other front-end tests see the renderer they saw before
    sys.stderr.write(f"\n[frontend] templates in both renderers: {ARTIFACTS}/template-*.png\n")

    assert sorted(result["layouts"]) == sorted(f"{name} | {mode}" for name in workflows for mode in ("classic", "vue"))
    for label, laid in result["layouts"].items():
        assert laid["vue"] == label.endswith("| vue"), f"{label}: the renderer setting did not take"
        nodes, groups = laid["nodes"], laid["groups"]
        assert len(nodes) == len(workflows[label.split(" | ")[0]]["nodes"])
        assert all(n["box"] for n in nodes), f"{label}: a node was not drawn: {nodes}"
        over = [f"{a['title']} / {b['title']}" for i, a in enumerate(nodes) for b in nodes[i + 1:]
                if _intersect(a["box"], b["box"])]
        assert not over, f"{label}: nodes drawn over each other: {over}"
        outside = [f"{n['title']} {[round(v) for v in n['box']]} past {g['title']!r} {g['box']}"
                   for n in nodes for g in groups if _intersect(n["box"], g["box"]) and not _inside(n["box"], g["box"])]
        assert not outside, f"{label}: nodes running out of their group: {outside}"
        assert not [1 for i, a in enumerate(groups) for b in groups[i + 1:] if _intersect(a["box"], b["box"])], label
    assert not _console_problems(result), _console_problems(result)

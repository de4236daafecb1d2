"""Training-time variety over HTTP (#16): a folder with masks and comma-tag captions plus a regularization folder
→ Encode Dataset (flip random, 4 shuffle variants, the empty caption, masklabel masks) and Encode Dataset of the
reg folder into the same cache → Train LoRA (caption dropout 0.1, the reg dataset at a ratio and weight) → Save
LoRA → Load LoRA → KSampler → VAE Decode → Save Image, on the session's real server; then one caption edited and
the prompt queued again encodes exactly that caption's variants.
"""

from __future__ import annotations

import copy
import json
import math
from pathlib import Path
from typing import Any

import pytest
from PIL import Image
from support.client import ComfyClient
from support.datasets import Subset, make_kohya_folder
from support.examples import MAIN_TEMPLATE, ExampleRun, run_example
from support.paths import PACK_ROOT
from support.server import ComfyServer

from dataset_cache.format.reader import open_cache

FOLDER, REG_FOLDER, CACHE = "e2e_variety", "e2e_variety_reg", "e2e_variety"
SHUFFLES, STEPS = 4, 12
TAGS = "red square, tiny pattern, test image, soft light, plain background, centered, number {i}"
"""Seven shufflable tags after the kept trigger word (5040 orders): four seeded orders of one line differ."""
MASKED = (0, 2)
"""Images that get a ``-masklabel.png`` (left half white, right half black); the others have none."""


def _captions(folder: Path) -> list[Path]:
    return sorted(folder.rglob("*.txt"))


def _write_folders(input_dir: Path) -> None:
    main = make_kohya_folder(input_dir / FOLDER, (Subset(2, "ohwx", ((64, 64), (64, 64), (96, 64), (64, 64))),))
    for i, img in enumerate(main.images):
        img.path.with_suffix(".txt").write_text("ohwx, " + TAGS.format(i=i), encoding="utf-8")
        if i in MASKED:
            w, h = img.size
            mask = Image.new("L", (w, h), 0)
            mask.paste(255, (0, 0, w // 2, h))
            mask.save(img.path.with_name(f"{img.path.stem}-masklabel.png"))
    make_kohya_folder(input_dir / REG_FOLDER, (Subset(1, "square", ((64, 64), (96, 64))),))


def _prompt() -> dict[str, Any]:
    """The shipped main example with the variety settings and a second Encode Dataset for the reg folder."""
    prompt = json.loads((PACK_ROOT / "example_workflows" / "api" / f"{MAIN_TEMPLATE}.json").read_text("utf-8"))
    encode = prompt["4"]["inputs"]
    encode.update(folder=FOLDER, cache=CACHE, flip="random", shuffle_variants=SHUFFLES, keep_tokens=1,
                  empty_caption=True, masks="masklabel")
    reg = copy.deepcopy(prompt["4"])
    reg["inputs"].update(folder=REG_FOLDER, dataset_name="reg", flip="none", shuffle_variants=0, masks="none")
    prompt["16"] = reg
    prompt["5"]["inputs"].update(steps=STEPS, caption_dropout=0.1, reg_dataset=["16", 0], reg_ratio=0.5,
                                 reg_weight=0.5, masked_loss=True, unmasked_weight=0.1)
    prompt["6"]["inputs"]["save_prefix"] = "loras/e2e_variety"
    prompt["14"]["inputs"]["filename_prefix"] = "e2e_variety"
    return prompt


def _report(run: ExampleRun, node: str) -> dict[str, Any]:
    (report,) = run.outputs()[node]["streamcache_report"]
    return report


@pytest.fixture(scope="module")
def variety(comfy_server: ComfyServer) -> ExampleRun:
    _write_folders(comfy_server.input_dir)
    return run_example(comfy_server.client(), _prompt(), timeout=900)


def test_encode_makes_every_variant(variety: ExampleRun, comfy_server: ComfyServer) -> None:
    assert all(r.status == "success" for r in variety.results)
    report = _report(variety, "4")
    assert report["samples"] == 4 and report["failed"] == 0
    assert report["encoded_mirrors"] == 4 and report["encoded_masks"] == len(MASKED)
    reg = _report(variety, "16")
    assert reg["samples"] == 2 and reg["encoded_mirrors"] == 0 and reg["encoded_masks"] == 0
    # one text encoder, so one empty caption: whichever encode ran first made it, the other reused it
    assert bool(report["encoded_empty_caption"]) + bool(reg["encoded_empty_caption"]) == 1
    assert report["encoded_conditionings"] == 4 * SHUFFLES + bool(report["encoded_empty_caption"])
    with open_cache(comfy_server.streamcache_dir / CACHE) as reader:
        samples = reader.dataset("default")
        assert all(len(s.captions) == SHUFFLES and s.mirror is not None for s in samples)
        assert sum(s.mask is not None for s in samples) == len(MASKED)
        assert len({s.empty_caption for s in samples}) == 1 and samples[0].empty_caption is not None
        mask = reader.read([next(s.mask for s in samples if s.mask)])[0]["mask"]
        assert mask.dtype.is_floating_point is False and tuple(mask.shape) == (1, 1, 8, 8)  # 64 px / 8
        assert mask[..., :4].min() == 255 and mask[..., 4:].max() == 0  # the left half is kept
        assert len(reader.dataset("reg")) == 2


def test_training_ran_saved_and_sampled(variety: ExampleRun, comfy_server: ComfyServer) -> None:
    losses = variety.outputs()["5"]["loss"]
    assert len(losses) == STEPS and all(math.isfinite(x) for x in losses)
    (summary,) = variety.outputs()["5"]["text"]
    # batch 1 × 12 steps; the plans are seeded, so these counts are those of this seed
    assert f"rows: {STEPS} trained, " in summary
    assert all(f" {what}" in summary for what in ("mirrored", "with a mask", "regularization")), summary
    (saved,) = variety.new_loras
    assert saved.startswith(f"e2e_variety_{STEPS}_steps_") and variety.prompt["8"]["inputs"]["lora_name"] == saved
    from safetensors.torch import load_file

    weights = load_file(str(comfy_server.output_dir / "loras" / saved))
    assert any("lora_up" in k for k in weights) and all(bool(v.float().isfinite().all()) for v in weights.values())
    (image,) = variety.outputs()["14"]["images"]
    assert (comfy_server.output_dir / image["subfolder"] / image["filename"]).is_file()


def test_one_caption_edited_encodes_only_its_variants(variety: ExampleRun, comfy_server: ComfyServer,
                                                      client: ComfyClient) -> None:
    caption = _captions(comfy_server.input_dir / FOLDER)[1]
    caption.write_text("ohwx, " + TAGS.format(i="edited"), encoding="utf-8")
    prompt = copy.deepcopy(variety.prompt)
    result = client.run({k: v for k, v in prompt.items() if k in ("1", "2", "4")})
    (report,) = result.outputs["4"]["streamcache_report"]
    assert report["changed"] == 1 and report["new"] == 0
    assert report["encoded_conditionings"] == SHUFFLES  # the edited line's variants, nothing else
    assert report["encoded_latents"] == 0 and report["encoded_mirrors"] == 0 and report["encoded_masks"] == 0
    assert not report["encoded_empty_caption"]


def test_cache_info_and_clean_see_the_variants(variety: ExampleRun, client: ComfyClient,
                                               comfy_server: ComfyServer) -> None:
    """Cache Info lists each role's entries and bytes per dataset; after the caption edit above, Clean Cache finds
    the edited line's four old variants unreferenced and removes them, and nothing the datasets name."""
    info = client.run({"1": {"class_type": "StreamCache_CacheInfo", "inputs": {"cache": CACHE}}})
    (text,) = info.outputs["1"]["text"]
    (fields,) = info.outputs["1"]["streamcache_info"]
    default = fields["variants"]["default"]
    assert (default["mirrors"]["entries"], default["masks"]["entries"], default["empty_caption"]["entries"]) == (
        4, len(MASKED), 1)
    assert default["captions"]["entries"] == 4 * SHUFFLES and default["mirrors"]["bytes"] > 0
    assert "dataset 'default': 4 samples" in text and "mirrors: 4 entries" in text
    assert "variant settings: shuffle_variants 4" in text

    clean = {"1": {"class_type": "StreamCache_CleanCache", "inputs": {"cache": CACHE, "dry_run": False}}}
    (summary,) = client.run(clean).outputs["1"]["text"]
    assert f"unreferenced: {SHUFFLES} entries" in summary  # the edited line's old shuffles
    with open_cache(comfy_server.streamcache_dir / CACHE) as reader:
        assert reader.verify() == []
        live = {k for name in ("default", "reg") for s in reader.dataset(name) for k in s.keys()}
        assert live == set(reader.keys())

"""Reference images over HTTP: a dataset folder and a reference folder made after the server started → Encode
Dataset with ``reference_folder`` (validated by ComfyUI against the input directory's folders as they are now) →
Train LoRA, on the session's real server; a reference edited and the encode queued again encodes that reference
alone; a reference folder that is not there is refused by ComfyUI's validation, naming the input, and the server
keeps serving.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
from PIL import Image
from support.client import ComfyClient, PromptError
from support.datasets import Subset, make_kohya_folder
from support.examples import MAIN_TEMPLATE
from support.paths import PACK_ROOT
from support.server import ComfyServer

from dataset_cache.format.reader import open_cache

FOLDER, REFS, CACHE = "e2e_edits", "e2e_edits_before", "e2e_edits"
STEPS = 2


def _prompt(**encode: Any) -> dict[str, Any]:
    """The shipped main example's encode, train and save nodes, with the reference folder."""
    full = json.loads((PACK_ROOT / "example_workflows" / "api" / f"{MAIN_TEMPLATE}.json").read_text("utf-8"))
    prompt = {k: full[k] for k in ("1", "2", "3", "4", "5", "6")}
    prompt["4"]["inputs"].update(folder=FOLDER, cache=CACHE, reference_folder=REFS, **encode)
    prompt["5"]["inputs"].update(steps=STEPS, sample_count=0)
    prompt["6"]["inputs"]["save_prefix"] = "loras/e2e_edits"
    return prompt


@pytest.fixture(scope="module")
def folders(comfy_server: ComfyServer) -> tuple[Path, Path]:
    data = make_kohya_folder(comfy_server.input_dir / FOLDER, (Subset(1, "hat", ((64, 64), (64, 64), (96, 64))),))
    refs = comfy_server.input_dir / REFS
    for i, img in enumerate(data.images[:2]):  # the third image has none; the kohya subfolder mirrored
        target = (refs / img.path.relative_to(data.root)).with_suffix(".png")
        target.parent.mkdir(parents=True, exist_ok=True)
        Image.new("RGB", img.size, (40 * i, 120, 200)).save(target)
    return data.root, refs


def test_encode_and_train_with_references_over_http(folders: tuple[Path, Path], client: ComfyClient,
                                                    comfy_server: ComfyServer) -> None:
    data, refs = folders
    result = client.run(_prompt(), timeout=600)
    (report,) = result.outputs["4"]["streamcache_report"]
    assert report["samples"] == 3 and report["encoded_references"] == 2 and report["failed"] == 0
    assert report["variants"]["references"] == 2 and report["variants"]["referenced_samples"] == 2
    (summary,) = result.outputs["5"]["text"]
    assert "2 sample(s) have a reference image" in summary  # the tiny SD1.5 model reads none
    with open_cache(comfy_server.streamcache_dir / CACHE) as reader:
        samples = reader.dataset("default")
        assert sum(s.reference is not None for s in samples) == 2
        for s in samples:
            if s.reference is not None:
                lat, ref = reader.read([s.latent, s.reference])
                assert ref["samples"].shape == lat["samples"].shape

    first = sorted(refs.rglob("*.png"))[0]
    Image.new("RGB", Image.open(first).size, (200, 10, 10)).save(first)
    again = client.run({k: v for k, v in _prompt().items() if k in ("1", "2", "4")}, timeout=300)
    (report,) = again.outputs["4"]["streamcache_report"]
    assert report["encoded_latents"] == 1 and report["encoded_references"] == 1
    assert report["encoded_conditionings"] == 0 and not report["clip_loaded"]


def test_a_reference_folder_that_is_not_there_is_refused_by_name(folders: tuple[Path, Path],
                                                                 client: ComfyClient) -> None:
    prompt = {k: v for k, v in _prompt().items() if k in ("1", "2", "4")}
    prompt["4"]["inputs"]["reference_folder"] = "no_such_folder"
    with pytest.raises(PromptError, match="reference_folder"):
        client.run(prompt, timeout=120)
    assert client.run({k: v for k, v in _prompt().items() if k in ("1", "2", "4")}, timeout=300).outputs["4"]

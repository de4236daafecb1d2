"""The shipped example workflows: offered as templates, each UI template equal to its API twin, and run.

``example_workflows/*.json`` are UI workflows (the template browser lists exactly those: ComfyUI globs the top
level only); ``example_workflows/api/<same name>.json`` is the same workflow in API format (``POST /prompt``).
The training workflows are run from their API twins by test_train_flow.py (the twin equals the template's
conversion, so that runs the template); the others run here, queued like a user queues them in the UI.
"""

from __future__ import annotations

import json
import urllib.parse
import urllib.request
from pathlib import Path
from typing import Any

import pytest
from support.client import ComfyClient
from support.examples import MAIN_TEMPLATE, SAVE_THEN_TRAIN_TEMPLATE, as_saved_before, run_example
from support.paths import PACK_ROOT
from support.renames import RENAMED, as_current
from support.server import PACK_LINK_NAME
from support.workflow import _widget_inputs, ui_to_api

EXAMPLES = sorted((PACK_ROOT / "example_workflows").glob("*.json"))
API_DIR = PACK_ROOT / "example_workflows" / "api"
RUN_BY_TEST_TRAIN_FLOW = {MAIN_TEMPLATE, SAVE_THEN_TRAIN_TEMPLATE}


def _bare(prompt: dict[str, Any]) -> dict[str, Any]:
    return {k: {"class_type": v["class_type"], "inputs": v["inputs"]} for k, v in prompt.items()}


def test_examples_are_offered_as_templates(client: ComfyClient) -> None:
    assert EXAMPLES, "example_workflows/ is empty"
    templates = client.get("/workflow_templates")
    assert sorted(templates.get(PACK_LINK_NAME, [])) == sorted(p.stem for p in EXAMPLES)  # api/ is not listed
    for path in EXAMPLES:  # and each is served to the template browser
        served = client.get(urllib.parse.quote(f"/api/workflow_templates/{PACK_LINK_NAME}/{path.name}"))
        assert served["nodes"] == json.loads(path.read_text(encoding="utf-8"))["nodes"]


def _fetch(client: ComfyClient, route: str) -> tuple[bytes, str]:
    with urllib.request.urlopen(client.base_url + urllib.parse.quote(route), timeout=30) as resp:
        return resp.read(), resp.headers.get("Content-Type", "")


def test_thumbnails_and_help_pages_are_served_where_the_front_end_asks(client: ComfyClient) -> None:
    """The template browser requests ``/api/workflow_templates/<pack>/<name>.jpg``; the Info panel requests
    ``/extensions/<pack>/docs/<node id>.md`` and refuses a text/html answer."""
    for path in EXAMPLES:
        body, kind = _fetch(client, f"/api/workflow_templates/{PACK_LINK_NAME}/{path.stem}.jpg")
        assert kind == "image/jpeg" and body == path.with_suffix(".jpg").read_bytes(), path.name
    node_ids = sorted(k for k in client.object_info() if k.startswith("StreamCache_"))
    assert len(node_ids) >= 6
    for node_id in node_ids:
        body, kind = _fetch(client, f"/extensions/{PACK_LINK_NAME}/docs/{node_id}.md")
        assert "text/html" not in kind and body == (PACK_ROOT / "web" / "docs" / f"{node_id}.md").read_bytes()


def test_every_template_has_an_equal_api_twin(client: ComfyClient) -> None:
    info = client.object_info()
    assert sorted(p.stem for p in API_DIR.glob("*.json")) == sorted(p.stem for p in EXAMPLES)
    for path in EXAMPLES:
        converted = ui_to_api(json.loads(path.read_text(encoding="utf-8")), info)
        twin = json.loads((API_DIR / path.name).read_text(encoding="utf-8"))
        assert _bare(converted) == _bare(twin), path.name


SAVED_BY_0_1_0 = sorted((Path(__file__).parent / "data" / "saved_by_0.1.0").glob("*.json"))
"""The templates as version 0.1.0 saved them, before Encode Dataset had its ``upscale`` input (users' saved
workflows look like these)."""


@pytest.mark.parametrize("old", SAVED_BY_0_1_0, ids=lambda p: p.stem)
def test_workflows_saved_by_the_previous_version_load_as_the_current_templates(old: Path, client: ComfyClient
                                                                              ) -> None:
    """Read the way the front end reads them (a widget the file lacks takes its default), the old files give the
    prompts the current templates give, so a saved workflow keeps working and encodes as it did (no upscale)."""
    info = client.object_info()
    converted = ui_to_api(json.loads(old.read_text(encoding="utf-8")), info)
    current = json.loads((API_DIR / old.name).read_text(encoding="utf-8"))
    assert _bare(converted) == as_saved_before(current), old.name
    assert all(n["inputs"].get("upscale") is False for n in converted.values()
               if n["class_type"] == "StreamCache_EncodeDataset")


@pytest.mark.parametrize("path", EXAMPLES, ids=lambda p: p.stem)
def test_template_links_and_widgets_are_consistent(path: Path, client: ComfyClient) -> None:
    """What the frontend needs to load a template as saved: every link joins existing slots of matching types, and
    each node has exactly one widget value per widget (a seed has a second one: its fixed/randomize selector)."""
    workflow = json.loads(path.read_text(encoding="utf-8"))
    nodes = {n["id"]: n for n in workflow["nodes"]}
    info = client.object_info()
    for node in workflow["nodes"]:
        if node["type"] in info:
            widgets = _widget_inputs(info[node["type"]])
            assert len(node["widgets_values"]) == len(widgets) + sum(c for _, c in widgets), node["type"]
    assert workflow["last_node_id"] >= max(nodes)
    assert workflow["last_link_id"] >= max((link[0] for link in workflow["links"]), default=0)
    for link_id, src, src_slot, dst, dst_slot, kind in workflow["links"]:
        assert link_id in (nodes[src]["outputs"][src_slot]["links"] or [])
        assert nodes[src]["outputs"][src_slot]["type"] == kind
        assert nodes[dst]["inputs"][dst_slot]["link"] == link_id
        assert nodes[dst]["inputs"][dst_slot]["type"] in (kind, "COMBO", "*") or kind == "*"


@pytest.mark.parametrize("path", [p for p in EXAMPLES if p.stem not in RUN_BY_TEST_TRAIN_FLOW], ids=lambda p: p.stem)
def test_example_workflow_runs(path: Path, client: ComfyClient) -> None:
    prompt = ui_to_api(json.loads(path.read_text(encoding="utf-8")), client.object_info())
    assert prompt, f"{path.name} has no executable node"
    run = run_example(client, prompt)
    assert all(r.status == "success" for r in run.results)
    assert run.outputs(), f"{path.name} produced no output"


SAVED_BEFORE_RENAMES = Path(__file__).parent / "data" / "saved_by_0.2.0-pre"
"""The templates, their API twins and a workflow with every node (``front-end/``: added fresh in the real front end,
saved with its own serializer, and the API prompt it queued), all as the pack saved them before 0.2.0 renamed
inputs: Save Streamable Cache ``name``, Load Lazy Cache ``name`` + ``dataset``, Clean Cache ``name`` and Encode
Dataset ``dataset`` (now ``cache`` and ``dataset_name``), and before Train LoRA had ``quantized_backward`` and
``bypass_mode``."""


@pytest.mark.parametrize("old", sorted(SAVED_BEFORE_RENAMES.glob("*.json")), ids=lambda p: p.stem)
def test_templates_saved_before_the_renames_load_as_the_current_templates(old: Path, client: ComfyClient) -> None:
    """A UI workflow stores widget values by position, and the renamed inputs kept theirs: read as the front end
    reads it (the browser side is in test_frontend.py), the old file gives the current template's prompt."""
    info = client.object_info()
    converted = ui_to_api(json.loads(old.read_text(encoding="utf-8")), info)
    current = json.loads((API_DIR / old.name).read_text(encoding="utf-8"))
    assert _bare(converted) == as_saved_before(current), old.name
    old_api = json.loads((SAVED_BEFORE_RENAMES / "api" / old.name).read_text(encoding="utf-8"))
    expected = as_current(old_api, info)  # renamed inputs under their new names, inputs added since at defaults
    assert as_saved_before(current) == _bare(expected), (
        f"{old.name}: the current twin is not the old one under the new names")


def test_api_prompts_saved_before_the_renames_still_run_over_http(client: ComfyClient,
                                                                comfy_server: Any) -> None:
    """The old input names are accepted in an API prompt: POST /prompt with the prompt the front end queued
    before the renames (every node with a renamed input, names as they were) encodes, saves, loads, copies,
    cleans and describes, exactly as with the new names."""
    from support.examples import make_example_folder

    make_example_folder(comfy_server.input_dir)
    old = json.loads((SAVED_BEFORE_RENAMES / "front-end" / "Every node, queued by the front end (API).json")
                     .read_text(encoding="utf-8"))
    assert any(name in n["inputs"] for n in old.values() for name in RENAMED.get(n["class_type"], {}))
    run = run_example(client, old)
    assert all(r.status == "success" for r in run.results)
    outputs = run.outputs()
    kinds = {k: v["class_type"] for k, v in old.items()}
    by_kind = {kinds[k]: v for k, v in outputs.items()}
    assert by_kind["StreamCache_EncodeDataset"]["streamcache_report"][0]["dataset"] == "old_default"
    saved = [outputs[k]["text"][0] for k in outputs if kinds[k] == "StreamCache_SaveCache"]
    assert any("saved dataset 'old_saved'" in t and "old_names_saved" in t for t in saved), saved
    assert any("saved dataset 'old_copy'" in t and "old_names_copy" in t for t in saved), saved
    assert "unreferenced" in by_kind["StreamCache_CleanCache"]["text"][0]
    loaded = [n for n, k in kinds.items() if k == "StreamCache_LoadLazyCache"]
    assert loaded and all(n in run.executed() for n in loaded)
    # the same prompt under the new names runs too, on the same caches and datasets
    again = client.run(as_current(old, client.object_info()))
    assert again.status == "success"
    assert "no cache" not in again.outputs[next(k for k in kinds if kinds[k] == "StreamCache_CacheInfo")]["text"][0]

"""Every shipped example workflow converts to an API prompt and runs on the session's server."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from support.client import ComfyClient
from support.paths import PACK_ROOT
from support.server import PACK_LINK_NAME
from support.workflow import ui_to_api

EXAMPLES = sorted((PACK_ROOT / "example_workflows").glob("*.json"))


def test_examples_are_offered_as_templates(client: ComfyClient) -> None:
    assert EXAMPLES, "example_workflows/ is empty"
    templates = client.get("/workflow_templates")
    assert sorted(templates.get(PACK_LINK_NAME, [])) == sorted(p.stem for p in EXAMPLES)


@pytest.mark.parametrize("path", EXAMPLES, ids=lambda p: p.stem)
def test_example_workflow_runs(path: Path, client: ComfyClient) -> None:
    prompt = ui_to_api(json.loads(path.read_text(encoding="utf-8")), client.object_info())
    assert prompt, f"{path.name} has no executable node"
    result = client.run(prompt)
    assert result.status == "success"
    assert result.outputs, f"{path.name} produced no output"

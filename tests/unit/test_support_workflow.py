"""The UI → API workflow converter used by scripts/run-example and the e2e suite."""

from __future__ import annotations

import pytest
from support.workflow import WorkflowError, ui_to_api

OBJECT_INFO = {
    "Loader": {"input": {"required": {"name": [["a.safetensors", "b.safetensors"], {}]}},
               "input_order": {"required": ["name"]}},
    "Sampler": {
        "input": {
            "required": {"model": ["MODEL", {}], "seed": ["INT", {"control_after_generate": True}],
                         "steps": ["INT", {"default": 2}]},
            "optional": {"note": ["STRING", {"forceInput": True}], "cfg": ["FLOAT", {}]},
        },
        "input_order": {"required": ["model", "seed", "steps"], "optional": ["note", "cfg"]},
    },
}


def _node(node_id: int, kind: str, values: list | dict, inputs: list | None = None, mode: int = 0) -> dict:
    return {"id": node_id, "type": kind, "mode": mode, "inputs": inputs or [], "widgets_values": values}


def test_widgets_links_and_control_values() -> None:
    workflow = {
        "nodes": [
            _node(1, "Loader", ["b.safetensors"]),
            _node(2, "Sampler", [42, "fixed", 3, 7.5], [{"name": "model", "link": 10}]),
            _node(3, "MarkdownNote", ["docs"]),
        ],
        "links": [[10, 1, 0, 2, 0, "MODEL"]],
    }
    prompt = ui_to_api(workflow, OBJECT_INFO)
    assert prompt["1"]["inputs"] == {"name": "b.safetensors"}
    assert prompt["2"]["inputs"] == {"seed": 42, "steps": 3, "cfg": 7.5, "model": ["1", 0]}
    assert "3" not in prompt


def test_dict_widget_values_and_muted_nodes() -> None:
    workflow = {"nodes": [_node(1, "Loader", {"name": "a.safetensors"}), _node(2, "Loader", ["a"], mode=2)],
                "links": []}
    assert ui_to_api(workflow, OBJECT_INFO) == {
        "1": {"class_type": "Loader", "inputs": {"name": "a.safetensors"}, "_meta": {"title": "Loader"}}}


@pytest.mark.parametrize("workflow, message", [
    ({"nodes": [_node(1, "Nope", [])], "links": []}, "not known to the server"),
    ({"nodes": [_node(1, "Loader", ["a"], mode=4)], "links": []}, "bypassed"),
    ({"nodes": [_node(1, "Sampler", [1])], "links": []}, "no widget value for input 'steps'"),
    ({"nodes": [_node(1, "Loader", ["a"], mode=2), _node(2, "Sampler", [1, "fixed", 2, 1.0],
                                                         [{"name": "model", "link": 5}])],
      "links": [[5, 1, 0, 2, 0, "MODEL"]]}, "linked to node 1"),
    ({"nodes": [], "links": [], "definitions": {"subgraphs": [{}]}}, "subgraphs"),
])
def test_unsupported_workflows_are_refused(workflow: dict, message: str) -> None:
    with pytest.raises(WorkflowError, match=message):
        ui_to_api(workflow, OBJECT_INFO)

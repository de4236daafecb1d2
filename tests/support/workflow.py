"""Turning a saved UI workflow (``example_workflows/*.json``, what the ComfyUI frontend saves and loads) into
the API prompt that ``POST /prompt`` takes.

The UI format stores widget values positionally (``widgets_values``) and links as a table; the API format
names every input. The mapping needs the node definitions from ``/object_info``: widget inputs in
``input_order``, and one extra value after inputs that have ``control_after_generate`` (the frontend's
"fixed/increment/randomize" selector, which the frontend also gives to INT inputs named ``seed``/``noise_seed``).
Covered: plain nodes, links, muted nodes, notes. Not covered (refused with a clear error): bypassed nodes,
reroutes, primitive nodes and subgraphs.
"""

from __future__ import annotations

from typing import Any

__all__ = ["WorkflowError", "ui_to_api"]

_WIDGET_TYPES = {"INT", "FLOAT", "STRING", "BOOLEAN", "COMBO"}
_FRONTEND_ONLY = {"Note", "MarkdownNote"}
_MUTED, _BYPASSED = 2, 4


class WorkflowError(ValueError):
    """The UI workflow uses something this converter does not handle, or a node type the server lacks."""


def _is_widget(spec: list[Any]) -> bool:
    kind = spec[0]
    options = spec[1] if len(spec) > 1 and isinstance(spec[1], dict) else {}
    if options.get("forceInput"):
        return False
    return isinstance(kind, list) or kind in _WIDGET_TYPES


def _widget_inputs(info: dict[str, Any]) -> list[tuple[str, bool]]:
    """(name, has_control_after_generate) for each widget input, in the order the frontend stores them."""
    out = []
    order = info.get("input_order", {})
    inputs = info.get("input", {})
    for section in ("required", "optional"):
        for name in order.get(section, list(inputs.get(section, {}))):
            spec = inputs.get(section, {}).get(name)
            if spec is None or not _is_widget(spec):
                continue
            options = spec[1] if len(spec) > 1 and isinstance(spec[1], dict) else {}
            # the frontend also adds the selector to INT inputs named seed/noise_seed that do not set the option
            implicit = spec[0] == "INT" and name in ("seed", "noise_seed") and "control_after_generate" not in options
            out.append((name, bool(options.get("control_after_generate")) or implicit))
    return out


def is_optional_input(info: dict[str, Any], name: str) -> bool:
    """Whether ``name`` is an optional input of the node whose ``/object_info`` entry is ``info``."""
    return name in info.get("input", {}).get("optional", {})


def input_default(info: dict[str, Any], name: str) -> Any:
    """The value the front end gives a widget that a workflow does not mention (its spec's default)."""
    inputs = info.get("input", {})
    spec = inputs.get("required", {}).get(name) or inputs.get("optional", {}).get(name) or [None]
    options = spec[1] if len(spec) > 1 and isinstance(spec[1], dict) else {}
    if "default" in options:
        return options["default"]
    return spec[0][0] if isinstance(spec[0], list) and spec[0] else None


def ui_to_api(workflow: dict[str, Any], object_info: dict[str, Any]) -> dict[str, Any]:
    """Convert a UI workflow to an API prompt using the server's ``/object_info``.

    Raises:
        WorkflowError: unknown node type, bypassed node, reroute/primitive/subgraph, or too few widget values.
    """
    if workflow.get("definitions", {}).get("subgraphs"):
        raise WorkflowError("subgraphs are not supported; convert them to plain nodes first")
    links = {link[0]: link for link in workflow.get("links", [])}
    prompt: dict[str, Any] = {}
    for node in workflow.get("nodes", []):
        kind, node_id = node["type"], str(node["id"])
        if kind in _FRONTEND_ONLY or node.get("mode") == _MUTED:
            continue
        if node.get("mode") == _BYPASSED:
            raise WorkflowError(f"node {node_id} ({kind}) is bypassed; un-bypass or delete it")
        if kind not in object_info:
            raise WorkflowError(f"node {node_id}: type {kind!r} is not known to the server (pack not installed?)")
        inputs: dict[str, Any] = {}
        values = node.get("widgets_values", [])
        if isinstance(values, dict):
            inputs.update({name: values[name] for name, _ in _widget_inputs(object_info[kind]) if name in values})
        else:
            position = 0
            for name, has_control in _widget_inputs(object_info[kind]):
                if position >= len(values):
                    # a workflow saved before an optional input was added: the front end shows its default
                    if is_optional_input(object_info[kind], name):
                        inputs[name] = input_default(object_info[kind], name)
                        continue
                    raise WorkflowError(f"node {node_id} ({kind}): no widget value for input {name!r}")
                inputs[name] = values[position]
                position += 2 if has_control else 1
        for slot in node.get("inputs", []):
            link_id = slot.get("link")
            if link_id is None:
                continue
            _, source, source_slot, *_ = links[link_id]
            inputs[slot["name"]] = [str(source), source_slot]
        prompt[node_id] = {"class_type": kind, "inputs": inputs, "_meta": {"title": node.get("title", kind)}}
    for node_id, entry in prompt.items():
        for name, value in entry["inputs"].items():
            if isinstance(value, list) and len(value) == 2 and isinstance(value[0], str) and value[0] not in prompt:
                raise WorkflowError(f"node {node_id} input {name!r} is linked to node {value[0]}, which is "
                                    "muted, a reroute or a primitive node (not supported)")
    return prompt

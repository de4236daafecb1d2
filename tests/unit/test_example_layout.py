"""The shipped templates are laid out so that nothing hides anything, in the classic and the Vue front end.

A node's rectangle is its ``pos`` and ``size`` plus the title bar above ``pos`` (LiteGraph draws the title
outside the body). The sizes saved in the templates are the ones the real front end (1.45) renders — the larger
of its LiteGraph and Vue ("Nodes 2.0") sizes, measured in headless Chromium — so rectangles that do not overlap
here do not overlap on screen. Groups must hold their nodes whole and must not overlap each other.
"""

from __future__ import annotations

import itertools
import json
from pathlib import Path

import pytest
from support.paths import PACK_ROOT

TEMPLATES = sorted((PACK_ROOT / "example_workflows").glob("*.json"))
TITLE_HEIGHT = 30  # LiteGraph.NODE_TITLE_HEIGHT
GROUP_TITLE_HEIGHT = 34  # room a group's title takes at the top of its bounding


def _rect(node: dict) -> tuple[float, float, float, float]:
    (x, y), (w, h) = node["pos"], node["size"]
    return x, y - TITLE_HEIGHT, x + w, y + h


def _overlap(a: tuple[float, ...], b: tuple[float, ...]) -> bool:
    return a[0] < b[2] and b[0] < a[2] and a[1] < b[3] and b[1] < a[3]


def _inside(inner: tuple[float, ...], outer: tuple[float, ...]) -> bool:
    return outer[0] <= inner[0] and outer[1] <= inner[1] and inner[2] <= outer[2] and inner[3] <= outer[3]


def test_there_are_templates() -> None:
    assert TEMPLATES


@pytest.mark.parametrize("path", TEMPLATES, ids=lambda p: p.stem)
def test_no_two_nodes_overlap(path: Path) -> None:
    nodes = json.loads(path.read_text(encoding="utf-8"))["nodes"]
    for node in nodes:
        w, h = node["size"]
        assert w > 0 and h > 0, f"{path.name}: node {node['id']} has no size"
    clashes = [(a["id"], a.get("title", a["type"]), b["id"], b.get("title", b["type"]))
               for a, b in itertools.combinations(nodes, 2) if _overlap(_rect(a), _rect(b))]
    assert not clashes, f"{path.name}: overlapping nodes {clashes}"


@pytest.mark.parametrize("path", TEMPLATES, ids=lambda p: p.stem)
def test_groups_hold_their_nodes_whole_and_do_not_overlap(path: Path) -> None:
    workflow = json.loads(path.read_text(encoding="utf-8"))
    groups = [(g["title"], (g["bounding"][0], g["bounding"][1], g["bounding"][0] + g["bounding"][2],
                            g["bounding"][1] + g["bounding"][3])) for g in workflow.get("groups", [])]
    for (ta, a), (tb, b) in itertools.combinations(groups, 2):
        assert not _overlap(a, b), f"{path.name}: groups {ta!r} and {tb!r} overlap"
    for node in workflow["nodes"]:
        rect = _rect(node)
        for title, bounds in groups:
            if _overlap(rect, bounds):  # a node touching a group must sit wholly inside it, below its title
                body = (bounds[0], bounds[1] + GROUP_TITLE_HEIGHT, bounds[2], bounds[3])
                assert _inside(rect, body), f"{path.name}: node {node['id']} sticks out of group {title!r}"


def test_the_check_catches_the_old_main_template() -> None:
    """The main template as shipped before the relayout: Train LoRA (rendered ~900 px tall by the Vue front end)
    ran into the sampling group. With its real height the check finds it."""
    train = {"id": 5, "pos": [840, 60], "size": [360, 884]}
    lora_loader = {"id": 8, "pos": [420, 700], "size": [360, 196]}
    positive = {"id": 9, "pos": [840, 700], "size": [360, 120]}
    assert _overlap(_rect(train), _rect(positive)) and not _overlap(_rect(train), _rect(lora_loader))

"""Every node has a help page that the front end's Info panel shows, and the page names every input and output.

The front end fetches ``/extensions/<pack folder>/docs/<node id>.md`` (after a ``/<node id>/<locale>.md``
variant) from the pack's web folder. The pages are written by hand; these checks keep them true when the
schemas change: a new or renamed input, or a renamed output, fails here until its page mentions it.
"""

from __future__ import annotations

import asyncio
import re
from pathlib import Path
from types import ModuleType

import pytest
from support.paths import PACK_ROOT


def _schemas(pack: ModuleType) -> list:
    extension = asyncio.run(pack.comfy_entrypoint())
    return [node.GET_SCHEMA() for node in asyncio.run(extension.get_node_list())]


def _docs(pack: ModuleType) -> Path:
    return (PACK_ROOT / pack.WEB_DIRECTORY / "docs").resolve()


def test_every_node_has_a_help_page_naming_every_input_and_output(pack: ModuleType) -> None:
    schemas = _schemas(pack)
    assert len(schemas) >= 6
    for schema in schemas:
        page = _docs(pack) / f"{schema.node_id}.md"
        assert page.is_file(), f"{schema.node_id} has no help page {page.relative_to(PACK_ROOT)}"
        text = page.read_text(encoding="utf-8")
        assert text.startswith(f"# {schema.display_name}\n"), f"{page.name}: title is not the display name"
        for heading in ("## When to use it", "## Inputs", "## Outputs", "## Example"):
            assert heading in text, f"{page.name}: no '{heading}' section"
        missing = [inp.id for inp in schema.inputs if f"`{inp.id}`" not in text]
        assert not missing, f"{page.name} does not mention the inputs {missing}"
        outputs = [out.display_name for out in schema.outputs]
        assert all(f"`{name}`" in text for name in outputs), f"{page.name} does not name the outputs {outputs}"


def test_inputs_table_rows_are_real_inputs(pack: ModuleType) -> None:
    """A row of a page's Inputs table names an input the node has (no row for a removed or renamed input)."""
    for schema in _schemas(pack):
        text = (_docs(pack) / f"{schema.node_id}.md").read_text(encoding="utf-8")
        table = text.split("## Inputs", 1)[1].split("\n## ", 1)[0]
        rows = re.findall(r"^\| `([^`]+)` \|", table, flags=re.MULTILINE)
        assert rows == [inp.id for inp in schema.inputs], f"{schema.node_id}: table rows {rows}"


@pytest.mark.parametrize("suffix", [".png", ".jpg"])
def test_pictures_in_help_pages_exist(pack: ModuleType, suffix: str) -> None:
    """Relative pictures resolve against the page's folder (the front end renders them from /docs/)."""
    docs = _docs(pack)
    for page in docs.glob("*.md"):
        for target in re.findall(r"!\[[^\]]*\]\(([^)\s]+)\)", page.read_text(encoding="utf-8")):
            if target.endswith(suffix):
                assert not re.match(r"[a-z]+:", target) and (docs / target).is_file(), f"{page.name}: {target}"

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


def _readme_input_rows() -> dict[str, list[str]]:
    """README's Inputs table: the inputs its rows name, by node (a row with an empty first cell continues the
    node above it)."""
    readme = (PACK_ROOT / "README.md").read_text(encoding="utf-8")
    table = readme.split("### Inputs", 1)[1].split("\n#", 1)[0]
    rows: dict[str, list[str]] = {}
    node = ""
    for first, second in re.findall(r"^\|([^|]*)\|([^|]*)\|", table, flags=re.MULTILINE):
        if first.strip() == "Node" or set(first.strip()) == {"-"}:
            continue
        node = first.strip() or node
        rows.setdefault(node, []).extend(re.findall(r"`([^`]+)`", second))
    return rows


def test_readme_inputs_table_names_every_input(pack: ModuleType) -> None:
    """README's Inputs table has each node's inputs, and no input the node does not have: a new input, or a
    renamed one, fails here until the table says what it is."""
    rows = _readme_input_rows()
    for schema in _schemas(pack):
        named = rows.get(schema.display_name)
        assert named is not None, f"README's Inputs table has no rows for {schema.display_name}"
        ids = [inp.id for inp in schema.inputs]
        assert sorted(set(named)) == sorted(ids), (
            f"README, {schema.display_name}: missing {sorted(set(ids) - set(named))}, "
            f"not inputs {sorted(set(named) - set(ids))}")


_USER_LISTS = frozenset({"folder", "cache", "publish_to", "existing_lora"})
"""Combo inputs that list the user's own folders, caches, buckets or LoRAs (what the session's other tests
created, here), not choices the pack defines."""
_COMFY_LISTS = frozenset({"sample_sampler", "sample_scheduler"})
"""Combo inputs offering ComfyUI's own lists (KSampler's samplers and schedulers): ComfyUI documents those, and
the list grows with ComfyUI; the page says what the input does and names its default."""


def _fixed_options(schema: object) -> dict[str, list[str]]:
    """The combo inputs whose options the pack defines."""
    fixed = {}
    for inp in schema.inputs:  # type: ignore[attr-defined]
        options = getattr(inp, "options", None)
        if options and inp.id not in _USER_LISTS | _COMFY_LISTS:
            fixed[inp.id] = [str(o) for o in options]
    return fixed


def test_help_pages_name_every_option(pack: ModuleType) -> None:
    """A help page names each option of each of its node's fixed combo inputs: a new choice (a memory mode, a
    sampling mode) fails here until the page says what it does."""
    checked = 0
    for schema in _schemas(pack):
        text = (_docs(pack) / f"{schema.node_id}.md").read_text(encoding="utf-8")
        for name, options in _fixed_options(schema).items():
            missing = [o for o in options if f"`{o}`" not in text]
            assert not missing, f"{schema.node_id}.md does not name the options {missing} of `{name}`"
            checked += 1
    assert checked >= 10  # the pack's fixed combos: crop, flip, masks, optimizer, memory, ...
    train = (_docs(pack) / "StreamCache_TrainLoRA.md").read_text(encoding="utf-8")
    for name, default in (("sample_sampler", "euler"), ("sample_scheduler", "simple")):
        assert f"| `{name}` | {default} (advanced) |" in train, name


def test_readme_mapping_from_other_trainers_names_real_inputs(pack: ModuleType) -> None:
    """README's table of what other trainers' configs set names, in its second column, inputs of Encode Dataset
    (E) and Train LoRA (T) that exist: a renamed input fails here until the table follows."""
    readme = (PACK_ROOT / "README.md").read_text(encoding="utf-8")
    table = readme.split("### Coming from kohya", 1)[1].split("\n#", 1)[0]
    schemas = {s.display_name: {i.id for i in s.inputs} for s in _schemas(pack)}
    encode = next(ids for name, ids in schemas.items() if name.startswith("Encode Dataset"))
    train = next(ids for name, ids in schemas.items() if name.startswith("Train LoRA"))
    named = 0
    for here in re.findall(r"^\|[^|]*\|([^|]*)\|", table, flags=re.MULTILINE):
        for side, names in re.findall(r"\b([ET]) ((?:`[^`]+`(?:, | \+ |)?)+)", here):
            for name in re.findall(r"`([^`]+)`", names):
                assert name in (encode if side == "E" else train), f"README's mapping: {side} `{name}` is no input"
                named += 1
    assert named >= 50

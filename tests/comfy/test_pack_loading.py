"""ComfyUI's own loader accepts the pack: V3 entry point, prefixed ids, one category, web folder."""

from __future__ import annotations

import asyncio
from types import ModuleType

from support.paths import PACK_ROOT


def test_root_exports_v3_entry_point_only(pack: ModuleType) -> None:
    assert not hasattr(pack, "NODE_CLASS_MAPPINGS"), "a V1 mapping would make ComfyUI ignore comfy_entrypoint"
    assert pack.WEB_DIRECTORY == "./web"
    assert asyncio.iscoroutinefunction(pack.comfy_entrypoint)


def test_node_schemas_follow_pack_conventions(pack: ModuleType) -> None:
    from comfy_api.latest import ComfyExtension

    extension = asyncio.run(pack.comfy_entrypoint())
    assert isinstance(extension, ComfyExtension)
    node_list = asyncio.run(extension.get_node_list())
    assert node_list, "the extension lists no nodes"
    for node in node_list:
        schema = node.GET_SCHEMA()
        assert schema.node_id.startswith("StreamCache_"), schema.node_id
        assert schema.category == "StreamCache", schema.node_id
        assert schema.display_name and schema.description, schema.node_id
        for inp in schema.inputs:
            assert inp.tooltip, f"{schema.node_id}.{inp.id} has no tooltip"


def test_comfyui_loader_registers_every_node(comfy_nodes: ModuleType, pack: ModuleType) -> None:
    ok = asyncio.run(comfy_nodes.load_custom_node(str(PACK_ROOT), ignore=set(), module_parent="custom_nodes"))
    assert ok, "ComfyUI's load_custom_node reported IMPORT FAILED (see the captured log)"
    ids = {node.GET_SCHEMA().node_id for node in pack.nodes.NODES}
    assert ids <= set(comfy_nodes.NODE_CLASS_MAPPINGS)
    assert comfy_nodes.EXTENSION_WEB_DIRS[PACK_ROOT.name] == str(PACK_ROOT / "web")

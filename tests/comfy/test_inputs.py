"""One name per concept, old names still accepted, and what the pickers offer (nodes/inputs.py and the schemas)."""

from __future__ import annotations

import copy
import os
from pathlib import Path
from types import ModuleType

import pytest
from comfy_api.latest import io


@pytest.fixture(scope="module")
def inputs(pack: ModuleType) -> ModuleType:
    return pack.nodes.inputs


OLD_PROMPT = {  # an API prompt as 0.1.0 wrote it (every renamed input under its old name)
    "1": {"class_type": "StreamCache_EncodeDataset", "inputs": {"folder": "f", "cache": "c", "dataset": "d"}},
    "2": {"class_type": "StreamCache_SaveCache", "inputs": {"dataset": ["1", 0], "name": "s", "dataset_name": "e"}},
    "3": {"class_type": "StreamCache_LoadLazyCache", "inputs": {"name": "s", "dataset": "e"}},
    "4": {"class_type": "StreamCache_CleanCache", "inputs": {"name": "s", "dry_run": True}},
    "5": {"class_type": "StreamCache_CacheInfo", "inputs": {"cache": "s"}},
    "6": {"class_type": "SomeoneElses", "inputs": {"name": "x", "dataset": "y"}},
}


def test_old_input_names_in_an_api_prompt_are_renamed(inputs: ModuleType) -> None:
    prompt = copy.deepcopy(OLD_PROMPT)
    done = inputs.upgrade_prompt(prompt)
    assert sorted(done) == ["1.dataset->dataset_name", "2.name->cache", "3.dataset->dataset_name", "3.name->cache",
                            "4.name->cache"]
    assert prompt["1"]["inputs"] == {"folder": "f", "cache": "c", "dataset_name": "d"}
    assert prompt["2"]["inputs"] == {"dataset": ["1", 0], "cache": "s", "dataset_name": "e"}  # the socket stays
    assert prompt["3"]["inputs"] == {"cache": "s", "dataset_name": "e"}
    assert prompt["4"]["inputs"] == {"cache": "s", "dry_run": True}
    assert prompt["5"] == OLD_PROMPT["5"] and prompt["6"] == OLD_PROMPT["6"]  # other nodes untouched
    assert inputs.upgrade_prompt(prompt) == []  # a current prompt is left as it is


def test_the_new_name_wins_and_odd_prompts_pass_through(inputs: ModuleType) -> None:
    both = {"1": {"class_type": "StreamCache_CleanCache", "inputs": {"name": "old", "cache": "new"}}}
    assert inputs.upgrade_prompt(both) == [] and both["1"]["inputs"] == {"name": "old", "cache": "new"}
    for odd in (None, [], "x", {"1": None}, {"1": {"class_type": "StreamCache_CleanCache", "inputs": None}}):
        assert inputs.upgrade_prompt(odd) == []
    body = {"prompt": copy.deepcopy(OLD_PROMPT), "client_id": "c"}
    assert inputs._on_prompt(body) is body and body["prompt"]["4"]["inputs"]["cache"] == "s"
    assert inputs._on_prompt({"prompt": "not a prompt"}) == {"prompt": "not a prompt"}


def test_the_handler_is_registered_with_a_server_once(inputs: ModuleType, monkeypatch: pytest.MonkeyPatch) -> None:
    import sys
    import types

    monkeypatch.delitem(sys.modules, "server", raising=False)
    assert inputs.register_prompt_upgrade() is False  # no server in this process

    class Server:
        instance = None

        def __init__(self) -> None:
            self.on_prompt_handlers: list = []

        def add_on_prompt_handler(self, handler: object) -> None:
            self.on_prompt_handlers.append(handler)

    Server.instance = Server()
    monkeypatch.setitem(sys.modules, "server", types.SimpleNamespace(PromptServer=Server))
    assert inputs.register_prompt_upgrade() and inputs.register_prompt_upgrade()
    assert Server.instance.on_prompt_handlers == [inputs._on_prompt]


def test_the_renamed_inputs_are_the_schemas_inputs(pack: ModuleType, inputs: ModuleType) -> None:
    """Every new name exists on its node and no old name does (other than Save Streamable Cache's dataset socket,
    which never was a text input)."""
    schemas = {n.GET_SCHEMA().node_id: n.GET_SCHEMA() for n in pack.nodes.NODES}
    for node_id, renames in inputs.RENAMED_INPUTS.items():
        ids = {i.id: i for i in schemas[node_id].inputs}
        assert set(renames.values()) <= set(ids), node_id
        for old in renames:
            assert old not in ids or ids[old].get_io_type() == "STREAM_DATASET", (node_id, old)
    js = (Path(pack.__file__).parent / "web" / "js" / "streamcache.js").read_text(encoding="utf-8")
    for node_id, renames in inputs.RENAMED_INPUTS.items():  # the front end holds the same table
        for old, new in renames.items():
            assert f'{old}: "{new}"' in js.split(f"{node_id}:", 1)[1].split("\n", 1)[0], (node_id, old)


def test_one_widget_kind_per_role(pack: ModuleType, monkeypatch: pytest.MonkeyPatch) -> None:
    """A cache that is read: a dropdown; a cache that is created: text naming the existing ones; a fresh install
    offers one entry saying what to do, which the nodes refuse with that advice."""
    nodes = pack.nodes
    monkeypatch.setattr(nodes.load_cache, "list_caches", lambda: [])
    monkeypatch.setattr(nodes.load_cache, "list_comfy_datasets", lambda: [])
    for node in (nodes.load_cache.LoadLazyCache, nodes.clean_cache.CleanCache, nodes.cache_info.CacheInfo):
        (cache,) = [i for i in node.define_schema().inputs if i.id == "cache"]
        assert isinstance(cache, io.Combo.Input) and cache.options == [nodes.inputs.NO_CACHE_YET], node
        message = node.validate_inputs(cache=nodes.inputs.NO_CACHE_YET)
        assert message.startswith("cache: no cache exists yet") and "press R" in message, message
    for node in (nodes.encode_dataset.EncodeDataset, nodes.save_cache.SaveCache):
        (cache,) = [i for i in node.define_schema().inputs if i.id == "cache"]
        assert isinstance(cache, io.String.Input) and "No cache exists yet." in cache.tooltip
    monkeypatch.setattr(nodes.load_cache, "list_caches", lambda: ["a", "people/b"])
    (cache,) = [i for i in nodes.save_cache.SaveCache.define_schema().inputs if i.id == "cache"]
    assert "Existing caches (press R to refresh): a, people/b." in cache.tooltip
    (cache,) = [i for i in nodes.cache_info.CacheInfo.define_schema().inputs if i.id == "cache"]
    assert cache.options == ["a", "people/b"] and cache.default == "a"


def test_the_folder_dropdown_lists_input_folders(pack: ModuleType, monkeypatch: pytest.MonkeyPatch,
                                                 tmp_path: Path) -> None:
    import folder_paths

    nodes = pack.nodes
    base = tmp_path / "input"
    for rel in ("set/5_x", "people/alice/5_alice/deeper", ".hidden/a"):
        (base / rel).mkdir(parents=True)
    (base / "notes.txt").write_text("a file, not a folder")
    elsewhere = tmp_path / "elsewhere" / "photos"
    (elsewhere / "inner").mkdir(parents=True)
    os.symlink(elsewhere, base / "linked")
    monkeypatch.setattr(folder_paths, "get_input_directory", lambda: str(base))
    monkeypatch.delenv(nodes.encode_dataset.ALLOW_ABSOLUTE_ENV, raising=False)
    assert nodes.inputs.input_folders() == ["linked", "people", "people/alice", "people/alice/5_alice", "set",
                                            "set/5_x"]  # 3 levels, hidden left out, a link listed not entered
    (folder,) = [i for i in nodes.encode_dataset.EncodeDataset.define_schema().inputs if i.id == "folder"]
    assert isinstance(folder, io.Combo.Input) and folder.options[0] == "linked"
    monkeypatch.setenv(nodes.encode_dataset.ALLOW_ABSOLUTE_ENV, "1")  # absolute folders are typed
    (folder,) = [i for i in nodes.encode_dataset.EncodeDataset.define_schema().inputs if i.id == "folder"]
    assert isinstance(folder, io.String.Input)
    monkeypatch.delenv(nodes.encode_dataset.ALLOW_ABSOLUTE_ENV)
    empty = tmp_path / "empty_input"
    empty.mkdir()
    monkeypatch.setattr(folder_paths, "get_input_directory", lambda: str(empty))
    (folder,) = [i for i in nodes.encode_dataset.EncodeDataset.define_schema().inputs if i.id == "folder"]
    assert folder.options == [nodes.inputs.NO_FOLDER_YET]

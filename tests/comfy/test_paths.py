"""Cache names resolve inside the registered StreamCache folders and never escape them."""

from __future__ import annotations

import re

from pathlib import Path
from types import ModuleType

import pytest


@pytest.fixture
def resolve_under(pack: ModuleType):
    return pack.nodes.paths.resolve_under


@pytest.fixture
def roots(tmp_path: Path) -> list[Path]:
    first, second = tmp_path / "first", tmp_path / "second"
    first.mkdir()
    second.mkdir()
    return [first, second]


def test_new_name_goes_to_first_root(resolve_under, roots: list[Path]) -> None:
    assert resolve_under("my_set", roots) == roots[0] / "my_set"
    assert resolve_under("  people/my_set ", roots) == roots[0] / "people" / "my_set"


def test_existing_cache_is_found_in_any_root(resolve_under, roots: list[Path]) -> None:
    (roots[1] / "old").mkdir()
    assert resolve_under("old", roots) == roots[1] / "old"


def test_absolute_path_inside_a_root_is_accepted(resolve_under, roots: list[Path]) -> None:
    assert resolve_under(str(roots[1] / "x"), roots) == roots[1] / "x"


@pytest.mark.parametrize("name, message", [
    ("", "cache name is empty"),
    ("   ", "cache name is empty"),
    ("..", "must not contain '..'"),
    ("../elsewhere", "must not contain '..'"),
    ("a/../../b", "must not contain '..'"),
    ("a\\..\\..\\b", "must not contain '..'"),
    (".", "names a StreamCache folder itself"),
    ("/etc", "is outside the StreamCache folders"),
    ("C:\\caches\\x", "is outside the StreamCache folders"),
    ("bad\x00name", "NUL character"),
])
def test_escapes_are_refused_with_the_fix(resolve_under, roots: list[Path], name: str, message: str) -> None:
    with pytest.raises(ValueError, match=message) as info:
        resolve_under(name, roots)
    assert "extra_model_paths.yaml" in str(info.value) and str(roots[0]) in str(info.value)


def test_absolute_path_escaping_via_dotdot_is_refused(resolve_under, roots: list[Path]) -> None:
    with pytest.raises(ValueError, match="outside the StreamCache folders"):
        resolve_under(str(roots[0] / ".." / "elsewhere"), roots)


def test_registered_folder_is_under_models(pack: ModuleType, comfy_folders: Path) -> None:
    import folder_paths

    pack.nodes.paths.register_cache_folder()
    pack.nodes.paths.register_cache_folder()
    assert folder_paths.get_folder_paths("streamcache") == [str(comfy_folders / "streamcache")]


# ------------------------------------------------------------------------------------------ caches a node writes
@pytest.fixture
def outer(pack: ModuleType, cache_root: Path, request: pytest.FixtureRequest) -> str:
    """An existing cache named after the test, in the session's StreamCache folder."""
    import torch

    from comfyui_streamcache.dataset_cache.format.writer import CacheWriter

    name = f"outer_{request.node.name[-20:].strip('[]').replace('-', '_')}"
    with CacheWriter(cache_root / name) as w:
        w.add("k" * 32, {"samples": torch.zeros(1, 4, 8, 8)}, kind="latent")
    return name


@pytest.mark.parametrize("suffix, message", [
    ("/shards", "'shards' is the name of a folder inside every cache"),
    ("/datasets/mine", "'datasets' is the name of a folder inside every cache"),
    ("/inner", "lies inside the cache"),
    ("/deeper/inner", "lies inside the cache"),
])
def test_a_cache_to_write_inside_a_cache_is_refused(pack: ModuleType, outer: str, cache_root: Path, suffix: str,
                                                   message: str) -> None:
    with pytest.raises(ValueError, match=message):
        pack.nodes.paths.resolve_cache_to_write(outer + suffix)
    assert sorted(p.name for p in (cache_root / outer).iterdir() if not p.name.startswith(".")) == \
        ["journal-000001.jsonl", "manifest.json", "shards"] or (cache_root / outer / "manifest.json").is_file()
    assert pack.nodes.paths.resolve_cache_to_write(outer) == cache_root / outer  # the cache itself: fine


def test_names_that_cannot_be_folders_are_refused_up_front(pack: ModuleType, cache_root: Path) -> None:
    resolve = pack.nodes.paths.resolve_cache_to_write
    with pytest.raises(ValueError, match="is 300 bytes; a folder name may have at most 255"):
        resolve("a" * 300)
    (cache_root / "a_file").write_text("not a cache")
    with pytest.raises(ValueError, match="is a file, not a cache folder"):
        resolve("a_file")
    (cache_root / "not_a_cache" / "shards").mkdir(parents=True)
    (cache_root / "not_a_cache" / "shards" / "mine.bin").write_bytes(b"user data")
    with pytest.raises(ValueError, match="non-empty shards/"):
        resolve("not_a_cache")
    assert resolve("people/new_set") == cache_root / "people" / "new_set"


def test_encode_and_save_validate_each_input_with_one_message(pack: ModuleType) -> None:
    encode = pack.nodes.encode_dataset.EncodeDataset
    save = pack.nodes.save_cache.SaveStreamableCache if hasattr(pack.nodes.save_cache, "SaveStreamableCache") \
        else pack.nodes.save_cache.SaveCache
    assert encode.validate_inputs(cache="x/shards") == \
        "cache name 'x/shards': 'shards' is the name of a folder inside every cache; choose a name without it"
    for name, message in (("d" * 201, "(201 characters): use 1-200 printable characters"),
                          (" ", "dataset_name is empty; give the dataset a name, e.g. `default`"),
                          ("\x07", "(1 characters): use 1-200 printable")):  # checked when the nodes start
        with pytest.raises(ValueError, match=re.escape(message)):
            encode.check_lazy_status(folder="x", cache="fine", dataset_name=name)
        with pytest.raises(ValueError, match=re.escape(message)):
            save.execute(cache=["fine"], dataset_name=[name])
    assert encode.validate_inputs(cache="fine") is True and save.validate_inputs(cache=["fine"]) is True

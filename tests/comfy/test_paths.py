"""Cache names resolve inside the registered StreamCache folders and never escape them."""

from __future__ import annotations

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

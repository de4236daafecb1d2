"""docs/ARCHITECTURE.md stays true to the tree: every module of the library, the nodes and the benchmarks is
named there (as ``name.py`` or, inside a package's row, as ``name``), so a new module cannot be left out of the
map a reader starts from."""

from __future__ import annotations

import re
from pathlib import Path

PACK_ROOT = Path(__file__).resolve().parents[2]
PACKAGES = ("dataset_cache", "nodes", "bench")


def _named(text: str, module: Path) -> bool:
    file_name = re.escape(module.name)
    return bool(re.search(rf"(?<![\w.]){file_name}(?!\w)", text) or re.search(rf"`{re.escape(module.stem)}`", text))


def test_every_module_is_named_in_the_architecture_doc() -> None:
    text = (PACK_ROOT / "docs" / "ARCHITECTURE.md").read_text(encoding="utf-8")
    modules = [p for package in PACKAGES for p in sorted((PACK_ROOT / package).rglob("*.py"))
               if p.name not in ("__init__.py", "__main__.py")]
    assert len(modules) > 100  # the walk found the tree
    missing = [str(p.relative_to(PACK_ROOT)) for p in modules if not _named(text, p)]
    assert not missing, f"docs/ARCHITECTURE.md does not name: {missing}"


def test_the_check_sees_a_module_the_doc_does_not_name() -> None:
    assert not _named("`loader.py` and `sampler`", Path("dataset_cache/loader_jobs.py"))
    assert _named("`loader.py` and `sampler`", Path("dataset_cache/sampler.py"))
    assert _named("| `format/reader.py` |", Path("dataset_cache/format/reader.py"))

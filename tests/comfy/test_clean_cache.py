"""Node "Clean Cache": a dry run reports, a real run removes what no dataset references; bad names are named."""

from __future__ import annotations

import importlib
from pathlib import Path
from types import ModuleType

import pytest
import torch


@pytest.fixture(scope="module")
def mod(pack: ModuleType) -> ModuleType:
    return importlib.import_module(f"{pack.__name__}.nodes.clean_cache")


def _cache(pack: ModuleType, root: Path) -> None:
    """Two datasets; dataset ``old`` is then removed, leaving 2 latents + 1 conditioning unreferenced."""
    from comfyui_streamcache.dataset_cache.dataset import Sample

    writer_cls = importlib.import_module(f"{pack.__name__}.dataset_cache.format.writer").CacheWriter
    with writer_cls(root) as w:
        cond = [[torch.zeros(1, 77, 768), {"pooled_output": torch.zeros(1, 768)}]]
        w.add("c" * 32, cond, kind="conditioning")
        w.add("d" * 32, cond, kind="conditioning")
        for i in range(4):
            w.add(f"{i:032x}", {"samples": torch.full((1, 4, 16, 16), float(i))}, kind="latent")
            w.commit()  # one small shard per latent: something to compact
        w.set_dataset("keep", [Sample(f"{i:032x}", ("c" * 32,)) for i in (0, 1)])
        w.set_dataset("old", [Sample(f"{i:032x}", ("d" * 32,)) for i in (2, 3)])
        w.remove_dataset("old")


def test_dry_run_then_clean(mod: ModuleType, pack: ModuleType, cache_root: Path) -> None:
    from comfyui_streamcache.dataset_cache.format.reader import open_cache

    root = cache_root / "to_clean"
    _cache(pack, root)
    assert mod.CleanCache.define_schema().inputs[1].default is True
    assert "to_clean" in mod.CleanCache.define_schema().inputs[0].options
    (dry,) = mod.CleanCache.execute(cache="to_clean", dry_run=True).result
    assert "unreferenced: 3 entries" in dry and "dry run: nothing was changed" in dry
    assert len(open_cache(root)) == 6
    out = mod.CleanCache.execute(cache="to_clean", dry_run=False)
    (report,) = out.result
    assert out.ui.as_dict() == {"text": (report,)}
    assert "removed 3 entries" in report and "shards compacted:" in report
    with open_cache(root) as reader:
        assert len(reader) == 3 and reader.stats()["shards"] == 1
        assert reader.verify() == []
    value = mod.CleanCache.fingerprint_inputs(cache="to_clean", dry_run=True)
    assert value != value  # NaN: a clean always runs when asked


def test_bad_names_and_busy_cache(mod: ModuleType, pack: ModuleType, cache_root: Path) -> None:
    from comfyui_streamcache.dataset_cache.errors import CacheLockedError
    from comfyui_streamcache.dataset_cache.lock import READ_LOCK, CacheLock

    assert "must not contain '..'" in mod.CleanCache.validate_inputs(cache="../x")
    assert "cache 'nothing': unknown cache" in mod.CleanCache.validate_inputs(cache="nothing")
    assert mod.CleanCache.validate_inputs(cache=None) is True
    with pytest.raises(ValueError, match="cache 'nothing': unknown cache"):
        mod.CleanCache.execute(cache="nothing", dry_run=True)
    _cache(pack, cache_root / "busy")
    with CacheLock(cache_root / "busy", READ_LOCK, exclusive=False, purpose="training"):
        with pytest.raises(CacheLockedError):
            mod.CleanCache.execute(cache="busy", dry_run=False)
        (dry,) = mod.CleanCache.execute(cache="busy", dry_run=True).result  # a preview needs no lock
        assert "unreferenced: 3 entries" in dry


def test_repair_is_an_advanced_optional_input_that_moves_damaged_shards_aside(mod: ModuleType, pack: ModuleType,
                                                                              cache_root: Path) -> None:
    from comfyui_streamcache.dataset_cache.format.reader import open_cache

    schema = mod.CleanCache.define_schema()
    repair = next(i for i in schema.inputs if i.id == "repair")
    assert repair.default is False and repair.optional and repair.advanced  # old workflows lack it: off
    root = cache_root / "to_repair"
    _cache(pack, root)
    with open_cache(root) as reader:
        victim = next(sh.path for sh in reader.shards if f"{0:032x}" in sh.keys)
    data = bytearray(victim.read_bytes())
    data[-1] ^= 0xFF
    victim.write_bytes(bytes(data))
    (kept,) = mod.CleanCache.execute(cache="to_repair", dry_run=False).result  # as a workflow without `repair`
    assert victim.is_file() and "kept as they are" in kept
    (repaired,) = mod.CleanCache.execute(cache="to_repair", dry_run=False, repair=True).result
    assert (root / "damaged" / victim.name).is_file() and not victim.exists()
    assert "moved 1 shard file(s) to damaged/" in repaired and "re-encode it" in repaired

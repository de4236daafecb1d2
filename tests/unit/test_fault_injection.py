"""An ``OSError`` on each file operation of encode, commit, compact and clean in turn.

For every operation, the file calls it makes under the work folder are counted once, then the operation is run
again from the same starting state with the k-th call failing (EACCES, EMFILE, EIO or ENOSPC in turn). After each
run, every entry that was readable before (that the operation keeps: clean removes unreferenced ones) is still
readable with the same value, and the operation either completed or raised an error whose message names a file
or folder under the work folder.
"""

from __future__ import annotations

import shutil
from collections.abc import Callable
from pathlib import Path

import pytest
import torch

from dataset_cache import clean as clean_module
from dataset_cache import sources as sources_module
from dataset_cache.clean import clean
from dataset_cache.errors import CacheCorruptError, CacheError, CacheUnreadableError
from dataset_cache.format import CacheWriter, open_cache
from dataset_cache.format import durable as durable_module
from dataset_cache.buckets import BucketConfig
from dataset_cache.encode_settings import EncodeSettings
from dataset_cache.encode_plan import plan_encode
from dataset_cache.encode_run import run_encode
from support.datasets import make_kohya_folder
from support.fake_encoders import FakeEncoders
from support.fake_encoders import age as _age
from support.faults import ERRNOS, FaultInjector

SETTINGS = EncodeSettings(bucket=BucketConfig(resolution=64, step=16, min_side=32), batch_size=2)
MAX_RUNS = 250  # per operation (every call today); beyond that every stride-th call fails


def _readable(cache: Path) -> dict[str, torch.Tensor]:
    out: dict[str, torch.Tensor] = {}
    with open_cache(cache, strict=False) as r:
        for k in list(r.keys()):
            try:
                v = r.read([k])[0]
            except (CacheCorruptError, CacheUnreadableError):
                continue
            flat = [t for t in _tensors(v)]
            out[k] = torch.cat([t.flatten().float() for t in flat]) if flat else torch.zeros(0)
    return out


def _tensors(v: object) -> list[torch.Tensor]:
    if isinstance(v, torch.Tensor):
        return [v]
    if isinstance(v, dict):
        return [t for x in v.values() for t in _tensors(x)]
    if isinstance(v, (list, tuple)):
        return [t for x in v for t in _tensors(x)]
    return []


def _referenced(cache: Path) -> set[str]:
    with open_cache(cache) as r:
        return {k for name in r.datasets() for s in r.dataset(name) for k in (s.latent, *s.captions)}


@pytest.fixture(scope="module")
def template(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A folder encoded into a cache, then edited (one new image, one new caption), plus unreferenced entries."""
    base = tmp_path_factory.mktemp("template")
    folder, cache = base / "data", base / "cache"
    make_kohya_folder(folder)
    _age(folder)
    run_encode(plan_encode(folder, cache, dataset="ds", settings=SETTINGS, vae_fingerprint="vae",
                           text_fingerprint="te"), **FakeEncoders().kw())
    with CacheWriter(cache) as w:
        for i in range(3):
            w.add(f"loose-{i}", {"samples": torch.full((1, 4, 8, 8), float(i))}, kind="latent")
            w.commit()
    first = sorted(folder.rglob("*.png"))[0]
    shutil.copy(first, first.with_name("added.png"))
    first.with_suffix(".txt").write_text("an edited caption")
    _age(folder)
    return base


def _encode(work: Path) -> None:
    plan = plan_encode(work / "data", work / "cache", dataset="ds", settings=SETTINGS, vae_fingerprint="vae",
                       text_fingerprint="te")
    run_encode(plan, **FakeEncoders().kw())


def _commit(work: Path) -> None:
    with CacheWriter(work / "cache") as w:
        w.add("fresh", {"samples": torch.ones(1, 4, 8, 8)}, kind="latent")
        w.commit()
        w.add("fresh-2", {"samples": torch.zeros(1, 4, 8, 8)}, kind="latent")


def _compact(work: Path) -> None:
    with CacheWriter(work / "cache") as w:
        w.compact()


def _clean(work: Path) -> None:
    clean(work / "cache", dry_run=False)


OPERATIONS: dict[str, Callable[[Path], None]] = {"encode": _encode, "commit": _commit, "compact": _compact,
                                                 "clean": _clean}


@pytest.mark.parametrize("name", sorted(OPERATIONS))
def test_an_os_error_on_any_file_operation_loses_nothing_and_names_the_file(
        template: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch, name: str) -> None:
    operation = OPERATIONS[name]
    work = tmp_path / "work"
    faults = FaultInjector(work, monkeypatch, modules=[durable_module, sources_module, clean_module])

    def fresh() -> dict[str, torch.Tensor]:
        shutil.rmtree(work, ignore_errors=True)
        shutil.copytree(template, work, symlinks=True)
        before = _readable(work / "cache")
        if name == "clean":
            keep = _referenced(work / "cache")
            before = {k: v for k, v in before.items() if k in keep}
        return before

    fresh()
    with faults.active():
        operation(work)
    calls = len(faults.calls)
    assert calls > 5, faults.calls  # the injector sees the operation's file calls
    stride = max(1, calls // MAX_RUNS)
    failures = 0
    for k in range(0, calls, stride):
        before = fresh()
        err = ERRNOS[(k // stride) % len(ERRNOS)]
        with faults.active(fail_at=k, errno=err):
            try:
                operation(work)
            except (OSError, CacheError) as exc:
                failures += 1
                assert str(work) in str(exc), f"call {k} {faults.failed}: {exc!r} names no file"
        after = _readable(work / "cache")
        lost = sorted(set(before) - set(after))
        assert not lost, f"call {k} ({faults.failed}, errno {err}) lost {lost[:3]}"
        assert all(torch.equal(before[x], after[x]) for x in before), f"call {k} changed a value"
        operation(work)  # the cause gone, the same operation completes
    assert failures, "no injected error reached the caller: the test injects nothing"

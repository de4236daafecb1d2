"""Combine Datasets and Train LoRA's caption_dropout / reg_dataset on the real ComfyUI (CPU, tiny SD1.5 models).

The cache holds "people" (4 images, 64×64, with the empty caption encoded), "style" (2 images, 64×64, without
it) and "reg" (3 images, 96×64: a bucket of their own). Encoders are ComfyUI's own VAEEncode and CLIPTextEncode.
A spy around the training loop's per-batch step records every plan the run trained (it calls the real step).
Datasets of two caches: "people" copied into one cache, "style" and "reg" into another (the empty caption lands
in both), trained against the same datasets of the one cache.
"""

from __future__ import annotations

import hashlib
import importlib
import math
from pathlib import Path
from types import ModuleType
from typing import Any

import pytest
import torch

FAST = {
    "batch_size": 2, "grad_accumulation_steps": 1, "steps": 4, "learning_rate": 3e-3, "rank": 4,
    "optimizer": "AdamW", "loss_function": "MSE", "seed": 7, "training_dtype": "fp32", "lora_dtype": "fp32",
    "algorithm": "LoRA", "gradient_checkpointing": False, "checkpoint_depth": 1, "offloading": False,
    "existing_lora": "[None]", "prefetch_batches": 2, "loader_threads": 0,
}


def _module(pack: ModuleType, name: str) -> ModuleType:
    return importlib.import_module(f"{pack.__name__}.{name}")


def _key(text: str) -> str:
    return hashlib.blake2b(text.encode(), digest_size=16).hexdigest()


@pytest.fixture(scope="module")
def cache(pack: ModuleType, comfy_nodes: ModuleType, models: tuple, tmp_path_factory: pytest.TempPathFactory
          ) -> Path:
    writer_mod = _module(pack, "dataset_cache.format.writer")
    sample_cls = _module(pack, "dataset_cache.dataset").Sample
    _, clip, vae = models
    root = tmp_path_factory.mktemp("combine") / "cache"
    gen = torch.Generator().manual_seed(1)
    with torch.inference_mode(), writer_mod.CacheWriter(root) as writer:
        (empty,) = comfy_nodes.CLIPTextEncode().encode(clip, "")
        writer.add(_key("empty"), empty, kind="conditioning")
        for name, count, (h, w), with_empty in (("people", 4, (64, 64), True), ("style", 2, (64, 64), False),
                                                ("reg", 3, (96, 64), True)):
            samples = []
            for i in range(count):
                (latent,) = comfy_nodes.VAEEncode().encode(vae, torch.rand(1, h, w, 3, generator=gen))
                (cond,) = comfy_nodes.CLIPTextEncode().encode(clip, f"a photo of {name} {i}")
                writer.add(_key(f"{name}l{i}"), latent, kind="latent")
                writer.add(_key(f"{name}c{i}"), cond, kind="conditioning")
                samples.append(sample_cls(_key(f"{name}l{i}"), (_key(f"{name}c{i}"),), source=f"{name}{i}.png",
                                          empty_caption=_key("empty") if with_empty else None))
            writer.set_dataset(name, samples)
    return root


@pytest.fixture()
def trained_plans(pack: ModuleType, monkeypatch: pytest.MonkeyPatch) -> list[Any]:
    """Every BatchPlan the next runs train, recorded around the real per-batch step."""
    loop = _module(pack, "nodes.training.loop").StepLoop
    real = loop._fwd_bwd
    plans: list[Any] = []

    def spy(self: Any, batch: Any, index: int) -> float:
        plans.append(batch.plan)
        return real(self, batch, index)

    monkeypatch.setattr(loop, "_fwd_bwd", spy)
    return plans


def _combine(pack: ModuleType, a: Any, ra: int, b: Any = None, rb: int = 1) -> Any:
    node = _module(pack, "nodes.combine_datasets").CombineDatasets
    return node.execute(a, ra, b, rb).result[0]


def _train(pack: ModuleType, model: Any, dataset: Any, **options: Any) -> Any:
    node = _module(pack, "nodes.train_lora").TrainLoRA
    with torch.inference_mode():
        return node.execute(model, dataset, **{**FAST, **options})


def test_combined_datasets_with_a_regularization_set_train_a_real_model(
        pack: ModuleType, handles: ModuleType, models: tuple, cache: Path, trained_plans: list[Any]) -> None:
    people, style, reg = (handles.StreamDatasetHandle(str(cache), n) for n in ("people", "style", "reg"))
    combined = _combine(pack, people, 2, style, 1)
    assert combined.parts == ((str(cache), "people", 2), (str(cache), "style", 1))
    assert combined.parts[0].cache_root == str(cache) and combined.parts[1].repeats == 1
    out = _train(pack, models[0], combined, reg_dataset=reg, reg_ratio=0.5, reg_weight=0.25, steps=6)
    lora, loss_map, steps = out.result[:3]
    assert steps == 6 and len(loss_map["loss"]) == 6 and all(math.isfinite(x) for x in loss_map["loss"])
    assert lora and all(torch.isfinite(t).all() for t in lora.values())
    summary = out.ui["text"][0]
    # 4 × 2 + 2 = 10 main occurrences; ratio 0.5: 5 regularization occurrences, in their own 96×64 bucket
    assert "'people×2 + style' (6 samples)" in summary and "regularization 'reg' (3 samples" in summary
    assert "[4, 8, 8]×10" in summary and "[4, 12, 8]×5" in summary
    reg_rows = [(p.latent_keys[r], p.weights[r]) for p in trained_plans for r in range(len(p.sample_indices))
                if p.sample_indices[r] >= 6]
    main_rows = [p.weights[r] for p in trained_plans for r in range(len(p.sample_indices))
                 if p.sample_indices[r] < 6]
    assert reg_rows and {w for _, w in reg_rows} == {0.25} and set(main_rows) == {1.0}
    assert {k for k, _ in reg_rows} <= {_key(f"regl{i}") for i in range(3)}
    rows = sum(len(p.sample_indices) for p in trained_plans)  # the summary counts what was trained
    assert f"rows: {rows} trained, {len(reg_rows)} regularization" in summary


def test_the_same_seed_repeats_a_run_with_dropout_and_regularization(
        pack: ModuleType, handles: ModuleType, models: tuple, cache: Path, trained_plans: list[Any]) -> None:
    people, reg = handles.StreamDatasetHandle(str(cache), "people"), handles.StreamDatasetHandle(str(cache), "reg")
    opts = {"reg_dataset": reg, "caption_dropout": 0.5, "steps": 4}
    out = _train(pack, models[0], people, **opts)
    a, text = out.result, out.ui["text"][0]
    first = list(trained_plans)
    b = _train(pack, models[0], people, **opts).result
    assert trained_plans[len(first):] == first
    assert a[1]["loss"] == b[1]["loss"]
    assert all(torch.equal(a[0][k], b[0][k]) for k in a[0])
    dropped = [p.caption_keys[r] for p in first for r in range(len(p.dropped)) if p.dropped[r]]
    kept = [p.caption_keys[r] for p in first for r in range(len(p.dropped)) if not p.dropped[r]]
    assert set(dropped) == {_key("empty")} and kept and _key("empty") not in kept
    assert f"{len(dropped)} with the empty caption" in text


def test_continuing_a_lora_draws_the_drops_and_reg_rows_of_an_uninterrupted_run(
        pack: ModuleType, handles: ModuleType, models: tuple, cache: Path, trained_plans: list[Any],
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """6 steps at once against 3 steps, saved, then 3 more from the saved LoRA (Train LoRA's existing_lora): the
    continued run trains the very plans — samples, dropped captions, regularization rows — the uninterrupted run
    trained from step 4 on (the sampler is resumed at the batch after the first run's last)."""
    import folder_paths
    from safetensors.torch import save_file

    people, reg = handles.StreamDatasetHandle(str(cache), "people"), handles.StreamDatasetHandle(str(cache), "reg")
    opts = {"reg_dataset": reg, "reg_ratio": 1.0, "reg_weight": 0.5, "caption_dropout": 0.3, "batch_size": 1,
            "optimizer": "SGD"}
    _train(pack, models[0], people, steps=6, **opts)
    whole = list(trained_plans)
    first = _train(pack, models[0], people, steps=3, **opts).result
    save_file(first[0], str(tmp_path / "variety_3_steps_00001_.safetensors"))
    monkeypatch.setitem(folder_paths.folder_names_and_paths, "loras",
                        ([str(tmp_path)], set(folder_paths.supported_pt_extensions)))
    del trained_plans[:]
    _train(pack, models[0], people, steps=3, existing_lora="variety_3_steps_00001_.safetensors", **opts)
    assert trained_plans == whole[3:]
    assert any(p.dropped and any(p.dropped) for p in whole) and any(p.weights == (0.5,) for p in whole)


def test_caption_dropout_without_the_empty_caption_names_the_dataset(
        pack: ModuleType, handles: ModuleType, models: tuple, cache: Path) -> None:
    style = handles.StreamDatasetHandle(str(cache), "style")
    with pytest.raises(ValueError, match=r"dataset 'style' has no empty caption.*Encode Dataset's empty_caption"):
        _train(pack, models[0], style, caption_dropout=0.1)
    out = _train(pack, models[0], style, caption_dropout=0.0, steps=1)  # off: trains as before
    assert len(out.result[1]["loss"]) == 1


def test_single_dataset_nodes_refuse_a_combination_and_repeats_past_the_limit_are_named(
        pack: ModuleType, handles: ModuleType, cache: Path, tmp_path: Path) -> None:
    people = handles.StreamDatasetHandle(str(cache), "people")
    combined = _combine(pack, people, 100)
    save = _module(pack, "nodes.save_cache")
    with pytest.raises(ValueError, match=r"takes one dataset, but a combination .*people×100"):
        save.save_dataset(combined, tmp_path / "copy", "copy")
    assert not (tmp_path / "copy").exists()
    with pytest.raises(ValueError, match=r"dataset 'people': repeats 100 × 101 = 10100, above the limit"):
        _combine(pack, combined, 101)
    for bad in (0, 10_001, True):
        with pytest.raises(ValueError, match="repeats_a must be a whole number"):
            _combine(pack, people, bad)
    with pytest.raises(ValueError, match="dataset_b: expected a STREAM_DATASET"):
        _combine(pack, people, 1, "people", 1)


def test_repeats_past_the_limit_with_the_folders_own_are_refused_at_combine_datasets(
        pack: ModuleType, handles: ModuleType, cache: Path, tmp_path: Path) -> None:
    """#27 item 8: a folder's 20 repeats × repeats_a 1000 = 20000 was refused only at Train LoRA ("lower the
    dataset's repeats"); Combine Datasets refuses it, naming its input and the largest value that fits."""
    writer_mod = _module(pack, "dataset_cache.format.writer")
    sample_cls = _module(pack, "dataset_cache.dataset").Sample
    root = tmp_path / "folders"
    with writer_mod.CacheWriter(root) as writer:
        writer.add("1" * 32, {"samples": torch.zeros(1, 4, 8, 8)}, kind="latent")
        writer.add("2" * 32, [[torch.zeros(1, 77, 768), {}]], kind="conditioning")
        writer.set_dataset("twenty", [sample_cls("1" * 32, ("2" * 32,), repeats=20, source="20_x/a.png")])
    twenty = handles.StreamDatasetHandle(str(root), "twenty")
    people = handles.StreamDatasetHandle(str(cache), "people")
    with pytest.raises(ValueError, match=r"repeats_a 1000: dataset 'twenty' has images repeated 20 times by their "
                                         r"folder .* 20000 times per epoch, above the limit of 10000; set repeats_a "
                                         r"to at most 500"):
        _combine(pack, twenty, 1000)
    with pytest.raises(ValueError, match=r"repeats_b 501: dataset 'twenty' .* 10020 times .* repeats_b to at most "
                                         r"500"):
        _combine(pack, people, 1, twenty, 501)
    ten = _combine(pack, twenty, 10)
    with pytest.raises(ValueError, match=r"repeats_a 60: dataset 'twenty' has images repeated 20 times by their "
                                         r"folder \(kohya's <repeats>_<name>\) × 10 \(an earlier Combine "
                                         r"Datasets\), so they would repeat 12000 times"):
        _combine(pack, ten, 60)
    assert _combine(pack, ten, 50).parts[0].repeats == 500  # 20 × 500 = 10000: at the limit, accepted


def test_a_dataset_used_as_its_own_regularization_is_named_in_the_summary(
        pack: ModuleType, handles: ModuleType, models: tuple, cache: Path) -> None:
    """#27 item 5: the same dataset in dataset and reg_dataset (or overlapping images) trains, with a warning naming
    both (kohya does not check; a refusal could break a deliberate setup)."""
    people = handles.StreamDatasetHandle(str(cache), "people")
    out = _train(pack, models[0], people, steps=1, reg_dataset=people)
    (summary,) = out.ui["text"]
    assert ("NOTE: reg_dataset 'people' is the same dataset as dataset 'people' (all 4 of its images): those images "
            "train as both the subject and its regularization") in summary
    both = _combine(pack, people, 1, handles.StreamDatasetHandle(str(cache), "style"), 1)
    out = _train(pack, models[0], people, steps=1, reg_dataset=both)
    (summary,) = out.ui["text"]
    assert "NOTE: reg_dataset 'people + style' shares 4 of its 6 images with dataset 'people' (e.g. people0.png)" \
        in summary
    out = _train(pack, models[0], people, steps=1, reg_dataset=handles.StreamDatasetHandle(str(cache), "reg"))
    assert "NOTE" not in out.ui["text"][0]


def test_a_missing_dataset_in_a_combination_is_named(
        pack: ModuleType, handles: ModuleType, models: tuple, cache: Path) -> None:
    combined = _combine(pack, handles.StreamDatasetHandle(str(cache), "people"), 1,
                        handles.StreamDatasetHandle(str(cache), "nope"), 1)
    with pytest.raises(ValueError, match=r"dataset 'nope' is not in the cache .*\['people', 'reg', 'style'\]"):
        _train(pack, models[0], combined)


# ------------------------------------------------------------------------------------- datasets of two caches
@pytest.fixture(scope="module")
def split(pack: ModuleType, cache: Path, cache_root: Path) -> tuple[Path, Path]:
    """The datasets copied out of ``cache``: "people" into cache ``multi_main``, "style" and "reg" into cache
    ``multi_shared`` (a reg cache shared by projects); both under the models folder, so Clean Cache finds them."""
    copy_dataset = _module(pack, "dataset_cache.saving").copy_dataset
    open_cache = _module(pack, "dataset_cache.format.reader").open_cache
    main, shared = cache_root / "multi_main", cache_root / "multi_shared"
    with open_cache(cache) as reader:
        copy_dataset(reader, "people", main, "people")
        copy_dataset(reader, "style", shared, "style")
        copy_dataset(reader, "reg", shared, "reg")
    return main, shared


@pytest.fixture()
def multi_reads(pack: ModuleType, monkeypatch: pytest.MonkeyPatch) -> list[int]:
    """How many groups each MultiCacheReader read had (the spy calls the real read)."""
    cls = _module(pack, "dataset_cache.multi_reader").MultiCacheReader
    real = cls.read_plan
    groups: list[int] = []

    def spy(self: Any, plan: Any, **kwargs: Any) -> Any:
        groups.append(len(plan.groups))
        return real(self, plan, **kwargs)

    monkeypatch.setattr(cls, "read_plan", spy)
    return groups


def _same_run(a: Any, b: Any) -> None:
    assert a.result[1]["loss"] == b.result[1]["loss"] and a.result[2] == b.result[2]
    assert a.result[0].keys() == b.result[0].keys()
    assert all(torch.equal(a.result[0][k], b.result[0][k]) for k in a.result[0])


def test_a_regularization_set_of_another_cache_trains_as_from_one_cache(
        pack: ModuleType, handles: ModuleType, models: tuple, cache: Path, split: tuple[Path, Path],
        trained_plans: list[Any], multi_reads: list[int]) -> None:
    """dataset in one cache, reg_dataset in another: the same plans (samples, drops, reg rows), losses and LoRA
    as the same datasets of one cache with the same seed; the one-cache run reads through the plain reader."""
    main, shared = split
    opts = {"reg_ratio": 1.0, "reg_weight": 0.5, "caption_dropout": 0.5, "steps": 5}
    two = _train(pack, models[0], handles.StreamDatasetHandle(str(main), "people"),
                 reg_dataset=handles.StreamDatasetHandle(str(shared), "reg"), **opts)
    plans_two, reads_two = list(trained_plans), list(multi_reads)
    del trained_plans[:], multi_reads[:]
    one = _train(pack, models[0], handles.StreamDatasetHandle(str(cache), "people"),
                 reg_dataset=handles.StreamDatasetHandle(str(cache), "reg"), **opts)
    assert trained_plans == plans_two and len(plans_two) == 5
    _same_run(two, one)
    assert multi_reads == []  # one cache: its own CacheReader, as before
    assert reads_two  # two caches: every batch through the MultiCacheReader ...
    reg_dropped = [p for p in plans_two for r in range(len(p.sample_indices))
                   if p.sample_indices[r] >= 4 and p.dropped[r]]
    assert reg_dropped and max(reads_two) == 2  # a reg row with the empty caption reads it from the first cache
    assert any(i >= 4 for p in plans_two for i in p.sample_indices)  # regularization rows were trained
    assert "regularization 'reg' (3 samples" in two.ui["text"][0]


def test_combine_datasets_of_two_caches_trains_as_from_one_cache(
        pack: ModuleType, handles: ModuleType, models: tuple, cache: Path, split: tuple[Path, Path],
        trained_plans: list[Any], multi_reads: list[int]) -> None:
    """people (first cache) ×2 + style (second cache) share a bucket, so batches stack latents of both caches."""
    main, shared = split
    node = _module(pack, "nodes.combine_datasets").CombineDatasets
    out = node.execute(handles.StreamDatasetHandle(str(main), "people"), 2,
                       handles.StreamDatasetHandle(str(shared), "style"), 1)
    combined = out.result[0]
    assert combined.parts == ((str(main), "people", 2), (str(shared), "style", 1))
    assert combined.cache_roots == (str(main), str(shared))
    assert tuple(out.ui.as_dict()["text"]) == (f"people×2 + style (caches at {main} (people); {shared} (style))",)
    two = _train(pack, models[0], combined, batch_size=3, steps=4)
    plans_two = list(trained_plans)
    del trained_plans[:]
    one = _train(pack, models[0], _combine(pack, handles.StreamDatasetHandle(str(cache), "people"), 2,
                                           handles.StreamDatasetHandle(str(cache), "style"), 1),
                 batch_size=3, steps=4)
    assert trained_plans == plans_two
    _same_run(two, one)
    assert "'people×2 + style' (6 samples)" in two.ui["text"][0]
    spanning = [p for p in plans_two if min(p.sample_indices) < 4 <= max(p.sample_indices)]
    assert spanning and 2 in multi_reads  # batches read from both caches at once


def test_a_run_holds_the_read_lock_of_every_cache_it_reads(
        pack: ModuleType, handles: ModuleType, models: tuple, split: tuple[Path, Path],
        monkeypatch: pytest.MonkeyPatch) -> None:
    """During the run, Clean Cache refuses to clean either cache (a dry run still reports); after it, it may."""
    main, shared = split
    clean_node = _module(pack, "nodes.clean_cache").CleanCache
    locked_error = _module(pack, "dataset_cache.errors").CacheLockedError
    loop = _module(pack, "nodes.training.loop").StepLoop
    real = loop._fwd_bwd
    refused: list[str] = []

    def step(self: Any, batch: Any, index: int) -> float:
        for name in ("multi_main", "multi_shared"):
            with pytest.raises(locked_error, match=r"\.read\.lock is held.*clean needs it exclusively"):
                clean_node.execute(cache=name, dry_run=False)
            refused.append(name)
            (dry,) = clean_node.execute(cache=name, dry_run=True).result
            assert "dry run" in dry
        return real(self, batch, index)

    monkeypatch.setattr(loop, "_fwd_bwd", step)
    _train(pack, models[0], handles.StreamDatasetHandle(str(main), "people"),
           reg_dataset=handles.StreamDatasetHandle(str(shared), "reg"), steps=2)
    assert refused == ["multi_main", "multi_shared"] * 2
    monkeypatch.setattr(loop, "_fwd_bwd", real)
    lock_mod = _module(pack, "dataset_cache.lock")
    for root in split:  # released when the run ends
        with lock_mod.CacheLock(root, lock_mod.READ_LOCK, exclusive=True, timeout=0, purpose="test"):
            pass


def test_a_missing_cache_or_dataset_among_several_is_named_and_nothing_is_created(
        pack: ModuleType, handles: ModuleType, models: tuple, split: tuple[Path, Path], tmp_path: Path) -> None:
    main, shared = split
    people = handles.StreamDatasetHandle(str(main), "people")
    nowhere = tmp_path / "no_such_cache"
    with pytest.raises(ValueError, match=rf"reg_dataset 'reg': no StreamCache cache at {nowhere}"):
        _train(pack, models[0], people, reg_dataset=handles.StreamDatasetHandle(str(nowhere), "reg"))
    assert not nowhere.exists()  # no lock file, no folder made on a guess
    combined = _combine(pack, people, 1, handles.StreamDatasetHandle(str(shared), "people"), 1)
    with pytest.raises(ValueError, match=rf"dataset 'people' is not in the cache at {shared}: .*\['reg', 'style'\]"):
        _train(pack, models[0], combined)

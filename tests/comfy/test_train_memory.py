"""The memory plan inside Train LoRA (#25), with ComfyUI's own model management: ``auto`` streams blocks when the
memory free is small (bit-identical results), ComfyUI wins where it manages a model's weights itself, the plan is
handed over before the first step, and what ``checkpoint_depth`` now does is said once.

The model is the tiny Flux of ``support.tiny_families`` (4 double and 4 single blocks). The memory free of a
CPU is the host's RAM, so ``auto`` finds everything fits; the small device is the trainer's own budget function
giving less (the only thing replaced: ComfyUI's functions and the model run as they are).
"""

from __future__ import annotations

import importlib
from types import ModuleType
from typing import Any

import pytest
import torch
from support.encoded import write_random_samples
from support.tiny_families import FAMILIES, build_family_patcher

from .test_block_checkpointing import SETTINGS, Run, train

FLUX = FAMILIES["flux"]


def _module(pack: ModuleType, name: str) -> ModuleType:
    return importlib.import_module(f"{pack.__name__}.{name}")


@pytest.fixture(scope="module")
def dataset(pack: ModuleType, tmp_path_factory: pytest.TempPathFactory) -> Any:
    return write_random_samples(pack, FLUX, tmp_path_factory.mktemp("train_memory") / "cache")


KEEP_WHOLE = "auto + keep blocks whole"


@pytest.fixture(scope="module")
def resident(pack: ModuleType, dataset: Any) -> Run:
    """Batch 2 (``SETTINGS``) with blocks kept whole: ``auto`` keeps them at batch 1 only, this mode at any."""
    with pytest.MonkeyPatch.context() as monkeypatch:
        return train(pack, FLUX, 4, dataset, monkeypatch, memory=KEEP_WHOLE, gradient_checkpointing=True)


def test_auto_at_batch_1_on_a_large_device_keeps_every_weight_and_reports_its_figures(
        pack: ModuleType, dataset: Any, monkeypatch: pytest.MonkeyPatch) -> None:
    run = train(pack, FLUX, 4, dataset, monkeypatch, memory="auto", gradient_checkpointing=True, batch_size=1,
                steps=1)
    plan = run.memory_plan
    assert plan["mode"] == "auto" and plan["checkpoint"] and plan["streamed_blocks"] == 0 and plan["fits"]
    assert plan["blocks"] == 8 and plan["measured"] == "probe" and plan["blocks_found"].startswith("Flux's")
    needs = plan["needs"]
    assert needs["held_checkpointed"] < needs["held"] and needs["largest_block_saved"] > 0
    # a CPU's memory free is the host's RAM: every block is kept whole in half of what checkpointing leaves free
    assert plan["description"].startswith("0 of 8 blocks checkpointed (8 kept whole in spare memory), all weights "
                                          "on the device, estimated ")


def test_auto_above_batch_1_checkpoints_every_block_and_names_the_mode_that_keeps_them(
        pack: ModuleType, dataset: Any, resident: Run, lean: Run, monkeypatch: pytest.MonkeyPatch) -> None:
    """At batch 2 ``auto`` holds what every block checkpointed holds (the plan ``no offload`` fixes), trains the same
    numbers, and says what ``auto + keep blocks whole`` would keep and hold more."""
    run = train(pack, FLUX, 4, dataset, monkeypatch, memory="auto", gradient_checkpointing=True)
    plan = run.memory_plan
    assert plan["mode"] == "auto" and plan["kept_blocks"] == 0 and plan["keepable_blocks"] == 8
    assert plan["estimate_bytes"] == lean.memory_plan["estimate_bytes"] and run.saved == lean.saved
    assert plan["keepable_bytes"] == resident.memory_plan["estimate_bytes"] - plan["estimate_bytes"] > 0
    assert plan["description"].startswith(f"8 blocks checkpointed ('{KEEP_WHOLE}' would keep 8 whole, faster, in ")
    _same_numbers(run, lean)
    assert resident.memory_plan["mode"] == KEEP_WHOLE and resident.memory_plan["kept_blocks"] == 8


@pytest.fixture(scope="module")
def lean(pack: ModuleType, dataset: Any) -> Run:
    """Every block checkpointed (``no offload``: the leanest plan without streaming)."""
    with pytest.MonkeyPatch.context() as monkeypatch:
        return train(pack, FLUX, 4, dataset, monkeypatch, memory="no offload", gradient_checkpointing=True)


def _same_numbers(a: Run, b: Run) -> None:
    assert a.losses == b.losses
    assert all(torch.equal(x, y) for step_a, step_b in zip(a.grads, b.grads, strict=True)
               for x, y in zip(step_a, step_b, strict=True))
    assert all(torch.equal(a.lora[k], b.lora[k]) for k in b.lora)


def test_blocks_kept_whole_train_bit_for_bit_as_checkpointed_and_hold_more(resident: Run, lean: Run) -> None:
    """Kept whole, a block is not recomputed: the same kernels on the same values, so the same gradients bit for
    bit; what the step keeps for its backward grows by the kept blocks' activations, as the plan estimated."""
    assert resident.memory_plan["kept_blocks"] == 8 and lean.memory_plan["kept_blocks"] == 0
    assert lean.memory_plan["description"].startswith("8 blocks checkpointed, all weights on the device")
    _same_numbers(resident, lean)
    assert resident.saved > lean.saved
    assert resident.memory_plan["estimate_bytes"] > lean.memory_plan["estimate_bytes"]


def test_a_budget_between_keeps_some_blocks_whole_within_half_the_spare(
        pack: ModuleType, dataset: Any, resident: Run, lean: Run, monkeypatch: pytest.MonkeyPatch) -> None:
    memory = _module(pack, "nodes.training.memory")
    plans = _module(pack, "dataset_cache.memory_plan")
    low, high = lean.memory_plan["estimate_bytes"], resident.memory_plan["estimate_bytes"]
    budget = high  # half of what checkpointing leaves free holds about half of the kept blocks' bytes
    monkeypatch.setattr(memory, "device_budget", lambda _device, slots, _there: plans.Budget(budget, None, slots))
    run = train(pack, FLUX, 4, dataset, monkeypatch, memory=KEEP_WHOLE, gradient_checkpointing=True)
    plan = run.memory_plan
    assert 0 < plan["kept_blocks"] < 8 and plan["streamed_blocks"] == 0
    assert plan["estimate_bytes"] <= low + plans.SPARE_SHARE * (budget - low)
    assert f"{8 - plan['kept_blocks']} of 8 blocks checkpointed ({plan['kept_blocks']} kept whole" \
        in plan["description"]
    _same_numbers(run, lean)
    assert lean.saved < run.saved < resident.saved


def test_auto_streams_blocks_when_the_memory_free_is_small(pack: ModuleType, dataset: Any, resident: Run,
                                                           lean: Run, monkeypatch: pytest.MonkeyPatch) -> None:
    memory = _module(pack, "nodes.training.memory")
    budget_cls = _module(pack, "dataset_cache.memory_plan").Budget
    small = int(lean.memory_plan["estimate_bytes"] * 0.9)  # less than every block checkpointed needs
    monkeypatch.setattr(memory, "device_budget", lambda _device, slots, _there: budget_cls(small, None, slots))
    run = train(pack, FLUX, 4, dataset, monkeypatch, memory="auto", gradient_checkpointing=True)
    plan = run.memory_plan
    assert 0 < plan["streamed_blocks"] < 8 and plan["fits"] and plan["estimate_bytes"] <= small
    assert plan["budget_bytes"] == small
    assert f"{plan['streamed_blocks']} of 8 blocks streamed" in plan["description"]
    assert run.losses == resident.losses  # streaming changes where weights live, not the numbers
    assert all(torch.equal(run.lora[k], resident.lora[k]) for k in resident.lora)


def test_comfyui_wins_where_it_manages_the_weights(pack: ModuleType, dataset: Any,
                                                   monkeypatch: pytest.MonkeyPatch) -> None:
    """offloading on, or ComfyUI run with --lowvram: its own partial loading manages the weights; this plan only
    checkpoints (and says so). A model with dynamic VRAM is recognised the same way. Streaming on top is refused."""
    import comfy.model_management

    memory = _module(pack, "nodes.training.memory")
    settings_cls = _module(pack, "nodes.training").TrainSettings
    offloaded = train(pack, FLUX, 2, dataset, monkeypatch, memory="auto", offloading=True)
    assert offloaded.memory_plan["managed_by"] == "offloading is on"
    assert offloaded.memory_plan["streamed_blocks"] == 0 and "stream" not in offloaded.memory_plan
    assert "weights managed by ComfyUI (offloading is on)" in offloaded.memory_plan["description"]
    with monkeypatch.context() as patch:
        patch.setattr(comfy.model_management, "vram_state", comfy.model_management.VRAMState.LOW_VRAM)
        lowvram = train(pack, FLUX, 2, dataset, patch, memory="auto")
    assert lowvram.memory_plan["managed_by"] == "ComfyUI runs with --lowvram"
    dynamic = build_family_patcher(FLUX, 2)
    dynamic.is_dynamic = lambda: True
    assert memory.comfy_manages(dynamic, settings_cls()) == "the model is loaded with dynamic VRAM"
    assert memory.comfy_manages(build_family_patcher(FLUX, 2), settings_cls()) == ""
    with pytest.raises(ValueError, match="ComfyUI manages this model's weights .* turn offloading off"):
        train(pack, FLUX, 2, dataset, monkeypatch, memory="stream blocks", offloading=True)


def test_the_plan_is_handed_over_before_the_first_step(pack: ModuleType, dataset: Any) -> None:
    training = _module(pack, "nodes.training")
    calls: list[str] = []
    reader, samples = dataset.open()
    try:
        with torch.inference_mode():
            training.train_lora(build_family_patcher(FLUX, 2), reader, samples, training.TrainSettings(**SETTINGS),
                                on_step=lambda report: calls.append(f"step {report.step}"),
                                on_plan=lambda plan: calls.append(plan.describe()))
    finally:
        reader.close()
    assert calls[0].startswith("4 blocks checkpointed") and calls[1:] == ["step 1", "step 2"]


@pytest.mark.parametrize(("depth", "checkpointing", "noted"), [(1, True, True), (2, True, True), (0, True, False),
                                                               (1, False, False)])
def test_checkpoint_depth_of_an_old_workflow_is_noted_once(pack: ModuleType, dataset: Any, depth: int,
                                                           checkpointing: bool, noted: bool) -> None:
    training = _module(pack, "nodes.training")
    settings = training.TrainSettings(**{**SETTINGS, "steps": 1, "checkpoint_depth": depth,
                                         "gradient_checkpointing": checkpointing})
    reader, samples = dataset.open()
    try:
        with torch.inference_mode():
            result = training.train_lora(build_family_patcher(FLUX, 2), reader, samples, settings)
    finally:
        reader.close()
    summary = result.summary()
    assert summary.count("is no longer used") == (1 if noted else 0)
    if noted:
        assert f"NOTE: checkpoint_depth {depth} is no longer used: every block of the model is its own gradient " \
               "checkpoint" in summary
    assert f"memory: {result.memory_plan['description']}" in summary


def test_blocks_are_found_in_every_family_and_an_unknown_model_falls_back(
        pack: ModuleType, caplog: pytest.LogCaptureFixture) -> None:
    """The known block lists of each family (a UNet's containers opened down to the layers it calls); a model with
    other names: the elements of its module lists; one without lists: its top-level layers; both say so."""
    import logging

    from comfy.ldm.modules.diffusionmodules.openaimodel import TimestepEmbedSequential

    blocks_mod = _module(pack, "nodes.training.blocks")
    expected = {"sd15": "input_blocks, output_blocks", "sdxl": "input_blocks, output_blocks",
                "sd3": "joint_blocks", "flux": "double_blocks, single_blocks", "wan21": "blocks",
                "qwen_image": "transformer_blocks", "lumina2": "noise_refiner, context_refiner, layers"}
    for name, lists in expected.items():
        model = build_family_patcher(FAMILIES[name], 2).model.diffusion_model
        found, how = blocks_mod.find_blocks(model)
        assert how.endswith(f"'s {lists}"), (name, how)
        assert found and not any(isinstance(b.module, (torch.nn.ModuleList, TimestepEmbedSequential)) for b in found)
        listed = {id(p): p for n in lists.split(", ") for p in getattr(model, n).parameters()}
        covered = {id(p): p for b in found for p in b.module.parameters()}
        assert covered.keys() == listed.keys(), name  # every weight of the block lists is in exactly the blocks found

    class Staged(torch.nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.embed = torch.nn.Linear(4, 4)
            self.stages = torch.nn.ModuleList([torch.nn.Linear(4, 4) for _ in range(3)])

    class Flat(torch.nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.a, self.b = torch.nn.Linear(4, 4), torch.nn.Sequential(torch.nn.SiLU(), torch.nn.Identity())

    with caplog.at_level(logging.WARNING, logger="streamcache.train"):
        staged, how = blocks_mod.find_blocks(Staged())
        assert [b.name for b in staged] == ["stages.0", "stages.1", "stages.2"]
        assert "no known block list; checkpointing the elements of its module lists stages" in how
        flat, how = blocks_mod.find_blocks(Flat())
        assert [b.name for b in flat] == ["a", "b.0", "b.1"] and "its 3 top-level layers" in how
    assert caplog.text.count("Train LoRA: ") == 2


def test_nothing_of_the_trained_model_outlives_the_run(pack: ModuleType, dataset: Any,
                                                      monkeypatch: pytest.MonkeyPatch) -> None:
    """The trainer's deep copy of the model is freed when the run ends, the memory probe's fake pass included: a
    pack hook that kept each saved tensor as itself tied an op's output to its own grad_fn (a cycle through C++
    the collector cannot see), and every run leaked the copied model (measured: 10 GB held after the family
    matrix). Weak references to the copy's weights must be dead after one collection."""
    import gc
    import weakref

    training = _module(pack, "nodes.training")
    real_load = training.run.load
    copies: list[weakref.ref[torch.Tensor]] = []

    def load(*args: Any, **kwargs: Any) -> Any:
        run = real_load(*args, **kwargs)
        copies.extend(weakref.ref(p) for p in run.mp.model.diffusion_model.parameters())
        return run

    monkeypatch.setattr(training.run, "load", load)
    model = build_family_patcher(FLUX, 2)
    reader, samples = dataset.open()
    try:
        with torch.inference_mode():
            training.train_lora(model, reader, samples, training.TrainSettings(
                **{**SETTINGS, "steps": 2, "memory": "auto", "gradient_checkpointing": True}))
    finally:
        reader.close()
    gc.collect()
    assert copies and not [r for r in copies if r() is not None]


def _count_probe_passes(pack: ModuleType, monkeypatch: pytest.MonkeyPatch) -> list[int]:
    probe = _module(pack, "nodes.training.probe")
    passes: list[int] = []
    real = probe._pass

    def counted(*args: Any, **kwargs: Any) -> Any:
        passes.append(1)
        return real(*args, **kwargs)

    monkeypatch.setattr(probe, "_pass", counted)
    return passes


def test_a_rerun_on_the_same_model_and_shapes_reuses_the_probe(pack: ModuleType, dataset: Any,
                                                               monkeypatch: pytest.MonkeyPatch) -> None:
    """The fake forward pass costs seconds on a large model, before every first step: a second run of a model of the
    same structure (weights drawn anew: values do not count) at the same shapes takes the first run's figures, and
    trains exactly the same; the figures are the same as a fresh probe's."""
    probe = _module(pack, "nodes.training.probe")
    probe.clear_probe_cache()
    passes = _count_probe_passes(pack, monkeypatch)
    first = train(pack, FLUX, 4, dataset, monkeypatch, memory="auto", gradient_checkpointing=True)
    assert len(passes) >= 1 and len(probe.PROBES) == 1
    measured = len(passes)
    second = train(pack, FLUX, 4, dataset, monkeypatch, memory="auto", gradient_checkpointing=True)
    assert len(passes) == measured  # no fake pass the second time
    assert second.memory_plan["needs"] == first.memory_plan["needs"]  # (the memory free may differ: the host's RAM)
    assert second.losses == first.losses
    assert all(torch.equal(second.lora[k], first.lora[k]) for k in first.lora)
    probe.clear_probe_cache()
    third = train(pack, FLUX, 4, dataset, monkeypatch, memory="auto", gradient_checkpointing=True)
    assert len(passes) > measured and third.memory_plan["needs"] == first.memory_plan["needs"]


@pytest.mark.parametrize("change", ["blocks", "batch", "dtype", "checkpointing"])
def test_another_structure_shape_or_setting_probes_again(pack: ModuleType, dataset: Any, change: str,
                                                         monkeypatch: pytest.MonkeyPatch) -> None:
    """Whatever the probe's figures depend on is part of the key: a model with more blocks, another batch shape,
    another training dtype, checkpointing off."""
    probe = _module(pack, "nodes.training.probe")
    probe.clear_probe_cache()
    passes = _count_probe_passes(pack, monkeypatch)
    train(pack, FLUX, 4, dataset, monkeypatch, memory="auto", gradient_checkpointing=True, steps=1)
    before = len(passes)
    options: dict[str, Any] = {"memory": "auto", "gradient_checkpointing": change != "checkpointing", "steps": 1}
    if change == "batch":
        options["batch_size"] = 1
    if change == "dtype":
        options["training_dtype"] = "bf16"
    run = train(pack, FLUX, 6 if change == "blocks" else 4, dataset, monkeypatch, **options)
    assert len(passes) > before and len(probe.PROBES) == 2
    if change == "blocks":
        assert run.memory_plan["blocks"] == 12


def test_a_conditioning_the_key_cannot_describe_is_probed_and_not_remembered(pack: ModuleType) -> None:
    """An object in a conditioning (or a callable in the model options) has no plain description: such a run is
    probed every time instead of risking another run's figures."""
    cache = _module(pack, "nodes.training.probe_cache")
    with pytest.raises(cache.Uncacheable):
        cache.value_digest([[torch.zeros(1, 4, 8), {"hook": object()}]])
    mask = torch.ones(1, 12, dtype=torch.long)
    short = mask.clone()
    short[0, 8:] = 0
    # an attention mask's values decide the model's arguments (a length): they are in the key, a latent's are not
    assert cache.value_digest({"attention_mask": mask}) != cache.value_digest({"attention_mask": short})
    assert cache.value_digest(torch.zeros(1, 16, 64, 64)) == cache.value_digest(torch.ones(1, 16, 64, 64))
    assert cache.value_digest(torch.zeros(1, 16, 64, 64)) != cache.value_digest(torch.zeros(1, 16, 64, 32))


def test_the_key_ignores_the_values_of_embeddings_but_not_of_masks(pack: ModuleType) -> None:
    """A re-run on another dataset of the same shapes hits the cache (pooled outputs and embeddings differ, their
    values change nothing measured); a guidance value or a mask's contents are in the key."""
    cache = _module(pack, "nodes.training.probe_cache")
    gen = torch.Generator().manual_seed(1)
    a = [[torch.randn(1, 12, 64, generator=gen), {"pooled_output": torch.randn(1, 768, generator=gen)}]]
    b = [[torch.randn(1, 12, 64, generator=gen), {"pooled_output": torch.randn(1, 768, generator=gen)}]]
    assert cache.value_digest(a) == cache.value_digest(b)
    digest = cache.value_digest
    assert digest({"guidance": torch.tensor([3.5])}) != digest({"guidance": torch.tensor([1.0])})
    assert cache.value_digest({"guidance": 3.5}) != cache.value_digest({"guidance": 1.0})


def test_streamed_blocks_train_only_the_chosen_layers_as_resident_ones(pack: ModuleType, dataset: Any,
                                                                       monkeypatch: pytest.MonkeyPatch) -> None:
    """``train_layers`` with some blocks streamed: the LoRA is the chosen layers' (the double blocks' without their
    norms; the single blocks have no adapter) and the numbers are those of every weight resident, bit for bit."""
    chosen = {"train_layers": "double_blocks, -norm", "gradient_checkpointing": True}
    resident = train(pack, FLUX, 4, dataset, monkeypatch, memory="no offload", **chosen)
    assert resident.lora and all("double_blocks" in k and "norm" not in k for k in resident.lora)
    memory = _module(pack, "nodes.training.memory")
    budget_cls = _module(pack, "dataset_cache.memory_plan").Budget
    small = int(resident.memory_plan["estimate_bytes"] * 0.9)
    monkeypatch.setattr(memory, "device_budget", lambda _device, slots, _there: budget_cls(small, None, slots))
    run = train(pack, FLUX, 4, dataset, monkeypatch, memory="auto", **chosen)
    assert 0 < run.memory_plan["streamed_blocks"] < 8
    assert set(run.lora) == set(resident.lora)
    _same_numbers(run, resident)

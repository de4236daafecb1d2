"""The family matrix, training side: every model family ComfyUI trains, trained by the pack from a cache.

For each family of :data:`support.tiny_families.FAMILIES` a tiny diffusion model built with ComfyUI's classes is
read by ``UNETLoader`` (so ComfyUI's own detection names the family), a cache holds latents of the family's
shape (5-D for video VAEs) in two buckets and conditionings of the shapes and keys its text encoders return, and
Train LoRA runs 2 steps at batch 1 and 2. The LoRA must load with every key applied (ComfyUI logs ``lora key
not loaded`` for each one it cannot place) and a 1-step KSampler run with it must give a finite latent.
LLM text encoders (Qwen-Image, Lumina 2) give captions of different lengths, so their batches of 2 hold rows
that cannot be joined; the trainer must run them as ComfyUI's sampler would, separately.
The encoder side of each family needs its full-size text encoder and is not run here (README, "Model families").

Two more checks per family tie the pack's trainer to ComfyUI's own: one step at batch 1 gives the same loss and the
same gradient of every LoRA parameter as ComfyUI's built-in training path (``TrainLoraNode`` → ``TrainGuider`` →
``TrainSampler``) with the same noise, sigma, latent, conditioning and LoRA weights (which proves the noise scaling,
``process_latent_in``, the prediction type and the extra conds per family), and the built-in node itself trains the
tiny model 2 steps. Each test records its result in the family matrix (``support.matrix``): the table of README.md
and docs/BENCHMARKS.md is rendered from that record by ``scripts/family_matrix.py``.
"""

from __future__ import annotations

import copy
import gc
import importlib
import logging
from collections.abc import Callable, Iterator
from types import ModuleType
from typing import Any

import pytest
import torch
from torch.optim.optimizer import register_optimizer_step_pre_hook
from support.matrix import Cell, matrix  # noqa: F401 (the fixture)
from support.tiny_families import FAMILIES, Family, save_family_model

TRAIN = {
    "batch_size": 1, "grad_accumulation_steps": 1, "steps": 2, "learning_rate": 3e-3, "rank": 4,
    "optimizer": "AdamW", "loss_function": "MSE", "seed": 7, "training_dtype": "fp32", "lora_dtype": "fp32",
    "algorithm": "LoRA", "gradient_checkpointing": False, "checkpoint_depth": 1, "offloading": False,
    "existing_lora": "[None]", "prefetch_batches": 2, "loader_threads": 0,
}
TOKENS = (7, 12, 12, 20)  # caption lengths where the encoder does not pad (LLM encoders)


def _module(pack: ModuleType, name: str) -> ModuleType:
    return importlib.import_module(f"{pack.__name__}.{name}")


@pytest.fixture(scope="module", params=list(FAMILIES), ids=list(FAMILIES))
def family(request: pytest.FixtureRequest, comfy_nodes: ModuleType, tmp_path_factory: pytest.TempPathFactory
           ) -> Iterator[tuple[Family, Any]]:
    import folder_paths

    fam = FAMILIES[request.param]
    folder = tmp_path_factory.mktemp(f"family_{fam.name}")
    path = save_family_model(fam, folder)
    folder_paths.add_model_folder_path("diffusion_models", str(folder))
    (model,) = comfy_nodes.UNETLoader().load_unet(path.name, "default")
    assert type(model.model).__name__ == fam.model_class
    yield fam, model
    del model
    gc.collect()
    path.unlink()  # the heavy families' files are hundreds of MB


@pytest.fixture(scope="module")
def dataset(pack: ModuleType, family: tuple[Family, Any], tmp_path_factory: pytest.TempPathFactory) -> Any:
    """Four samples: three of the family's 64×64 latent shape and one a third wider (a second bucket)."""
    fam, _ = family
    writer_mod = _module(pack, "dataset_cache.format.writer")
    sample_cls = _module(pack, "dataset_cache.dataset").Sample
    handles = _module(pack, "nodes.handles")
    root = tmp_path_factory.mktemp(f"cache_{fam.name}") / "cache"
    gen = torch.Generator().manual_seed(0)
    wide = (*fam.latent[:-1], fam.latent[-1] * 3 // 2)
    samples = []
    with torch.inference_mode(), writer_mod.CacheWriter(root) as writer:
        for i, (shape, tokens) in enumerate(zip((fam.latent, fam.latent, fam.latent, wide), TOKENS)):
            writer.add(f"{i:032x}", {"samples": torch.randn(shape, generator=gen)}, kind="latent")
            writer.add(f"{i + 100:032x}", fam.conditioning(gen, tokens), kind="conditioning")
            samples.append(sample_cls(f"{i:032x}", (f"{i + 100:032x}",), source=f"img{i}.png"))
        writer.set_dataset("train", samples)
    return handles.StreamDatasetHandle(str(root), "train")


def _assert_lora_applies(model: Any, lora: dict[str, torch.Tensor], caplog: pytest.LogCaptureFixture) -> int:
    """Load ``lora`` onto ``model`` as ComfyUI does; fail on any ``lora key not loaded``; return how many modules
    the LoRA trains (each of them patched)."""
    import comfy.lora

    with caplog.at_level(logging.WARNING):
        caplog.clear()
        patches = comfy.lora.load_lora(lora, comfy.lora.model_lora_keys_unet(model.model, {}))
    assert "lora key not loaded" not in caplog.text
    trained = {k.rsplit(".lora_", 1)[0] for k in lora if ".lora_" in k}
    assert trained and len(patches) >= len(trained)
    return len(trained)


@pytest.mark.parametrize("batch_size", [1, 2])
def test_family_trains_and_its_lora_applies_with_every_key(
        pack: ModuleType, comfy_nodes: ModuleType, family: tuple[Family, Any], dataset: Any, batch_size: int,
        caplog: pytest.LogCaptureFixture, matrix: Callable[..., Cell]) -> None:
    fam, model = family
    part = f"batch {batch_size}"
    train_cell, keys_cell, sample_cell = (matrix(fam.name, c, part) for c in ("train", "lora_keys", "sample"))
    node = _module(pack, "nodes.train_lora").TrainLoRA
    options = {**TRAIN, **fam.train, "batch_size": batch_size}
    if batch_size == 1:  # and samples during training: the family's sampling, its latent format and shape
        options.update(sample_count=1, sample_steps=2)
    train_cell.note(f"{part}: Train LoRA from a cache of 2 buckets" + (", with a sample image" if batch_size == 1
                                                                       else ""))
    with torch.inference_mode():
        lora, loss_map, steps, images = node.execute(model, dataset, **options).result
    if batch_size == 1:  # before the first step and after the last, at the bucket of 3 sources
        assert images["samples"].shape == (2, *fam.latent[1:]) and torch.isfinite(images["samples"]).all()
    losses = loss_map["loss"]
    assert steps == TRAIN["steps"] and len(losses) == TRAIN["steps"]
    assert all(torch.isfinite(torch.tensor(losses))), losses
    assert lora and all(torch.isfinite(t).all() for t in lora.values())
    train_cell.passed(f"{part}: loss {losses[0]:.3f} → {losses[-1]:.3f}")
    keys_cell.note(f"{part}: the LoRA loads with no 'lora key not loaded'")
    applied = _assert_lora_applies(model, lora, caplog)
    keys_cell.passed(f"{part}: all {applied} modules")

    sample_cell.note(f"{part}: a 1-step KSampler with the LoRA")
    train_nodes = _module(pack, "nodes.training").nodes_train_module()
    with torch.inference_mode():
        (with_lora,) = train_nodes.LoraModelLoader.execute(model, lora, 1.0).result
        cond = fam.conditioning(torch.Generator().manual_seed(1), 9)
        (out,) = comfy_nodes.KSampler().sample(with_lora, 0, 1, 1.0, "euler", "simple", cond, cond,
                                              {"samples": torch.zeros(fam.latent)})
    assert out["samples"].shape == fam.latent and torch.isfinite(out["samples"]).all()
    sample_cell.passed(f"{part}: finite {list(fam.latent)}")


# ------------------------------------------------------------------------------- the same as ComfyUI's training
def _builtin_inputs(model: Any, latents: list[torch.Tensor], conditionings: list[list], options: dict[str, Any],
                    ) -> dict[str, list]:
    """ComfyUI's ``TrainLoraNode`` inputs (every input is a list: the node takes input lists), standard mode."""
    names = ("batch_size", "steps", "grad_accumulation_steps", "learning_rate", "rank", "optimizer",
             "loss_function", "seed", "training_dtype", "lora_dtype", "algorithm", "gradient_checkpointing",
             "checkpoint_depth", "offloading", "existing_lora")
    return {"model": [model], "latents": [{"samples": lat.clone()} for lat in latents],
            "positive": [copy.deepcopy(c) for c in conditionings], **{k: [options[k]] for k in names},
            "quantized_backward": [False], "bucket_mode": [False], "bypass_mode": [False]}


@pytest.fixture(scope="module")
def existing_lora(family: tuple[Family, Any], tmp_path_factory: pytest.TempPathFactory) -> str:
    """A LoRA file for every module the trainers adapt, with random up AND down matrices.

    A fresh LoRA starts with one of its two matrices zero (so that one gets no gradient); both trainers continue
    this file instead, so every LoRA parameter has a gradient and both start from the same weights. It holds no
    ``diff``/``diff_b`` (the built-in starts those at zero whatever the file holds; both then start at zero).
    """
    import folder_paths
    from safetensors.torch import save_file

    fam, model = family
    gen = torch.Generator().manual_seed(3)
    lora = {}
    for name, module in model.model.named_modules():
        weight = getattr(module, "weight", None)
        if hasattr(module, "weight_function") and weight is not None and weight.ndim >= 2:
            rank, inputs = TRAIN["rank"], weight.shape[1:].numel()
            lora[f"{name}.lora_up.weight"] = torch.randn(weight.shape[0], rank, generator=gen) * 0.05
            lora[f"{name}.lora_down.weight"] = torch.randn(rank, inputs, generator=gen) * 0.05
    assert lora
    folder = tmp_path_factory.mktemp(f"loras_{fam.name}")
    name = f"parity_{fam.name}_1_steps_00001_.safetensors"  # the step count where both trainers read it
    save_file(lora, str(folder / name))
    folder_paths.add_model_folder_path("loras", str(folder))
    return name


def _one_sample_dataset(pack: ModuleType, latent: torch.Tensor, conditioning: list, root: Any) -> Any:
    writer_mod = _module(pack, "dataset_cache.format.writer")
    sample_cls = _module(pack, "dataset_cache.dataset").Sample
    with torch.inference_mode(), writer_mod.CacheWriter(root) as writer:
        writer.add("a" * 32, {"samples": latent}, kind="latent")
        writer.add("b" * 32, conditioning, kind="conditioning")
        writer.set_dataset("one", [sample_cls("a" * 32, ("b" * 32,), source="one.png")])
    return _module(pack, "nodes.handles").StreamDatasetHandle(str(root), "one")


class _Grads:
    """The gradient of every optimized parameter, taken just before each optimizer step (any optimizer)."""

    def __init__(self) -> None:
        self.steps: list[list[torch.Tensor]] = []

    def __enter__(self) -> _Grads:
        def hook(optimizer: Any, _args: Any, _kwargs: Any) -> None:
            self.steps.append([p.grad.detach().clone() if p.grad is not None else torch.zeros_like(p)
                               for group in optimizer.param_groups for p in group["params"]])

        self._handle = register_optimizer_step_pre_hook(hook)
        return self

    def __exit__(self, *exc: object) -> None:
        self._handle.remove()


def _builtin_node_step(builtin: ModuleType, model: Any, latent: torch.Tensor, conditioning: list,
                       options: dict[str, Any], monkeypatch: pytest.MonkeyPatch) -> dict[str, Any]:
    """One step of ComfyUI's ``TrainLoraNode``; a spy notes the sigma, noise and latent its ``fwd_bwd`` got."""
    seen: dict[str, Any] = {}
    fwd_bwd = builtin.TrainSampler.fwd_bwd

    def spy(self: Any, model_wrap: Any, sigmas: torch.Tensor, noise: torch.Tensor, latents: torch.Tensor,
            *args: Any, **kwargs: Any) -> Any:
        seen.update(sigma=sigmas.detach().clone(), noise=noise.detach().clone(), latent=latents.detach().clone())
        return fwd_bwd(self, model_wrap, sigmas, noise, latents, *args, **kwargs)

    monkeypatch.setattr(builtin.TrainSampler, "fwd_bwd", spy)
    with _Grads() as grads, torch.inference_mode():
        lora, loss_map, _ = builtin.TrainLoraNode.execute(**_builtin_inputs(model, [latent], [conditioning], options)
                                                           ).result
    monkeypatch.undo()
    assert len(grads.steps) == 1 and set(seen) == {"sigma", "noise", "latent"}
    return {**seen, "loss": loss_map["loss"][0], "grads": grads.steps[0], "lora": lora, "route": ""}


def _builtin_guider_step(builtin: ModuleType, model: Any, latent: torch.Tensor, conditioning: list,
                         options: dict[str, Any]) -> dict[str, Any]:
    """One forward/backward of ComfyUI's ``TrainSampler.fwd_bwd`` through its ``TrainGuider``, the model and LoRA
    set up with its node's own helpers as its node does: for a family whose node fails before its first step (the
    node's driver loop, not its training math). Sigma and noise are fixed here (the driver would draw them)."""
    import comfy.model_management
    import comfy.samplers

    gen = torch.Generator().manual_seed(8)
    noise = torch.randn(latent.shape, generator=gen)
    seen: dict[str, Any] = {"noise": noise}
    existing, _ = builtin._load_existing_lora(options["existing_lora"])
    with torch.inference_mode(False):
        mp = model.clone(force_deepcopy=True)
        mp.set_model_compute_dtype(torch.float32)
        mp.model.requires_grad_(False).train()
        sigma = torch.tensor([float(mp.model.model_sampling.percent_to_sigma(0.37))])
        seen["sigma"] = sigma
        lora_sd, _adapters = builtin._setup_lora_adapters(mp, existing, options["algorithm"], torch.float32,
                                                          options["rank"])
        if options["gradient_checkpointing"]:
            for m in builtin.find_modules_at_depth(mp.model.diffusion_model, depth=options["checkpoint_depth"]):
                builtin.patch(m)
        comfy.model_management.load_models_gpu([mp], memory_required=1e20, force_full_load=True)
        trainer = builtin.TrainSampler(builtin._create_loss_function(options["loss_function"]), None,
                                       training_dtype=torch.float32)

        class OneStep(comfy.samplers.Sampler):
            def sample(self, model_wrap: Any, sigmas: Any, extra_args: Any, callback: Any, noise_: Any,
                       latent_image: Any = None, denoise_mask: Any = None, disable_pbar: bool = False) -> Any:
                seen["latent"] = latent_image.detach().clone()
                seen["loss"] = float(trainer.fwd_bwd(model_wrap, sigma, noise, latent_image,
                                                     model_wrap.conds["positive"], [0], extra_args, 1))
                return torch.zeros_like(latent_image)

        guider = builtin.TrainGuider(mp)
        guider.set_conds(copy.deepcopy(conditioning))
        try:
            comfy.model_management.in_training = True  # as the node: ComfyUI picks differentiable kernels then
            guider.sample(noise.clone(), latent.clone(), OneStep(), torch.tensor([0.0]), seed=0)
        finally:
            comfy.model_management.in_training = False
            for m in mp.model.modules():
                builtin.unpatch(m)
    seen["grads"] = [p.grad.detach().clone() if p.grad is not None else torch.zeros_like(p)
                     for p in lora_sd.values()]
    seen["keys"] = list(lora_sd)
    seen["route"] = " (its TrainGuider + TrainSampler.fwd_bwd: the node fails)"
    return seen


def test_one_step_gives_the_loss_and_gradients_of_comfyuis_own_training(
        pack: ModuleType, family: tuple[Family, Any], existing_lora: str, tmp_path: Any,
        monkeypatch: pytest.MonkeyPatch, matrix: Callable[..., Cell]) -> None:
    """Batch 1, one SGD step, fp32 on the CPU: ComfyUI's ``TrainLoraNode`` runs first and a spy notes the sigma,
    noise and latent its ``TrainSampler.fwd_bwd`` gets (its own draws, its own ``process_latent_in``); the pack's
    trainer then runs with its draw replaced by those values. Loss, every gradient and the stepped LoRA must agree.
    Where the node fails on the family (``Family.builtin_fails``), its guider and ``fwd_bwd`` are run directly."""
    fam, model = family
    cell = matrix(fam.name, "parity")
    training = _module(pack, "nodes.training")
    builtin = training.nodes_train_module()
    gen = torch.Generator().manual_seed(21)
    latent = torch.randn(fam.latent, generator=gen)
    conditioning = fam.conditioning(gen, 12)
    options = {**TRAIN, **fam.train, "steps": 1, "optimizer": "SGD", "learning_rate": 0.5,
               "existing_lora": existing_lora}
    cell.note("ComfyUI's training, 1 step")
    if fam.builtin_fails:
        theirs = _builtin_guider_step(builtin, model, latent, conditioning, options)
    else:
        theirs = _builtin_node_step(builtin, model, latent, conditioning, options, monkeypatch)
    with torch.inference_mode():
        in_model_space = model.model.process_latent_in(latent.clone())
    torch.testing.assert_close(theirs["latent"].float(), in_model_space, rtol=0, atol=0)  # both scale the latent

    monkeypatch.setattr(training.loop.StepLoop, "_draw", lambda _self, shape, _index: (
        theirs["sigma"].float().cpu().reshape(shape[0]), theirs["noise"].float().cpu().reshape(shape)))
    cell.note("the pack's trainer, 1 step with the same sigma and noise")
    reader, samples = _one_sample_dataset(pack, latent, conditioning, tmp_path / "cache").open()
    try:
        settings = training.TrainSettings(**{k: v for k, v in options.items()
                                              if k in training.TrainSettings.__dataclass_fields__})
        with _Grads() as ours, torch.inference_mode():
            result = training.train_lora(model, reader, samples, settings)
    finally:
        reader.close()
    assert len(ours.steps) == 1

    loss, expected = result.losses[0], theirs["loss"]
    assert loss == pytest.approx(expected, rel=1e-5, abs=1e-7), (loss, expected)
    keys = theirs.get("keys") or list(theirs["lora"])
    assert list(result.lora) == keys and len(ours.steps[0]) == len(theirs["grads"]) == len(keys)
    worst = 0.0
    # Same operations in the same order: agreement to fp32 rounding (1e-5 of the largest element). Blocks the pack
    # runs with out-of-place additions (Flux's `img += ...`, result.memory_plan["out_of_place"]) have another
    # backward graph: autograd then accumulates each gradient's terms (one per block and token path, ~10^3 in
    # these models) in another order, and a reordered fp32 sum of K terms differs by up to ~K * 2^-24 of their
    # magnitude. The terms are gradients flowing through the model, bounded by the largest gradient of the run
    # (a LoRA alpha's gradient is a sum with much cancellation), so the bound is taken from that: 1e-4 of it.
    reordered = bool(result.memory_plan.get("out_of_place"))
    largest = max(float(r.abs().max()) for r in theirs["grads"]) or 1.0
    for key, g, ref in zip(keys, ours.steps[0], theirs["grads"]):
        scale = float(ref.abs().max()) or 1.0
        grad_atol = 1e-4 * largest if reordered else 1e-5 * scale
        torch.testing.assert_close(g, ref, rtol=1e-4, atol=grad_atol, msg=lambda m, k=key: f"grad of {k}: {m}")
        worst = max(worst, float((g - ref).abs().max()) / scale)
        if "lora" in theirs:
            # one SGD step: LoRA = start - lr * grad, so the gradients' difference times lr, plus rounding
            lora_atol = options["learning_rate"] * grad_atol if reordered else 1e-6 * scale
            torch.testing.assert_close(result.lora[key], theirs["lora"][key], rtol=1e-4, atol=lora_atol + 1e-7)
    nonzero = sum(bool(ref.abs().max() > 0) for ref in theirs["grads"])
    same = f"loss {loss:.5f} = {expected:.5f}" if loss == expected else \
        f"loss {loss:.5f} vs {expected:.5f} (|Δ| {abs(loss - expected):.0e})"
    grads = "equal" if worst == 0 else f"within {worst:.0e} of the largest"
    cell.passed(f"{same}; all {len(keys)} LoRA gradients {grads} ({nonzero} non-zero){theirs['route']}")


def test_comfyuis_builtin_train_lora_node_trains_the_family(
        family: tuple[Family, Any], caplog: pytest.LogCaptureFixture, matrix: Callable[..., Cell],
        pack: ModuleType) -> None:
    """ComfyUI's own ``TrainLoraNode`` on the same tiny model (2 images, batch 1, 2 steps): the family is one
    ComfyUI trains, so a difference in the parity test is the pack's to fix, not the model's. Where it is known to
    fail (``Family.builtin_fails``) the test checks it still fails that way and records the failure."""
    import traceback

    fam, model = family
    cell = matrix(fam.name, "builtin")
    builtin = _module(pack, "nodes.training").nodes_train_module()
    gen = torch.Generator().manual_seed(5)
    latents = [torch.randn(fam.latent, generator=gen) for _ in range(2)]
    conditionings = [fam.conditioning(gen, tokens) for tokens in (7, 12)]
    options = {**TRAIN, **fam.train}
    note = ", gradient checkpointing" if options["gradient_checkpointing"] else ""
    cell.note(f"ComfyUI's TrainLoraNode, 2 steps{note}")
    inputs = _builtin_inputs(model, latents, conditionings, options)
    if fam.builtin_fails:
        with pytest.raises(Exception, match=fam.builtin_fails) as failure, torch.inference_mode():
            builtin.TrainLoraNode.execute(**inputs)
        where = [f.name for f in traceback.extract_tb(failure.tb) if f.filename.endswith("nodes_train.py")][-1]
        cell.known_failure(f"TrainLoraNode raises {failure.typename}: {failure.value} (its {where} walks into "
                           "the list of reference latents)")
        return
    with torch.inference_mode():
        lora, loss_map, steps = builtin.TrainLoraNode.execute(**inputs).result
    losses = loss_map["loss"]
    assert steps == 2 and len(losses) == 2 and all(torch.isfinite(torch.tensor(losses))), losses
    applied = _assert_lora_applies(model, lora, caplog)
    cell.passed(f"loss {losses[0]:.3f} → {losses[-1]:.3f}, all {applied} modules applied{note}")

"""Node "Train LoRA (Stream Cache)" on the real ComfyUI, CPU, with the tiny SD1.5-shaped models.

The dataset is encoded with ComfyUI's own VAEEncode (TAESD) and CLIPTextEncode (CLIP-L) and written with the
library's CacheWriter: four 64×64 images and two 96×64 ones, so batches come from two resolution buckets.
Training runs in fp32 where speed matters (bf16 convolutions are emulated on CPUs without AVX512-BF16, ~4× slower);
one short run covers the node's defaults (bf16, gradient checkpointing).
"""

from __future__ import annotations

import dataclasses
import gc
import json
import importlib
import logging
import math
import os
import re
import sys
import threading
import time
import traceback
import types
from collections import Counter
from pathlib import Path
from collections.abc import Callable
from types import ModuleType
from typing import Any

import pytest
import torch
from support.encoded import key as _key
from support.encoded import write_comfy_encoded
from support.train_options import save_lora

STEPS = 20
FAST = {  # the options every run shares unless a test says otherwise
    "batch_size": 2, "grad_accumulation_steps": 1, "steps": 6, "learning_rate": 3e-3, "rank": 4,
    "optimizer": "AdamW", "loss_function": "MSE", "seed": 7, "training_dtype": "fp32", "lora_dtype": "fp32",
    "algorithm": "LoRA", "gradient_checkpointing": False, "checkpoint_depth": 1, "offloading": False,
    "existing_lora": "[None]", "prefetch_batches": 2, "loader_threads": 0, "quantized_backward": False,
    "bypass_mode": False, "masked_loss": True, "unmasked_weight": 0.1,
    "caption_dropout": 0.0, "reg_dataset": None, "reg_ratio": 1.0, "reg_weight": 1.0,
    "memory": "auto", "stream_blocks": 0, "allow_fp8": False, "devices": "auto", "checkpoint_mode": "exact",
    "save_every": 0, "save_prefix": "loras/streamcache_lora", "lr_schedule": "constant", "warmup_steps": 0,
    "timestep_sampling": "uniform", "noise_offset": 0.0, "val_dataset": None, "val_every": 0, "max_grad_norm": 0.0,
    "ema_decay": 0.0, "min_snr_gamma": 0.0, "train_layers": "", "min_timestep": 0, "max_timestep": 1000,
    "lora_alpha": 1.0, "val_split": 0.0, "loss_target": "clean latent", "multires_noise_iterations": 0,
    "multires_noise_discount": 0.3, "sample_count": 0, "sample_every": 0, "sample_steps": 20, "sample_cfg": 1.0,
    "sample_prompt": None, "sample_negative": None, "debiased_estimation": False,
    "sample_sampler": "euler", "sample_scheduler": "simple", "scale_v_pred_loss": False, "sample_width": 0,
    "sample_height": 0, "sample_clip": None, "sample_texts": "",
    "sample_seed": -1, "network_dropout": 0.0, "rank_dropout": 0.0, "module_dropout": 0.0, "optimizer_args": "",
    "ip_noise_gamma": 0.0, "v_pred_like_loss": 0.0, "noise_offset_random_strength": False,
    "ip_noise_gamma_random_strength": False,
}
SIZES = [(64, 64)] * 4 + [(64, 96)] * 2  # (height, width)


def _module(pack: ModuleType, name: str) -> ModuleType:
    return importlib.import_module(f"{pack.__name__}.{name}")


@pytest.fixture(scope="module")
def node(pack: ModuleType) -> type:
    return _module(pack, "nodes.train_lora").TrainLoRA


@pytest.fixture(scope="module")
def dataset(pack: ModuleType, comfy_nodes: ModuleType, models: tuple, handles: ModuleType,
            tmp_path_factory: pytest.TempPathFactory) -> Any:
    """A cache with dataset "train" (6 samples, 2 buckets) and an empty dataset "empty"; returns its handle."""
    _, clip, vae = models
    root = tmp_path_factory.mktemp("train_lora") / "cache"
    write_comfy_encoded(pack, comfy_nodes, clip, vae, root, SIZES, seed=0,
                        caption="a photo of test pattern number {}", extra={"empty": lambda _cls, _samples: []})
    return handles.StreamDatasetHandle(str(root), "train")


def _train(node: type, model: Any, dataset: Any, **options: Any) -> Any:
    with torch.inference_mode():  # ComfyUI executes every node under inference mode
        return node.execute(model, dataset, **{**FAST, **options})


def _loader_threads() -> list[str]:
    return [t.name for t in threading.enumerate() if t.name.startswith("dataset_cache-loader")]


def _eval_loss(model: Any, latents: list[torch.Tensor], conds: list[Any]) -> float:
    """Denoising loss of ``model`` at fixed sigmas and noise, over every sample (x0 prediction vs. latent)."""
    import comfy.model_management
    import comfy.sampler_helpers
    import comfy.samplers

    comfy.model_management.load_models_gpu([model])
    base = model.model
    gen = torch.Generator().manual_seed(123)
    total, count = 0.0, 0
    with torch.no_grad():
        for latent, cond in zip(latents, conds):
            x0 = base.process_latent_in(latent.float())
            for percent in (0.2, 0.5, 0.8):
                sigma = torch.tensor([base.model_sampling.percent_to_sigma(percent)])
                noise = torch.randn(x0.shape, generator=gen)
                xt = base.model_sampling.noise_scaling(sigma, noise, x0)
                encoded = comfy.samplers.encode_model_conds(
                    base.extra_conds, comfy.sampler_helpers.convert_cond(cond), noise, torch.device("cpu"), "positive")
                kwargs = {k: v.process_cond(batch_size=1, area=None).cond
                          for k, v in encoded[0]["model_conds"].items()}
                pred = base.apply_model(xt, sigma, **kwargs)
                total += torch.nn.functional.mse_loss(pred.float(), x0).item()
                count += 1
    return total / count


# ------------------------------------------------------------------------------------------------------ schema
def test_schema_matches_the_builtin_options(node: type) -> None:
    from comfy.weight_adapter import adapter_maps

    schema = node.GET_SCHEMA()
    info = node.GET_NODE_INFO_V1()  # what ComfyUI's /object_info serves: the schema finalizes
    assert info["output"] == ["LORA_MODEL", "LOSS_MAP", "INT", "LATENT"]
    assert all(i.tooltip for i in schema.inputs)
    assert schema.node_id == "StreamCache_TrainLoRA"
    assert schema.display_name == "Train LoRA (Stream Cache)"
    assert schema.category == "StreamCache"
    assert not schema.is_input_list
    inputs = {i.id: i for i in schema.inputs}
    assert list(inputs) == ["model", "dataset", *FAST]
    assert inputs["dataset"].get_io_type() == "STREAM_DATASET"
    assert inputs["algorithm"].options == list(adapter_maps)
    assert "[None]" in inputs["existing_lora"].options
    assert [o.get_io_type() for o in schema.outputs] == ["LORA_MODEL", "LOSS_MAP", "INT", "LATENT"]
    seed = info["input"]["required"]["seed"]
    assert seed[1]["control_after_generate"] == "fixed"  # the front end would randomize any other `seed`
    # expert inputs fold away in the new front end; what the built-in node shows stays in view
    assert {i.id for i in schema.inputs if i.advanced} == {"checkpoint_depth", "offloading", "lora_dtype",
                                                           "prefetch_batches", "loader_threads",
                                                           "quantized_backward", "bypass_mode",
                                                           "masked_loss", "unmasked_weight", "stream_blocks",
                                                           "allow_fp8", "checkpoint_mode", "save_every",
                                                           "save_prefix", "timestep_sampling", "noise_offset",
                                                           "val_every", "ema_decay", "min_snr_gamma",
                                                           "train_layers", "min_timestep", "max_timestep",
                                                           "lora_alpha", "loss_target",
                                                           "multires_noise_iterations", "multires_noise_discount",
                                                           "sample_every", "sample_steps", "sample_cfg",
                                                           "debiased_estimation", "sample_sampler",
                                                           "sample_scheduler", "scale_v_pred_loss",
                                                           "sample_width", "sample_height", "sample_texts",
                                                           "sample_seed", "network_dropout", "rank_dropout",
                                                           "module_dropout", "optimizer_args", "ip_noise_gamma",
                                                           "v_pred_like_loss", "noise_offset_random_strength",
                                                           "ip_noise_gamma_random_strength"}
    # added after 0.1.0: optional with the behaviour of before, so saved workflows and API prompts run unchanged
    for name in ("quantized_backward", "bypass_mode"):
        assert inputs[name].optional and inputs[name].default is False and name in info["input"]["optional"]
    for name, default in (("masked_loss", True), ("unmasked_weight", 0.1)):  # no effect on a dataset without masks
        assert inputs[name].optional and inputs[name].default == default and name in info["input"]["optional"]
    assert (inputs["unmasked_weight"].min, inputs["unmasked_weight"].max) == (0.0, 1.0)
    for name, default in (("caption_dropout", 0.0), ("reg_ratio", 1.0), ("reg_weight", 1.0)):  # #16
        assert inputs[name].optional and inputs[name].default == default and name in info["input"]["optional"]
    assert inputs["reg_dataset"].optional and inputs["reg_dataset"].get_io_type() == "STREAM_DATASET"
    # #25: the memory plan; a prompt without these inputs runs 'auto', which only changes where memory goes
    for name, default in (("memory", "auto"), ("stream_blocks", 0), ("allow_fp8", False)):
        assert inputs[name].optional and inputs[name].default == default and name in info["input"]["optional"]
    assert inputs["memory"].options == ["auto", "auto + keep blocks whole", "no offload", "stream blocks",
                                        "stream blocks + host activations"]
    assert (inputs["checkpoint_depth"].default, inputs["checkpoint_depth"].min) == (0, 0)  # 0: no note
    # #26: one device (or a CPU) trains exactly as before; several GPUs data-parallel
    assert inputs["devices"].optional and inputs["devices"].default == "auto" and "devices" in info["input"]["optional"]
    # a prompt without it checkpoints exactly as before; "fast" is opt-in
    assert inputs["checkpoint_mode"].optional and inputs["checkpoint_mode"].default == "exact"
    assert inputs["checkpoint_mode"].options == ["exact", "fast"] and "checkpoint_mode" in info["input"]["optional"]
    # a prompt without them saves nothing during the run, as before
    for name, default in (("save_every", 0), ("save_prefix", "loras/streamcache_lora")):
        assert inputs[name].optional and inputs[name].default == default and name in info["input"]["optional"]
    # a prompt without them trains at learning_rate throughout, as before (and as ComfyUI's own Train LoRA)
    for name, default in (("lr_schedule", "constant"), ("warmup_steps", 0)):
        assert inputs[name].optional and inputs[name].default == default and name in info["input"]["optional"]
    assert inputs["lr_schedule"].options == ["constant", "cosine", "linear"]
    # a prompt without them draws ComfyUI's own trainer's timesteps and noise, as before
    for name, default in (("timestep_sampling", "uniform"), ("noise_offset", 0.0)):
        assert inputs[name].optional and inputs[name].default == default and name in info["input"]["optional"]
    assert inputs["timestep_sampling"].options == ["uniform", "logit-normal"]
    # a prompt without them validates nothing, as before
    assert inputs["val_dataset"].optional and inputs["val_dataset"].get_io_type() == "STREAM_DATASET"
    assert inputs["val_every"].optional and inputs["val_every"].default == 0
    assert "val_every" in info["input"]["optional"]
    # a prompt without it clips nothing, as before (and as ComfyUI's own Train LoRA)
    assert inputs["max_grad_norm"].optional and inputs["max_grad_norm"].default == 0.0
    assert "max_grad_norm" in info["input"]["optional"] and not inputs["max_grad_norm"].advanced
    # a prompt without it outputs the last step's weights, as before
    assert inputs["ema_decay"].optional and inputs["ema_decay"].default == 0.0
    assert "ema_decay" in info["input"]["optional"]
    # a prompt without it weighs every row's loss alike, as before
    assert inputs["min_snr_gamma"].optional and inputs["min_snr_gamma"].default == 0.0
    assert "min_snr_gamma" in info["input"]["optional"]
    # a prompt without it gives every layer an adapter, as before
    assert inputs["train_layers"].optional and inputs["train_layers"].default == ""
    assert "train_layers" in info["input"]["optional"]
    # a prompt without them draws every timestep, as before
    for name, default in (("min_timestep", 0), ("max_timestep", 1000)):
        assert inputs[name].optional and inputs[name].default == default and name in info["input"]["optional"]
    # a prompt without them drops nothing in the adapters, as before (and as ComfyUI's own Train LoRA)
    for name in ("network_dropout", "rank_dropout", "module_dropout"):
        assert inputs[name].optional and inputs[name].default == 0.0 and name in info["input"]["optional"]
        assert (inputs[name].min, inputs[name].max) == (0.0, 0.9)
    # a prompt without it makes the optimizer with its defaults, as before (and as ComfyUI's own Train LoRA)
    assert inputs["optimizer_args"].optional and inputs["optimizer_args"].default == ""
    assert "optimizer_args" in info["input"]["optional"]
    # a prompt without it noises the input as the target, as before (and as ComfyUI's own Train LoRA)
    assert inputs["ip_noise_gamma"].optional and inputs["ip_noise_gamma"].default == 0.0
    assert "ip_noise_gamma" in info["input"]["optional"]
    # a prompt without it weighs the loss as before
    assert inputs["v_pred_like_loss"].optional and inputs["v_pred_like_loss"].default == 0.0
    assert "v_pred_like_loss" in info["input"]["optional"]
    # a prompt without them noises with the offset and perturbation as set, as before
    for name in ("noise_offset_random_strength", "ip_noise_gamma_random_strength"):
        assert inputs[name].optional and inputs[name].default is False and name in info["input"]["optional"]


# ----------------------------------------------------------------------------------------------------- training
@pytest.fixture(scope="module")
def trained(node: type, models: tuple, dataset: Any) -> Any:
    """One real run: 20 steps, two buckets, seed 7 (the loss curve and the LoRA are checked by several tests)."""
    return _train(node, models[0], dataset, steps=STEPS)


@pytest.fixture(scope="module")
def untrained(node: type, models: tuple, dataset: Any) -> list[float]:
    """The same run at the smallest learning rate: the same batches, sigmas and noise, on (nearly) the base model."""
    return _train(node, models[0], dataset, steps=STEPS, learning_rate=1e-7).result[1]["loss"]


def test_loss_falls(trained: Any, untrained: list[float]) -> None:
    """Raw losses swing by 100× with the random sigma of each step, so each step's loss is divided by the loss the
    untrained model has on the very same batch, sigma and noise: that ratio starts at 1 and must fall."""
    lora, loss_map, steps = trained.result[:3]
    losses = loss_map["loss"]
    assert steps == STEPS and len(losses) == STEPS
    assert all(torch.isfinite(torch.tensor(losses)))
    assert losses[0] == pytest.approx(untrained[0], rel=1e-4)  # step 1 runs before any update: same model
    ratio = [a / b for a, b in zip(losses, untrained)]
    first, last = sum(ratio[:5]) / 5, sum(ratio[-5:]) / 5
    assert last < 0.8 * first, ratio


def test_trained_lora_lowers_a_fixed_evaluation_loss(trained: Any, models: tuple, dataset: Any,
                                                      comfy_nodes: ModuleType, pack: ModuleType) -> None:
    """Independent of the training curve's noise: the same sigmas and noise before and after, via LoraModelLoader."""
    train_module = _module(pack, "nodes.training").nodes_train_module()
    reader, samples = dataset.open()
    try:
        values = reader.read([s.latent for s in samples] + [s.captions[0] for s in samples])
    finally:
        reader.close()
    latents = [v["samples"] for v in values[: len(samples)]]
    conds = values[len(samples):]
    model = models[0]
    with torch.inference_mode():
        (with_lora,) = train_module.LoraModelLoader.execute(model, trained.result[0], 1.0).result
        before = _eval_loss(model, latents, conds)
        after = _eval_loss(with_lora, latents, conds)
    assert after < 0.9 * before, (before, after)


def test_outputs_work_with_the_builtin_lora_nodes(trained: Any, models: tuple, pack: ModuleType,
                                                   comfy_folders: Path, caplog: pytest.LogCaptureFixture) -> None:
    import comfy.lora
    import comfy.utils
    import folder_paths

    lora, loss_map, steps = trained.result[:3]
    assert lora and all(t.device.type == "cpu" and not t.requires_grad for t in lora.values())
    assert {k.rsplit(".", 2)[-2] if k.endswith(".weight") else k.rsplit(".", 1)[-1] for k in lora} == {
        "lora_up", "lora_down", "alpha", "diff", "diff_b"}
    model = models[0]
    with caplog.at_level(logging.WARNING):
        patches = comfy.lora.load_lora(lora, comfy.lora.model_lora_keys_unet(model.model, {}))
    assert "lora key not loaded" not in caplog.text
    assert len(patches) > 0
    train_module = _module(pack, "nodes.training").nodes_train_module()
    train_module.SaveLoRA.execute(lora, "loras/streamcache_test", steps)
    saved = sorted(Path(folder_paths.get_output_directory(), "loras").glob(f"streamcache_test_{steps}_steps_*"))
    assert saved, "SaveLoRA wrote no file"
    reloaded = comfy.utils.load_torch_file(str(saved[-1]))
    assert set(reloaded) == set(lora)
    assert all(torch.equal(reloaded[k], lora[k]) for k in lora)
    train_module.LossGraphNode.execute(loss_map, "streamcache_loss")  # draws the chart without error


def test_ui_carries_the_curve_and_a_summary(trained: Any) -> None:
    ui = trained.ui
    assert ui["loss"] == trained.result[1]["loss"]
    (text,) = ui["text"]
    assert text.startswith("dataset 'train' (6 samples): trained 20 steps")
    assert "samples/s" in text and "[4, 8, 8]" in text and "[4, 8, 12]" in text


STARTUP_PHASES = ["data", "model", "memory plan", "loader", "model to device", "garbage collection", "first batch",
                  "first step"]


def test_the_summary_says_where_the_time_before_the_first_step_went(trained: Any) -> None:
    """Every phase from the node's call to its first step, in the order they run, with its seconds; they add up to
    the total named (each is rounded to 0.1 s)."""
    (text,) = trained.ui["text"]
    found = re.search(r"first step after (\d+\.\d) s \(([^)]*)\)", text)
    assert found, text
    phases = [part.rsplit(" ", 2) for part in found.group(2).split(", ")]
    assert [name for name, _seconds, unit in phases] == STARTUP_PHASES and {unit for *_, unit in phases} == {"s"}
    assert abs(sum(float(seconds) for _name, seconds, _unit in phases) - float(found.group(1))) <= 0.05 * 9


def test_each_phase_before_the_first_step_is_timed_where_it_runs(pack: ModuleType, models: tuple, dataset: Any,
                                                                monkeypatch: pytest.MonkeyPatch) -> None:
    """A memory probe and a first batch made slow on purpose show in their own phases; the phases end before the
    first step is reported."""
    training = _module(pack, "nodes.training")
    memory = _module(pack, "nodes.training.memory")
    run = _module(pack, "nodes.training.run")
    delay = 0.3
    real_measure, real_counted = memory.measure, run.counted

    def slow_measure(*args: Any, **kwargs: Any) -> Any:
        time.sleep(delay)
        return real_measure(*args, **kwargs)

    def slow_first_batch(*args: Any, **kwargs: Any) -> Any:
        batches = real_counted(*args, **kwargs)
        first = next(batches)
        time.sleep(delay)  # inside the loop's first next()
        yield first
        yield from batches

    monkeypatch.setattr(memory, "measure", slow_measure)
    monkeypatch.setattr(run, "counted", slow_first_batch)
    reported: list[float] = []
    fields = {f.name for f in dataclasses.fields(training.TrainSettings)}
    settings = training.TrainSettings(**{**{k: v for k, v in FAST.items() if k in fields}, "steps": 2})
    reader, samples = dataset.open()
    try:
        start = time.perf_counter()
        with torch.inference_mode():
            result = training.train_lora(models[0], reader, samples, settings,
                                         on_step=lambda _report: reported.append(time.perf_counter() - start))
    finally:
        reader.close()
    assert list(result.startup) == STARTUP_PHASES
    assert all(seconds >= 0 for seconds in result.startup.values())
    assert result.startup["memory plan"] >= delay and result.startup["first batch"] >= delay
    assert sum(result.startup.values()) <= reported[0]


def test_same_seed_same_run(node: type, models: tuple, dataset: Any) -> None:
    a = _train(node, models[0], dataset, steps=3)
    b = _train(node, models[0], dataset, steps=3)
    c = _train(node, models[0], dataset, steps=1, seed=8)
    assert a.result[1]["loss"] == b.result[1]["loss"]
    assert all(torch.equal(a.result[0][k], b.result[0][k]) for k in a.result[0])
    assert a.result[1]["loss"][:1] != c.result[1]["loss"]


def test_defaults_bf16_checkpointing_and_accumulation(node: type, models: tuple, dataset: Any) -> None:
    """The node's default dtypes (bf16 autocast, bf16 LoRA) and gradient checkpointing, two batches per step."""
    out = _train(node, models[0], dataset, steps=1, grad_accumulation_steps=2, training_dtype="bf16",
                 lora_dtype="bf16", gradient_checkpointing=True, prefetch_batches=0)
    lora, loss_map, steps = out.result[:3]
    assert steps == 1 and len(loss_map["loss"]) == 1
    assert all(torch.isfinite(torch.tensor(loss_map["loss"])))
    assert {t.dtype for t in lora.values()} == {torch.bfloat16}
    assert any(t.abs().sum() > 0 for k, t in lora.items() if k.endswith("lora_up.weight"))  # it did train


def test_bypass_mode_trains_the_same_lora_through_forward_hooks(pack: ModuleType, node: type, models: tuple,
                                                              dataset: Any, monkeypatch: pytest.MonkeyPatch) -> None:
    """bypass_mode (ComfyUI's, for quantized weights that cannot be patched) applies the adapters as forward hooks:
    the same seed trains the same LoRA as weight patching, the base model is untouched, no hook is left.

    What "the same" can mean in fp32, and the tolerances that follow from it:

    * Step 1's loss is bit-identical: a new LoRA's ``down`` matrix starts at zero, so the patched weight is
      ``W + up @ 0 = W`` exactly and the hooked forward adds ``up(0(x)) = 0`` exactly; both compute ``W x`` with the
      same kernels.
    * After that the two differ only in the association of fp32 sums: patching reduces ``dL/dW = dYᵀX`` first and
      multiplies by ``up`` after, a hook multiplies ``dY`` by ``up`` first. Each order has the norm-wise rounding bound
      ``‖ΔC‖ ≤ γ_n ‖A‖‖B‖`` (Higham, ch. 3) with ``γ_n ≈ n·2⁻²⁴`` and ``n`` the reduction length: at most
      3×3×320 = 2880 (this UNet's widest convolution) plus 128 tokens, so ``γ_n < 2e-4`` and the gradients agree to
      that, relative to the norms of their factors. SGD turns a gradient difference into the same relative weight
      difference (the update is ``lr × g``), so each trained tensor's change agrees to ``1e-3`` in norm: ``γ_n`` with a
      factor 5 for the cancellation of ``‖A‖‖B‖`` against ``‖AB‖``. AdamW would not do: it divides each gradient by
      its own running size, so an element whose gradient is rounding noise (near zero) gets a full-size step of
      random sign whatever the order, and an element-wise comparison then depends on the CPU's BLAS kernels (a
      1.2e-5 miss on an AMD EPYC was the flake this replaced).
    """
    training = _module(pack, "nodes.training")
    hooks: list[int] = []
    step = training.loop.StepLoop._optimizer_step

    def record(self: Any, *args: Any) -> None:  # modules whose forward is replaced by a hook while training runs
        hooks.append(sum("forward" in vars(m) for m in self.mp.model.diffusion_model.modules()))
        step(self, *args)

    monkeypatch.setattr(training.loop.StepLoop, "_optimizer_step", record)
    model = models[0]
    before = {k: v.clone() for k, v in model.model.diffusion_model.state_dict().items()}
    sgd = {"optimizer": "SGD", "learning_rate": 0.05, "steps": 3}
    start = _train(node, model, dataset, **{**sgd, "steps": 1, "learning_rate": 1e-30}).result[0]  # the initial LoRA
    patched = _train(node, model, dataset, **sgd)
    assert hooks[1:] == [0, 0, 0]
    hooked = _train(node, model, dataset, **sgd, bypass_mode=True)
    assert min(hooks[4:]) > 10, hooks
    assert sorted(hooked.result[0]) == sorted(patched.result[0])
    assert hooked.result[1]["loss"][0] == patched.result[1]["loss"][0]  # step 1: the very same forward
    assert hooked.result[1]["loss"] == pytest.approx(patched.result[1]["loss"], rel=1e-3)
    moved = 0
    for key, want in patched.result[0].items():
        change = (want - start[key]).norm()
        moved += bool(change > 0)
        assert (hooked.result[0][key] - want).norm() <= 1e-3 * change, key
    assert moved >= len(patched.result[0]) // 2  # it did train: most tensors moved (the others are diff/alpha)
    after = model.model.diffusion_model.state_dict()
    assert all(torch.equal(before[k], after[k]) for k in before)
    assert not [n for n, m in model.model.diffusion_model.named_modules() if "forward" in vars(m)]


def test_quantized_backward_is_set_for_the_run_only(pack: ModuleType, node: type, models: tuple, dataset: Any,
                                                     monkeypatch: pytest.MonkeyPatch) -> None:
    """quantized_backward sets ComfyUI's training_fp8_bwd switch (read by its quantized layers' backward) while
    this node trains, as the built-in node does, and puts the previous value back afterwards."""
    import comfy.model_management

    training = _module(pack, "nodes.training")
    seen: list[bool] = []
    step = training.loop.StepLoop._optimizer_step

    def record(self: Any, *args: Any) -> None:
        seen.append(comfy.model_management.training_fp8_bwd)
        step(self, *args)

    monkeypatch.setattr(training.loop.StepLoop, "_optimizer_step", record)
    assert comfy.model_management.training_fp8_bwd is False
    _train(node, models[0], dataset, steps=2, quantized_backward=True)
    assert seen == [True, True] and comfy.model_management.training_fp8_bwd is False
    _train(node, models[0], dataset, steps=1)
    assert seen[-1] is False


def test_existing_lora_is_continued(node: type, models: tuple, dataset: Any, trained: Any, tmp_path: Path,
                                    monkeypatch: pytest.MonkeyPatch) -> None:
    """A LoRA saved by SaveLoRA is loaded as the starting point; its step count (from the file name) is added."""
    import folder_paths
    from safetensors.torch import save_file

    lora = trained.result[0]
    save_file(lora, str(tmp_path / f"streamcache_{STEPS}_steps_00001_.safetensors"))
    monkeypatch.setitem(folder_paths.folder_names_and_paths, "loras",
                        ([str(tmp_path)], set(folder_paths.supported_pt_extensions)))
    out = _train(node, models[0], dataset, steps=1, learning_rate=1e-7,
                 existing_lora=f"streamcache_{STEPS}_steps_00001_.safetensors")
    continued, _, steps = out.result[:3]
    assert steps == STEPS + 1
    assert set(continued) == set(lora)
    # every tensor, including the norm/bias deltas and alpha that ComfyUI's own setup would reset
    assert all(torch.allclose(continued[k], lora[k], atol=1e-5) for k in lora)
    with pytest.raises(ValueError, match="existing_lora 'missing.safetensors' is not in the loras folder"):
        _train(node, models[0], dataset, existing_lora="missing.safetensors")


def test_continuing_a_lora_reproduces_an_uninterrupted_run(node: type, models: tuple, dataset: Any, tmp_path: Path,
                                                           monkeypatch: pytest.MonkeyPatch) -> None:
    """3 steps, save, 3 more from the saved LoRA == 6 steps at once: the continued run picks up the batch order,
    noise and timesteps where the first stopped (SGD keeps no optimizer state, so nothing else differs)."""
    import folder_paths
    from safetensors.torch import save_file

    opts = {"optimizer": "SGD", "learning_rate": 0.05, "grad_accumulation_steps": 2, "batch_size": 1}
    whole = _train(node, models[0], dataset, steps=6, **opts).result
    first = _train(node, models[0], dataset, steps=3, **opts).result
    save_file(first[0], str(tmp_path / "half_3_steps_00001_.safetensors"))
    monkeypatch.setitem(folder_paths.folder_names_and_paths, "loras",
                        ([str(tmp_path)], set(folder_paths.supported_pt_extensions)))
    rest = _train(node, models[0], dataset, steps=3, existing_lora="half_3_steps_00001_.safetensors", **opts).result
    assert rest[2] == 6
    assert first[1]["loss"] == pytest.approx(whole[1]["loss"][:3], rel=1e-5)
    assert rest[1]["loss"] == pytest.approx(whole[1]["loss"][3:], rel=1e-4)
    assert all(torch.allclose(rest[0][k], whole[0][k], atol=1e-5) for k in whole[0])
    # and a fresh run from step 0 sees other batches than the continued one
    fresh = _train(node, models[0], dataset, steps=3, **opts).result
    assert fresh[1]["loss"] != pytest.approx(rest[1]["loss"], rel=1e-4)


def _summary(out: Any) -> str:
    (text,) = out.ui["text"] if isinstance(out.ui, dict) else out.ui.as_dict()["text"]
    return text


@pytest.mark.parametrize(("optimizer", "rate"), [("AdamW", 0.01), ("Prodigy", 1.0), ("Lion", 1e-3)])
def test_continuing_a_lora_with_its_training_state_equals_one_run_bit_for_bit(
        node: type, models: tuple, dataset: Any, lora_folder: Path, optimizer: str, rate: float) -> None:
    """#27 item 10: 3 steps, Save LoRA Weights, 3 more from the saved file == 6 steps at once, bit for bit (CPU,
    fp32): the optimizer's moments, the step count and the sampler's position come back from the training state
    Train LoRA saved beside the LoRA (AdamW used to start fresh: max abs diff 0.005); Prodigy's step size too,
    which it keeps in its parameter groups."""
    opts = {"optimizer": optimizer, "learning_rate": rate, "grad_accumulation_steps": 2, "batch_size": 2}
    whole = _train(node, models[0], dataset, steps=6, **opts).result
    first = _train(node, models[0], dataset, steps=3, **opts)
    assert "training state saved as streamcache_train_state/" in _summary(first)
    name = save_lora(first.result[0], first.result[2], "loras/half")
    rest = _train(node, models[0], dataset, steps=3, existing_lora=name, **opts)
    lora, losses, steps = rest.result[:3]
    assert steps == 6
    assert first.result[1]["loss"] + losses["loss"] == whole[1]["loss"]
    assert set(lora) == set(whole[0]) and all(torch.equal(lora[k], whole[0][k]) for k in whole[0])
    summary = _summary(rest)
    assert f"continued {name!r} from its training state (3 steps): {optimizer} state restored, the batch order " \
           "where it stopped" in summary and "NOTE" not in summary


def test_lora_alpha_scales_the_new_adapters_and_a_continued_lora_keeps_its_own(
        node: type, models: tuple, dataset: Any, lora_folder: Path) -> None:
    """One SGD step from zero downs (ComfyUI draws the ups, zeroes the downs): the gradient of a down matrix is the
    scale alpha / rank times what it is at alpha 1, and 16 is a power of two, so the downs trained at lora_alpha 16
    are exactly 16 times those at 1 (the ups and alphas get no gradient yet: the difference is 0; the norm and bias
    diffs no scale). The file holds 16 in every alpha; continuing it at another lora_alpha keeps 16 and says so;
    OFT refuses another alpha."""
    sgd = {"optimizer": "SGD", "learning_rate": 0.05, "steps": 1, "batch_size": 1}
    one = _train(node, models[0], dataset, **sgd).result[0]
    sixteen = _train(node, models[0], dataset, lora_alpha=16.0, **sgd)
    lora = sixteen.result[0]
    downs = [k for k in lora if k.endswith("lora_down.weight")]
    assert downs and any(one[k].abs().max() > 0 for k in downs)
    assert all(torch.equal(lora[k], 16 * one[k]) for k in downs)
    assert all(torch.equal(lora[k], one[k]) for k in lora if not k.endswith(("lora_down.weight", ".alpha")))
    alphas = [k for k in lora if k.endswith(".alpha")]
    assert alphas and all(float(lora[k]) == 16.0 for k in alphas) and all(float(one[k]) == 1.0 for k in alphas)
    name = save_lora(lora, sixteen.result[2], "loras/half")
    continued = _train(node, models[0], dataset, lora_alpha=4.0, existing_lora=name, **sgd)
    # ComfyUI's adapters train their alpha too (every adapter parameter requires a gradient): a step moves it by
    # a small amount from where it starts, 16 when kept, 4 had lora_alpha replaced it
    assert all(abs(float(continued.result[0][k]) - 16.0) < 1.0 for k in alphas)
    assert (f"NOTE: existing_lora {name!r} keeps the alpha it was trained with (16), not lora_alpha 4"
            in _summary(continued))
    with pytest.raises(ValueError, match="lora_alpha scales LoRA, LoHa, LoKr adapters; OFT's alpha is no scale"):
        _train(node, models[0], dataset, algorithm="OFT", lora_alpha=8.0, **sgd)


def test_val_split_holds_sources_out_of_training_and_measures_them(node: type, models: tuple,
                                                                    dataset: Any) -> None:
    """val_split 0.3 of the 6-sample dataset: 2 samples held out, measured before the first step and after the
    last (a validation loss on images the run never trained on), the run's rows from the other 4; the same two on
    every run. With a val_dataset too, refused naming both."""
    out = _train(node, models[0], dataset, steps=2, batch_size=1, val_split=0.3)
    lora, losses, _steps = out.result[:3]
    summary = _summary(out)
    assert summary.startswith("dataset 'train' (4 samples): trained 2 steps")  # the other 4 train
    assert "val_split 0.3: 2 source(s) held out of training for the validation loss (2 samples:" in summary
    assert "validation loss (2 images, the same noise and timesteps each time)" in summary
    assert [step for step, _ in losses["val_loss"]] == [0, 2]
    again = _summary(_train(node, models[0], dataset, steps=1, batch_size=1, val_split=0.3))
    held = re.search(r"\(2 samples: ([^)]*)\)", summary)
    assert held and f"(2 samples: {held.group(1)})" in again
    with pytest.raises(ValueError, match="val_split 0.3 holds out images of the dataset .* use one"):
        _train(node, models[0], dataset, steps=1, val_split=0.3, val_dataset=dataset)


def test_prodigy_trains_and_a_rate_far_below_one_is_named(node: type, models: tuple, dataset: Any) -> None:
    """Prodigy finds its own step size: at rate 1.0 it trains (the LoRA moves from where the same seed starts it,
    and its summary has no note); at the node's default rate the summary says to set 1.0."""
    start = _train(node, models[0], dataset, steps=1, optimizer="SGD", learning_rate=1e-30).result[0]
    out = _train(node, models[0], dataset, steps=3, optimizer="Prodigy", learning_rate=1.0)
    moved = [k for k, v in out.result[0].items() if not torch.equal(v, start[k])]
    assert len(moved) >= len(start) // 2 and "NOTE" not in _summary(out)
    found = re.search(r"Prodigy's step size at the last step: d = ([0-9.e+-]+), so Adam's rate was learning_rate "
                      r"× d = ([0-9.e+-]+)", _summary(out))
    assert found and float(found.group(1)) >= 1e-6 and found.group(1) == found.group(2)  # from d0 up; rate 1
    slow = _train(node, models[0], dataset, steps=1, optimizer="Prodigy", learning_rate=0.0005)
    assert ("NOTE: optimizer Prodigy finds its own step size and learning_rate 0.0005 multiplies it: set "
            "learning_rate to 1.0") in _summary(slow)


def test_a_lora_without_a_training_state_continues_as_before_and_says_the_optimizer_starts_fresh(
        node: type, models: tuple, dataset: Any, lora_folder: Path) -> None:
    """#27 items 7 and 10: a LoRA saved before training states existed (here: its state removed) continues from
    the step count in its name, with a note; a name without a step count restarts the batch order, with a note."""
    first = _train(node, models[0], dataset, steps=2)
    for state in (lora_folder / "streamcache_train_state").iterdir():
        state.unlink()
    name = save_lora(first.result[0], 2, "loras/half")
    out = _train(node, models[0], dataset, steps=1, existing_lora=name)
    assert out.result[2] == 3
    assert (f"NOTE: existing_lora {name!r}: it has no saved training state (trained before Train LoRA saved one, "
            "by another trainer, or its state was removed): continuing at step 2 from its name, but AdamW starts "
            "fresh") in _summary(out)
    for state in (lora_folder / "streamcache_train_state").iterdir():
        state.unlink()
    unnamed = save_lora(first.result[0], None, "loras/renamed")
    out = _train(node, models[0], dataset, steps=1, existing_lora=unnamed)
    assert out.result[2] == 1
    assert "its name carries no step count (Save LoRA Weights names files <prefix>_<steps>_steps_<counter>_): the " \
           "batch order, noise and timesteps start again from step 0 and AdamW starts fresh" in _summary(out)


def test_a_training_state_that_does_not_fit_is_named_and_the_optimizer_starts_fresh(
        node: type, models: tuple, dataset: Any, lora_folder: Path) -> None:
    """A state file at the LoRA's digest that is not what it claims (moments of another shape; NaN values) never
    reaches the optimizer: the node names the file and the reason and trains on with a fresh optimizer."""
    from safetensors import safe_open
    from safetensors.torch import load_file, save_file

    first = _train(node, models[0], dataset, steps=2)
    name = save_lora(first.result[0], 2, "loras/half")
    (path,) = (lora_folder / "streamcache_train_state").iterdir()
    tensors = load_file(str(path))
    with safe_open(str(path), "pt") as f:
        metadata = f.metadata()
    key = next(k for k in tensors if k.startswith("exp_avg/") and tensors[k].ndim == 2)
    save_file({**tensors, key: tensors[key].reshape(1, -1)}, str(path), metadata)  # moments of another shape
    out = _train(node, models[0], dataset, steps=1, existing_lora=name)
    assert out.result[2] == 3
    assert f"NOTE: existing_lora {name!r}: its saved optimizer state does not fit this run (its exp_avg of " \
           f"{key.split('/', 1)[1]!r} has shape" in _summary(out)
    save_file({**tensors, key: torch.full_like(tensors[key], float("nan"))}, str(path), metadata)
    out = _train(node, models[0], dataset, steps=1, existing_lora=name)
    assert f"its training state {path.name} cannot be used (tensor {key!r} holds NaN or infinite values)" \
        in _summary(out)


# ------------------------------------------------------------------------------------------- saves during a run
_CONTINUED = {"optimizer": "AdamW", "learning_rate": 0.01, "grad_accumulation_steps": 2, "batch_size": 2}
"""Settings whose continuation is checked bit for bit: a stateful optimizer, batches that span two buckets."""


def _saves(lora_folder: Path) -> list[str]:
    return sorted(p.name for p in (lora_folder / "loras").glob("streamcache_lora_*.safetensors"))


@pytest.fixture(scope="module")
def whole_run(node: type, models: tuple, dataset: Any) -> Any:
    """4 steps of :data:`_CONTINUED` at once, nothing saved: what every save must continue into."""
    return _train(node, models[0], dataset, steps=4, **_CONTINUED).result


def test_saves_every_n_steps_are_what_save_lora_writes_and_continue_exactly(
        node: type, models: tuple, dataset: Any, lora_folder: Path, whole_run: Any) -> None:
    """save_every 3 of 4 steps: a file at step 3, named as Save LoRA Weights names it, whose continuation for 1 step
    is the uninterrupted run bit for bit (its training state was saved with it); saving changes nothing trained."""
    out = _train(node, models[0], dataset, steps=4, save_every=3, **_CONTINUED)
    lora, losses, _ = out.result[:3]
    assert losses == whole_run[1] and all(torch.equal(lora[k], whole_run[0][k]) for k in lora)
    assert _saves(lora_folder) == ["streamcache_lora_3_steps_00001_.safetensors"]
    assert re.search(r"saved the LoRA at step 3 \(training waited \d+\.\d s per save at most, writing took "
                     r"\d+\.\d s; the last, with its training state, as "
                     r"output/loras/streamcache_lora_3_steps_00001_\.safetensors\)", _summary(out))
    assert len(list((lora_folder / "streamcache_train_state").iterdir())) == 2  # the save's and the end's
    rest = _train(node, models[0], dataset, steps=1, existing_lora="streamcache_lora_3_steps_00001_.safetensors",
                  **_CONTINUED)
    assert rest.result[2] == 4 and rest.result[1]["loss"] == whole_run[1]["loss"][3:]
    assert all(torch.equal(rest.result[0][k], whole_run[0][k]) for k in lora)
    assert "from its training state (3 steps): AdamW state restored, the batch order where it stopped" \
        in _summary(rest)


def test_a_save_of_the_last_step_is_the_runs_state_written_once(node: type, models: tuple, dataset: Any,
                                                                 lora_folder: Path, whole_run: Any) -> None:
    """save_every 2 of 2 steps: the save is the run's end, so the run writes no second copy of its state; continuing
    the returned LoRA (the save, by content) for 2 steps is the 4-step run bit for bit."""
    out = _train(node, models[0], dataset, steps=2, save_every=2, **_CONTINUED)
    assert "training state saved as" not in _summary(out) and len(list((lora_folder / "streamcache_train_state"
                                                                         ).iterdir())) == 1
    rest = _train(node, models[0], dataset, steps=2, existing_lora=save_lora(out.result[0], 2, "loras/half"),
                  **_CONTINUED)
    assert rest.result[1]["loss"] == whole_run[1]["loss"][2:]
    assert all(torch.equal(rest.result[0][k], whole_run[0][k]) for k in whole_run[0])


def test_a_run_keeps_the_training_state_of_its_last_save_only(node: type, models: tuple, dataset: Any,
                                                            lora_folder: Path, whole_run: Any) -> None:
    """save_every 1 of 4 steps: four files, the last the node's own LoRA, and one training state (the last save's,
    which is the end's): a state per save would push other LoRAs' states out of the folder's 32. An earlier save
    continues as a LoRA without a state, and says so. A state the run did not create is never removed."""
    from safetensors.torch import load_file

    store = lora_folder / "streamcache_train_state"
    store.mkdir()
    foreign = store / ("0" * 32 + ".safetensors")
    foreign.write_bytes(b"another LoRA's state")
    out = _train(node, models[0], dataset, steps=4, save_every=1, **_CONTINUED)
    assert _saves(lora_folder) == [f"streamcache_lora_{i}_steps_0000{i}_.safetensors" for i in range(1, 5)]
    last = load_file(str(lora_folder / "loras" / "streamcache_lora_4_steps_00004_.safetensors"))
    assert set(last) == set(out.result[0]) and all(torch.equal(last[k], out.result[0][k]) for k in last)
    assert foreign.read_bytes() == b"another LoRA's state" and len(list(store.iterdir())) == 2
    early = _train(node, models[0], dataset, steps=1, existing_lora="streamcache_lora_2_steps_00002_.safetensors",
                   **_CONTINUED)
    assert "it has no saved training state" in _summary(early) and early.result[2] == 3


@pytest.fixture
def output_only(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    """ComfyUI's output folder for this test, and a ``loras`` model folder elsewhere (ComfyUI's default set-up: the
    output folder's ``loras/`` is no model folder)."""
    import folder_paths

    output, models = tmp_path / "output", tmp_path / "models_loras"
    (output / "loras").mkdir(parents=True)
    models.mkdir()
    monkeypatch.setattr(folder_paths, "output_directory", str(output))
    monkeypatch.setitem(folder_paths.folder_names_and_paths, "loras",
                        ([str(models)], set(folder_paths.supported_pt_extensions)))
    return output


def test_loras_saved_in_the_output_folder_are_offered_newest_first_and_continue_exactly(
        node: type, models: tuple, dataset: Any, output_only: Path, whole_run: Any) -> None:
    """A save lands in output/loras, which is no model folder: existing_lora offers it as ComfyUI names output files
    ("<path> [output]"), newest first, never a link or another kind of file, and continuing it by that name is the
    uninterrupted run bit for bit. With README's recipe (output/loras a model folder too) it is offered once."""
    import folder_paths

    older = output_only / "loras" / "old" / "older_2_steps_00001_.safetensors"
    older.parent.mkdir()
    older.write_bytes(b"not read: only listed")
    os.utime(older, (1_000_000_000, 1_000_000_000))
    (output_only / "loras" / "notes.txt").write_text("not a LoRA")
    elsewhere = output_only.parent / "elsewhere.safetensors"
    elsewhere.write_bytes(b"outside the output folder")
    (output_only / "loras" / "link.safetensors").symlink_to(elsewhere)
    (output_only / "loras" / "linked").symlink_to(output_only.parent, target_is_directory=True)
    _train(node, models[0], dataset, steps=4, save_every=3, **_CONTINUED)
    name = "loras/streamcache_lora_3_steps_00001_.safetensors [output]"
    options = [o for o in _existing_lora_options(node) if o.endswith(" [output]")]
    assert options == [name, "loras/old/older_2_steps_00001_.safetensors [output]"]
    rest = _train(node, models[0], dataset, steps=1, existing_lora=name, **_CONTINUED)
    assert rest.result[2] == 4 and rest.result[1]["loss"] == whole_run[1]["loss"][3:]
    assert all(torch.equal(rest.result[0][k], whole_run[0][k]) for k in whole_run[0])
    assert f"continued {name!r} from its training state (3 steps)" in _summary(rest)
    folder_paths.folder_names_and_paths["loras"][0].append(str(output_only / "loras"))
    options = _existing_lora_options(node)
    assert "streamcache_lora_3_steps_00001_.safetensors" in options and name not in options


def _existing_lora_options(node: type) -> list[str]:
    (entry,) = [i for i in node.GET_SCHEMA().inputs if i.id == "existing_lora"]
    return list(entry.options)


@pytest.mark.parametrize(("name", "why"), [
    ("../escape.safetensors [output]", "is not a .safetensors file under the output folder's loras/"),
    ("loras/../../escape.safetensors [output]", "is not a .safetensors file under the output folder's loras/"),
    ("/etc/escape.safetensors [output]", "is not a .safetensors file under the output folder's loras/"),
    ("images/x.safetensors [output]", "is not a .safetensors file under the output folder's loras/"),
    ("loras/x.ckpt [output]", "is not a .safetensors file under the output folder's loras/"),
    ("loras/gone.safetensors [output]", "does not exist (moved or deleted?)"),
    ("loras/link.safetensors [output]", "is a symbolic link, which is never followed out of the output folder"),
    ("loras/linked/elsewhere.safetensors [output]", "is a symbolic link, which is never followed"),
])
def test_an_output_lora_outside_its_folder_or_through_a_link_is_refused_by_name(
        node: type, models: tuple, dataset: Any, output_only: Path, name: str, why: str) -> None:
    elsewhere = output_only.parent / "elsewhere.safetensors"
    elsewhere.write_bytes(b"outside the output folder")
    (output_only / "loras" / "link.safetensors").symlink_to(elsewhere)
    (output_only / "loras" / "linked").symlink_to(output_only.parent, target_is_directory=True)
    with pytest.raises(ValueError, match=re.escape(f"existing_lora {name!r}") + ".*" + re.escape(why)):
        _train(node, models[0], dataset, steps=1, existing_lora=name)
    assert _loader_threads() == []


@pytest.mark.parametrize("options", [{"bypass_mode": True}, {"memory": "stream blocks", "stream_blocks": 2},
                                     {"lora_dtype": "bf16", "algorithm": "LoHa"}], ids=["bypass", "streamed", "loha"])
def test_a_save_is_the_lora_of_its_step_whatever_holds_the_weights(node: type, models: tuple, dataset: Any,
                                                                    lora_folder: Path, options: dict) -> None:
    """The adapters of bypass mode (forward hooks), of a run whose blocks' weights are streamed, and of another
    algorithm in bf16: the save after the last step is the node's LoRA, key for key and bit for bit."""
    from safetensors.torch import load_file

    out = _train(node, models[0], dataset, steps=2, save_every=2, **options)
    (name,) = _saves(lora_folder)
    saved = load_file(str(lora_folder / "loras" / name))
    lora = out.result[0]
    assert set(saved) == set(lora) and all(saved[k].dtype == lora[k].dtype and torch.equal(saved[k], lora[k])
                                           for k in lora)


# ---------------------------------------------------------------------------------------- the learning-rate schedule
def test_a_warmup_step_trains_at_its_share_of_the_learning_rate(node: type, models: tuple, dataset: Any) -> None:
    """SGD's update is the rate times the gradient: the first of 4 warm-up steps at 0.02 is the step of a run at
    0.02 / 4, bit for bit (a division by a power of two rounds nothing); a step at the full rate is another."""
    opts = {"optimizer": "SGD", "steps": 1}
    warm = _train(node, models[0], dataset, learning_rate=0.02, lr_schedule="cosine", warmup_steps=4, **opts)
    quarter = _train(node, models[0], dataset, learning_rate=0.02 / 4, **opts).result[0]
    full = _train(node, models[0], dataset, learning_rate=0.02, **opts).result[0]
    assert all(torch.equal(warm.result[0][k], quarter[k]) for k in quarter)
    assert not all(torch.equal(full[k], quarter[k]) for k in quarter)
    assert "; learning rate cosine from 0.02 over 1 step, 4 warm-up: 0.005 at step 1, 0.005 at step 1" \
        in _summary(warm)
    assert "learning rate" not in _summary(_train(node, models[0], dataset, **opts))  # constant: nothing to say


def test_each_steps_report_carries_the_rate_it_trained_at(pack: ModuleType, node: type, models: tuple, dataset: Any,
                                                          monkeypatch: pytest.MonkeyPatch) -> None:
    """The progress event (the node's live head) says each step's rate: linear over 4 steps after a warm-up of 2."""
    reports: list[Any] = []
    monkeypatch.setattr(_module(pack, "nodes.train_lora")._Events, "__call__", lambda self, r: reports.append(r))
    _train(node, models[0], dataset, steps=4, learning_rate=0.02, lr_schedule="linear", warmup_steps=2)
    assert [r.learning_rate for r in reports] == [0.01, 0.02, 0.02, 0.01]


_SCHEDULED = {**_CONTINUED, "lr_schedule": "cosine", "warmup_steps": 2}


def test_a_scheduled_run_continued_from_a_save_sets_the_rates_of_the_run_that_never_stopped(
        node: type, models: tuple, dataset: Any, lora_folder: Path) -> None:
    """Cosine after 2 warm-up steps, 5 steps, saved at step 3: continuing the save with the 2 steps it had left is the
    5-step run bit for bit (the schedule counts the save's 3 steps). Continuing it with steps 5 stretches the decay
    over 8 steps: the node says which rate step 4 now takes instead of the saved run's, and how to finish that."""
    whole = _train(node, models[0], dataset, steps=5, save_every=3, **_SCHEDULED).result
    (name,) = _saves(lora_folder)
    rest = _train(node, models[0], dataset, steps=2, existing_lora=name, **_SCHEDULED)
    assert rest.result[1]["loss"] == whole[1]["loss"][3:]
    assert all(torch.equal(rest.result[0][k], whole[0][k]) for k in whole[0])
    assert "NOTE" not in _summary(rest)
    assert "learning rate cosine from 0.01 over 5 steps, 2 warm-up: 0.0075 at step 4, 0.0025 at step 5" \
        in _summary(rest)  # (1 + cos(pi / 3)) / 2 and (1 + cos(2 pi / 3)) / 2 of 0.01
    longer = _summary(_train(node, models[0], dataset, steps=5, existing_lora=name, **_SCHEDULED))
    assert (f"NOTE: existing_lora {name!r}: step 4 trains at learning rate 0.00933, where the run that saved it "
            "would have used 0.0075 (it trained with cosine from 0.01 over 5 steps, 2 warm-up; this run has cosine "
            "from 0.01 over 8 steps, 2 warm-up: the 3 steps it had + steps 5); to finish its schedule exactly, set "
            "steps to 2") in longer
    constant = _summary(_train(node, models[0], dataset, steps=1, existing_lora=name, **_CONTINUED))
    assert "step 4 trains at learning rate 0.01, where the run that saved it would have used 0.0075" in constant
    assert "set steps to" not in constant  # another schedule: nothing to finish


def test_logit_normal_timesteps_and_a_noise_offset_train_otherwise_and_continue_exactly(
        node: type, models: tuple, dataset: Any, lora_folder: Path, whole_run: Any) -> None:
    """Both are drawn from each batch's own generator: the first step's loss is not the default run's (other sigmas
    and noise), and a save at step 3 of 5, continued for the 2 steps left, is the uninterrupted run bit for bit."""
    drawn = {**_CONTINUED, "timestep_sampling": "logit-normal", "noise_offset": 0.1}
    whole = _train(node, models[0], dataset, steps=5, save_every=3, **drawn).result
    assert whole[1]["loss"][0] != whole_run[1]["loss"][0]
    (name,) = _saves(lora_folder)
    rest = _train(node, models[0], dataset, steps=2, existing_lora=name, **drawn)
    assert rest.result[1]["loss"] == whole[1]["loss"][3:]
    assert all(torch.equal(rest.result[0][k], whole[0][k]) for k in whole[0])


def test_a_noise_offset_shifts_each_row_and_channel_of_the_drawn_noise(pack: ModuleType, models: tuple) -> None:
    """The trainer's own draw (what the loader's workers hand each batch): with noise_offset the noise minus the
    plain noise is one value per row and channel; the sigmas are those of the same timesteps."""
    loop = _module(pack, "nodes.training.loop")
    settings = _module(pack, "nodes.training.settings")
    draws = {}
    for offset in (0.0, 0.2):
        stand_in = types.SimpleNamespace(settings=settings.TrainSettings(seed=3, noise_offset=offset),
                                         _sampling_cpu=models[0].model.model_sampling, percent_span=(0.0, 1.0))
        stand_in.sigmas = types.MethodType(loop.StepLoop.sigmas, stand_in)
        draws[offset] = loop.StepLoop._draw(stand_in, (2, 4, 8, 8), 7)
    assert torch.equal(draws[0.0][0], draws[0.2][0])
    shift = (draws[0.2][1] - draws[0.0][1]).reshape(2, 4, -1)
    assert float((shift - shift[..., :1]).abs().max()) <= 1e-6  # rounding of noise + s - noise: ulps of |noise| < 8
    assert float(shift[..., 0].abs().min()) > 0


def test_a_random_strength_scales_each_rows_offset_by_its_own_uniform(pack: ModuleType, models: tuple) -> None:
    """The trainer's own draw with noise_offset_random_strength: the sigmas and plain noise of the draw without it,
    each row's shifts those of the plain offset times one factor in [0, 1) (the same for every channel of the row,
    to the rounding of noise + s - noise: 1e-6), the rows' factors differing."""
    loop = _module(pack, "nodes.training.loop")
    settings = _module(pack, "nodes.training.settings")
    draws = {}
    for offset, random in ((0.0, False), (0.2, False), (0.2, True)):
        chosen = settings.TrainSettings(seed=3, noise_offset=offset, noise_offset_random_strength=random)
        stand_in = types.SimpleNamespace(settings=chosen, _sampling_cpu=models[0].model.model_sampling,
                                         percent_span=(0.0, 1.0))
        stand_in.sigmas = types.MethodType(loop.StepLoop.sigmas, stand_in)
        draws[offset, random] = loop.StepLoop._draw(stand_in, (4, 4, 8, 8), 7)
    assert torch.equal(draws[0.0, False][0], draws[0.2, True][0])
    plain = (draws[0.2, False][1] - draws[0.0, False][1]).reshape(4, 4, -1)[..., 0]
    scaled = (draws[0.2, True][1] - draws[0.0, False][1]).reshape(4, 4, -1)
    assert float((scaled - scaled[..., :1]).abs().max()) <= 1e-6
    factors = (scaled[..., 0] * plain).sum(1) / (plain * plain).sum(1)
    torch.testing.assert_close(scaled[..., 0], factors[:, None] * plain, rtol=0, atol=1e-6)
    assert float(factors.min()) >= 0 and float(factors.max()) < 1 + 1e-5 and float(factors.std()) > 0.01


def _drawn_timesteps(pack: ModuleType, patcher: Any, shape: tuple[int, ...], batches: int,
                     **options: Any) -> list[float]:
    """The model timesteps of the sigmas the trainer's own draw gives ``batches`` batches (a stand-in loop with the
    model's sampling and ``options``' settings)."""
    loop, settings = _module(pack, "nodes.training.loop"), _module(pack, "nodes.training.settings")
    stand_in = types.SimpleNamespace(settings=settings.TrainSettings(seed=5, **options),
                                     _sampling_cpu=patcher.model.model_sampling)
    for name in ("sigmas", "timestep_at"):
        setattr(stand_in, name, types.MethodType(getattr(loop.StepLoop, name), stand_in))
    stand_in.percent_span = _module(pack, "dataset_cache.noise_draws").percent_span(
        stand_in.timestep_at, stand_in.settings.min_timestep, stand_in.settings.max_timestep)
    import comfy.model_sampling

    sampling = patcher.model.model_sampling
    sigmas = torch.cat([loop.StepLoop._draw(stand_in, shape, i)[0] for i in range(batches)])
    if isinstance(sampling, comfy.model_sampling.CONST):  # a flow model (Flux): its timestep is σ × 1000
        return [1000.0 * float(s) for s in sigmas]
    return [float(sampling.timestep(s.double().reshape(1))[0]) for s in sigmas]  # SD's schedule index


@pytest.mark.parametrize("family", ["sd15", "flux"])
@pytest.mark.parametrize("sampling", ["uniform", "logit-normal"])
def test_a_timestep_range_keeps_every_drawn_timestep_in_it(pack: ModuleType, models: tuple, family: str,
                                                           sampling: str) -> None:
    """The trainer's own draws with min_timestep 875 and max_timestep 1000 (WAN 2.2's high-noise expert): every
    sigma's timestep (SD1.5's schedule index; tiny Flux's shifted sigma × 1000, not linear in the schedule's
    percent) lies in the range, and the draws spread over it."""
    from support.tiny_families import FAMILIES, build_family_patcher

    patcher = models[0] if family == "sd15" else build_family_patcher(FAMILIES["flux"], 2)
    shape = (4, 4, 8, 8) if family == "sd15" else (4, 16, 8, 8)
    every = _drawn_timesteps(pack, patcher, shape, 8, timestep_sampling=sampling)
    drawn = _drawn_timesteps(pack, patcher, shape, 8, timestep_sampling=sampling, min_timestep=875,
                             max_timestep=1000)
    assert min(every) < 500 < max(every)  # the whole schedule without a range
    # the bounds: exact percents (bisection to 1e-18), the sigmas then rounded to fp32 (1000σ off by 6e-5 at most)
    assert all(875 - 1e-4 <= t <= 1000 + 1e-4 for t in drawn), drawn
    assert min(drawn) < 900 and max(drawn) > 975  # spread over the range, not stuck at one end


def test_a_timestep_range_trains_continues_exactly_and_says_so(node: type, models: tuple, dataset: Any,
                                                               lora_folder: Path, whole_run: Any) -> None:
    """Noised in the range only: the first loss is not the default run's, the summary names the range and the
    schedule it covers, and a save at step 3 of 5 continued is the uninterrupted run bit for bit."""
    drawn = {**_CONTINUED, "min_timestep": 875, "max_timestep": 1000}
    out = _train(node, models[0], dataset, steps=5, save_every=3, **drawn)
    whole = out.result
    assert whole[1]["loss"][0] != whole_run[1]["loss"][0]
    assert re.search(r"noised at the model's timesteps 875 to 1000 \(from 0\.0% to \d+\.\d% of its schedule\)",
                     _summary(out)), _summary(out)
    (name,) = _saves(lora_folder)
    rest = _train(node, models[0], dataset, steps=2, existing_lora=name, **drawn)
    assert rest.result[1]["loss"] == whole[1]["loss"][3:]
    assert all(torch.equal(rest.result[0][k], whole[0][k]) for k in whole[0])


# ------------------------------------------------------------------------------------------------- validation loss
# ----------------------------------------------------------------------------------------------- gradient clipping
def test_clipping_scales_a_steps_update_by_the_limit_over_the_reported_norm(node: type, models: tuple,
                                                                         dataset: Any) -> None:
    """One SGD step of a new LoRA (fp32): ComfyUI starts every adapter but the up matrices at 0 (the down matrices,
    the norm and bias diffs), so the step writes ``-lr * g`` into those, and the up matrices get no gradient (nor
    does an ``alpha`` move: its update is below its ulp). Clipped to a tenth of the norm the unclipped step reports,
    each element is the unclipped one times ``max / (norm + 1e-6)`` (each side rounded once or twice in fp32:
    4 ulp); a limit above the norm multiplies by exactly 1, so the LoRA is the unclipped one bit for bit. The
    reported norm is the norm of the unclipped update over the rate (fp32 sums: 1e-5; alpha's gradient is about
    1e-6 of the largest, its share of the norm far below that)."""
    opts = {"optimizer": "SGD", "steps": 1, "learning_rate": 0.02}
    free = _train(node, models[0], dataset, **opts)
    (norm,) = free.result[1]["grad_norm"]
    assert free.ui["grad_norm"] == [norm]
    down = [k for k in free.result[0] if not k.endswith((".lora_up.weight", ".alpha"))]
    assert len(down) < len(free.result[0]) and norm > 0
    update = torch.cat([free.result[0][k].double().flatten() for k in down])
    assert norm == pytest.approx(float(update.norm()) / 0.02, rel=1e-5)
    clipped = _train(node, models[0], dataset, max_grad_norm=norm / 10, **opts)
    assert clipped.result[1]["grad_norm"] == [norm]  # the norm before clipping
    scale = (norm / 10) / (norm + 1e-6)
    for k, value in clipped.result[0].items():
        if k in down:
            torch.testing.assert_close(value.double(), free.result[0][k].double() * scale, rtol=4 * 2.0 ** -24,
                                       atol=0.0)
        else:
            assert torch.equal(value, free.result[0][k])
    above = _train(node, models[0], dataset, max_grad_norm=norm * 2, **opts).result[0]
    assert all(torch.equal(above[k], free.result[0][k]) for k in above)
    assert f"; gradient norm {norm:.3g} median, {norm:.3g} max, clipped to {norm / 10:g} in 1 of 1 steps" \
        in _summary(clipped)
    assert f"; gradient norm {norm:.3g} median, {norm:.3g} max; buckets" in _summary(free)  # measured, nothing clipped


def test_a_clipped_run_continued_from_a_save_is_the_run_that_never_stopped(
        node: type, models: tuple, dataset: Any, lora_folder: Path) -> None:
    """Clipping keeps no state: a save at step 3 of 5 (bf16, AdamW, a limit most steps reach), continued for the 2
    steps left, is the uninterrupted run bit for bit, its gradient norms included."""
    clipped = {**_CONTINUED, "training_dtype": "bf16", "lora_dtype": "bf16"}
    probe = _train(node, models[0], dataset, steps=5, **clipped).result[1]["grad_norm"]
    clipped["max_grad_norm"] = sorted(probe)[1]  # four of the five steps clipped
    whole = _train(node, models[0], dataset, steps=5, save_every=3, **clipped)
    assert f"clipped to {clipped['max_grad_norm']:g} in 4 of 5 steps" in _summary(whole)
    (name,) = _saves(lora_folder)
    rest = _train(node, models[0], dataset, steps=2, existing_lora=name, **clipped)
    assert rest.result[1]["loss"] == whole.result[1]["loss"][3:]
    assert rest.result[1]["grad_norm"] == whole.result[1]["grad_norm"][3:]
    assert all(torch.equal(rest.result[0][k], whole.result[0][k]) for k in whole.result[0])


def test_the_summary_counts_clipped_and_non_finite_norms(pack: ModuleType) -> None:
    describe = _module(pack, "nodes.training.report").describe_grad_norms
    assert describe([], 1.0) == ""
    assert describe([0.5, 2.0, 0.25], 0.0) == "; gradient norm 0.5 median, 2 max"
    assert describe([0.5, 2.0, 1.0, math.inf], 1.0) == (
        "; gradient norm 1 median, 2 max, clipped to 1 in 2 of 4 steps, not finite in 1 steps (with fp16: steps the "
        "gradient scaler skipped)")  # 1.0 + 1e-6 > 1: torch's own formula scales it by 1 / (1 + 1e-6)
    assert describe([math.nan], 1.0) == (
        "; gradient norm, clipped to 1 in 0 of 1 steps, not finite in 1 steps (with fp16: steps the gradient scaler "
        "skipped)")


# ---------------------------------------------------------------------------------------------------- Min-SNR
def test_min_snr_weighs_a_rows_loss_and_its_update_by_its_capped_snr(pack: ModuleType, node: type, models: tuple,
                                                                     dataset: Any) -> None:
    """The tiny SD1.5 is ε-prediction (x_t = x0 + σ·ε): SNR 1/σ². One SGD step of one image (fp32), at the σ the
    trainer draws for batch 0: with min_snr_gamma γ its loss is the unweighted one times w = min(1/σ², γ), and so is
    the update of every parameter ComfyUI starts at 0 (ComfyUI's down matrices, norm and bias diffs), for a γ that
    caps the SNR and one that does not. The weighted loss is ComfyUI's per-element loss times w, averaged (the
    unweighted one ComfyUI's mean): rounding apart, 1e-5; the update passes that through the backward: 1e-4."""
    import comfy.model_sampling

    loop, settings = _module(pack, "nodes.training.loop"), _module(pack, "nodes.training.settings")
    assert isinstance(models[0].model.model_sampling, comfy.model_sampling.EPS)
    stand_in = types.SimpleNamespace(settings=settings.TrainSettings(seed=FAST["seed"]),
                                     _sampling_cpu=models[0].model.model_sampling, percent_span=(0.0, 1.0))
    stand_in.sigmas = types.MethodType(loop.StepLoop.sigmas, stand_in)
    (sigma,) = loop.StepLoop._draw(stand_in, (1, 4, 8, 8), 0)[0].tolist()
    snr = 1.0 / sigma ** 2
    opts = {"optimizer": "SGD", "steps": 1, "batch_size": 1, "learning_rate": 0.02}
    plain = _train(node, models[0], dataset, **opts).result
    zero_init = [k for k in plain[0] if not k.endswith((".lora_up.weight", ".alpha"))]
    start = _train(node, models[0], dataset, **{**opts, "learning_rate": 1e-30}).result[0]  # the step's start
    for gamma in (snr / 2, min(2 * snr, 100.0)):
        weighted = _train(node, models[0], dataset, min_snr_gamma=gamma, **opts)
        w = min(snr, gamma)
        assert weighted.result[1]["loss"][0] == pytest.approx(w * plain[1]["loss"][0], rel=1e-5)
        for k in zero_init:
            step, plain_step = weighted.result[0][k] - start[k], plain[0][k] - start[k]
            torch.testing.assert_close(step, w * plain_step, rtol=1e-4, atol=1e-5 * float(plain_step.abs().max()))
        assert f"; each image's loss weighed by min(SNR, {gamma:g}) of its noise level" in _summary(weighted)


def test_the_prediction_target_weighs_an_eps_models_loss_by_its_snr(pack: ModuleType, node: type, models: tuple,
                                                                   dataset: Any) -> None:
    """The tiny SD1.5 predicts the noise ε, and its clean-latent error is σ times its ε error: with loss_target
    "prediction" one SGD step (fp32) has the loss of ε, the clean latent's times 1/σ², and so has the update of every
    parameter ComfyUI starts at 0 (tolerances as for Min-SNR above: rounding, 1e-5; through the backward, 1e-4).
    debiased_estimation weighs that loss by kohya's 1/√SNR."""
    loop, settings = _module(pack, "nodes.training.loop"), _module(pack, "nodes.training.settings")
    stand_in = types.SimpleNamespace(settings=settings.TrainSettings(seed=FAST["seed"]),
                                     _sampling_cpu=models[0].model.model_sampling, percent_span=(0.0, 1.0))
    stand_in.sigmas = types.MethodType(loop.StepLoop.sigmas, stand_in)
    (sigma,) = loop.StepLoop._draw(stand_in, (1, 4, 8, 8), 0)[0].tolist()
    opts = {"optimizer": "SGD", "steps": 1, "batch_size": 1, "learning_rate": 0.02}
    plain = _train(node, models[0], dataset, **opts).result
    start = _train(node, models[0], dataset, **{**opts, "learning_rate": 1e-30}).result[0]
    out = _train(node, models[0], dataset, loss_target="prediction", **opts)
    assert out.result[1]["loss"][0] == pytest.approx(plain[1]["loss"][0] / sigma ** 2, rel=1e-5)
    for k in (k for k in plain[0] if not k.endswith((".lora_up.weight", ".alpha"))):
        step, plain_step = out.result[0][k] - start[k], plain[0][k] - start[k]
        torch.testing.assert_close(step, plain_step / sigma ** 2, rtol=1e-4,
                                   atol=1e-5 * float(plain_step.abs().max()) / sigma ** 2)
    assert "; the loss is on the model's prediction (the noise), not the clean latent" in _summary(out)
    debiased = _train(node, models[0], dataset, loss_target="prediction", debiased_estimation=True, **opts)
    weight = min(1.0 / sigma ** 2, 1000.0) ** -0.5  # kohya's 1/√SNR, the SNR capped at 1000
    assert debiased.result[1]["loss"][0] == pytest.approx(out.result[1]["loss"][0] * weight, rel=1e-5)
    assert "debiased estimation (1/√SNR of its noise level" in _summary(debiased)


@pytest.mark.parametrize("patch", ["zsnr", "sd3 shift"])
def test_a_model_sampling_nodes_patch_is_the_sampling_the_run_draws_and_weighs_with(
        pack: ModuleType, node: type, models: tuple, dataset: Any, monkeypatch: pytest.MonkeyPatch,
        patch: str) -> None:
    """A Model Sampling node before Train LoRA replaces the model's sampling by an object patch, which ComfyUI
    applies only when it loads the model. The run's noise levels come from the patched sampling from the first
    step (ModelSamplingDiscrete's zero-terminal-SNR schedule, or ModelSamplingSD3's shift 3, musubi-tuner's
    discrete_flow_shift: other sigmas for the same draws), as ComfyUI's own trainer gets them from its loaded
    model."""
    import comfy_extras.nodes_model_advanced as advanced

    loop, settings = _module(pack, "nodes.training.loop"), _module(pack, "nodes.training.settings")
    if patch == "zsnr":
        (patched,) = advanced.ModelSamplingDiscrete().patch(models[0], "eps", True)
    else:
        (patched,) = advanced.ModelSamplingSD3().patch(models[0], 3.0)

    def expected(sampling: Any) -> float:
        stand_in = types.SimpleNamespace(settings=settings.TrainSettings(seed=FAST["seed"]),
                                         _sampling_cpu=sampling, percent_span=(0.0, 1.0))
        stand_in.sigmas = types.MethodType(loop.StepLoop.sigmas, stand_in)
        return float(loop.StepLoop._draw(stand_in, (1, 4, 8, 8), 0)[0])

    drawn: list[float] = []
    draw = loop.StepLoop._draw

    def recorded(self: Any, shape: tuple[int, ...], index: int) -> tuple[torch.Tensor, torch.Tensor]:
        sigma, noise = draw(self, shape, index)
        drawn.append(float(sigma[0]))
        return sigma, noise

    monkeypatch.setattr(loop.StepLoop, "_draw", recorded)
    _train(node, patched, dataset, steps=1, batch_size=1)
    zsnr, plain = expected(patched.get_model_object("model_sampling")), expected(models[0].model.model_sampling)
    assert not math.isclose(zsnr, plain, rel_tol=1e-3)
    assert drawn[0] == pytest.approx(zsnr, rel=1e-6)


def test_scale_v_pred_loss_weighs_a_v_models_loss_as_a_noise_predictions(pack: ModuleType, node: type,
                                                                        models: tuple, dataset: Any) -> None:
    """The tiny SD1.5 made a v-prediction model by ComfyUI's ModelSamplingDiscrete node: one step's prediction loss
    with scale_v_pred_loss is the one without times kohya's SNR/(SNR + 1) (SNR = 1/σ² of the step's drawn σ;
    rounding only, 1e-5); the plain model (ε) is refused before its first step, naming the option."""
    import comfy_extras.nodes_model_advanced

    loop, settings = _module(pack, "nodes.training.loop"), _module(pack, "nodes.training.settings")
    (v_model,) = comfy_extras.nodes_model_advanced.ModelSamplingDiscrete().patch(models[0], "v_prediction", False)
    stand_in = types.SimpleNamespace(settings=settings.TrainSettings(seed=FAST["seed"]),
                                     _sampling_cpu=v_model.get_model_object("model_sampling"), percent_span=(0.0, 1.0))
    stand_in.sigmas = types.MethodType(loop.StepLoop.sigmas, stand_in)
    (sigma,) = loop.StepLoop._draw(stand_in, (1, 4, 8, 8), 0)[0].tolist()
    opts = {"optimizer": "SGD", "steps": 1, "batch_size": 1, "learning_rate": 0.02, "loss_target": "prediction"}
    plain = _train(node, v_model, dataset, **opts)
    scaled = _train(node, v_model, dataset, scale_v_pred_loss=True, **opts)
    snr = 1.0 / sigma ** 2
    assert scaled.result[1]["loss"][0] == pytest.approx(plain.result[1]["loss"][0] * snr / (snr + 1), rel=1e-5)
    assert "; the loss is on the model's prediction (v), not the clean latent" in _summary(scaled)
    assert "each image's v loss weighed by SNR/(SNR + 1)" in _summary(scaled)
    with pytest.raises(ValueError, match="turn scale_v_pred_loss off"):
        _train(node, models[0], dataset, scale_v_pred_loss=True, **opts)


def test_v_pred_like_loss_adds_the_implied_v_loss_to_an_eps_models(pack: ModuleType, node: type, models: tuple,
                                                                  dataset: Any) -> None:
    """The tiny SD1.5 (ε): one step's prediction loss with v_pred_like_loss λ is the one without times kohya's
    1 + λ·(SNR + 1)/SNR = 1 + λ·(1 + σ²) of the step's drawn σ (rounding only, 1e-5); the summary names it."""
    loop, settings = _module(pack, "nodes.training.loop"), _module(pack, "nodes.training.settings")
    stand_in = types.SimpleNamespace(settings=settings.TrainSettings(seed=FAST["seed"]),
                                     _sampling_cpu=models[0].get_model_object("model_sampling"),
                                     percent_span=(0.0, 1.0))
    stand_in.sigmas = types.MethodType(loop.StepLoop.sigmas, stand_in)
    (sigma,) = loop.StepLoop._draw(stand_in, (1, 4, 8, 8), 0)[0].tolist()
    opts = {"optimizer": "SGD", "steps": 1, "batch_size": 1, "learning_rate": 0.02, "loss_target": "prediction"}
    plain = _train(node, models[0], dataset, **opts)
    added = _train(node, models[0], dataset, v_pred_like_loss=0.2, **opts)
    assert sigma > 0.04  # SNR under kohya's cap of 1000
    assert added.result[1]["loss"][0] == pytest.approx(plain.result[1]["loss"][0] * (1 + 0.2 * (1 + sigma ** 2)),
                                                       rel=1e-5)
    assert "plus 0.2 times the v loss it implies (v_pred_like_loss)" in _summary(added)
    assert added.result[0].metadata["ss_v_pred_like_loss"] == "0.2"


def test_multires_noise_is_drawn_after_the_plain_noise_and_trains_another_lora(pack: ModuleType, node: type,
                                                                             models: tuple, dataset: Any) -> None:
    """With multires_noise_iterations a batch's sigmas and plain noise are the ones drawn without it (the same
    generator calls first), and its noise is their pyramid (:func:`dataset_cache.noise_draws.pyramid_noise`, tested
    on its own) with the generator's next values; the run trains another LoRA and its summary says so."""
    loop, settings = _module(pack, "nodes.training.loop"), _module(pack, "nodes.training.settings")
    noise_draws, seeding = _module(pack, "dataset_cache.noise_draws"), _module(pack, "dataset_cache.seeding")

    def draw(**options: Any) -> tuple[torch.Tensor, torch.Tensor]:
        stand_in = types.SimpleNamespace(settings=settings.TrainSettings(seed=FAST["seed"], **options),
                                         _sampling_cpu=models[0].model.model_sampling, percent_span=(0.0, 1.0))
        stand_in.sigmas = types.MethodType(loop.StepLoop.sigmas, stand_in)
        return loop.StepLoop._draw(stand_in, (2, 4, 8, 12), 3)

    plain_sigma, plain_noise = draw()
    sigma, noise = draw(multires_noise_iterations=4, multires_noise_discount=0.5)
    assert torch.equal(sigma, plain_sigma)
    g = seeding.seeded_generator(FAST["seed"], 3, "noise")
    noise_draws.draw_percents(g, 2, "uniform")
    torch.randn((2, 4, 8, 12), generator=g)  # the plain noise
    assert torch.equal(noise, noise_draws.pyramid_noise(plain_noise.clone(), g, 4, 0.5))
    opts = {"optimizer": "SGD", "steps": 1, "batch_size": 1, "learning_rate": 0.02}
    plain = _train(node, models[0], dataset, **opts).result[0]
    out = _train(node, models[0], dataset, multires_noise_iterations=6, **opts)
    assert any(not torch.equal(out.result[0][k], plain[k]) for k in plain)
    assert ("; multi-resolution noise: 6 levels, each coarser one weighing 0.3 times the one before"
            in _summary(out))


# ------------------------------------------------------------------------------------------ the weights' average
def test_the_lora_of_an_averaging_run_is_the_average_of_its_steps(node: type, models: tuple, dataset: Any,
                                                                  lora_folder: Path) -> None:
    """Two SGD steps (fp32) from a LoRA file of 1 step: the average starts at the file's weights and takes each
    step's weights with 1 - min(0.9, (1 + t) / (10 + t)) at global steps t = 2 and 3 (0.75 and 9/13): the same
    lerps on the same fp32 values as computed here, so bit for bit. Averaging never changes what is trained: the
    runs without it give those steps' weights."""
    opts = {"optimizer": "SGD", "learning_rate": 0.02}
    start = _train(node, models[0], dataset, steps=1, **opts).result[0]
    name = save_lora(start, 1, "loras/start")
    one = _train(node, models[0], dataset, steps=1, existing_lora=name, **opts).result[0]
    two = _train(node, models[0], dataset, steps=2, existing_lora=name, **opts).result[0]
    averaged = _train(node, models[0], dataset, steps=2, existing_lora=name, ema_decay=0.9, **opts)
    for key, value in averaged.result[0].items():
        expected = torch.lerp(torch.lerp(start[key], one[key], 1.0 - 3 / 12), two[key], 1.0 - 4 / 13)
        assert torch.equal(value, expected), key
    assert not all(torch.equal(averaged.result[0][k], two[k]) for k in two)
    assert "; the LoRA is the moving average of its weights (ema_decay 0.9)" in _summary(averaged)


_AVERAGED = {**_CONTINUED, "training_dtype": "bf16", "lora_dtype": "bf16", "ema_decay": 0.9}


def test_an_averaging_run_continued_from_a_save_is_the_run_that_never_stopped(
        node: type, models: tuple, dataset: Any, val_dataset: Any, lora_folder: Path) -> None:
    """bf16, AdamW, 5 steps averaged at 0.9, saved at step 3: the save is the average (its state holds the trained
    weights and the fp32 average). Continued for the 2 steps left it is the uninterrupted run bit for bit, and so
    is its validation loss, measured on the average: the continuation's first value (step 3) is the whole run's."""
    whole = _train(node, models[0], dataset, steps=5, save_every=3, val_dataset=val_dataset, val_every=3,
                   **_AVERAGED).result
    (name,) = _saves(lora_folder)
    rest = _train(node, models[0], dataset, steps=2, existing_lora=name, val_dataset=val_dataset, val_every=3,
                  **_AVERAGED)
    assert "NOTE: existing_lora" not in _summary(rest)
    assert rest.result[1]["loss"] == whole[1]["loss"][3:]
    assert all(torch.equal(rest.result[0][k], whole[0][k]) for k in whole[0])
    assert rest.result[1]["val_loss"] == whole[1]["val_loss"][1:]  # [[3, v3], [5, v5]]
    plain = _train(node, models[0], dataset, steps=5, val_dataset=val_dataset, val_every=3, **{
        **_AVERAGED, "ema_decay": 0.0}).result
    assert plain[1]["loss"] == whole[1]["loss"]  # the same training ...
    assert plain[1]["val_loss"][0] == whole[1]["val_loss"][0]  # ... from the same start ...
    assert plain[1]["val_loss"][1:] != whole[1]["val_loss"][1:]  # ... measured on other weights: the average


def test_a_save_of_an_averaging_run_continued_without_averaging_goes_on_from_its_trained_weights(
        node: type, models: tuple, dataset: Any, lora_folder: Path) -> None:
    """The save is the average, but its state holds the trained weights: continued with ema_decay 0, the run goes
    on from those (and AdamW's state), so it is the 5-step run that never averaged, bit for bit, and says so."""
    _train(node, models[0], dataset, steps=5, save_every=3, **_AVERAGED)
    (name,) = _saves(lora_folder)
    plain = {**_AVERAGED, "ema_decay": 0.0}
    rest = _train(node, models[0], dataset, steps=2, existing_lora=name, **plain)
    never = _train(node, models[0], dataset, steps=5, **plain).result
    assert all(torch.equal(rest.result[0][k], never[0][k]) for k in never[0])
    assert (f"NOTE: existing_lora {name!r} is the moving average of its weights (ema_decay 0.9): this run continues "
            "the weights it trained, without averaging; set ema_decay to continue the average") in _summary(rest)


@pytest.fixture(scope="module")
def val_dataset(pack: ModuleType, comfy_nodes: ModuleType, models: tuple, handles: ModuleType,
                tmp_path_factory: pytest.TempPathFactory) -> Any:
    """Three other images of one bucket (64×64), in a cache of their own: a held-out set."""
    _, clip, vae = models
    root = tmp_path_factory.mktemp("val") / "cache"
    write_comfy_encoded(pack, comfy_nodes, clip, vae, root, [(64, 64)] * 3, seed=1,
                        caption="a held-out test pattern number {}")
    return handles.StreamDatasetHandle(str(root), "train")


def test_the_validation_loss_is_measured_at_fixed_draws_and_changes_nothing_trained(
        pack: ModuleType, node: type, models: tuple, dataset: Any, val_dataset: Any, whole_run: Any,
        monkeypatch: pytest.MonkeyPatch) -> None:
    """Before the first step, every val_every steps and after the last; the LoRA and its losses are the run's without
    validation, bit for bit (validation draws from generators of its own); a shorter run measures the same values at
    the same steps (each image's noise and timestep are the same every time). The step reports carry the latest."""
    reports: list[Any] = []
    monkeypatch.setattr(_module(pack, "nodes.train_lora")._Events, "__call__", lambda self, r: reports.append(r))
    out = _train(node, models[0], dataset, steps=4, val_dataset=val_dataset, val_every=3, **_CONTINUED)
    lora, loss_map, _ = out.result[:3]
    assert loss_map["loss"] == whole_run[1]["loss"]
    assert all(torch.equal(lora[k], whole_run[0][k]) for k in whole_run[0])
    steps = [step for step, _ in loss_map["val_loss"]]
    assert steps == [0, 3, 4] and all(math.isfinite(v) for _, v in loss_map["val_loss"])
    assert out.ui["val_loss"] == loss_map["val_loss"]
    first, last = loss_map["val_loss"][0][1], loss_map["val_loss"][-1][1]
    assert (f"validation loss (3 images, the same noise and timesteps each time): {first:.4f} at step 0 → "
            f"{last:.4f} at step 4") in _summary(out)
    # the measurement before the first step is a phase of its own, not counted in another one's time
    assert re.search(r"first step after \d+\.\d s \([^)]*model to device \d+\.\d s, validation \d+\.\d s, garbage "
                     r"collection", _summary(out)), _summary(out)
    # the latest measurement when each step is reported (steps 2 and 3 are reported a step late, after step 3's)
    assert [(r.val_step, r.val_loss) for r in reports] == [(0, first)] * 2 + [tuple(loss_map["val_loss"][1]),
                                                                           (4, last)]
    shorter = _train(node, models[0], dataset, steps=3, val_dataset=val_dataset, **_CONTINUED).result[1]
    assert shorter["val_loss"] == loss_map["val_loss"][:2]  # steps 0 and 3 (the last): the same values


def test_the_validation_loss_is_the_training_loss_of_each_held_out_image_at_its_own_draws(
        pack: ModuleType, node: type, models: tuple, val_dataset: Any, monkeypatch: pytest.MonkeyPatch) -> None:
    """The validation loss before the first step equals the first training step's loss (computed before any update)
    of a run on the held-out images whose draws are replaced, row by row, by what validation should draw for each
    image: a uniform percent and plain noise from the generator of (seed, "validation", the image's latent key),
    written out here. The training loss is ComfyUI's own (tests/comfy/test_families.py, 1e-5). One batch of the 3
    images either way, in another row order: the means agree to a reordered fp32 sum of 3 × 4096 elements; 1e-5
    relative allows that and nothing a wrong draw gives (these images' losses range from 0.2 to 51 by their draws)."""
    seeding = _module(pack, "dataset_cache.seeding")
    loop = _module(pack, "nodes.training.loop")
    sampling = models[0].model.model_sampling

    def validation_draws(self: Any, number: int, plan: Any, shape: Any) -> dict[str, torch.Tensor]:
        sigmas, noises = [], []
        for key in plan.latent_keys:
            g = seeding.seeded_generator(5, "validation", key)
            percent = float(torch.rand(1, generator=g, dtype=torch.float64).clamp(1e-5, 1 - 1e-5))
            sigmas.append(float(sampling.percent_to_sigma(percent)))
            noises.append(torch.randn((1, *shape[1:]), generator=g))
        return {"sigma": torch.tensor(sigmas), "noise": torch.cat(noises)}

    options = {"steps": 1, "batch_size": 3, "seed": 5, "optimizer": "SGD", "learning_rate": 1e-30}
    measured = _train(node, models[0], val_dataset, val_dataset=val_dataset, **options).result[1]["val_loss"]
    monkeypatch.setattr(loop.StepLoop, "per_batch", validation_draws)
    trained = _train(node, models[0], val_dataset, **options).result[1]["loss"]
    assert measured[0][0] == 0 and measured[0][1] == pytest.approx(trained[0], rel=1e-5)


@pytest.mark.parametrize("memory", [{"memory": "stream blocks", "stream_blocks": 2},
                                    {"memory": "stream blocks + host activations", "stream_blocks": 2},
                                    {"memory": "no offload", "gradient_checkpointing": True}],
                         ids=["streamed", "host-activations", "checkpointed"])
def test_validation_between_steps_leaves_every_memory_plan_training_the_same_lora(
        node: type, models: tuple, dataset: Any, val_dataset: Any, memory: dict) -> None:
    """A forward pass without gradients between steps (the streamer's prefetches out of their order, checkpoints not
    taken, no activations saved) changes nothing the plan trains: the LoRA is the one of the same run without it."""
    plain = _train(node, models[0], dataset, steps=3, **memory).result
    validated = _train(node, models[0], dataset, steps=3, val_dataset=val_dataset, val_every=1, **memory).result
    assert [s for s, _ in validated[1]["val_loss"]] == [0, 1, 2, 3]
    assert validated[1]["loss"] == plain[1]["loss"]
    assert all(torch.equal(validated[0][k], plain[0][k]) for k in plain[0])


def test_cancel_during_a_validation_stops_the_run_saves_its_steps_and_leaves_no_threads(
        pack: ModuleType, node: type, models: tuple, dataset: Any, val_dataset: Any, lora_folder: Path) -> None:
    """Cancel while the validation after step 2 reads its batches: the run stops there (no step 3), the two steps
    trained are saved (save_every), and neither the training loader's threads nor the validation's are left."""
    import comfy.model_management

    validation = _module(pack, "nodes.training.validation").Validation
    measure = validation.measure

    def cancelled_at_step_2(self: Any, step: int) -> float:
        if step == 2:
            comfy.model_management.interrupt_current_processing(True)  # as POST /interrupt, seen between batches
        return measure(self, step)

    try:
        with pytest.MonkeyPatch.context() as patch:
            patch.setattr(validation, "measure", cancelled_at_step_2)
            with pytest.raises(comfy.model_management.InterruptProcessingException):
                _train(node, models[0], dataset, steps=6, save_every=4, val_dataset=val_dataset, val_every=2)
    finally:
        comfy.model_management.interrupt_current_processing(False)
    assert _saves(lora_folder) == ["streamcache_lora_2_steps_00001_.safetensors"]
    assert _loader_threads() == []


def test_a_validation_set_that_shares_images_with_the_training_is_named(node: type, models: tuple, dataset: Any
                                                                        ) -> None:
    out = _train(node, models[0], dataset, steps=1, val_dataset=dataset)
    assert "NOTE: val_dataset shares 6 of its 6 images with the dataset it trains" in _summary(out)


@pytest.mark.parametrize(("options", "message"), [
    ({"lr_schedule": "exponential"}, "unknown lr_schedule 'exponential'; use one of constant, cosine, linear"),
    ({"warmup_steps": -1}, "warmup_steps must be >= 0, got -1"),
    ({"warmup_steps": 100001}, "warmup_steps must be at most 100000, got 100001"),
    ({"timestep_sampling": "beta"}, "unknown timestep_sampling 'beta'; use one of uniform, logit-normal"),
    ({"noise_offset": 1.5}, "noise_offset must be a number from 0 to 1, got 1.5"),
    ({"val_every": -1}, "val_every must be >= 0, got -1"),
    ({"max_grad_norm": -0.5}, "max_grad_norm must be a number from 0 (no clipping) to 10000, got -0.5"),
    ({"max_grad_norm": math.nan}, "max_grad_norm must be a number from 0 (no clipping) to 10000, got nan"),
    ({"ema_decay": 1.0}, "ema_decay must be a number from 0 (no average) to 0.9999, got 1.0"),
    ({"min_snr_gamma": -5.0}, "min_snr_gamma must be a number from 0 (no weighting) to 100, got -5.0"),
    ({"loss_target": "noise"}, "unknown loss_target 'noise'; use one of clean latent, prediction"),
    ({"multires_noise_iterations": 11}, "multires_noise_iterations must be a whole number from 0 (no "
                                        "multi-resolution noise) to 10, got 11"),
    ({"multires_noise_iterations": 6, "multires_noise_discount": 1.5}, "multires_noise_discount must be a number "
                                                                       "from 0 to 1, got 1.5"),
    ({"sample_count": 17}, "sample_count must be a whole number from 0 to 16, got 17"),
    ({"sample_count": 1, "sample_cfg": 0.5}, "sample_cfg must be a number from 1 (no guidance"),
    ({"debiased_estimation": True}, "debiased_estimation weighs the loss on the model's prediction, as kohya's "
                                    "--debiased_estimation_loss does: set loss_target to prediction"),
    ({"scale_v_pred_loss": True}, "scale_v_pred_loss weighs the loss on the model's prediction (v), as kohya's "
                                  "--scale_v_pred_loss_like_noise_pred does: set loss_target to prediction"),
    ({"loss_target": "prediction", "scale_v_pred_loss": True}, "scale_v_pred_loss weighs a v-prediction model's "
                                                               "loss like a noise-prediction one's, as kohya's "
                                                               "--scale_v_pred_loss_like_noise_pred; this model's "
                                                               "sampling is "),
    ({"v_pred_like_loss": 0.1}, "v_pred_like_loss adds to the loss on the model's prediction (the noise), as kohya's "
                                "--v_pred_like_loss does: set loss_target to prediction"),
    ({"loss_target": "prediction", "v_pred_like_loss": 1.5}, "v_pred_like_loss must be a number from 0 (none) to 1"),
    ({"sample_count": 1, "sample_sampler": "k_euler"}, "unknown sample_sampler 'k_euler'"),
    ({"min_timestep": 900, "max_timestep": 900}, "min_timestep and max_timestep must be whole numbers with 0 <= "
                                                 "min_timestep < max_timestep <= 1000"),
    ({"max_timestep": 1001}, "got 0 and 1001"),
])
def test_a_bad_schedule_is_refused_before_training(node: type, models: tuple, dataset: Any, options: dict,
                                                   message: str) -> None:
    with pytest.raises(ValueError, match=re.escape(message)):
        _train(node, models[0], dataset, **options)
    assert _loader_threads() == []


def _stop_at(monkeypatch: pytest.MonkeyPatch, pack: ModuleType, call: int, stop: Callable[[], Any]) -> None:
    """Make the ``call``-th batch's forward and backward (1-based) run ``stop`` once it is done."""
    loop = _module(pack, "nodes.training.loop").StepLoop
    fwd_bwd, calls = loop._fwd_bwd, [0]

    def counted(self: Any, batch: Any, index: int) -> torch.Tensor:
        loss = fwd_bwd(self, batch, index)
        calls[0] += 1
        replaced = stop() if calls[0] == call else None
        return loss if replaced is None else replaced

    monkeypatch.setattr(loop, "_fwd_bwd", counted)


def _interrupt() -> None:
    import comfy.model_management

    comfy.model_management.interrupt_current_processing(True)  # checked before the next batch


def _fail() -> None:
    raise RuntimeError("a read failed")


@pytest.mark.parametrize("how", ["cancel", "error"])
def test_a_run_stopped_mid_step_saves_the_steps_it_finished_and_continues_exactly(
        pack: ModuleType, node: type, models: tuple, dataset: Any, lora_folder: Path, whole_run: Any, how: str,
        monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture) -> None:
    """Cancel (or an error) after the first batch of step 4: the 3 steps done are saved, though the loader had
    handed out a batch of step 4, and continuing the save for 1 step is the uninterrupted run bit for bit."""
    import comfy.model_management

    expected = comfy.model_management.InterruptProcessingException if how == "cancel" else RuntimeError
    with pytest.MonkeyPatch.context() as patch, caplog.at_level(logging.WARNING, logger="streamcache.train"), \
            pytest.raises(expected):
        _stop_at(patch, pack, 7, _interrupt if how == "cancel" else _fail)  # 2 batches a step: step 4's first
        _train(node, models[0], dataset, steps=4, save_every=10, **_CONTINUED)
    assert _saves(lora_folder) == ["streamcache_lora_3_steps_00001_.safetensors"]
    said = "cancelled" if how == "cancel" else "RuntimeError: a read failed"
    assert f"the run stopped after step 3 ({said}); the LoRA trained so far is saved as " in caplog.text
    rest = _train(node, models[0], dataset, steps=1, existing_lora="streamcache_lora_3_steps_00001_.safetensors",
                  **_CONTINUED)
    assert rest.result[2] == 4 and rest.result[1]["loss"] == whole_run[1]["loss"][3:]
    assert all(torch.equal(rest.result[0][k], whole_run[0][k]) for k in whole_run[0])


def test_a_step_whose_loss_is_not_finite_is_never_saved(pack: ModuleType, node: type, models: tuple, dataset: Any,
                                                       lora_folder: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """A NaN loss at step 3 stops the run (a step late: losses are read once the next step is queued); the save
    of step 2 stands, nothing after it is written, periodic or on the stop."""
    training = _module(pack, "nodes.training")
    _stop_at(monkeypatch, pack, 5, lambda: torch.tensor(float("nan")))  # step 3's first batch
    with pytest.raises(training.NonFiniteLossError, match="training stopped at step 3"):
        _train(node, models[0], dataset, steps=4, save_every=2, **_CONTINUED)
    assert _saves(lora_folder) == ["streamcache_lora_2_steps_00001_.safetensors"]


def test_a_save_that_cannot_be_written_is_said_and_the_run_goes_on(node: type, models: tuple, dataset: Any,
                                                                    lora_folder: Path) -> None:
    (lora_folder / "blocked").write_text("a file where the saves' folder would be")
    out = _train(node, models[0], dataset, steps=2, save_every=1, save_prefix="blocked/run")
    assert out.result[2] == 2 and len(out.result[1]["loss"]) == 2
    summary = _summary(out)
    assert "NOTE: the LoRA could not be saved at step 1 (" in summary and "); the run went on" in summary
    assert summary.count("could not be saved") == 1 and "saved the LoRA with" not in summary


@pytest.mark.parametrize("prefix, why", [
    ("/tmp/run", "leaves ComfyUI's output folder"), ("../run", "leaves ComfyUI's output folder"),
    ("loras/../../run", "leaves ComfyUI's output folder"), ("C:\\run", "leaves ComfyUI's output folder"),
    ("loras/", "names a folder but no file name"), ("", "1-200 printable characters"),
    ("a\nb", "1-200 printable characters"),
])
def test_a_save_prefix_outside_the_output_folder_is_refused_before_training(node: type, models: tuple,
                                                                            dataset: Any, lora_folder: Path,
                                                                            prefix: str, why: str) -> None:
    with pytest.raises(ValueError, match=f"save_prefix .*{re.escape(why)}"):
        _train(node, models[0], dataset, steps=1, save_every=1, save_prefix=prefix)
    assert not list(lora_folder.rglob("*.safetensors"))


def test_a_bucket_smaller_than_the_batch_trains_as_a_smaller_batch(pack: ModuleType, node: type, models: tuple,
                                                                   dataset: Any,
                                                                   monkeypatch: pytest.MonkeyPatch) -> None:
    """#27 item 1: at batch 4 the 64×96 bucket (2 images) was completed with copies, so its images trained twice as
    often as the others; now it trains as a batch of 2 and every image once per epoch (2 epochs of 2 steps)."""
    run = _module(pack, "nodes.training.run")
    real = run.counted
    seen: list[tuple[str, ...]] = []

    def spy(batches: Any, counts: Any, main_samples: int) -> Any:
        for batch in real(batches, counts, main_samples):
            seen.append(batch.plan.latent_keys)
            yield batch

    monkeypatch.setattr(run, "counted", spy)
    _train(node, models[0], dataset, batch_size=4, steps=4)
    assert sorted(len(rows) for rows in seen) == [2, 2, 4, 4]
    assert Counter(key for rows in seen for key in rows) == {_key(f"latent{i}"): 2 for i in range(len(SIZES))}


def test_every_row_is_paired_with_its_own_caption(pack: ModuleType, models: tuple) -> None:
    """The built-in trainer averages every caption over the whole batch; here row i sees caption i only."""
    training = _module(pack, "nodes.training")
    model = models[0]
    short = torch.randn(1, 77, 768)
    long = torch.randn(1, 154, 768)
    conds = [[[short, {"pooled_output": torch.randn(1, 768)}]], [[long, {"pooled_output": torch.randn(1, 768)}]]]
    noise = torch.zeros(2, 4, 8, 8)
    ((rows, kwargs),) = training.conditioning.Conditioner(model.model, torch.device("cpu"))(conds, noise, noise, seed=0)
    assert rows == [0, 1]  # CLIP contexts of 77 and 154 tokens join into one batch
    context = kwargs["c_crossattn"]
    assert context.shape == (2, 154, 768)
    assert torch.equal(context[0], short[0].repeat(2, 1))  # padded by repetition, as ComfyUI's cond_cat does
    assert torch.equal(context[1], long[0])


def test_rows_whose_conditionings_cannot_be_joined_run_as_separate_groups(pack: ModuleType, models: tuple) -> None:
    """77 and 100 CLIP tokens have no small common multiple, so ComfyUI's sampler would not batch them: neither
    does the trainer. Each group's prediction equals the prediction of its rows alone."""
    training = _module(pack, "nodes.training")
    model = models[0]
    gen = torch.Generator().manual_seed(3)
    conds = [[[torch.randn(1, n, 768, generator=gen), {}]] for n in (77, 100, 77)]
    noise = torch.randn(3, 4, 8, 8, generator=gen)
    groups = training.conditioning.Conditioner(model.model, torch.device("cpu"))(conds, noise, noise, seed=0)
    assert [rows for rows, _ in groups] == [[0, 2], [1]]
    assert groups[0][1]["c_crossattn"].shape == (2, 77, 768) and groups[1][1]["c_crossattn"].shape == (1, 100, 768)


def test_progress_events_reach_the_server_throttled(pack: ModuleType, monkeypatch: pytest.MonkeyPatch) -> None:
    """``streamcache.train`` events go to the prompting client, at most every 0.5 s plus the last step; without a
    server (this in-process suite) nothing is sent and nothing fails."""
    node_module = _module(pack, "nodes.train_lora")
    report = _module(pack, "nodes.training").StepReport
    events = node_module._Events("12")
    monkeypatch.delitem(sys.modules, "server", raising=False)
    events(report(1, 3, 0.5, 0.5, 2.0, 1.0, 0))  # no server: a no-op
    sent: list[tuple] = []
    instance = types.SimpleNamespace(client_id="client-1", last_prompt_id="p1",
                                     send_sync=lambda *a: sent.append(a))
    monkeypatch.setitem(sys.modules, "server", types.SimpleNamespace(PromptServer=types.SimpleNamespace(
        instance=instance)))
    events = node_module._Events("12")
    for step in (1, 2, 3):
        events(report(step, 3, 1.0 / step, 0.9, 2.0, 1.5, 0))
    assert [a[2] for a in sent] == ["client-1", "client-1"]  # step 2 throttled, the last step always sent
    event, data, _ = sent[-1]
    assert event == "streamcache.train"
    assert data == {"node": "12", "prompt_id": "p1", "step": 3, "total": 3, "loss": 1.0 / 3, "loss_smooth": 0.9,
                    "samples_per_s": 2.0, "data_wait_pct": 1.5}
    events(report(3, 3, 0.25, 0.9, 2.0, 1.5, 0, learning_rate=2.5e-4, val_step=2, val_loss=0.125,
                  grad_norm=0.75))  # the last step
    assert (sent[-1][1]["learning_rate"], sent[-1][1]["val_loss"], sent[-1][1]["val_step"],
            sent[-1][1]["grad_norm"]) == (2.5e-4, 0.125, 2, 0.75)
    events(report(3, 3, 0.25, 0.9, 2.0, 1.5, 0, grad_norm=math.inf))  # JSON has no inf: the browser would refuse it
    assert sent[-1][1]["grad_norm"] is None and json.loads(json.dumps(sent[-1][1], allow_nan=False))


# -------------------------------------------------------------------------------------------------- interrupts
def test_interrupt_stops_within_a_step_and_leaves_no_threads(node: type, models: tuple, dataset: Any) -> None:
    import comfy.model_management
    import comfy.utils

    updates: list[int] = []
    fired: list[int] = []

    def hook(value: int, total: int, preview: Any, node_id: str | None = None) -> None:
        updates.append(value)
        if value >= 3 and not fired:  # what POST /interrupt does, from any thread
            fired.append(value)
            comfy.model_management.interrupt_current_processing(True)

    saved = comfy.utils.PROGRESS_BAR_HOOK
    comfy.utils.set_progress_bar_global_hook(hook)
    try:
        with pytest.raises(comfy.model_management.InterruptProcessingException):
            _train(node, models[0], dataset, steps=20)
    finally:
        comfy.utils.set_progress_bar_global_hook(saved)
        comfy.model_management.interrupt_current_processing(False)
    assert fired and updates[-1] == fired[0]  # no step finished after the interrupt
    assert _loader_threads() == []
    assert comfy.model_management.in_training is False
    assert gc.isenabled() and gc.get_freeze_count() == 0  # the step collector ended with the run


def test_the_collector_runs_between_steps_only_and_is_back_after_training(node: type, models: tuple,
                                                                          dataset: Any) -> None:
    """While the steps run the cyclic collector is paused and the objects from before the run are frozen (a pass
    never walks the model); after the run both are as they were."""
    import comfy.utils

    inside: list[tuple[bool, int]] = []

    def hook(value: int, total: int, preview: Any, node_id: str | None = None) -> None:
        inside.append((gc.isenabled(), gc.get_freeze_count()))

    assert gc.isenabled() and gc.get_freeze_count() == 0
    saved = comfy.utils.PROGRESS_BAR_HOOK
    comfy.utils.set_progress_bar_global_hook(hook)
    try:
        _train(node, models[0], dataset, steps=3)
    finally:
        comfy.utils.set_progress_bar_global_hook(saved)
    # a step is reported when the next one is queued: the last one's report comes after the loop, the collector back
    assert inside[:2] and all(not enabled and frozen > 0 for enabled, frozen in inside[:2])
    assert inside[2:] == [(True, 0)]
    assert gc.isenabled() and gc.get_freeze_count() == 0


class _BackwardOOM(RuntimeError):
    pass


def _fail_in_backward() -> tuple[Any, list[Any]]:
    """A hook on every module call that fails the backward pass in its middle (as a CUDA out-of-memory error there
    would) and keeps weak references to the convolutions' outputs, which later ops save for the backward pass.
    Global, not on the test's model: Train LoRA trains a fresh copy of it."""
    import weakref

    saved: list[Any] = []

    def fail(grad: torch.Tensor) -> torch.Tensor:
        raise _BackwardOOM("CUDA out of memory (raised in the backward pass by the test)")

    def hook(module: Any, args: Any, out: Any) -> None:
        # every convolution's output but the last one's (4 latent channels: the first to get its gradient), in
        # every forward pass (the memory probe's forward passes run no backward)
        if isinstance(module, torch.nn.Conv2d) and out.requires_grad:
            saved.append(weakref.ref(out))
            if module.out_channels > 4:
                out.register_hook(fail)

    return torch.nn.modules.module.register_module_forward_hook(hook), saved


@pytest.mark.parametrize("memory", ["auto + keep blocks whole", "auto", "no offload"])
def test_out_of_memory_with_blocks_kept_whole_says_what_to_try(node: type, models: tuple, dataset: Any,
                                                               memory: str) -> None:
    """Blocks kept whole take memory found free, on an estimate: running out of memory then says so and what to
    set (the original error kept as the cause); with every block checkpointed (``auto`` at this batch of 2, as
    ``no offload``) the error is ComfyUI's and torch's as it was."""
    message = "CUDA out of memory (raised in the backward pass by the test)"

    def fail(grad: torch.Tensor) -> torch.Tensor:
        raise torch.OutOfMemoryError(message)

    def hook(module: Any, args: Any, out: Any) -> None:
        if isinstance(module, torch.nn.Conv2d) and out.requires_grad and module.out_channels > 4:
            out.register_hook(fail)

    handle = torch.nn.modules.module.register_module_forward_hook(hook)
    try:
        with pytest.raises(torch.OutOfMemoryError) as failure:
            _train(node, models[0], dataset, steps=1, gradient_checkpointing=True, memory=memory)
    finally:
        handle.remove()
    text = str(failure.value)
    if memory == "auto + keep blocks whole":  # a CPU's memory free is its RAM: every block was kept whole
        assert text.startswith(message + "\nTrain LoRA memory: ") and "blocks were kept whole" in text
        assert "set memory to 'no offload'" in text and str(failure.value.__cause__) == message
    else:
        assert text == message


@pytest.mark.parametrize("checkpointing", [False, True], ids=["plain", "checkpointed"])
def test_a_failed_backward_pass_leaves_no_activations_behind(pack: ModuleType, node: type, models: tuple,
                                                             dataset: Any, checkpointing: bool,
                                                             monkeypatch: pytest.MonkeyPatch) -> None:
    """Out of memory in a backward pass fails the run with that error, and the failed step's graph is freed at
    once: without the release, autograd keeps it (and on a GPU its memory) until the thread's next backward pass,
    so a retry with a smaller batch would start short of memory (dataset_cache/autograd_release.py)."""
    loop = _module(pack, "nodes.training.loop")

    def failed_run() -> list[Any]:
        hook, saved = _fail_in_backward()
        try:
            with pytest.raises(_BackwardOOM):
                # "no offload": every block checkpointed (auto would keep this tiny model's blocks whole)
                _train(node, models[0], dataset, steps=3, gradient_checkpointing=checkpointing, memory="no offload")
        finally:
            hook.remove()
        gc.collect()
        assert saved, "the hooks saw no activation"
        return [ref for ref in saved if ref() is not None]

    with monkeypatch.context() as m:  # the premise: without the release the failed graph stays
        m.setattr(loop, "release_failed_backward", lambda devices: None)
        kept = failed_run()
    if not kept:
        pytest.skip(f"torch {torch.__version__} frees a failed backward pass's graph by itself")
    loop.release_failed_backward([torch.device("cpu")])  # what the premise run left
    assert failed_run() == []
    assert gc.isenabled() and gc.get_freeze_count() == 0


def _held_as_comfyui_holds_it(run: Any) -> BaseException:
    """Call ``run`` and return its error the way ComfyUI's ``execute`` does: with the traceback kept in a local of a
    frame that traceback holds (a reference cycle, freed only by the collector)."""
    try:
        run()
    except Exception as ex:
        typ, _, tb = sys.exc_info()  # what execution.execute keeps
        return ex
    raise AssertionError("the run did not fail")


def test_the_failed_step_is_freed_while_comfyui_still_holds_the_error(pack: ModuleType, node: type, models: tuple,
                                                                       dataset: Any,
                                                                       monkeypatch: pytest.MonkeyPatch) -> None:
    """ComfyUI keeps the error it reports, in a reference cycle, until the collector's next full pass; the frames
    its traceback holds would keep the failed step's batch and loss, and through the loss its graph, and the run's
    LoRA and optimizer (on a GPU: their tensors on the device). Train LoRA clears those frames' locals as the error
    leaves the node, so they go at once, with the collector off and the error still held
    (dataset_cache/autograd_release.py)."""
    node_module = _module(pack, "nodes.train_lora")

    def held_run() -> tuple[BaseException, list[Any], int]:
        hook, saved = _fail_in_backward()
        gc.collect()
        gc.disable()
        try:
            error = _held_as_comfyui_holds_it(lambda: _train(node, models[0], dataset, steps=3))
            optimizers = sum(isinstance(o, torch.optim.Optimizer) for o in gc.get_objects())
            return error, [ref for ref in saved if ref() is not None], optimizers
        finally:
            gc.enable()
            hook.remove()

    with monkeypatch.context() as m:  # the premise: without clearing the frames the held error keeps them
        m.setattr(node_module, "release_error_frames", lambda error: None)
        error, kept, optimizers = held_run()
    assert isinstance(error, _BackwardOOM) and kept and optimizers == 1
    del error, kept
    gc.collect()
    error, kept, optimizers = held_run()
    assert isinstance(error, _BackwardOOM) and kept == [] and optimizers == 0
    assert "CUDA out of memory (raised in the backward pass by the test)" in "".join(
        traceback.format_exception(error))  # what ComfyUI shows is still there


# ------------------------------------------------------------------------------------------------- bad inputs
def test_missing_cache_is_a_clear_error(node: type, models: tuple, handles: ModuleType, tmp_path: Path) -> None:
    handle = handles.StreamDatasetHandle(str(tmp_path / "nothing"), "train")
    with pytest.raises(ValueError, match="no StreamCache cache at .*nothing"):
        _train(node, models[0], handle)


def test_unknown_dataset_names_the_ones_there(node: type, models: tuple, dataset: Any, handles: ModuleType) -> None:
    handle = handles.StreamDatasetHandle(dataset.cache_root, "nope")
    with pytest.raises(ValueError, match=r"dataset 'nope' is not in the cache .*\['empty', 'train'\]"):
        _train(node, models[0], handle)


def test_empty_dataset_is_a_clear_error(node: type, models: tuple, dataset: Any, handles: ModuleType) -> None:
    handle = handles.StreamDatasetHandle(dataset.cache_root, "empty")
    with pytest.raises(ValueError, match="dataset 'empty' .* is empty"):
        _train(node, models[0], handle)
    assert _loader_threads() == []


def test_unknown_algorithm_is_a_clear_error(node: type, models: tuple, dataset: Any) -> None:
    with pytest.raises(ValueError, match="unknown algorithm 'DoRA'; use one of LoRA"):
        _train(node, models[0], dataset, algorithm="DoRA")


# ------------------------------------------------------------------------------------------ values that train wrong
def _poisoned(pack: ModuleType, handles: ModuleType, root: Path, bad_latent: torch.Tensor) -> Any:
    """Three good samples and one whose latent is ``bad_latent`` (valid checksums: stored that way)."""
    writer_mod = _module(pack, "dataset_cache.format.writer")
    sample_cls = _module(pack, "dataset_cache.dataset").Sample
    gen = torch.Generator().manual_seed(5)
    samples = []
    with torch.inference_mode(), writer_mod.CacheWriter(root) as writer:
        for i in range(4):
            value = bad_latent if i == 2 else torch.randn(1, 4, 8, 8, generator=gen)
            writer.add(_key(f"poison-latent{i}"), {"samples": value}, kind="latent")
            writer.add(_key(f"poison-cond{i}"), [[torch.randn(1, 77, 768, generator=gen), {}]], kind="conditioning")
            samples.append(sample_cls(_key(f"poison-latent{i}"), (_key(f"poison-cond{i}"),), source=f"img{i}.png"))
        writer.set_dataset("train", samples)
    return handles.StreamDatasetHandle(str(root), "train")


def test_a_nan_latent_stops_training_at_its_first_batch_naming_it(pack: ModuleType, node: type, models: tuple,
                                                                 handles: ModuleType, tmp_path: Path) -> None:
    bad = torch.randn(1, 4, 8, 8)
    bad[0, 1, 2, 3] = float("nan")
    dataset = _poisoned(pack, handles, tmp_path / "nan_cache", bad)
    training = _module(pack, "nodes.training")
    with pytest.raises(training.NonFiniteLossError) as info:
        _train(node, models[0], dataset, batch_size=1, steps=8, seed=3)
    message = str(info.value)
    assert f"latent {_key('poison-latent2')}" in message and "No LoRA was written" in message
    assert info.value.step <= 4 and info.value.entries == [f"latent {_key('poison-latent2')}"]


def test_an_integer_latent_is_refused_before_any_step(pack: ModuleType, node: type, models: tuple,
                                                      handles: ModuleType, tmp_path: Path,
                                                      monkeypatch: pytest.MonkeyPatch) -> None:
    dataset = _poisoned(pack, handles, tmp_path / "int_cache", torch.zeros(1, 4, 8, 8, dtype=torch.int16))
    training = _module(pack, "nodes.training")
    steps: list[int] = []
    loop = training.loop.StepLoop
    real_fwd_bwd = loop._fwd_bwd
    monkeypatch.setattr(loop, "_fwd_bwd", lambda self, b, i: steps.append(i) or real_fwd_bwd(self, b, i))
    with pytest.raises(ValueError, match=r"sample 2 \(img2.png\): latent entry .* holds torch.int16 samples"):
        _train(node, models[0], dataset)
    assert steps == []


def test_a_batch_larger_than_the_dataset_is_clamped_and_the_node_says_so(node: type, models: tuple,
                                                                         dataset: Any) -> None:
    out = _train(node, models[0], dataset, batch_size=10_000, steps=2)  # the input's maximum
    lora, loss_map, steps = out.result[:3]
    (summary,) = out.ui["text"] if isinstance(out.ui, dict) else out.ui.as_dict()["text"]
    # 6 samples in buckets of 4 (64×64) and 2 (64×96): the largest bucket fills a batch of 4
    assert "batch_size 10000 is larger than this dataset's largest bucket (4 images × repeats per epoch): " \
           "trained with batch_size 4" in summary
    assert steps == 2 and len(loss_map["loss"]) == 2 and lora


@pytest.mark.parametrize("algorithm", ["LoRA", "LoHa", "LoKr", "OFT"])
def test_a_new_lora_is_drawn_again_from_the_cpus_generator_exactly_as_comfyui_draws_it_there(
        pack: ModuleType, models: tuple, algorithm: str) -> None:
    """What the trainer does when a new LoRA's adapters were made on a GPU (the model already there): ComfyUI's
    ``create_train`` on CPU stand-ins of the weights, in module order, from the same seed, gives exactly the values
    ComfyUI's ``_setup_lora_adapters`` draws on the CPU (the same calls on the same generator: equality). Values
    it does not draw again are ComfyUI's constant zeros (bias and 1-D adapters), the same on any device."""
    parts = _module(pack, "nodes.training.comfy_parts")
    train = parts.nodes_train_module()
    mp = models[0].clone()
    with torch.inference_mode(False), torch.random.fork_rng(devices=[]):
        torch.manual_seed(5)
        lora_sd, _ = train._setup_lora_adapters(mp, {}, algorithm, torch.float32, 4)
        drawn = {k: v.detach().clone() for k, v in lora_sd.items()}
        with torch.no_grad():
            for v in lora_sd.values():
                v.fill_(7.0)
        modules = [(n, m) for n, m in mp.model.named_modules()
                   if hasattr(m, "weight_function") and m.weight is not None and m.weight.ndim >= 2]
        torch.manual_seed(5)
        parts._draw_again(train.adapter_maps[algorithm], modules, lora_sd, torch.float32, 4)
    again = [k for k, v in lora_sd.items() if not torch.all(v == 7.0)]
    assert len(again) >= len(modules)  # every adapted matrix has at least one part drawn again
    for key, value in lora_sd.items():
        if key in again:
            assert torch.equal(value, drawn[key]), key
        else:
            assert not torch.any(drawn[key]), key  # left alone: a constant ComfyUI never draws
    assert not parts.draw_new_adapters_on_cpu(train, mp, lora_sd, {}, algorithm, torch.float32, 4)  # on the CPU


def test_a_steps_losses_are_read_once_the_next_step_is_queued(pack: ModuleType) -> None:
    """The loop's lagged losses: a step's values come back at the next step's swap, each with its own step and
    batches and the gradient norm of its optimizer step (``None``: a step cut short), and the last ones when the run
    ends (swap with None); nothing is held after that."""
    lagged = _module(pack, "nodes.training.step_losses").LaggedLosses(torch.device("cpu"))
    first, second = object(), object()
    assert lagged.swap(0, [torch.tensor(1.5), torch.tensor(2.5)], [first, first], torch.tensor(0.25)) is None
    assert lagged.swap(1, [torch.tensor(3.0, dtype=torch.bfloat16)], [second]) == (0, [1.5, 2.5], [first, first], 0.25)
    assert lagged.swap(None, [], []) == (1, [3.0], [second], None)
    assert lagged.swap(None, [], []) is None


def test_the_first_steps_loss_is_reported_at_once_and_each_later_one_a_step_late(
        pack: ModuleType, models: tuple, dataset: Any, monkeypatch: pytest.MonkeyPatch) -> None:
    """The first progress shows when the first step is done (its loss read at once, one wait per run); from the
    second step on a step's loss is read once the next step's work is queued, and the last one after the loop."""
    training = _module(pack, "nodes.training")
    loop = _module(pack, "nodes.training.loop")
    events: list[str] = []
    real_fwd_bwd = loop.StepLoop._fwd_bwd

    def fwd_bwd(self: Any, batch: Any, index: int) -> Any:
        events.append(f"step {index + 1}")
        return real_fwd_bwd(self, batch, index)

    monkeypatch.setattr(loop.StepLoop, "_fwd_bwd", fwd_bwd)
    fields = {f.name for f in dataclasses.fields(training.TrainSettings)}
    settings = training.TrainSettings(**{**{k: v for k, v in FAST.items() if k in fields}, "steps": 4})
    reader, samples = dataset.open()
    try:
        with torch.inference_mode():
            result = training.train_lora(models[0], reader, samples, settings,
                                         on_step=lambda report: events.append(f"report {report.step}"))
    finally:
        reader.close()
    assert events == ["step 1", "report 1", "step 2", "step 3", "report 2", "step 4", "report 3", "report 4"]
    assert len(result.losses) == 4


@pytest.mark.cuda
def test_reading_a_steps_loss_does_not_wait_for_the_next_steps_work(pack: ModuleType) -> None:
    """On CUDA: the loss of step 0 is read while step 1's work (here a long sleep kernel) is still running, so
    the training thread can queue step 2 meanwhile; the value is the one computed. One warm-up run first: the
    first launch of a kernel loads it, and loading a kernel synchronizes the device (CUDA's lazy loading, measured
    on an H200), which a training run pays once and this test must not count."""
    lagged_type = _module(pack, "nodes.training.step_losses").LaggedLosses
    loss = (torch.arange(4, device="cuda", dtype=torch.float32) ** 2).mean()
    warm = lagged_type(torch.device("cuda"))
    for step in (0, 1, None):
        warm.swap(step, [] if step is None else [loss * 2], ["warm-up"])
    torch.cuda.synchronize()
    lagged = lagged_type(torch.device("cuda"))
    assert lagged.swap(0, [loss], ["batch 0"], loss / 2) is None
    torch.cuda._sleep(2_000_000_000)  # ~1 s of device time: step 1's work
    done = lagged.swap(1, [loss * 2], ["batch 1"], loss)
    busy = not torch.cuda.current_stream().query()
    assert done == (0, [3.5], ["batch 0"], 1.75) and busy
    assert lagged.swap(None, [], []) == (1, [7.0], ["batch 1"], 3.5)

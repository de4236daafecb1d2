"""Train LoRA on several devices, on the CPU: ``devices="cpu:2"`` makes this process rank 0 and starts one worker
process (gloo): the code path of several GPUs with NCCL, with the real ComfyUI and the tiny SD1.5-shaped models.

The dataset: four 64×64 images and two 64×96 ones (two buckets), encoded with ComfyUI's own TAESD and CLIP-L.

What "the same LoRA" can mean between 2 ranks × batch b and 1 rank × batch 2b, in fp32 (SGD, so that the update is
a fixed multiple of the gradient and nothing divides by a gradient's own size, as AdamW does per element). Both
train the same rows with the same noise and timesteps (the sampler's global batches, each rank drawing the noise of
the whole global batch and keeping its rows), so they compute the same sums in another order:

* the forward pass runs each conv/matmul on b rows instead of 2b: the kernels may block the reduction over the
  input channels differently, a rounding difference of each output;
* each weight gradient ``dL/dW = Σ dYᵀX`` sums over rows × positions: one sum of 2b·h·w terms on one rank, two sums
  of b·h·w terms added by the all-reduce (then halved: exact) on two; and the loss is a mean of 2b rows' elements
  against the mean of two means.

Each order has the norm-wise rounding bound ``‖ΔC‖ ≤ γ_n ‖A‖‖B‖`` (Higham, ch. 3), ``γ_n ≈ n·2⁻²⁴``, with ``n`` the
longest reduction: 3×3×320 = 2880 (this UNet's widest convolution) in the forward pass, 2·12·8 = 192 positions in a
weight gradient, 128 tokens: ``γ_n < 2e-4``. SGD turns a relative gradient difference into the same relative
difference of the weights' change (the update is ``lr × g``), so each trained tensor's change agrees to ``1e-3``
in norm (``γ_n`` with a factor 5 for the cancellation of ``‖A‖‖B‖`` against ``‖AB‖``), and the loss of each step to
``1e-3`` relative (step 1's from the forward bound alone; later ones on weights that agree that closely). Each
trained tensor is also stored in fp32 after every update, a rounding of up to half an ulp, at most ``2⁻²⁴|w|``
per element, in each run: a tensor that barely moves (a LoRA's ``alpha``, 1.8e-5 in 3 steps) can differ by that
alone, so the weights' bound adds ``STORED_ROUNDINGS · 2⁻²³‖w‖`` (an update of each run per step, 6 steps at
most here) to ``1e-3`` of the change. The
bypass-mode test of test_train_lora.py derives the same bound for another reordering.
"""

from __future__ import annotations

import importlib
import os
import signal
import threading
from collections.abc import Iterator
from pathlib import Path
from types import ModuleType
from typing import Any

import pytest
import torch
from support.comfy_folders import only_folder
from support.encoded import key as _key
from support.encoded import write_comfy_encoded
from support.processes import PROC_READABLE, wait_gone, workers_of

OPTIONS = {
    "batch_size": 1, "grad_accumulation_steps": 1, "steps": 3, "learning_rate": 0.05, "rank": 4,
    "optimizer": "SGD", "loss_function": "MSE", "seed": 11, "training_dtype": "fp32", "lora_dtype": "fp32",
    "algorithm": "LoRA", "gradient_checkpointing": False, "checkpoint_depth": 1, "offloading": False,
    "existing_lora": "[None]", "prefetch_batches": 2, "loader_threads": 0,
}
SIZES = [(64, 64)] * 4 + [(64, 96)] * 2
TOLERANCE = 1e-3
STORED_ROUNDINGS = 6
"""Updates each compared run stores in fp32, at most (the longest run here has 6 steps): see the docstring."""
"""Relative agreement of the trained change and of the losses (derived in the module docstring)."""

pytestmark = pytest.mark.skipif(not PROC_READABLE, reason="the no-orphan checks read /proc (Linux)")


def _module(pack: ModuleType, name: str) -> ModuleType:
    return importlib.import_module(f"{pack.__name__}.{name}")


@pytest.fixture(scope="module")
def node(pack: ModuleType) -> type:
    return _module(pack, "nodes.train_lora").TrainLoRA


@pytest.fixture(scope="module")
def dataset(pack: ModuleType, comfy_nodes: ModuleType, models: tuple, handles: ModuleType,
            tmp_path_factory: pytest.TempPathFactory) -> Any:
    _, clip, vae = models
    root = tmp_path_factory.mktemp("train_ddp") / "cache"

    def odd(sample_cls: Any, samples: list[Any]) -> list[Any]:
        """The same entries with odd buckets: 5 occurrences of 64×64 (sample 0 twice) and one of 64×96."""
        return [sample_cls(samples[0].latent, samples[0].captions, repeats=2, source="img0.png"), *samples[1:5]]

    write_comfy_encoded(pack, comfy_nodes, clip, vae, root, SIZES, seed=1, extra={"odd": odd})
    return handles.StreamDatasetHandle(str(root), "train")


@pytest.fixture(scope="module")
def loras(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Path]:
    """A private ``loras`` folder for the module (a worker finds ``existing_lora`` through rank 0's folders)."""
    with only_folder("loras", tmp_path_factory.mktemp("loras")) as folder:
        yield folder


def _train(node: type, model: Any, dataset: Any, **options: Any) -> Any:
    with torch.inference_mode():  # as ComfyUI runs nodes
        return node.execute(model, dataset, **{**OPTIONS, **options})


@pytest.fixture(scope="module")
def start(node: type, models: tuple, dataset: Any) -> dict[str, torch.Tensor]:
    """The LoRA every run starts from (the seeded initial weights): one step at a learning rate of 1e-30."""
    return _train(node, models[0], dataset, steps=1, learning_rate=1e-30).result[0]


@pytest.fixture(scope="module")
def one(node: type, models: tuple, dataset: Any) -> Any:
    """3 steps on one rank with the global batch (2)."""
    return _train(node, models[0], dataset, batch_size=2).result


def _assert_same_training(got: Any, want: Any, start: dict[str, torch.Tensor]) -> None:
    """``got`` trained what ``want`` trained, within the tolerance of the module docstring."""
    assert sorted(got[0]) == sorted(want[0])
    assert got[1]["loss"] == pytest.approx(want[1]["loss"], rel=TOLERANCE)
    moved = 0
    for key, value in want[0].items():
        change = (value - start[key]).norm()
        moved += bool(change > 0)
        stored = STORED_ROUNDINGS * torch.finfo(torch.float32).eps * value.norm()  # fp32 rounding of the updates
        assert (got[0][key] - value).norm() <= TOLERANCE * change + stored, key
    assert moved >= len(want[0]) // 2  # it did train: most tensors moved


def _no_workers_left() -> None:
    assert wait_gone(os.getpid(), timeout=30) == []
    assert not torch.distributed.is_initialized()  # the process group is gone too: a next run makes its own


# ------------------------------------------------------------------------------------------------- equivalence
def test_two_ranks_train_what_one_rank_trains_with_the_global_batch(node: type, models: tuple, dataset: Any,
                                                                   one: Any, start: dict) -> None:
    two = _train(node, models[0], dataset, batch_size=1, devices="cpu:2").result
    _assert_same_training(two, one, start)
    assert two[2] == 3
    _no_workers_left()


def test_a_learning_rate_schedule_and_validation_on_two_ranks_are_what_they_are_on_one(node: type, models: tuple,
                                                                            dataset: Any, start: dict) -> None:
    """Every rank sets each step's rate from the same schedule: a linear decay after a warm-up step on 2 ranks × 1
    trains what it trains on 1 rank × 2, within the module's tolerance. Rank 0 measures the validation loss of
    the whole validation set (the workers wait for it at the next step): the values agree as the weights do.
    Gradients are clipped after the ranks averaged them (every rank the same global norm, each step's reported
    the same), and the LoRA is the moving average of the weights, the same on every rank; each rank weighs its
    rows' losses by their Min-SNR weights (drawn with its share of the global batch's sigmas), all noised within
    one timestep range."""
    scheduled = {"lr_schedule": "linear", "warmup_steps": 2, "val_dataset": dataset}
    free = _train(node, models[0], dataset, batch_size=2, steps=3, **scheduled).result[1]["grad_norm"]
    scheduled["max_grad_norm"] = sorted(free)[1]  # the steps above the middle norm clipped
    scheduled["ema_decay"] = 0.9  # every rank averages the same weights; rank 0's average is the LoRA
    scheduled["min_snr_gamma"] = 5.0  # each rank weighs its own rows by their own sigmas
    scheduled.update(min_timestep=100, max_timestep=900)  # every rank maps its draws into the same span
    one_rank = _train(node, models[0], dataset, batch_size=2, **scheduled).result
    two = _train(node, models[0], dataset, batch_size=1, devices="cpu:2", **scheduled).result
    _assert_same_training(two, one_rank, start)
    assert two[1]["grad_norm"] == pytest.approx(one_rank[1]["grad_norm"], rel=TOLERANCE)
    assert [s for s, _ in two[1]["val_loss"]] == [s for s, _ in one_rank[1]["val_loss"]] == [0, 3]
    assert [v for _, v in two[1]["val_loss"]] == pytest.approx([v for _, v in one_rank[1]["val_loss"]],
                                                               rel=TOLERANCE)


def test_the_loss_target_pyramid_noise_lion_and_samples_on_two_ranks_are_what_they_are_on_one(
        node: type, models: tuple, dataset: Any) -> None:
    """The loss on the model's prediction (each rank scales its own rows), multi-resolution noise (each row scaled
    by its own deviation, so a rank's rows are those of the global batch), the input perturbation (drawn for the
    global batch, each rank its rows), Lion (every rank steps from the same
    averaged gradients) and sample images (rank 0 samples, the workers wait for it at the next step): 2 ranks × 1
    train what 1 rank × 2 trains, and rank 0's first samples, of the same starting LoRA through the same model
    call, are the single rank's up to rounding: a rank runs with fewer CPU threads, which changes how the BLAS
    kernels sum (1e-4 relative after 2 Euler steps)."""
    chosen = {"loss_target": "prediction", "multires_noise_iterations": 4, "optimizer": "Lion",
              "learning_rate": 1e-3, "sample_count": 1, "sample_steps": 2, "ip_noise_gamma": 0.1}
    start = _train(node, models[0], dataset, steps=1, **{**chosen, "learning_rate": 1e-30}).result[0]
    one_rank = _train(node, models[0], dataset, batch_size=2, **chosen).result
    two = _train(node, models[0], dataset, batch_size=1, devices="cpu:2", **chosen).result
    _assert_same_training(two, one_rank, start)
    assert two[3]["samples"].shape == one_rank[3]["samples"].shape and two[3]["samples"].shape[0] == 2
    first, single = two[3]["samples"][:1], one_rank[3]["samples"][:1]
    torch.testing.assert_close(first, single, rtol=1e-4, atol=1e-5 * float(single.abs().max()))
    _no_workers_left()


def test_chosen_layers_on_two_ranks_are_what_they_are_on_one(node: type, models: tuple, dataset: Any) -> None:
    """``train_layers``: every rank gives adapters to the same layers (rank 0's initial values broadcast by key),
    and 2 ranks × 1 train what 1 rank × 2 trains; with Prodigy (every rank estimates its step size from the same
    averaged gradients) and its ``optimizer_args``, and ``lora_alpha`` (every rank's new adapters get it)."""
    chosen = {"train_layers": "attn, -attn1", "optimizer": "Prodigy", "learning_rate": 1.0, "lora_alpha": 8.0,
              "optimizer_args": "d_coef=0.8 betas=0.9,0.99"}
    start = _train(node, models[0], dataset, steps=1, **{**chosen, "learning_rate": 1e-30}).result[0]
    assert start and all("attn2" in k for k in start)
    assert all(float(v) == 8.0 for k, v in start.items() if k.endswith(".alpha"))
    one_rank = _train(node, models[0], dataset, batch_size=2, **chosen).result
    two = _train(node, models[0], dataset, batch_size=1, devices="cpu:2", **chosen).result
    _assert_same_training(two, one_rank, start)


def test_dropout_on_two_ranks_draws_each_ranks_own_masks_the_same_every_time(node: type, models: tuple,
                                                                             dataset: Any, start: dict) -> None:
    """``module_dropout`` and ``rank_dropout`` on 2 ranks: each rank draws its own rows' choices (seeded by the
    batch and the rank), so a layer may train on one rank and skip on the other in a step (its gradient then
    averages with the other rank's zeros, as a rank without it counts); the same run twice is the same LoRA, bit
    for bit (the same operations, the same two-rank sums), and not the one trained without dropout."""
    dropout = {"module_dropout": 0.5, "rank_dropout": 0.5}
    a = _train(node, models[0], dataset, batch_size=1, devices="cpu:2", **dropout).result
    b = _train(node, models[0], dataset, batch_size=1, devices="cpu:2", **dropout).result
    plain = _train(node, models[0], dataset, batch_size=1, devices="cpu:2").result
    assert a[1]["loss"] == b[1]["loss"] and all(torch.equal(a[0][k], b[0][k]) for k in a[0])
    assert any(not torch.equal(a[0][k], plain[0][k]) for k in a[0])
    assert sum(not torch.equal(a[0][k], start[k]) for k in a[0]) >= len(a[0]) // 2  # it did train
    _no_workers_left()


def test_short_batches_and_stand_in_rows_train_what_one_rank_trains(node: type, models: tuple, dataset: Any,
                                                                    handles: ModuleType, start: dict) -> None:
    """Global batch 4 over buckets of 5 and 1 occurrences: batches of 4, 1 and 1 rows (kohya's short last batch).
    Two ranks share 4 rows as 2 + 2, and a single row as 1 + a stand-in of weight 0 (the row alone weighs twice on
    its rank, so the ranks' mean is the row's loss): what one rank × 4 trains, within the same tolerance."""
    odd = handles.StreamDatasetHandle(dataset.cache_root, "odd")
    one_rank = _train(node, models[0], odd, batch_size=4).result
    two = _train(node, models[0], odd, batch_size=2, devices="cpu:2").result
    _assert_same_training(two, one_rank, start)


def test_a_run_continues_on_two_ranks_where_one_rank_stopped(node: type, models: tuple, dataset: Any, one: Any,
                                                            start: dict, loras: Path) -> None:
    """Elastic determinism through the node: 3 steps on 1 rank × 2, saved; 3 more on 2 ranks × 1 (the worker loads
    the saved LoRA by name and its training state from rank 0's output folder, and the sampler continues at the 4th
    global batch) == 6 steps on 1 rank × 2."""
    from safetensors.torch import save_file

    save_file(one[0], str(loras / "half_3_steps_00001_.safetensors"))
    out = _train(node, models[0], dataset, batch_size=1, devices="cpu:2",
                 existing_lora="half_3_steps_00001_.safetensors")
    rest = out.result
    (summary,) = out.ui["text"] if isinstance(out.ui, dict) else out.ui.as_dict()["text"]
    # every rank restored the first run's training state (checked equal across ranks before the first step)
    assert "continued 'half_3_steps_00001_.safetensors' from its training state" in summary, summary
    whole = _train(node, models[0], dataset, batch_size=2, steps=6).result
    assert whole[1]["loss"][:3] == one[1]["loss"]  # the same computation: bit for bit
    assert rest[2] == 6
    _assert_same_training((rest[0], {"loss": rest[1]["loss"]}, 6), (whole[0], {"loss": whole[1]["loss"][3:]}, 6),
                          start)


def test_patches_applied_upstream_reach_the_worker(node: type, models: tuple, dataset: Any, comfy_nodes: ModuleType,
                                                   one: Any, start: dict, loras: Path) -> None:
    """A LoRA loaded before training (weight patches) and Model Sampling Discrete (an object patch whose class
    ComfyUI defines inside the node function) are rebuilt in the worker: 2 ranks train what 1 rank trains on the
    patched model, and that differs from training the plain model."""
    from safetensors.torch import save_file

    save_file(one[0], str(loras / "upstream.safetensors"))
    (patched,) = comfy_nodes.LoraLoaderModelOnly().load_lora_model_only(models[0], "upstream.safetensors", 1.0)
    sampling = importlib.import_module("comfy_extras.nodes_model_advanced").ModelSamplingDiscrete()
    (patched,) = sampling.patch(patched, "v_prediction", False)
    assert patched.patches and "model_sampling" in patched.object_patches
    one_patched = _train(node, patched, dataset, batch_size=2).result
    two_patched = _train(node, patched, dataset, batch_size=1, devices="cpu:2").result
    # the patches change the training far beyond the tolerance, so a worker without them would fail the check
    assert one_patched[1]["loss"][0] != pytest.approx(one[1]["loss"][0], rel=10 * TOLERANCE)
    _assert_same_training(two_patched, one_patched, start)


def test_a_patch_that_cannot_reach_a_worker_is_refused_by_name_before_any_process_starts(
        pack: ModuleType, node: type, models: tuple, dataset: Any, monkeypatch: pytest.MonkeyPatch) -> None:
    started: list[int] = []
    monkeypatch.setattr(_module(pack, "dataset_cache.workers").WorkerPool, "start",
                        lambda self, payloads: started.append(1))
    wrapped = models[0].clone()

    def local_wrapper(apply_model: Any, args: dict) -> Any:
        return apply_model(args["input"], args["timestep"], **args["c"])
    wrapped.set_model_unet_function_wrapper(local_wrapper)
    with pytest.raises(ValueError, match=r"the model's model_options\['model_function_wrapper'\] \(.*local_wrapper"
                                         r".*cannot be sent to the worker processes.*devices '0'"):
        _train(node, wrapped, dataset, devices="cpu:2")
    unknown = models[0].clone()
    unknown.cached_patcher_init = None
    with pytest.raises(ValueError, match="does not record how to load it again.*Load Diffusion Model"):
        _train(node, unknown, dataset, devices="cpu:2")
    in_memory = models[0].clone()  # a recipe carrying the weights themselves, not a file (each worker: a copy)
    in_memory.cached_patcher_init = (torch.zeros, ({"weights": torch.zeros(5 << 20)},))
    with pytest.raises(ValueError, match="holds 20.0 MiB of weights in memory rather than a file to load"):
        _train(node, in_memory, dataset, devices="cpu:2")
    assert started == [] and workers_of(os.getpid()) == []


def test_auto_falls_back_to_one_device_for_a_model_that_cannot_reach_workers(pack: ModuleType, node: type,
                                                                            models: tuple, dataset: Any,
                                                                            monkeypatch: pytest.MonkeyPatch) -> None:
    """``auto`` on a machine with several GPUs (stood in for by a plan of 2 CPU ranks) trains a model the workers
    cannot rebuild on one device, as before #26, and the node says so; a list naming the devices refuses it."""
    distributed = _module(pack, "nodes.training.distributed")
    plan = _module(pack, "dataset_cache.devices").DevicePlan("cpu", (0, 1))
    monkeypatch.setattr(distributed, "parse_devices", lambda spec, **kw: plan)
    monkeypatch.setattr(_module(pack, "dataset_cache.workers").WorkerPool, "start",
                        lambda self, payloads: pytest.fail("no worker may start"))
    wrapped = models[0].clone()
    wrapped.set_model_unet_function_wrapper(lambda apply_model, args: apply_model(args["input"], args["timestep"],
                                                                                  **args["c"]))
    out = _train(node, wrapped, dataset, devices="auto", steps=1)
    (summary,) = out.ui["text"] if isinstance(out.ui, dict) else out.ui.as_dict()["text"]
    assert "NOTE: devices 'auto' trained on one device, not on 2 CPU processes: training on several devices: the " \
           "model's model_options['model_function_wrapper']" in summary
    assert len(out.result[1]["loss"]) == 1
    with pytest.raises(ValueError, match="model_function_wrapper"):
        _train(node, wrapped, dataset, devices="cpu:2", steps=1)


def test_node_defaults_bf16_checkpointing_and_accumulation_on_two_ranks(node: type, models: tuple,
                                                                      dataset: Any) -> None:
    """bf16 autocast and adapters (gradients reduced in fp32, weights broadcast as fp32), gradient checkpointing and
    two accumulated batches per step: the paths the fp32 tests do not take."""
    out = _train(node, models[0], dataset, devices="cpu:2", steps=2, grad_accumulation_steps=2, optimizer="AdamW",
                 learning_rate=1e-3, training_dtype="bf16", lora_dtype="bf16", gradient_checkpointing=True).result
    assert len(out[1]["loss"]) == 2 and all(v == v and abs(v) < 1e6 for v in out[1]["loss"])
    assert {v.dtype for v in out[0].values()} == {torch.bfloat16}
    _no_workers_left()


def test_devices_a_cpu_comfyui_cannot_use_are_named(node: type, models: tuple, dataset: Any) -> None:
    with pytest.raises(ValueError, match="devices '0,1': this ComfyUI trains on cpu, not on CUDA devices"):
        _train(node, models[0], dataset, devices="0,1")


def test_the_global_batch_is_what_the_largest_bucket_clamps(pack: ModuleType, dataset: Any) -> None:
    """batch_size × devices rows of one bucket make a global batch: the largest bucket (4 occurrences) holds
    batch 2 × 2 devices, or 1 per device on 3 or 4; not 5 devices."""
    run = _module(pack, "nodes.training.run")
    settings = _module(pack, "nodes.training").TrainSettings(batch_size=2)
    reader, samples = dataset.open()
    try:
        assert run.plan_data(reader, samples, settings, None, "", 2).settings.batch_size == 2
        plan = run.plan_data(reader, samples, settings, None, "", 3)
        assert plan.settings.batch_size == 1
        assert plan.notes == ["batch_size 2 × 3 devices is larger than this dataset's largest bucket (4 images × "
                              "repeats per epoch): trained with batch_size 1 per device"]
        with pytest.raises(ValueError, match="training on 5 devices needs at least 5 images × repeats in the "
                                             "largest bucket .* this dataset has 4"):
            run.plan_data(reader, samples, settings, None, "", 5)
    finally:
        reader.close()


# ---------------------------------------------------------------------------------------- stopping and failing
class _Hook:
    """ComfyUI's progress hook, doing ``action`` once at ``at`` steps (rank 0 updates it after each step)."""

    def __init__(self, at: int, action: Any) -> None:
        self.at, self.action = at, action
        self.updates: list[int] = []
        self.fired: list[int] = []

    def __call__(self, value: int, total: int, preview: Any, node_id: str | None = None) -> None:
        self.updates.append(value)
        if value >= self.at and not self.fired:
            self.fired.append(value)
            self.action()


@pytest.fixture
def progress_hook() -> Iterator[Any]:
    import comfy.model_management
    import comfy.utils

    saved = comfy.utils.PROGRESS_BAR_HOOK

    def install(hook: _Hook) -> _Hook:
        comfy.utils.set_progress_bar_global_hook(hook)
        return hook
    yield install
    comfy.utils.set_progress_bar_global_hook(saved)
    comfy.model_management.interrupt_current_processing(False)


def test_cancel_stops_every_rank_at_the_same_step_and_leaves_no_process(node: type, models: tuple, dataset: Any,
                                                                       progress_hook: Any,
                                                                       caplog: pytest.LogCaptureFixture) -> None:
    import comfy.model_management

    hook = progress_hook(_Hook(2, lambda: comfy.model_management.interrupt_current_processing(True)))
    with caplog.at_level("INFO", logger="dataset_cache.workers"), \
            pytest.raises(comfy.model_management.InterruptProcessingException):
        _train(node, models[0], dataset, steps=50, devices="cpu:2")
    assert hook.fired and hook.updates[-1] == hook.fired[0]  # no step finished after the one that saw Cancel
    assert "worker rank 1" in caplog.text and "ended: stopped, exited with code 0" in caplog.text  # agreed, not killed
    assert "did not exit" not in caplog.text
    _no_workers_left()
    assert [t.name for t in threading.enumerate() if t.name.startswith(("dataset_cache-loader", "streamcache-ddp"))] \
        == []
    assert comfy.model_management.in_training is False


def test_cancel_on_two_ranks_saves_rank_0s_lora_of_the_agreed_step(node: type, models: tuple, dataset: Any,
                                                                   progress_hook: Any, tmp_path: Path,
                                                                   monkeypatch: pytest.MonkeyPatch) -> None:
    """save_every on two ranks: rank 0 alone writes (the ranks hold the same LoRA), and a Cancel saves the steps
    every rank finished before agreeing to stop, with the training state to continue them."""
    import comfy.model_management
    import folder_paths

    monkeypatch.setattr(folder_paths, "output_directory", str(tmp_path))
    hook = progress_hook(_Hook(2, lambda: comfy.model_management.interrupt_current_processing(True)))
    with pytest.raises(comfy.model_management.InterruptProcessingException):
        _train(node, models[0], dataset, steps=50, devices="cpu:2", save_every=100)
    done = hook.updates[-1]
    saved = sorted(p.relative_to(tmp_path).as_posix() for p in tmp_path.rglob("*.safetensors")
                   if "streamcache_train_state" not in p.parts)
    assert saved == [f"loras/streamcache_lora_{done}_steps_00001_.safetensors"]
    assert len(list((tmp_path / "streamcache_train_state").iterdir())) == 1
    _no_workers_left()


def test_a_killed_worker_fails_the_node_naming_its_rank_and_the_next_run_works(node: type, models: tuple,
                                                                               dataset: Any, pack: ModuleType,
                                                                               progress_hook: Any) -> None:
    killed: list[int] = []

    def kill() -> None:
        for pid in workers_of(os.getpid()):
            os.kill(pid, signal.SIGKILL)
            killed.append(pid)
    progress_hook(_Hook(2, kill))
    failed = _module(pack, "dataset_cache.workers").WorkerFailedError
    with pytest.raises(failed, match=r"failed on rank 1: the worker \(pid (\d+)\) was killed by SIGKILL") as info:
        _train(node, models[0], dataset, steps=50, devices="cpu:2")
    assert killed and f"pid {killed[0]}" in str(info.value)
    _no_workers_left()
    again = _train(node, models[0], dataset, steps=1, devices="cpu:2").result
    assert len(again[1]["loss"]) == 1
    _no_workers_left()


def test_a_worker_error_names_the_rank_and_carries_its_traceback(pack: ModuleType, node: type, models: tuple,
                                                                 handles: ModuleType, tmp_path: Path) -> None:
    """A NaN latent that only rank 1 reads: rank 1 stops with the trainer's own message, rank 0 reports it."""
    sharding = _module(pack, "dataset_cache.sharding")
    sample_cls = _module(pack, "dataset_cache.dataset").Sample
    writer_mod = _module(pack, "dataset_cache.format.writer")
    samples = [sample_cls(_key(f"nan-latent{i}"), (_key(f"nan-cond{i}"),), source=f"img{i}.png") for i in range(2)]
    rank1 = sharding.RowShardSampler(samples, [(4, 8, 8)] * 2, 1, 5, rank=1, world_size=2, tail="wrap")
    (bad,) = rank1.plan(0, 0).sample_indices  # the sample rank 1 trains first
    gen = torch.Generator().manual_seed(2)
    root = tmp_path / "cache"
    with torch.inference_mode(), writer_mod.CacheWriter(root) as writer:
        for i, sample in enumerate(samples):
            latent = torch.full((1, 4, 8, 8), float("nan")) if i == bad else torch.randn(1, 4, 8, 8, generator=gen)
            writer.add(sample.latent, {"samples": latent}, kind="latent")
            writer.add(sample.captions[0], [[torch.randn(1, 77, 768, generator=gen), {}]], kind="conditioning")
        writer.set_dataset("train", samples)
    dataset = handles.StreamDatasetHandle(str(root), "train")
    failed = _module(pack, "dataset_cache.workers").WorkerFailedError
    with pytest.raises(failed, match="failed on rank 1: NonFiniteLossError: training stopped at step 1") as info:
        _train(node, models[0], dataset, seed=5, devices="cpu:2")
    assert f"latent {samples[bad].latent}" in str(info.value)
    assert "raise NonFiniteLossError" in info.value.details  # the worker's traceback
    _no_workers_left()

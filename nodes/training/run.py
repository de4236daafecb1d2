"""``train_lora``: one training run as its steps — plan the data, load the model and adapters, run the step loop,
release — each its own function, so a step (the memory plan, say) changes without touching the others."""

from __future__ import annotations

import dataclasses
import logging
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from types import ModuleType
from typing import Any, NamedTuple

import torch

import comfy.model_management
import comfy.model_patcher
import comfy.sampler_helpers
import comfy.samplers

from ...dataset_cache.dataset import Sample
from ...dataset_cache.dataset_mix import DatasetMix, Regularization
from ...dataset_cache.ema import WeightAverage
from ...dataset_cache.latent_buckets import buckets_from_reader, fit_batch_size
from ...dataset_cache.layer_filter import LayerFilter
from ...dataset_cache.loader import PrefetchLoader
from ...dataset_cache.memory_plan import MemoryPlan
from ...dataset_cache.reading import DatasetReader
from ...dataset_cache.sample_choice import choose_sample_rows
from ...dataset_cache.sampler import BucketSampler
from ...dataset_cache.sharding import shard_sampler
from ...dataset_cache.seeding import derive_seed
from ...dataset_cache.trainable import check_trainable
from .comfy_parts import (
    bypass_setup, check_latent_channels, draw_new_adapters_on_cpu, load_existing_lora, nodes_train_module, release,
    resume_exactly, set_alpha, training_dtypes,
)
from .conditioning import Conditioner, ModelCall, unread_references
from .dropout import AdapterDropout
from .distributed import plan_team
from .layers import LayerChoice, choose_layers
from .loop import StepLoop
from .memory import MemoryStep, plan_run_memory
from .optimizers import create_optimizer, optimizer_info, optimizer_notes
from .report import (RowCounts, Startup, StepReport, TrainResult, counted, describe_rates, overlap_notes,
                     validation_overlap_notes)
from .resume import Start, TrainState, capture_state, resume_run, save_state
from .sample_prompts import NO_PROMPTS, SamplePrompts
from .samples import Sampling, SamplingPlan, sized_plan
from .saves import RunSaves, lora_weights
from .settings import TrainSettings
from .validation import Validation

__all__ = ["train_lora"]

log = logging.getLogger("streamcache.train")


def train_lora(
    model: Any,
    reader: DatasetReader,
    samples: Sequence[Sample] | DatasetMix,
    settings: TrainSettings,
    *,
    on_step: Callable[[StepReport], None] | None = None,
    reg: Sequence[Sample] | DatasetMix | None = None,
    reg_name: str = "the regularization dataset",
    on_plan: Callable[[MemoryPlan], None] | None = None,
    world: Any = None,
    on_saved: Callable[[int, str], None] | None = None,
    val: Sequence[Sample] | DatasetMix | None = None,
    on_sampled: Callable[[int, torch.Tensor], None] | None = None,
    sample_prompts: SamplePrompts = NO_PROMPTS,
    lora_metadata: Mapping[str, str] | None = None,
) -> TrainResult:
    """Train a LoRA (or LoHa/LoKr/OFT) on ``model`` over the cached ``samples`` and return its weights.

    Runs on the calling thread (ComfyUI's execution thread): the interrupt flag is checked before every batch and
    while waiting for data, so Cancel stops within one batch; the loader's threads are stopped and joined whatever
    happens. The model passed in is not modified (a deep copy is trained and discarded).

    Args:
        model: a ComfyUI ``ModelPatcher`` (the ``MODEL`` socket's value).
        reader: the open cache reader of the datasets: a ``CacheReader``, or a ``MultiCacheReader`` when they (or
            the regularization set) live in several caches.
        samples: the dataset's samples, or a :class:`~dataset_cache.dataset_mix.DatasetMix` of several datasets.
        settings: the options; validated here.
        on_step: called after every optimizer step on this thread (progress, websocket events).
        reg: regularization samples (read through ``reader`` too), mixed in at ``settings.reg_ratio`` with loss weight
            ``settings.reg_weight``; ``None``: none.
        reg_name: the regularization dataset's name, for messages.
        on_plan: called with the memory plan before the first step (the node shows it).
        on_saved: called with the total steps and the file (``output/...``) of each save of ``save_every``, from the
            thread that wrote it (the node shows it).
        val: validation samples (read through ``reader`` too): their loss is measured before the first step, every
            ``settings.val_every`` steps and after the last (:mod:`.validation`); ``None``: none.
        on_sampled: called with the steps this run has done and the latents of each sampling of
            ``settings.sample_count`` (:mod:`.samples`), on this thread (the node previews it).
        sample_prompts: the node's ``sample_prompt`` (replacing the cached captions) and ``sample_negative`` (the
            empty caption's place).
        lora_metadata: the training keys the saves of ``save_every`` write into their files
            (:func:`.lora_output.describe_training`); ``None``: none.
        world: a worker's own collective (``nodes/training/worker.py``); not for callers. Where to train is
            ``settings.devices``: several devices train data-parallel with a global batch of ``batch_size`` ×
            devices (see :mod:`.distributed`).

    Raises:
        ValueError: bad settings, an empty dataset, or latents the model cannot take.
        comfy.model_management.InterruptProcessingException: the user cancelled the run.
    """
    startup = Startup()
    settings.validate()
    team = plan_team(settings.devices, model, reader, world)
    data = plan_data(reader, samples, settings, reg, reg_name, team.size, val, sample_prompts)
    data.sampling = sized_plan(data.sampling, model, settings.sample_width, settings.sample_height, data.shapes)
    data.notes.extend(team.notes)
    train = nodes_train_module()
    existing, name_steps = load_existing_lora(settings.existing_lora)
    startup.mark("data")
    with torch.inference_mode(False), team.started(model, samples, settings, reg, reg_name):
        settings = data.settings
        run = load(model, train, data, existing)
        team.same_adapters(run.lora_sd)
        data.notes.extend(team.joined_notes)
        startup.mark("model")
        run.memory = plan_run_memory(run, reader, data.rows, data.shapes, on_plan)
        startup.mark("memory plan")
        parts = start_steps(run, data, reader, samples, existing, name_steps, team, startup, (on_saved, on_sampled),
                            lora_metadata)
        outcome = run_steps(run, train, reader, parts.sampler, parts.loop, team, parts.saves, startup, on_step)
        # rank 0's run is the one to continue; a save of its last step already wrote this state
        saved_at_end = parts.saves is not None and parts.saves.holds_the_end(parts.start.steps + settings.steps)
        state = capture_state(run, parts.sampler, parts.start) if team.is_main and not saved_at_end else None
        lora = finish(run)  # releases the optimizer (after the state is captured)
    return train_result(run, data, parts, outcome, lora, state, startup, team.describe(settings.batch_size))


class RunParts(NamedTuple):
    """What the step loop of a loaded run is made of: its sampler, where it starts (a continued LoRA's steps,
    optimizer and batch order), its saves of ``save_every`` (``None``: none, or not the main rank) and the loop."""

    sampler: BucketSampler
    start: Start
    saves: RunSaves | None
    loop: StepLoop


def start_steps(run: LoadedRun, data: DataPlan, reader: DatasetReader, samples: Sequence[Sample] | DatasetMix,
                existing: dict[str, torch.Tensor], name_steps: int | None, team: Any, startup: Startup,
                callbacks: tuple[Callable[[int, str], None] | None, Callable[[int, torch.Tensor], None] | None],
                lora_metadata: Mapping[str, str] | None = None) -> RunParts:
    """The sampler of this rank's batches, where the run starts (continuing ``existing``: its optimizer, steps and
    batch order, agreed by every rank), the weights' average, the saves and the step loop; ``callbacks``: the
    node's for each save and each sampling; ``lora_metadata``: what the saves write into their files."""
    settings = run.settings
    on_saved, on_sampled = callbacks
    sampler = shard_sampler(samples, data.buckets, settings.batch_size, settings.seed, tail="short",
                            rank=team.rank, world_size=team.size, caption_dropout=settings.caption_dropout,
                            reg=data.regularization)
    start = resume_run(run, sampler, existing, name_steps)  # continuing: optimizer, steps, batch order
    team.same_start(start.steps, start.first_batch, sampler.position, run.optimizer)
    if settings.ema_decay > 0:  # after the trained weights (and the saved average) are restored
        run.average = WeightAverage(run.lora_sd, settings.ema_decay, start.average)
    saves = (RunSaves(run, sampler, start, on_saved, lora_metadata) if settings.save_every > 0 and team.is_main
             else None)
    loop = make_loop(run, data, reader, start, team, startup, saves)
    if data.sampling is not None and team.is_main:  # rank 0 samples, as it validates
        loop.sampling = Sampling(
            loop, reader, data.sampling, batch_size=settings.batch_size, seed=settings.samples_seed,
            every=settings.sample_every, last=start.steps + settings.steps, steps=settings.sample_steps,
            cfg=settings.sample_cfg, sampler=settings.sample_sampler, scheduler=settings.sample_scheduler,
            on_sampled=on_sampled,
            interrupt=comfy.model_management.throw_exception_if_processing_interrupted if team.size == 1 else None)
    return RunParts(sampler, start, saves, loop)


def train_result(run: LoadedRun, data: DataPlan, parts: RunParts,
                 outcome: tuple[list[float], float, int, float, RowCounts], lora: dict[str, torch.Tensor],
                 state: TrainState | None, startup: Startup, where: str | None = None) -> TrainResult:
    """The run's result once its steps are done: the training state written beside the LoRA (``state``, rank 0's
    when no save of the last step holds it), and the notes and info lines that say what the run did (``where``:
    the ranks of a run on several devices, first)."""
    settings, start, saves, loop = run.settings, parts.start, parts.saves, parts.loop
    losses, seconds, rows, waited, counts = outcome
    notes, info = save_state(state, lora) if state is not None else ([], [])
    if saves is not None:
        notes, info = [*saves.notes, *notes], [*saves.describe(), *info]
    info = [*describe_rates(settings.lr_schedule_after(start.steps), start.steps, settings.steps), *info]
    if run.average is not None:
        info.append(f"the LoRA is the moving average of its weights (ema_decay {settings.ema_decay:g})")
    if settings.multires_noise_iterations > 0:
        info.append(f"multi-resolution noise: {settings.multires_noise_iterations} levels, each coarser one weighing "
                    f"{settings.multires_noise_discount:g} times the one before")
    info += loop.loss.describe()
    if run.layers is not None and not run.layers.filter.everything:
        info.append(run.layers.describe())
    if loop.percent_span != (0.0, 1.0):
        lo, hi = loop.percent_span
        info.append(f"noised at the model's timesteps {settings.min_timestep} to {settings.max_timestep} (from "
                    f"{lo:.1%} to {hi:.1%} of its schedule)")
    info.extend(run.closing_info)
    if loop.validation is not None:
        info.insert(0, loop.validation.describe())
    if where is not None:
        info.insert(0, where)
    if loop.sampling is not None:
        info.append(loop.sampling.describe())
    return TrainResult(lora, losses, settings.steps + start.steps, seconds, rows / seconds if seconds else 0.0,
                       100.0 * waited / seconds if seconds > 0 else 0.0, dict(parts.sampler.buckets),
                       (*data.notes, *run.memory.notes(), *start.notes, *notes), counts, (*start.info, *info),
                       run.memory.report(), dict(startup.phases),
                       {"waited_s": saves.waited, "written_s": saves.written} if saves is not None else {},
                       list(loop.validation.results) if loop.validation is not None else [],
                       grad_norms=list(loop.grad_norms), max_grad_norm=settings.max_grad_norm,
                       samples=loop.sampling.latents() if loop.sampling is not None else None)


def run_steps(run: LoadedRun, train: ModuleType, reader: DatasetReader, sampler: BucketSampler, loop: StepLoop,
              team: Any, saves: RunSaves | None, startup: Startup, on_step: Callable[[StepReport], None] | None
              ) -> tuple[list[float], float, int, float, RowCounts]:
    """The steps themselves: the loader over ``sampler``, the model on the device, the step loop. Whatever happens,
    the loader's threads are joined, the model is released and the last save of ``save_every`` is on disk before
    this returns or raises. Returns the loop's results and the rows trained, counted over every rank.

    Raises:
        torch.OutOfMemoryError: with the memory plan's hint of what to try, where it has one.
    """
    settings = run.settings
    loader = PrefetchLoader(  # noise, sigmas and row weights drawn on its workers: loop.per_batch
        reader, sampler, prefetch_batches=settings.prefetch_batches,
        threads=settings.loader_threads or None, device=run.loader_device, epochs=None,
        on_wait=comfy.model_management.throw_exception_if_processing_interrupted if team.size == 1 else None,
        per_batch=loop.per_batch,
    )
    counts = RowCounts.for_settings(settings.masked_loss, settings.unmasked_weight)
    startup.mark("loader")
    try:
        prepare(run, train)
        startup.mark("model to device")
        losses, seconds, rows, waited = loop.run(counted(iter(loader), counts, sampler.main_samples), on_step)
        counts = team.total(counts)
    except torch.OutOfMemoryError as error:
        hint = run.memory.out_of_memory_hint()
        if not hint:
            raise
        raise torch.OutOfMemoryError(f"{error}\n{hint}") from error
    finally:
        loader.close()
        unprepare(run, train)
        if saves is not None:
            saves.wait()  # the last save on disk before the run's own state (and before an error leaves)
    return losses, seconds, rows, waited, counts


def make_loop(run: LoadedRun, data: DataPlan, reader: DatasetReader, start: Start, team: Any, startup: Startup,
              saves: RunSaves | None) -> StepLoop:
    """The step loop of a loaded run: its learning-rate schedule over the existing LoRA's steps and this run's, its
    first batch, its saves, and the validation of ``data.validation`` measured through it."""
    settings = run.settings
    loop = StepLoop(run.mp, settings, run.dtype, run.loss_fn, run.optimizer, run.scaler,
                    ModelCall(run.mp, run.model_options), Conditioner(run.mp.model, run.device), run.device,
                    first_batch=start.first_batch, world=team.collective, startup=startup, save=saves,
                    schedule=settings.lr_schedule_after(start.steps), first_step=start.steps)
    loop.average = run.average
    loop.dropout = run.dropout
    if data.validation is not None:
        loop.validation = Validation(
            loop, reader, *data.validation, batch_size=settings.batch_size, seed=settings.seed,
            every=settings.val_every, last=start.steps + settings.steps, device=run.loader_device,
            interrupt=comfy.model_management.throw_exception_if_processing_interrupted if team.size == 1 else None)
    return loop


@dataclass
class DataPlan:
    """What the run trains on, decided from the headers before any model loads.

    Attributes:
        settings: the settings, with a batch size clamped to the largest bucket.
        buckets: each main sample's latent shape.
        regularization: the regularization set, or ``None``.
        shapes: every latent shape the run will see (main and regularization).
        notes: settings the run had to change, for the user.
        rows: the sample of each of ``shapes`` (the memory probe reads the largest one's caption).
        validation: the validation samples (each once) and their buckets, or ``None``.
        sampling: what ``sample_count`` samples (:class:`~.samples.SamplingPlan`), or ``None``.
    """

    settings: TrainSettings
    buckets: list[tuple[int, ...]]
    regularization: Regularization | None
    shapes: list[tuple[int, ...]]
    notes: list[str]
    rows: list[Sample]
    validation: tuple[list[Sample], list[tuple[int, ...]]] | None = None
    sampling: SamplingPlan | None = None


def plan_data(reader: DatasetReader, samples: Sequence[Sample] | DatasetMix, settings: TrainSettings,
              reg: Sequence[Sample] | DatasetMix | None, reg_name: str, ranks: int = 1,
              val: Sequence[Sample] | DatasetMix | None = None,
              sample_prompts: SamplePrompts = NO_PROMPTS) -> DataPlan:
    """Buckets, the regularization set and the batch size, checked before any model loads.

    With several ``ranks`` a global batch is ``batch_size × ranks`` rows of one bucket; it is what is clamped.

    Raises:
        ValueError: an empty dataset, or entries the trainer cannot take (integer latents, combined or area
            conditionings).
    """
    main = samples.samples if isinstance(samples, DatasetMix) else samples
    if not main:
        raise ValueError("the dataset has no samples; encode a folder with images first")
    buckets = buckets_from_reader(reader, main)
    check_trainable(reader, main)
    regularization = None
    shapes, rows = list(buckets), list(main)
    if reg is not None:
        reg_samples = reg.samples if isinstance(reg, DatasetMix) else reg
        reg_buckets = buckets_from_reader(reader, reg_samples)
        check_trainable(reader, reg_samples)
        regularization = Regularization(reg, reg_buckets, settings.reg_ratio, settings.reg_weight, name=reg_name)
        shapes += reg_buckets
        rows += reg_samples
    notes: list[str] = [] if reg is None else overlap_notes(samples, reg, reg_name)
    validation = None
    if val is not None:  # each sample once, whatever its repeats; its shapes join the memory probe's
        val_samples = list(dict.fromkeys(dataclasses.replace(s, repeats=1)
                                         for s in (val.samples if isinstance(val, DatasetMix) else val)))
        val_buckets = buckets_from_reader(reader, val_samples)
        check_trainable(reader, val_samples)
        validation = (val_samples, val_buckets)
        shapes += val_buckets
        rows += val_samples
        notes += validation_overlap_notes(samples, val_samples)
    sampling = _sampling_plan(main, buckets, validation, settings, sample_prompts)
    fitted = fit_batch_size(main, buckets, settings.batch_size * ranks) // ranks
    if ranks > 1 and fitted < 1:
        raise ValueError(f"training on {ranks} devices needs at least {ranks} images × repeats in the largest "
                         f"bucket (one per device in each global batch), this dataset has "
                         f"{fit_batch_size(main, buckets, ranks)}: train on fewer devices or raise the repeats")
    if fitted < settings.batch_size:  # a batch holds one bucket, so it cannot be larger: clamp, and say so
        notes.append(f"batch_size {settings.batch_size} is larger than this dataset's largest bucket ({fitted} "
                     f"images × repeats per epoch): trained with batch_size {fitted}" if ranks == 1 else
                     f"batch_size {settings.batch_size} × {ranks} devices is larger than this dataset's largest "
                     f"bucket ({fit_batch_size(main, buckets, settings.batch_size * ranks)} images × repeats per "
                     f"epoch): trained with batch_size {fitted} per device")
        log.warning("Train LoRA: %s", notes[-1])
        settings = dataclasses.replace(settings, batch_size=fitted)
    return DataPlan(settings, buckets, regularization, shapes, notes, rows, validation, sampling)


def _sampling_plan(main: Sequence[Sample], buckets: Sequence[tuple[int, ...]],
                   validation: tuple[list[Sample], list[tuple[int, ...]]] | None, settings: TrainSettings,
                   prompts: SamplePrompts) -> SamplingPlan | None:
    """What ``sample_count`` samples: the captions of the validation set when there is one (captions the LoRA never
    trains on), else of the dataset, or the node's prompts (``sample_prompt``, ``sample_texts``), at the chosen
    bucket's shape; ``None`` without sampling.

    Raises:
        ValueError: ``sample_cfg`` above 1 without a ``sample_negative`` and a chosen sample has no empty caption
            to guide against.
    """
    if settings.sample_count == 0:
        return None
    pool, shapes = validation if validation is not None else (main, buckets)
    chosen, shape = choose_sample_rows(pool, shapes, settings.sample_count)
    needed = chosen[:1] if prompts.given else chosen
    missing = [s.source or s.latent for s in needed if s.empty_caption is None]
    if prompts.needs_empty_caption(settings.sample_cfg) and missing:
        scale = f"sample_cfg {settings.sample_cfg:g}" if settings.sample_cfg > 1 else "a sample_texts line's --l"
        raise ValueError(f"{scale} guides each sample image against the empty caption, "
                         f"which this dataset has not encoded ({', '.join(missing[:3])}): encode it with Encode "
                         "Dataset's empty_caption on, connect a sample_negative, or sample without guidance "
                         "(sample_cfg 1, no line's --l above 1)")
    count = settings.sample_count if prompts.given else len(chosen)
    return SamplingPlan(chosen, shape, count, prompts)


@dataclass
class LoadedRun:
    """The training clone and everything made for it: adapters, optimizer, loss, options."""

    mp: Any
    settings: TrainSettings
    dtype: torch.dtype
    adapter_dtype: torch.dtype
    lora_sd: dict[str, torch.Tensor]
    adapters: list[Any]
    bypass: Any
    optimizer: Any
    loss_fn: Any
    scaler: Any
    model_options: dict[str, Any]
    injections: list[Any] = dataclasses.field(default_factory=list)
    fp8_bwd: bool = False
    memory: MemoryStep = dataclasses.field(default=None)  # type: ignore[assignment]  # set by plan_run_memory
    average: WeightAverage | None = None  # with ema_decay: the weights' moving average, what the run outputs
    layers: LayerChoice | None = None  # the layers train_layers chose (None: a run made without load)
    dropout: AdapterDropout | None = None  # the adapters' dropout (None: a run made without load)
    closing_info: list[str] = dataclasses.field(default_factory=list)  # what finish() read before releasing

    @property
    def device(self) -> torch.device:
        return self.mp.load_device

    @property
    def loader_device(self) -> torch.device:
        """Where the loader delivers batches: the training device when it is the CPU or CUDA, else the CPU."""
        return self.device if self.device.type in ("cpu", "cuda") else torch.device("cpu")


def load(model: Any, train: ModuleType, data: DataPlan, existing: dict[str, torch.Tensor]) -> LoadedRun:
    """Clone the model (the caller's stays untouched), set its compute dtype, create the seeded adapters (weights of
    ``existing`` continued exactly), the optimizer and the loss, as ComfyUI's own trainer does."""
    settings = data.settings
    mp = model.clone(force_deepcopy=True)
    dtype, adapter_dtype, use_scaler = training_dtypes(mp, settings.training_dtype, settings.lora_dtype)
    check_latent_channels(mp, data.shapes)
    data.notes.extend(unread_references(mp.model, data.rows))
    mp.model.requires_grad_(False).train()
    layers = choose_layers(mp.model, LayerFilter.parse(settings.train_layers), existing, settings.existing_lora)
    data.notes.extend(layers.notes())
    chosen = layers.view(mp)  # what ComfyUI's adapter setup sees: the chosen layers only
    device = mp.load_device
    rng_devices = [device.index if device.index is not None else torch.cuda.current_device()] \
        if device.type == "cuda" else []
    bypass = None
    with torch.random.fork_rng(devices=rng_devices):  # seeded adapter init, the caller's RNG untouched
        torch.manual_seed(derive_seed(settings.seed, "adapters"))
        if settings.bypass_mode:
            lora_sd, adapters, bypass = bypass_setup(train)(chosen, existing, settings.algorithm, adapter_dtype,
                                                            settings.rank)
        else:
            lora_sd, adapters = train._setup_lora_adapters(chosen, existing, settings.algorithm, adapter_dtype,
                                                           settings.rank)
        torch.manual_seed(derive_seed(settings.seed, "adapters"))  # the same draws again, from the CPU's generator
        draw_new_adapters_on_cpu(train, chosen, lora_sd, existing, settings.algorithm, adapter_dtype, settings.rank)
    dropout = AdapterDropout(settings.dropout_rates, settings.seed, adapters)  # before any forward: the probe's too
    resume_exactly(lora_sd, existing)
    data.notes.extend(set_alpha(lora_sd, existing, settings.lora_alpha, settings.existing_lora))
    optimizer = create_optimizer(train, settings, lora_sd.values())
    data.notes.extend(optimizer_notes(settings))
    loss_fn = train._create_loss_function(settings.loss_function)
    scaler = torch.amp.GradScaler() if use_scaler else None
    model_options = comfy.model_patcher.create_model_options_clone(mp.model_options)
    return LoadedRun(mp, settings, dtype, adapter_dtype, lora_sd, adapters, bypass, optimizer, loss_fn, scaler,
                     model_options, layers=layers, dropout=dropout)


def prepare(run: LoadedRun, train: ModuleType) -> None:
    """The memory plan in place (blocks checkpointed, weights streamed), the patcher's wrappers, the model on the
    device (every other model off it), bypass hooks.

    Undone by :func:`unprepare`, whatever happened in between.
    """
    settings, mp = run.settings, run.mp
    run.fp8_bwd = getattr(comfy.model_management, "training_fp8_bwd", False)
    comfy.model_management.training_fp8_bwd = settings.quantized_backward  # as the built-in node
    run.memory.place(mp, run.device)
    comfy.sampler_helpers.prepare_model_patcher(mp, {}, run.model_options)  # patcher wrappers + callbacks
    # As the built-in node: free the device for training (1e20 unloads every other model); a full load unless
    # ComfyUI manages the weights itself (offloading, dynamic VRAM, --lowvram).
    with run.memory.loading():
        comfy.model_management.load_models_gpu([mp], memory_required=1e20,
                                               force_full_load=not run.memory.plan.managed_by)
    comfy.samplers.cast_to_load_options(run.model_options, device=run.device, dtype=mp.model_dtype())
    if run.bypass is not None:  # adapters as forward hooks: the (quantized) weights are never rewritten
        for injection in run.bypass.create_injections(mp.model):
            injection.inject(mp)
            run.injections.append(injection)
    mp.pre_run()
    comfy.model_management.in_training = True


def unprepare(run: LoadedRun, train: ModuleType) -> None:
    """Undo :func:`prepare`: ComfyUI's switches back, hooks and checkpoint wrappers removed, the clone unloaded."""
    mp = run.mp
    comfy.model_management.in_training = False
    comfy.model_management.training_fp8_bwd = run.fp8_bwd
    for injection in reversed(run.injections):
        injection.eject(mp)
    run.injections.clear()
    run.memory.release()
    for m in mp.model.modules():
        train.unpatch(m)
    mp.cleanup()
    comfy.samplers.cast_to_load_options(run.model_options, device=mp.offload_device)
    release(mp)


def finish(run: LoadedRun) -> dict[str, torch.Tensor]:
    """The trained adapter weights as detached CPU tensors (``SaveLoRA``'s keys); the adapters stop needing grads."""
    lora = lora_weights(run)
    run.closing_info.extend(optimizer_info(run.optimizer))
    if run.dropout is not None:
        run.dropout.detach()
    for adapter in run.adapters:
        adapter.requires_grad_(False)
    run.adapters.clear()
    run.lora_sd.clear()
    run.optimizer = None
    return lora

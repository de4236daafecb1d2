"""Node "Train LoRA (Stream Cache)": trains a LoRA on a cached dataset, reading batches ahead in the background.

The first outputs are the built-in trainer's (``LORA_MODEL``, ``LOSS_MAP``, steps), so ComfyUI's "Save LoRA
Weights", "Plot Loss Graph" and "Load LoRA Model" take them unchanged; a fourth gives the sample images' latents
(``sample_count``). The training itself lives in :mod:`.training` and the inputs' declarations in
:mod:`.train_lora_inputs`; this file is the ComfyUI face of it: checks, progress events and the node's UI output.
"""

from __future__ import annotations

import contextlib
import dataclasses
import logging
import math
import sys
import time
from collections.abc import Mapping
from typing import Any

from comfy_api.latest import io
from comfy_execution.graph_utils import ExecutionBlocker

from ..dataset_cache.autograd_release import release_error_frames
from ..dataset_cache.constants import DEFAULT_PREFETCH_BATCHES
from ..dataset_cache.dataset import Sample
from ..dataset_cache.dataset_mix import DatasetMix
from ..dataset_cache.devices import AUTO as ALL_DEVICES
from ..dataset_cache.holdout import hold_out
from ..dataset_cache.lock import READ_LOCK, CacheLock
from ..dataset_cache.lora_metadata import network_shape
from ..dataset_cache.tag_frequency import folder_name
from ..dataset_cache.remote import is_remote_url
from ..dataset_cache.memory_plan import AUTO, MemoryPlan
from .handles import (
    CombinedDatasetHandle,
    StreamDatasetHandle,
    cache_roots,
    open_caches,
    require_caches,
    training_reader,
)
from .training import (
    DEFAULT_SAVE_PREFIX,
    LOSS_TARGETS,
    MAX_TIMESTEP,
    StepReport,
    TrainResult,
    TrainSettings,
    train_lora,
)
from .train_lora_inputs import train_lora_inputs
from .ui_output import show_text
from .training.sample_prompts import (NO_PROMPTS, SamplePrompts, check_prompt, encode_sample_texts, lines_size,
                                      sample_text_lines)
from .training.lora_output import TrainedLora, describe_training
from .training.samples import SAMPLE_SAMPLER, SAMPLE_SCHEDULER, node_preview

__all__ = ["EVENT", "TrainLoRA"]

log = logging.getLogger("streamcache.train")

EVENT = "streamcache.train"
"""Websocket event type of the live training report: ``{"node", "prompt_id", "step", "total", "loss",
"loss_smooth", "samples_per_s", "data_wait_pct"}``."""
_EVENT_INTERVAL_S = 0.5
"""At most two events a second (plus the last step): enough for a live chart, light on the socket."""

LoraModel = io.Custom("LORA_MODEL")
LossMap = io.Custom("LOSS_MAP")


def _json_number(value: float) -> float | None:
    """``value``, or ``None`` where JSON has no number for it (inf, NaN): the browser's parser refuses those."""
    return value if math.isfinite(value) else None


class _Events:
    """Sends the throttled ``streamcache.train`` event from the execution thread, when a server exists."""

    def __init__(self, node_id: str | None) -> None:
        self.node_id = node_id
        self._last = 0.0

    def __call__(self, report: StepReport) -> None:
        now = time.monotonic()
        if report.step < report.total and now - self._last < _EVENT_INTERVAL_S:
            return
        self._last = now
        server_module = sys.modules.get("server")  # never imported by us: no server, no event
        instance = getattr(getattr(server_module, "PromptServer", None), "instance", None)
        if instance is None:
            return
        data = {"node": self.node_id, "prompt_id": getattr(instance, "last_prompt_id", None),
                "step": report.step, "total": report.total, "loss": report.loss,
                "loss_smooth": report.loss_smooth, "samples_per_s": round(report.samples_per_s, 3),
                "data_wait_pct": round(report.data_wait_pct, 2)}
        if report.learning_rate is not None:
            data["learning_rate"] = report.learning_rate
        if report.val_loss is not None:
            data["val_loss"], data["val_step"] = report.val_loss, report.val_step
        if report.grad_norm is not None:
            data["grad_norm"] = _json_number(report.grad_norm)
        try:
            instance.send_sync(EVENT, data, getattr(instance, "client_id", None))
        except Exception:  # a progress event must never fail the training
            log.debug("could not send %s", EVENT, exc_info=True)


class _NodeText:
    """The node's progress text (ComfyUI's ``send_progress_text``), when a server exists: the memory plan before the
    first step, then under it the latest save of ``save_every`` (sent from the saves' writer thread: ComfyUI's
    ``send_sync`` is thread-safe)."""

    def __init__(self, node_id: str | None) -> None:
        self.node_id = node_id
        self._plan = ""

    def plan(self, plan: MemoryPlan) -> None:
        self._plan = f"memory: {plan.describe()}"
        self._send(self._plan)

    def saved(self, steps: int, where: str) -> None:
        self._send("\n".join(filter(None, (self._plan, f"saved the LoRA at step {steps}: {where}"))))

    def _send(self, text: str) -> None:
        show_text(text, self.node_id)


def _check_datasets(dataset: Any, reg_dataset: Any, val_dataset: Any) -> None:
    """Refuse, before any cache is opened, a dataset socket that holds no StreamCache dataset (or none at all)."""
    for what, handle in (("dataset", dataset), ("reg_dataset", reg_dataset), ("val_dataset", val_dataset)):
        if handle is not None and not isinstance(handle, (StreamDatasetHandle, CombinedDatasetHandle)):
            raise ValueError(
                f"{what}: expected a STREAM_DATASET from a StreamCache node, got {type(handle).__name__}")
    if dataset is None:
        raise ValueError("dataset: connect a StreamCache dataset (Encode Dataset, Load Lazy Cache, ...)")


def _check_validation(val_dataset: Any, settings: TrainSettings) -> None:
    """Refuse two validation sets: a held-out share of the dataset and a connected val_dataset."""
    if val_dataset is not None and settings.val_split > 0:
        raise ValueError(f"val_split {settings.val_split:g} holds out images of the dataset for the validation loss, "
                         "and val_dataset gives another validation set: use one (val_split 0, or disconnect "
                         "val_dataset)")


def _output(result: TrainResult, dataset: StreamDatasetHandle | CombinedDatasetHandle,
            reg_dataset: StreamDatasetHandle | CombinedDatasetHandle | None, samples: int, reg_count: int,
            settings: TrainSettings) -> io.NodeOutput:
    """The node's outputs (the LoRA, the loss map, the steps) and its UI (the summary, logged too, and the curves:
    loss, validation loss, gradient norm) from a finished run."""
    summary = f"dataset {dataset.name!r} ({samples} samples)"
    if reg_dataset is not None:
        summary += (f", regularization {reg_dataset.name!r} ({reg_count} samples, ratio {settings.reg_ratio:g}, "
                    f"weight {settings.reg_weight:g})")
    summary += f": {result.summary()}"
    log.info("Train LoRA (Stream Cache): %s", summary)
    loss_map: dict[str, Any] = {"loss": result.losses}
    ui: dict[str, Any] = {"loss": result.losses, "text": [summary]}
    if result.validation:  # (global step, loss) pairs; Plot Loss Graph reads "loss" only
        loss_map["val_loss"] = ui["val_loss"] = [[step, loss] for step, loss in result.validation]
    if result.grad_norms:  # null for a norm that was not finite: JSON has no inf or NaN
        loss_map["grad_norm"] = ui["grad_norm"] = [_json_number(n) for n in result.grad_norms]
    images: Any = ExecutionBlocker("Train LoRA made no sample images: set its sample_count above 0")
    if result.samples is not None:
        images = {"samples": result.samples}
    return io.NodeOutput(result.lora, loss_map, result.steps, images, ui=ui)


def _described(model: Any, settings: TrainSettings, mix: DatasetMix, reg: DatasetMix | None,
               dataset: StreamDatasetHandle | CombinedDatasetHandle, readers: Mapping[str, Any]) -> dict[str, str]:
    """The run's training metadata (what its LoRA files say about it), from the stored infos of the datasets
    ``dataset`` names (what they were encoded with, their tag counts). A courtesy: what fails to describe leaves
    the LoRA without metadata, never the run without its LoRA."""
    try:
        infos, folders = [], {}
        for part in dataset.parts:
            found = readers[part.cache_root].datasets().get(part.name)
            info = found.info if found is not None and isinstance(found.info, dict) else {}
            infos.append(info)
            folder = info.get("folder")
            if isinstance(folder, str) and folder_name(folder):  # the encoded folder's own name
                folders[part.name] = folder_name(folder)
        names = (mix.name_of(i) for i in range(len(mix.samples)))
        named = [(sample, folders.get(name, name)) for sample, name in zip(mix.samples, names)]
        return describe_training(model, settings, named, reg.samples if reg is not None else (), infos, time.time())
    except Exception:
        log.warning("Train LoRA: could not describe the run for its LoRA's metadata; it is saved without",
                    exc_info=True)
        return {}


class TrainLoRA(io.ComfyNode):
    """Trains a LoRA (or LoHa, LoKr, OFT) from a StreamCache dataset on ComfyUI's training machinery."""

    @classmethod
    def define_schema(cls) -> io.Schema:
        return io.Schema(
            node_id="StreamCache_TrainLoRA",
            display_name="Train LoRA (Stream Cache)",
            category="StreamCache",
            has_intermediate_output=True,  # a cached re-queue re-sends the loss curve to the node and /history
            description=(
                "Trains a LoRA on a cached dataset. Batches are read ahead in background threads while the model "
                "trains, each image is paired with its own caption, and device memory holds one batch whatever the "
                "dataset's size. Outputs work with Save LoRA Weights, Plot Loss Graph and Load LoRA Model."
            ),
            inputs=train_lora_inputs(),
            outputs=[
                LoraModel.Output(display_name="lora", tooltip="The LoRA weights."),
                LossMap.Output(display_name="loss_map", tooltip="The loss of every step."),
                io.Int.Output(display_name="steps", tooltip="Total training steps (with the existing LoRA's)."),
                io.Latent.Output(display_name="samples",
                                 tooltip="The sample images of sample_count, as latents: every sampling's images "
                                 "in turn (decode with VAE Decode)."),
            ],
            hidden=[io.Hidden.unique_id],
        )

    @classmethod
    def execute(
        cls,
        model: Any,
        dataset: StreamDatasetHandle,
        batch_size: int,
        grad_accumulation_steps: int,
        steps: int,
        learning_rate: float,
        rank: int,
        optimizer: str,
        loss_function: str,
        seed: int,
        training_dtype: str,
        lora_dtype: str,
        algorithm: str,
        gradient_checkpointing: bool,
        checkpoint_depth: int,
        offloading: bool,
        existing_lora: str,
        prefetch_batches: int = DEFAULT_PREFETCH_BATCHES,
        loader_threads: int = 0,
        quantized_backward: bool = False,
        bypass_mode: bool = False,
        masked_loss: bool = True,
        unmasked_weight: float = 0.1,
        caption_dropout: float = 0.0,
        reg_dataset: Any = None,
        reg_ratio: float = 1.0,
        reg_weight: float = 1.0,
        memory: str = AUTO,
        stream_blocks: int = 0,
        allow_fp8: bool = False,
        devices: str = ALL_DEVICES,
        checkpoint_mode: str = "exact",
        save_every: int = 0,
        save_prefix: str = DEFAULT_SAVE_PREFIX,
        lr_schedule: str = "constant",
        warmup_steps: int = 0,
        timestep_sampling: str = "uniform",
        noise_offset: float = 0.0,
        val_dataset: Any = None,
        val_every: int = 0,
        max_grad_norm: float = 0.0,
        ema_decay: float = 0.0,
        min_snr_gamma: float = 0.0,
        train_layers: str = "",
        min_timestep: int = 0,
        max_timestep: int = MAX_TIMESTEP,
        lora_alpha: float = 1.0,
        val_split: float = 0.0,
        loss_target: str = LOSS_TARGETS[0],
        multires_noise_iterations: int = 0,
        multires_noise_discount: float = 0.3,
        sample_count: int = 0,
        sample_every: int = 0,
        sample_steps: int = 20,
        sample_cfg: float = 1.0,
        sample_prompt: Any = None,
        sample_negative: Any = None,
        debiased_estimation: bool = False,
        sample_sampler: str = SAMPLE_SAMPLER,
        sample_scheduler: str = SAMPLE_SCHEDULER,
        scale_v_pred_loss: bool = False,
        sample_width: int = 0,
        sample_height: int = 0,
        sample_clip: Any = None,
        sample_texts: str = "",
        sample_seed: int = -1,
        network_dropout: float = 0.0,
        rank_dropout: float = 0.0,
        module_dropout: float = 0.0,
        optimizer_args: str = "",
        ip_noise_gamma: float = 0.0,
        v_pred_like_loss: float = 0.0,
        noise_offset_random_strength: bool = False,
        ip_noise_gamma_random_strength: bool = False,
    ) -> io.NodeOutput:
        settings = TrainSettings(
            steps=steps, batch_size=batch_size, grad_accumulation_steps=grad_accumulation_steps,
            learning_rate=learning_rate, rank=rank, optimizer=optimizer, loss_function=loss_function, seed=seed,
            training_dtype=training_dtype, lora_dtype=lora_dtype, algorithm=algorithm,
            gradient_checkpointing=gradient_checkpointing, checkpoint_depth=checkpoint_depth, offloading=offloading,
            existing_lora=existing_lora, prefetch_batches=prefetch_batches, loader_threads=loader_threads,
            quantized_backward=bool(quantized_backward), bypass_mode=bool(bypass_mode),
            masked_loss=bool(masked_loss), unmasked_weight=float(unmasked_weight),
            caption_dropout=float(caption_dropout), reg_ratio=float(reg_ratio), reg_weight=float(reg_weight),
            memory=memory, stream_blocks=int(stream_blocks), allow_fp8=bool(allow_fp8),
            devices=str(devices), checkpoint_mode=str(checkpoint_mode), save_every=int(save_every),
            save_prefix=str(save_prefix), lr_schedule=str(lr_schedule), warmup_steps=int(warmup_steps),
            timestep_sampling=str(timestep_sampling), noise_offset=float(noise_offset), val_every=int(val_every),
            max_grad_norm=float(max_grad_norm), ema_decay=float(ema_decay), min_snr_gamma=float(min_snr_gamma),
            train_layers="" if train_layers is None else train_layers, min_timestep=min_timestep,
            max_timestep=max_timestep, lora_alpha=float(lora_alpha), val_split=round(float(val_split), 4),
            loss_target=str(loss_target), multires_noise_iterations=multires_noise_iterations,
            multires_noise_discount=round(float(multires_noise_discount), 4), sample_count=sample_count,
            sample_every=sample_every, sample_steps=sample_steps, sample_cfg=round(float(sample_cfg), 4),
            debiased_estimation=bool(debiased_estimation), sample_sampler=str(sample_sampler),
            sample_scheduler=str(sample_scheduler), scale_v_pred_loss=bool(scale_v_pred_loss),
            sample_width=sample_width, sample_height=sample_height, sample_seed=sample_seed,
            network_dropout=round(float(network_dropout), 4), rank_dropout=round(float(rank_dropout), 4),
            module_dropout=round(float(module_dropout), 4),
            optimizer_args="" if optimizer_args is None else optimizer_args,
            ip_noise_gamma=round(float(ip_noise_gamma), 4), v_pred_like_loss=round(float(v_pred_like_loss), 4),
            noise_offset_random_strength=bool(noise_offset_random_strength),
            ip_noise_gamma_random_strength=bool(ip_noise_gamma_random_strength),
        )
        settings.validate()  # before opening anything: a typo fails fast
        _check_datasets(dataset, reg_dataset, val_dataset)
        _check_validation(val_dataset, settings)
        check_prompt(sample_prompt, "sample_prompt")
        check_prompt(sample_negative, "sample_negative")
        lines = sample_text_lines(sample_texts)
        size = lines_size(lines, settings.sample_width, settings.sample_height)  # the lines' --w and --h
        if size != (settings.sample_width, settings.sample_height):
            settings = dataclasses.replace(settings, sample_width=size[0], sample_height=size[1])
            settings.validate()
        texts = encode_sample_texts(sample_clip, lines) if settings.sample_count else ()
        node_id = getattr(getattr(cls, "hidden", None), "unique_id", None)
        result, samples, reg_count = cls._train_locked(model, dataset, settings, node_id, reg_dataset, val_dataset,
                                                       SamplePrompts(sample_prompt, sample_negative, texts))
        return _output(result, dataset, reg_dataset, samples, reg_count, settings)

    @classmethod
    def _train_locked(cls, model: Any, dataset: StreamDatasetHandle | CombinedDatasetHandle,
                      settings: TrainSettings, node_id: str | None,
                      reg_dataset: StreamDatasetHandle | CombinedDatasetHandle | None,
                      val_dataset: StreamDatasetHandle | CombinedDatasetHandle | None,
                      prompts: SamplePrompts = NO_PROMPTS) -> tuple[Any, int, int]:
        """:meth:`_train` holding a shared read lock on EVERY cache the run reads, for the whole run: Clean Cache
        (and compaction after an encode) refuse to delete shard files while anybody trains from them."""
        roots = cache_roots(dataset, reg_dataset, val_dataset)
        require_caches(dataset=dataset, reg_dataset=reg_dataset, val_dataset=val_dataset)
        with contextlib.ExitStack() as locks:
            for root in roots:
                if not is_remote_url(root):  # a bucket has no lock: its published files are never deleted
                    locks.enter_context(CacheLock(root, READ_LOCK, exclusive=False, purpose="training"))
            return cls._train(model, dataset, settings, node_id, reg_dataset, val_dataset, prompts)

    @classmethod
    def _train(cls, model: Any, dataset: StreamDatasetHandle | CombinedDatasetHandle, settings: TrainSettings,
               node_id: str | None, reg_dataset: StreamDatasetHandle | CombinedDatasetHandle | None = None,
               val_dataset: StreamDatasetHandle | CombinedDatasetHandle | None = None,
               prompts: SamplePrompts = NO_PROMPTS) -> tuple[Any, int, int]:
        """Train; returns the result and how many main and regularization samples it drew from.

        Each cache involved is opened once; datasets of one cache train through its own reader, datasets of
        several through a :class:`~dataset_cache.multi_reader.MultiCacheReader` over them all.
        """
        readers = open_caches(cache_roots(dataset, reg_dataset, val_dataset), f"dataset {dataset.name!r}")
        try:
            mix = dataset.load_mix(readers)
            reg = reg_dataset.load_mix(readers) if reg_dataset is not None else None
            loaded_val = val_dataset.load_mix(readers) if val_dataset is not None else None
            for what, handle, loaded in (("dataset", dataset, mix), ("reg_dataset", reg_dataset, reg),
                                         ("val_dataset", val_dataset, loaded_val)):
                if handle is not None and loaded is not None and not loaded.samples:
                    raise ValueError(
                        f"{what} {handle.name!r} in the {handle.where()} is empty (0 samples): there is nothing to "
                        "train on; encode a folder that holds images")
            val: DatasetMix | tuple[Sample, ...] | None = loaded_val
            held = hold_out(mix, settings.val_split) if settings.val_split > 0 else None
            if held is not None:  # the dataset's held-out sources are the validation set
                mix, val = held.train, held.validation
            text = _NodeText(node_id)
            preview = node_preview(model, node_id, settings.steps) if settings.sample_count else None
            described = _described(model, settings, mix, reg, dataset, readers)
            result = train_lora(model, training_reader(readers), mix, settings, on_step=_Events(node_id), reg=reg,
                                reg_name=f"reg_dataset {reg_dataset.name!r}" if reg_dataset is not None else "",
                                on_plan=text.plan, on_saved=text.saved, val=val, on_sampled=preview,
                                sample_prompts=prompts, lora_metadata=described)
            total = str(result.steps)  # an existing LoRA's steps and this run's
            result.lora = TrainedLora(result.lora, {**described, **network_shape(result.lora), "ss_steps": total,
                                                    "ss_max_train_steps": total} if described else {})
            if held is not None:
                result.info = (held.describe(settings.val_split), *result.info)
        except BaseException as error:  # ComfyUI keeps its error in a reference cycle: the run's finished frames
            release_error_frames(error)  # would keep its tensors until a full collection (autograd_release)
            raise
        finally:
            for reader in readers.values():
                reader.close()
        return result, len(mix.samples), len(reg.samples) if reg is not None else 0

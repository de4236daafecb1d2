"""Sample images during training: a few cached captions (or a prompt the node is given) turned into latents by the LoRA
being trained, from the same noise each time, before the first step, every ``sample_every`` steps and after the
last.

kohya, OneTrainer and ai-toolkit show images as training goes, which tell more than a loss curve. Here the prompts
are cached captions (:mod:`dataset_cache.sample_choice`), or the node's prompts (:mod:`.sample_prompts`: the
conditioning wired to ``sample_prompt``, ``sample_texts`` lines, all encoded by ComfyUI before the run), so sampling
needs no text encoder and no VAE while the model trains: any of ComfyUI's samplers and schedulers
(``sample_sampler``, ``sample_scheduler``: Euler over "simple" by default) denoises them through the run's own model
call (its memory plan, its adapters), as ComfyUI's KSampler would (its sampler object, noise scaling, sigmas and
guidance function; the latent format's ``process_latent_out`` at the end). The images leave as one ``LATENT`` batch
(the ``samples`` output, for VAE Decode and Save Image), each sampling's rows in turn; each sampling also previews
its first image on the node. It runs without gradients and draws nothing from the training's generators (it restores
torch's global ones), so a run with samples trains the same LoRA bit for bit as one without.
"""

from __future__ import annotations

import dataclasses
import logging
import math
import time
from collections.abc import Callable, Sequence
from typing import Any

import comfy.model_management
import comfy.model_patcher
import comfy.samplers
import comfy.utils
import torch

from ...dataset_cache.dataset import Sample
from ...dataset_cache.loader import PrefetchLoader
from ...dataset_cache.reading import DatasetReader
from ...dataset_cache.sampler import BucketSampler
from ...dataset_cache.seeding import derive_seed, seeded_generator
from .sample_prompts import NO_PROMPTS, LineOptions, SamplePrompts

__all__ = ["SAMPLE_SAMPLER", "SAMPLE_SCHEDULER", "SamplingPlan", "Sampling", "check_sampler", "node_preview",
           "sample_sigmas", "sized_plan"]

log = logging.getLogger("streamcache.train")

SAMPLE_SAMPLER = "euler"
"""``sample_sampler``'s default: ComfyUI's Euler, deterministic and right for every family."""
SAMPLE_SCHEDULER = "simple"
"""``sample_scheduler``'s default: evenly spaced in the model's own sigmas, for every family."""


def check_sampler(sampler: object, scheduler: object) -> None:
    """Refuse a ``sample_sampler`` or ``sample_scheduler`` this ComfyUI does not have (an API prompt's typo, or a
    workflow from a ComfyUI with another list).

    Raises:
        ValueError: naming the input and the names ComfyUI offers.
    """
    for name, value, known in (("sample_sampler", sampler, comfy.samplers.KSampler.SAMPLERS),
                               ("sample_scheduler", scheduler, comfy.samplers.KSampler.SCHEDULERS)):
        if value not in known:
            raise ValueError(f"unknown {name} {value!r:.60}; use one of ComfyUI's: {', '.join(known)}")


def sample_sigmas(model_sampling: Any, sampler: str, scheduler: str, steps: int) -> torch.Tensor:
    """The noise levels KSampler denoises over for ``steps`` steps of ``sampler`` with ``scheduler``: ComfyUI's
    ``calculate_sigmas``, one step more with the penultimate level dropped for the samplers KSampler does so for
    (DPM2, UniPC)."""
    discard = sampler in comfy.samplers.KSampler.DISCARD_PENULTIMATE_SIGMA_SAMPLERS
    sigmas = comfy.samplers.calculate_sigmas(model_sampling, scheduler, steps + 1 if discard else steps)
    return torch.cat([sigmas[:-2], sigmas[-1:]]) if discard else sigmas


@dataclasses.dataclass(frozen=True)
class SamplingPlan:
    """What a run samples, decided with its data: ``samples`` (whose captions, and empty captions, are read), ``shape``
    (their bucket's latent shape without the batch, ``(C, H, W)`` or ``(C, T, H, W)``: every image's), ``count``
    images, and the node's ``prompts`` (a connected ``sample_prompt`` or ``sample_texts`` lines replace the
    captions: ``count`` images of each, each from its own noise). ``size``: ``(width, height)`` in pixels when
    ``sample_width`` and ``sample_height`` set it (``shape`` is then that size's; ``None``: the bucket's);
    ``rows_per_call``: images per model call when fewer than the run's ``batch_size`` (a size larger than every
    training bucket: one at a time)."""

    samples: tuple[Sample, ...]
    shape: tuple[int, ...]
    count: int
    prompts: SamplePrompts = NO_PROMPTS
    size: tuple[int, int] | None = None
    rows_per_call: int | None = None


def sized_plan(plan: SamplingPlan | None, model: Any, width: int, height: int,
               shapes: Sequence[tuple[int, ...]]) -> SamplingPlan | None:
    """``plan`` at ``width`` × ``height`` pixels (0 and 0: unchanged), its latent shape from the model's latent
    format (its spatial downscale, 8 for SD and Flux); one image per model call when that latent is larger than
    every training shape (``shapes``), so sampling needs no more memory than a training row's forward.

    Raises:
        ValueError: a size that is not a multiple of the downscale, naming the input and the nearest that is.
    """
    if plan is None or (width == 0 and height == 0):
        return plan
    latent_format = model.get_model_object("latent_format")
    ratio = int(getattr(latent_format, "spacial_downscale_ratio", 8))
    for name, value in (("sample_width", width), ("sample_height", height)):
        if value % ratio:
            raise ValueError(f"{name} {value} is not a multiple of {ratio}, this model's latent downscale: use "
                             f"{max(ratio, round(value / ratio) * ratio)}")
    shape = (*plan.shape[:-2], height // ratio, width // ratio)
    largest = max(math.prod(s[-2:]) for s in shapes) if shapes else 0
    rows = 1 if math.prod(shape[-2:]) > largest else None
    return dataclasses.replace(plan, shape=shape, size=(width, height), rows_per_call=rows)


@dataclasses.dataclass
class _Rows:
    """One batch of sample rows: its conditionings (and the negatives, for guidance), the noise keys in row order,
    the latent shape, and the batch's steps, guidance scale and seed (the node's, or its prompt line's own)."""

    positive: list[Any]
    negative: list[Any] | None
    keys: list[str]
    shape: tuple[int, ...]
    steps: int
    cfg: float
    seed: int


class Sampling:
    """Generates the images its plan asks for (the captions of samples of one bucket,
    :func:`~dataset_cache.sample_choice.choose_sample_rows`, or a connected prompt) and keeps every sampling's
    latents.

    Args:
        loop: the run's :class:`~.loop.StepLoop` (its model call, conditioner, autocast and model sampling).
        reader: the reader of the samples' cache.
        plan: what to sample (:class:`SamplingPlan`).
        batch_size: rows per model call; ``seed``: the run's seed (each image's noise is ``(seed, "sample", its
            latent key)``'s, or a prompt's key for its image ``i`` (:meth:`~.sample_prompts.SamplePrompts.images`):
            the same at every sampling).
        every: sample after every ``every`` steps (global step numbers); 0: before the first and after the last
            only. ``last``: the run's last global step.
        steps: denoising steps per image; ``cfg``: classifier-free guidance against the empty caption or the
            connected negative (1: none); ``sampler``, ``scheduler``: ComfyUI's names (:func:`check_sampler`).
        interrupt: checked between model calls (Cancel);
            ``on_sampled``: called with the steps this run has done and the latents after each sampling (the node's
            preview: :func:`node_preview`).
    """

    def __init__(self, loop: Any, reader: DatasetReader, plan: SamplingPlan, *, batch_size: int, seed: int,
                 every: int, last: int, steps: int, cfg: float, sampler: str = SAMPLE_SAMPLER,
                 scheduler: str = SAMPLE_SCHEDULER, interrupt: Callable[[], None] | None = None,
                 on_sampled: Callable[[int, torch.Tensor], None] | None = None) -> None:
        self.loop = loop
        self.reader = reader
        self.plan = plan
        self.batch_size = batch_size
        self.seed = seed
        self.every = every
        self.last = last
        self.steps = steps
        self.cfg = cfg
        self.sampler = sampler
        self.scheduler = scheduler
        self.interrupt = interrupt
        self.on_sampled = on_sampled
        self.results: list[tuple[int, torch.Tensor]] = []  # (global step, latents on the CPU)
        self.seconds = 0.0
        self._rows: list[_Rows] | None = None  # read from the cache at the first sampling, kept for the others

    def due(self, step: int) -> bool:
        """Whether images are sampled after global step ``step``."""
        return step == self.last or (self.every > 0 and step % self.every == 0)

    def take(self, step: int) -> torch.Tensor:
        """The images of the LoRA after global step ``step`` (latents in the VAE's space, on the CPU, in the order
        of the samples); recorded, previewed and returned."""
        t0 = time.perf_counter()
        if self._rows is None:
            self._rows = self._read()
        with torch.no_grad(), self._own_random_state():
            latents = torch.cat([self._generate(rows) for rows in self._rows])
        self.results.append((step, latents))
        self.seconds += time.perf_counter() - t0
        log.info("Train LoRA: %d sample image(s) at step %d (%.1f s)", latents.shape[0], step,
                 time.perf_counter() - t0)
        if self.on_sampled is not None:
            self.on_sampled(step - self.loop.first_step, latents)
        return latents

    def _own_random_state(self) -> Any:
        """Restores torch's global generators after a sampling: ComfyUI's "ddim" sampler reseeds the global CPU
        generator (``torch.manual_seed``), and a sampling must leave the training's random numbers as it found
        them."""
        device = torch.device(self.loop.device)
        return torch.random.fork_rng(devices=[device] if device.type == "cuda" else [])

    def latents(self) -> torch.Tensor | None:
        """Every sampling's latents in one batch, in the order they were taken; ``None`` before the first."""
        return torch.cat([latents for _, latents in self.results]) if self.results else None

    def describe(self) -> str:
        """One line for the run's summary."""
        plan = self.plan
        if plan.prompts.given:
            what = f"sample images of {plan.prompts.describe(plan.count)}"
        else:
            names = ", ".join(s.source or s.latent for s in plan.samples[:3]) + (", ..." if len(plan.samples) > 3
                                                                               else "")
            what = f"sample images of {len(plan.samples)} caption(s) ({names})"
        steps = ", ".join(str(step) for step, _ in self.results)
        prompts = plan.prompts
        against = ("the sample_negative" if prompts.negative is not None else
                   "each line's --n negative" if prompts.own_negatives else "the empty caption")
        if not prompts.own_negatives and any(t.negative is not None for t in prompts.texts):
            against += " (a line's own --n where it has one)"
        own_cfg = " (a line's own --l where it has one)" if any(t.options.cfg is not None for t in prompts.texts) \
            else ""
        guidance = f", cfg {self.cfg:g}{own_cfg} against {against}" if prompts.guided(self.cfg) else ""
        size = f", {plan.size[0]}×{plan.size[1]} px" if plan.size is not None else ""
        return (f"{what} at steps {steps or 'none'}: {self.steps} {self.sampler} steps ({self.scheduler} schedule)"
                f"{guidance}{size}, {self.seconds:.1f} s (the samples output)")

    def _read(self) -> list[_Rows]:
        """Every image's conditioning, key (its noise's seed) and, with guidance, negative, in batches of
        ``batch_size``: the connected prompts, or the samples' captions and empty captions read from the cache."""
        plan = self.plan
        images = plan.prompts.images(plan.count)
        if images:
            keys, positive = [image.key for image in images], [image.conditioning for image in images]
        else:
            positive, keys = self._cached(plan.samples)
        options = [image.options for image in images] or [LineOptions()] * len(keys)
        settings = [o.resolved(self.steps, self.cfg, self.seed) for o in options]
        negative = self._negatives(keys, [image.negative for image in images] or [None] * len(keys), settings)
        n = plan.rows_per_call or self.batch_size
        batches: list[_Rows] = []
        start = 0
        for end in range(1, len(keys) + 1):  # a batch holds consecutive images of one setting, at most n
            if end == len(keys) or settings[end] != settings[start] or end - start == n:
                own = negative[start:end]
                given = all(mine is not None for mine in own)
                batches.append(_Rows(positive[start:end], own if given else None, keys[start:end],
                                     (end - start, *plan.shape), *settings[start]))
                start = end
        return batches

    def _negatives(self, keys: list[str], own: list[Any], settings: list[tuple[int, float, int]]) -> list[Any]:
        """The negative of each image (``None`` where it needs none): a prompt line's own (``own``), else, for an
        image that is guided or when ``sample_negative`` is connected, :meth:`_default_negatives`' (the cache's empty
        captions read once for every batch). A connected or a line's own negative is already encoded and given to
        every model call, which uses it when the guidance or the sampler asks (:class:`_Guider`); the empty captions
        are read for guidance only. A batch is given its negatives only when every image has one."""
        wanted = [mine is None and (self.plan.prompts.negative is not None or cfg > 1)
                  for mine, (_, cfg, _) in zip(own, settings)]
        defaults = iter(self._default_negatives([key for key, want in zip(keys, wanted) if want]) if any(wanted)
                        else ())
        return [next(defaults) if want else mine for mine, want in zip(own, wanted)]

    def _default_negatives(self, keys: list[str]) -> list[Any]:
        """The negative of each image of ``keys`` without one of its own: the connected one, else its sample's empty
        caption (one serves every image of a prompt); the plan refused guidance where none exists."""
        plan = self.plan
        if plan.prompts.negative is not None:
            return [plan.prompts.negative] * len(keys)
        empties = [dataclasses.replace(s, captions=(s.empty_caption,), empty_caption=None)
                   for s in plan.samples if s.empty_caption is not None]
        if plan.prompts.given:
            conditionings, _ = self._cached(empties[:1])
            return conditionings * len(keys)
        conditionings, latent_keys = self._cached(empties)
        by_latent = dict(zip(latent_keys, conditionings))  # an empty caption's row has its sample's latent key
        return [by_latent[key] for key in keys]

    def _cached(self, samples: Sequence[Sample]) -> tuple[list[Any], list[str]]:
        """The first caption's conditioning of each of ``samples`` and their latent keys, in their order."""
        rows = min(self.batch_size, len(samples))
        sampler = BucketSampler(list(samples), [self.plan.shape] * len(samples), rows, self.seed, tail="short",
                                rank=0, world_size=1, shuffle=False, name="samples")
        loader = PrefetchLoader(self.reader, sampler, prefetch_batches=1, threads=1, device=None, epochs=1,
                                on_wait=self.interrupt)
        conditionings: list[Any] = []
        keys: list[str] = []
        try:
            for batch in loader:
                conditionings += batch.conditioning
                keys += batch.plan.latent_keys
        finally:
            loader.close()
        return conditionings, keys

    def _generate(self, rows: _Rows) -> torch.Tensor:
        """One batch of images as ComfyUI's KSampler makes them: its sampler object for ``sampler`` (noise of an
        empty latent scaled as its ``max_denoise`` says, the sampler's steps, the inverse scaling) over
        :func:`sample_sigmas`, with the run's model call in place of KSampler's (:class:`_Guider`), then the latent
        format's ``process_latent_out``. A sampler that adds noise as it goes draws it from the seed of
        ``(seed, "sample", the batch's first latent key)``, the same at every sampling."""
        loop, device = self.loop, self.loop.device
        sigmas = sample_sigmas(loop.model_sampling, self.sampler, self.scheduler, rows.steps).to(device, torch.float32)
        noise = torch.cat([torch.randn((1, *rows.shape[1:]), generator=seeded_generator(rows.seed, "sample", key),
                                       dtype=torch.float32) for key in rows.keys]).to(device)
        empty = loop.mp.model.process_latent_in(torch.zeros_like(noise))
        seed = derive_seed(rows.seed, "sample", rows.keys[0])
        positive = loop.conditioner(rows.positive, noise, empty, seed)
        negative = loop.conditioner(rows.negative, noise, empty, seed) if rows.negative is not None else None
        guider = _Guider(loop, positive, negative, rows.cfg, self.interrupt)
        options = comfy.model_patcher.create_model_options_clone(guider.model_options)  # as CFGGuider.inner_sample
        options.setdefault("transformer_options", {})["sample_sigmas"] = sigmas
        x = comfy.samplers.sampler_object(self.sampler).sample(guider, sigmas, {"model_options": options, "seed": seed},
                                                                None, noise, empty, disable_pbar=True)
        return loop.mp.model.process_latent_out(x).to("cpu", torch.float32)


class _Guider:
    """The model ComfyUI's samplers call (the interface of its ``CFGGuider``: ``inner_model``, ``model_patcher``,
    a call on ``(x, sigma, model_options, seed)``), running the run's own model call rather than KSampler's, which
    would load the model through model management and move the memory plan's weights. Guidance is ComfyUI's own
    ``cfg_function`` given the model patcher's options, so the guidance hooks of the user's model nodes (RescaleCFG's
    ``sampler_cfg_function``, post-CFG functions) and of a sampler (CFG++) apply as in KSampler; pre-CFG hooks and
    cond-batch functions, which work on ComfyUI's own cond lists, do not.

    Args:
        loop: the run's :class:`~.loop.StepLoop`; ``positive``, ``negative``: its conditioner's model arguments
            (``negative`` ``None``: no guidance); ``cfg``: the guidance scale; ``interrupt``: checked at each call.
    """

    def __init__(self, loop: Any, positive: Any, negative: Any, cfg: float,
                 interrupt: Callable[[], None] | None) -> None:
        self.loop = loop
        self.inner_model = loop.mp.model
        self.model_patcher = loop.mp
        self.model_options: dict[str, Any] = loop.mp.model_options
        self.positive = positive
        self.negative = negative
        self.cfg = cfg
        self.interrupt = interrupt

    def __call__(self, x: torch.Tensor, sigma: torch.Tensor, model_options: dict[str, Any] | None = None,
                 seed: int | None = None) -> torch.Tensor:
        """The guided prediction of the clean latent, as ComfyUI's ``sampling_function``: the negative's call is
        skipped at cfg 1 unless the sampler asks for it (``disable_cfg1_optimization``); skipped, it counts as
        zeros, as there, and with no negative at all the prompt's own prediction serves."""
        options = model_options or {}
        if self.interrupt is not None:
            self.interrupt()
        uses_negative = not math.isclose(self.cfg, 1.0) or bool(options.get("disable_cfg1_optimization", False))
        with self.loop._autocast():
            cond = self.loop.predict(x, sigma, self.positive).float()
            if not uses_negative:
                uncond = torch.zeros_like(cond)
            elif self.negative is None:
                uncond = cond
            else:
                uncond = self.loop.predict(x, sigma, self.negative).float()
        return comfy.samplers.cfg_function(self.inner_model, cond, uncond, self.cfg, x, sigma, model_options=options)


def node_preview(model: Any, node_id: str | None, total: int) -> Callable[[int, torch.Tensor], None]:
    """A sampling's first image shown on the node (``node_id``) as ComfyUI's KSampler shows its previews: the
    previewer of the model's latent format (Latent2RGB, or TAESD where ComfyUI is set to and has it) through
    ComfyUI's progress bar, at the run's progress (``done`` of ``total`` steps). A video shows its first frame. A
    preview never fails the run: ComfyUI without previews, or one that cannot decode, shows none."""
    import latent_preview  # ComfyUI's module (top level of its source)

    try:
        previewer = latent_preview.get_previewer(model.load_device, model.model.latent_format)
    except Exception:
        log.debug("Train LoRA: no previewer for the sample images", exc_info=True)
        previewer = None

    def show(done: int, latents: torch.Tensor) -> None:
        if previewer is None:
            return
        try:
            first = latents[:1] if latents.ndim == 4 else latents[:1, :, 0]
            image = previewer.decode_latent_to_preview_image("JPEG", model.model.process_latent_in(first))
            comfy.utils.ProgressBar(total, node_id=node_id).update_absolute(done, total, image)
        except comfy.model_management.InterruptProcessingException:
            raise  # ComfyUI's progress hook checks Cancel
        except Exception:
            log.debug("Train LoRA: could not preview a sample image", exc_info=True)

    return show

"""Each batch row's own conditioning turned into the model's keyword arguments, and one model call on a batch,
both as ComfyUI's sampler makes them."""

from __future__ import annotations

import uuid
from collections.abc import Sequence
from typing import Any

import torch

import comfy.sampler_helpers
import comfy.samplers

from ...dataset_cache.batch_assembly import REFERENCE_LATENTS

__all__ = ["Conditioner", "ModelCall", "unread_references"]


def unread_references(model: Any, samples: Sequence[Any]) -> list[str]:
    """A note when samples have reference images (an edit model's) and ``model`` does not read them: none of its
    classes' ``extra_conds`` names ``reference_latents`` (Flux Kontext's, Qwen-Image's and other edit models' do).
    A note, not a refusal: the references are passed, and a model that does not read them trains as without."""
    with_reference = sum(1 for s in samples if getattr(s, "reference", None) is not None)
    if not with_reference:
        return []
    for cls in type(model).__mro__:
        code = getattr(cls.__dict__.get("extra_conds"), "__code__", None)
        if code is not None and REFERENCE_LATENTS in code.co_consts:
            return []
    return [f"{with_reference} sample(s) have a reference image (Encode Dataset's reference_folder), and "
            f"{type(model).__name__} reads no reference latents: they are ignored. Edit models such as Flux "
            "Kontext or Qwen-Image-Edit read them; for another model, encode without reference_folder"]


class Conditioner:
    """Turns each batch row's own conditioning into the keyword arguments of ``BaseModel.apply_model``.

    Per row: ``convert_cond`` (ComfyUI's dict form of a conditioning entry) → ``encode_model_conds`` with the
    model's ``extra_conds`` (``c_crossattn``, ``y`` for SDXL-style pooled vectors, concat inputs, ...) for that row's
    noise and latent → ``process_cond(batch_size=1)``; then ``cond_cat`` joins the rows, padding cross-attention of
    different token lengths the way ComfyUI's sampler does. Rows whose conditionings cannot be joined (an LLM
    encoder's captions of different lengths, a T5 prompt past its padded length) form groups of their own, each
    run through the model separately, as ComfyUI's sampler runs conditionings it cannot batch.

    What ``extra_conds`` makes on the host (Flux's guidance, SDXL's size-and-pooled vector) reaches a CUDA device
    through pinned memory without blocking (:func:`_to_device`): ``cond_cat``'s own ``.to(device)`` is a pageable
    copy, and each one makes the training thread wait until the device has finished the step before
    (docs/BENCHMARKS.md, "Ops per training step").
    """

    def __init__(self, model: Any, device: torch.device) -> None:
        self.model = model
        self.device = device

    def __call__(self, conditionings: Sequence[Any], noise: torch.Tensor, latents: torch.Tensor,
                 seed: int) -> list[tuple[list[int], dict[str, Any]]]:
        """Return ``(row indices, apply_model keyword arguments)`` per group of rows that batch together."""
        rows = []
        for i, conditioning in enumerate(conditionings):
            # check_trainable refused multi-entry conditionings and sampler-only options when the dataset opened
            (entry,) = comfy.sampler_helpers.convert_cond(conditioning)
            (encoded,) = comfy.samplers.encode_model_conds(
                self.model.extra_conds, [entry], noise[i : i + 1], self.device, "positive",
                latent_image=latents[i : i + 1], seed=seed,
            )
            rows.append({k: v.process_cond(batch_size=1, area=None) for k, v in encoded["model_conds"].items()})
        groups: list[list[int]] = []
        for i, row in enumerate(rows):
            home = next((g for g in groups if comfy.samplers.cond_equal_size(rows[g[0]], row)), None)
            if home is None:
                groups.append([i])
            else:
                home.append(i)
        return [(g, self._on_device(comfy.samplers.cond_cat([rows[i] for i in g]))) for g in groups]

    def _on_device(self, kwargs: dict[str, Any]) -> dict[str, Any]:
        """``cond_cat(..., device=)``'s last step (every value that has ``.to`` moved to the device), each host
        tensor copied without blocking."""
        return {k: _to_device(v, self.device) if hasattr(v, "to") else v for k, v in kwargs.items()}


def _to_device(value: Any, device: torch.device) -> Any:
    """``value.to(device)``, the same values; a host tensor bound for the CPU or a CUDA device is copied without
    blocking, through pinned memory for CUDA (torch's caching host allocator keeps the pinned block until the copy
    is done; on the CPU there is nothing to copy)."""
    if isinstance(value, torch.Tensor) and value.device.type == "cpu" and device.type in ("cpu", "cuda"):
        source = value.pin_memory() if device.type == "cuda" else value
        return source.to(device, non_blocking=True)
    return value.to(device)


class ModelCall:
    """One call of the model on a batch, as ComfyUI's ``_calc_cond_batch`` makes it for a single conditioning:
    the patcher's transformer options, wrappers and callbacks, ``model_function_wrapper`` when set."""

    def __init__(self, mp: Any, model_options: dict[str, Any]) -> None:
        self.mp = mp
        self.model_options = model_options
        self.uuid = uuid.uuid4()

    def __call__(self, xt: torch.Tensor, sigma: torch.Tensor, kwargs: dict[str, Any]) -> torch.Tensor:
        self.mp.prepare_state(sigma, self.model_options)
        options = dict(self.model_options.get("transformer_options", {}))
        options.update(cond_or_uncond=[0], uuids=[self.uuid], sigmas=sigma)
        c = {**kwargs, "transformer_options": options}
        wrapper = self.model_options.get("model_function_wrapper")
        if wrapper is not None:
            return wrapper(self.mp.model.apply_model,
                           {"input": xt, "timestep": sigma, "c": c, "cond_or_uncond": [0]})
        return self.mp.model.apply_model(xt, sigma, **c)

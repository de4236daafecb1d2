"""What a batch is made of, from the values of its one read: the :class:`Batch`, and its assembly on the CPU.

The loader reads every entry of a batch (latents, conditionings, loss masks, reference images) in ONE read, into
one reusable buffer; this module turns those values into a :class:`Batch`. The checks and the byte-level steps here
are shared by both targets: the CPU batch is made here (views of the read buffer wherever the reader laid the rows
out so), the CUDA batch by :mod:`.cuda_delivery` from the same rows, mask bytes and lookup table, so both widen
masks the same way.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import torch

from .sampler import BatchPlan

__all__ = ["Batch", "MASK_LUT", "PerBatch", "REFERENCE_LATENTS", "assemble_cpu", "latent_rows", "as_one_block",
           "stack_rows", "mask_rows", "mask_bytes", "widen_masks", "check_extras", "entry_keys", "map_tensors",
           "host_bytes", "reference_rows", "with_references"]

PerBatch = Callable[[int, BatchPlan, torch.Size], dict[str, torch.Tensor]]
"""A loader's per-batch hook: called on a worker thread after the batch's read with the batch's number in the
iteration (0 for the first the consumer gets; workers may call it out of order), its plan and the latents' shape;
the CPU tensors it returns reach the consumer as ``Batch.extras``, on the batch's device."""

MASK_LUT = torch.arange(256, dtype=torch.float32) / 255
"""A stored mask byte ``b`` means the loss weight ``b / 255`` (float32, divided on the CPU, once).

Both targets widen a mask by looking its bytes up in this table, so the device holds exactly the CPU's values:
CUDA's own division by a CPU scalar multiplies by the reciprocal instead, which differs in the last bit for some
bytes (a mask computed on the device would not train what the CPU tests prove)."""


@dataclass
class Batch:
    """One batch, on the loader's device.

    Attributes:
        plan: which samples and entries it holds.
        latents: the stacked ``"samples"`` of every row, ``[B, C, H, W]`` (``[B, C, T, H, W]`` for video latents).
        conditioning: per row, its conditioning structure with real tensors (rows sharing a caption entry share the
            same objects; do not modify them in place), a row's reference image in its ``reference_latents``.
        latent_extras: per row, the latent dict's other keys (e.g. ``"noise_mask"``), or ``None`` if no row has any.
        copy_events: CUDA only: timing events recorded on the loader's side stream before and after this batch's
            host-to-device copies (for profiling: ``start.elapsed_time(end)``); ``None`` on CPU.
        masks: the rows' loss masks, ``[B, 1, h, w]`` float32 in [0, 1] (1: full weight) at the latents' spatial
            size, a mirrored row's mask flipped with it, rows without a mask all ones; ``None`` when no row has one.
        extras: what the loader's ``per_batch`` hook returned for this batch, on the batch's device (empty without
            a hook).
    """

    plan: BatchPlan
    latents: torch.Tensor
    conditioning: list[Any]
    latent_extras: list[dict[str, Any]] | None = None
    copy_events: tuple[Any, Any] | None = None
    masks: torch.Tensor | None = None
    extras: dict[str, torch.Tensor] = field(default_factory=dict)


REFERENCE_LATENTS = "reference_latents"
"""The conditioning option that holds an edit model's reference images as latents (a list of ``[1, C, h, w]``
tensors, as ComfyUI's ReferenceLatent node appends them; Flux Kontext and Qwen-Image-Edit read it)."""


def entry_keys(plan: BatchPlan) -> list[str]:
    """Every entry one batch reads, each once: latents, conditionings, loss masks and reference images in ONE
    read."""
    masks = tuple(k for k in plan.mask_keys if k is not None)
    refs = tuple(k for k in plan.reference_keys if k is not None) if plan.reference_keys else ()
    return list(dict.fromkeys(plan.latent_keys + plan.caption_keys + masks + refs))


def reference_rows(plan: BatchPlan, values: dict[str, Any]) -> list[torch.Tensor | None] | None:
    """Each row's reference latent (its entry's ``"samples"``, checked to be a floating-point latent), ``None`` for
    a row without one; ``None`` when no row has one."""
    if not any(k is not None for k in plan.reference_keys):
        return None
    out: list[torch.Tensor | None] = []
    for key, latent in zip(plan.reference_keys, plan.latent_keys):
        if key is None:
            out.append(None)
            continue
        value = values[key]
        ref = value.get("samples") if isinstance(value, dict) else None
        if not isinstance(ref, torch.Tensor) or ref.dim() < 4 or ref.shape[0] != 1 \
                or not ref.dtype.is_floating_point:
            raise ValueError(f"reference entry {key} (of latent {latent}) is not a latent dict with a floating "
                             "point [1, C, ...] 'samples' tensor; re-encode the dataset's reference images")
        out.append(ref)
    return out


def with_references(conditionings: list[Any], refs: list[torch.Tensor | None] | None) -> list[Any]:
    """Each row's conditioning with its reference latent appended to :data:`REFERENCE_LATENTS` of each of its
    entries, as ComfyUI's ReferenceLatent node does; new lists and dicts (rows that share a caption share its
    objects), a row without a reference as it was."""
    if refs is None:
        return conditionings
    out = []
    for cond, ref in zip(conditionings, refs):
        if ref is None:
            out.append(cond)
            continue
        rows = []
        for entry in cond:
            options = dict(entry[1])
            options[REFERENCE_LATENTS] = [*options.get(REFERENCE_LATENTS, ()), ref]
            rows.append([entry[0], options, *entry[2:]])
        out.append(rows)
    return out


def map_tensors(value: Any, fn: Callable[[torch.Tensor], torch.Tensor]) -> Any:
    """``value`` rebuilt with ``fn`` applied to each tensor leaf (lists, tuples and dicts walked)."""
    if isinstance(value, torch.Tensor):
        return fn(value)
    if isinstance(value, list):
        return [map_tensors(v, fn) for v in value]
    if isinstance(value, tuple):
        return tuple(map_tensors(v, fn) for v in value)
    if isinstance(value, dict):
        return {k: map_tensors(v, fn) for k, v in value.items()}
    return value


def copy_bytes(dst: torch.Tensor, src: torch.Tensor) -> None:
    """Copy ``src`` into ``dst`` (contiguous CPU tensors of equal size) with numpy: one thread, GIL released.

    ``torch``'s own copy would fan out to the intra-op thread pool, which the consumer's thread uses too; waking
    it on a busy machine cost far more than the copy (docs/ARCHITECTURE.md, the read path).
    """
    np.copyto(dst.view(-1).view(torch.uint8).numpy(), src.reshape(-1).view(torch.uint8).numpy())


def latent_rows(plan: BatchPlan, values: dict[str, Any]) -> list[torch.Tensor]:
    """Each row's ``"samples"`` tensor, checked to be one shape and dtype (the sampler's buckets)."""
    rows = []
    for key in plan.latent_keys:
        v = values[key]
        if not isinstance(v, dict) or not isinstance(v.get("samples"), torch.Tensor):
            raise ValueError(f"latent entry {key} is not a latent dict with a 'samples' tensor")
        rows.append(v["samples"])
    shape, dtype = rows[0].shape[1:], rows[0].dtype
    if not all(r.shape[1:] == shape and r.dtype == dtype for r in rows):
        kinds = {(tuple(r.shape[1:]), str(r.dtype)) for r in rows}
        raise ValueError(
            f"batch {plan.index} of epoch {plan.epoch} mixes latent shapes/dtypes {sorted(kinds)}: the sampler's "
            "buckets do not match the latents; build buckets with buckets_from_reader()"
        )
    return rows


def batch_shape(rows: list[torch.Tensor]) -> torch.Size:
    """The stacked latents' shape ``[B, ...]`` (rows of one shape, checked by :func:`latent_rows`)."""
    return torch.Size((sum(r.shape[0] for r in rows), *rows[0].shape[1:]))


def as_one_block(rows: list[torch.Tensor]) -> torch.Tensor | None:
    """``rows`` as one ``[B, ...]`` view when they already lie back to back, in order, in one storage (the
    reader places a batch's latents so); ``None`` otherwise.

    Checked with a few calls per row (this runs for every batch, under the GIL): each row of the first's shape and
    dtype, contiguous, at the next address, and the whole block inside the first row's storage."""
    first = rows[0]
    shape = first.shape
    if shape[0] != 1 or not first.is_contiguous():
        return None
    nbytes = first.nbytes
    at = first.data_ptr()
    for r in rows[1:]:
        at += nbytes
        if r.data_ptr() != at or r.shape != shape or r.dtype != first.dtype or not r.is_contiguous():
            return None
    storage = first.untyped_storage()
    if at + nbytes > storage.data_ptr() + storage.nbytes():  # never a view past the storage's end
        return None
    strides, acc = [], 1
    for d in reversed(shape[1:]):
        strides.append(acc)
        acc *= max(d, 1)
    return first.as_strided((len(rows), *shape[1:]), (first.numel(), *reversed(strides)), first.storage_offset())


def stack_rows(rows: list[torch.Tensor]) -> torch.Tensor:
    """Latent rows as one ``[B, ...]`` CPU tensor: a view of the read buffer when the reader left them back to
    back (no copy), else one copy of each row into a new tensor."""
    block = as_one_block(rows)
    if block is not None:
        return block
    out = torch.empty(batch_shape(rows), dtype=rows[0].dtype)
    at = 0
    for r in rows:
        copy_bytes(out[at : at + r.shape[0]], r.contiguous())
        at += r.shape[0]
    return out


def mask_rows(plan: BatchPlan, values: dict[str, Any], hw: tuple[int, int]) -> list[torch.Tensor | None]:
    """Each row's stored ``uint8`` mask (``[1, 1, h, w]``, checked against its latent's size ``hw``), ``None``
    for a row without one."""
    h, w = hw
    out: list[torch.Tensor | None] = []
    for key, latent in zip(plan.mask_keys, plan.latent_keys):
        if key is None:
            out.append(None)
            continue
        value = values[key]
        mask = value.get("mask") if isinstance(value, dict) else None
        if not isinstance(mask, torch.Tensor) or mask.dim() != 4 or mask.shape[:2] != (1, 1):
            raise ValueError(f"mask entry {key} is not a mask dict with a [1, 1, h, w] 'mask' tensor (got "
                             f"{type(mask).__name__ if not isinstance(mask, torch.Tensor) else list(mask.shape)}); "
                             "re-encode the dataset's masks")
        if tuple(mask.shape[-2:]) != (h, w):
            raise ValueError(f"mask entry {key} is {list(mask.shape[-2:])} but its latent {latent} is "
                             f"{[h, w]} (height, width): the mask was made for another crop or resolution; "
                             "re-encode the dataset's masks")
        out.append(mask)
    return out


def mask_bytes(plan: BatchPlan, rows: list[torch.Tensor | None], hw: tuple[int, int],
               device: torch.device) -> torch.Tensor:
    """The batch's stored mask bytes ``[B, 1, h, w]`` ``uint8`` on ``device``: each row's mask (``rows``: tensors
    on ``device``), flipped for a mirrored row, 255 (full weight) for a row without one. Exact on any device."""
    gathered = torch.full((len(rows), 1, *hw), 255, dtype=torch.uint8, device=device)
    for i, (mask, flip) in enumerate(zip(rows, plan.mirrored or (False,) * len(rows))):
        if mask is None:
            continue
        src = mask[0].flip(-1) if flip else mask[0]
        if device.type == "cpu":
            copy_bytes(gathered[i], src.contiguous())
        else:
            gathered[i].copy_(src)
    return gathered


def widen_masks(gathered: torch.Tensor, lut: torch.Tensor) -> torch.Tensor:
    """Mask bytes as float32 loss weights: each byte looked up in ``lut`` (:data:`MASK_LUT`, on the bytes' device).

    A lookup copies the table's values, so the result is the same bits on every device."""
    return torch.index_select(lut, 0, gathered.reshape(-1).to(torch.int32)).view(gathered.shape)


def check_extras(extras: Any) -> dict[str, torch.Tensor]:
    """What a ``per_batch`` hook returned, checked: a dict of names to CPU tensors (named in the error)."""
    if not isinstance(extras, dict):
        raise TypeError(f"the loader's per_batch hook returned {type(extras).__name__}, not a dict of tensors")
    for name, t in extras.items():
        if not isinstance(name, str) or not isinstance(t, torch.Tensor) or t.device.type != "cpu":
            what = f"a tensor on {t.device}" if isinstance(t, torch.Tensor) else type(t).__name__
            raise TypeError(f"the loader's per_batch hook returned {what} for {name!r}: it must return CPU "
                            "tensors by name (the loader moves them to the batch's device)")
    return extras


def assemble_cpu(plan: BatchPlan, values: dict[str, Any], rows: list[torch.Tensor],
                 extras: dict[str, torch.Tensor]) -> Batch:
    """The CPU batch: views of the values of its read (the batch owns its read buffer), latents stacked only when
    the reader did not lay them back to back, masks widened through :data:`MASK_LUT`."""
    latents = stack_rows(rows)
    conds = [values[k] for k in plan.caption_keys]
    if plan.reference_keys:  # () when no sample of the dataset has one: no Python per batch for them
        conds = with_references(conds, reference_rows(plan, values))
    latent_extras = [{k: v for k, v in values[key].items() if k != "samples"} for key in plan.latent_keys]
    masks = None
    if any(k is not None for k in plan.mask_keys):
        hw = (latents.shape[-2], latents.shape[-1])
        gathered = mask_bytes(plan, mask_rows(plan, values, hw), hw, latents.device)
        masks = widen_masks(gathered, MASK_LUT)
    return Batch(plan, latents, conds, latent_extras if any(latent_extras) else None, masks=masks, extras=extras)


def host_bytes(batch: Batch) -> int:
    """Bytes of host memory a (CPU) batch's tensors cover, each memory once."""
    seen: dict[int, int] = {}

    def visit(t: torch.Tensor) -> torch.Tensor:
        seen[t.data_ptr()] = t.numel() * t.element_size()
        return t

    map_tensors([batch.latents, batch.conditioning, batch.latent_extras, batch.masks, batch.extras], visit)
    return sum(seen.values())

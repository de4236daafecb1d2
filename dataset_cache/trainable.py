"""What a dataset must hold before a trainer reads it, checked from shard headers alone.

A cache verifies its bytes, not their meaning: a latent column relabelled as integers, or a conditioning that
combines several prompts, has valid checksums and would train silently wrong (integer latents train at loss 0;
only the first of several conditioning entries would be used). :func:`check_trainable` refuses such a dataset
when training opens it, naming the entry, before any tensor is read. Values that are NaN or infinite can only
be seen by reading them; the trainer stops at the first non-finite loss instead (:func:`non_finite_entries`
then names the rows that hold them).
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from typing import Any

import torch

from .dataset import Sample
from .reading import EntryHeaders

__all__ = ["UNTRAINABLE_CONDITIONING_KEYS", "check_trainable", "non_finite_entries"]

UNTRAINABLE_CONDITIONING_KEYS = ("area", "mask", "strength", "timestep_start", "timestep_end", "control",
                                 "gligen", "hooks")
"""Conditioning options that change how ComfyUI's sampler applies a prompt (areas, masks, timestep ranges,
ControlNets, hooks). A training step predicts the whole latent from one prompt, so a conditioning that carries
one of them cannot be trained as it was meant and is refused."""


def _leaves(value: Any) -> Iterable[tuple[str, Any]]:
    """``(path, leaf)`` of every tensor leaf (``torch.Size`` or a lazy/real tensor) of an entry's structure."""
    stack: list[tuple[str, Any]] = [("", value)]
    while stack:
        path, v = stack.pop()
        if isinstance(v, dict):
            stack.extend((f"{path}[{k!r}]", x) for k, x in v.items())
        elif isinstance(v, (list, tuple)) and not isinstance(v, torch.Size):
            stack.extend((f"{path}[{i}]", x) for i, x in enumerate(v))
        elif hasattr(v, "dtype") and hasattr(v, "shape"):
            yield path, v


def _where(i: int, s: Sample) -> str:
    return f"sample {i} ({s.source or s.latent})"


def check_trainable(reader: EntryHeaders, samples: Sequence[Sample]) -> None:
    """Refuse a dataset whose latents or conditionings a trainer would use wrongly; reads headers only.

    Args:
        reader: an open cache reader (``get(key)`` gives the entry with lazy tensor leaves).
        samples: the dataset's samples.

    Raises:
        ValueError: naming the sample and entry: a latent ``"samples"`` tensor that is not floating point; a
            conditioning tensor that is not floating point (attention masks and other integer or bool options
            are allowed); a conditioning with more than one entry; a conditioning option of
            :data:`UNTRAINABLE_CONDITIONING_KEYS`.
    """
    seen: set[str] = set()
    for i, s in enumerate(samples):
        for latent in (k for k in (s.latent, s.mirror, s.reference, s.reference_mirror) if k is not None):
            if latent in seen:
                continue
            seen.add(latent)
            value = reader.get(latent)
            leaf = value.get("samples") if isinstance(value, dict) else None  # shape problems: buckets_from_reader
            if leaf is not None and not leaf.dtype.is_floating_point:
                raise ValueError(f"{_where(i, s)}: latent entry {latent} holds {leaf.dtype} samples; a latent must "
                                 "be floating point (the cache was written wrongly: re-encode the dataset)")
        for key in s.captions if s.empty_caption is None else (*s.captions, s.empty_caption):
            if key in seen:
                continue
            seen.add(key)
            _check_conditioning(reader.get(key), key, _where(i, s))


def _check_conditioning(value: Any, key: str, where: str) -> None:
    if not isinstance(value, list) or not value:
        return  # not a ComfyUI conditioning list: the trainer's own conversion names what it cannot use
    if len(value) > 1:
        raise ValueError(
            f"{where}: conditioning entry {key} holds {len(value)} conditionings (as Conditioning Combine makes); "
            "a training step needs one per caption. Use Conditioning Concat, or one caption line per variant")
    first = value[0]
    tensor = first[0] if isinstance(first, (list, tuple)) and first else None
    options = first[1] if isinstance(first, (list, tuple)) and len(first) > 1 and isinstance(first[1], dict) else {}
    if tensor is not None and hasattr(tensor, "dtype") and not tensor.dtype.is_floating_point:
        raise ValueError(f"{where}: conditioning entry {key} holds a {tensor.dtype} tensor; a text conditioning "
                         "must be floating point (re-encode the dataset)")
    unusable = [k for k in UNTRAINABLE_CONDITIONING_KEYS if k in options]
    if unusable:
        raise ValueError(f"{where}: conditioning entry {key} carries {', '.join(map(repr, unusable))}, which "
                         "changes how the sampler applies a prompt and cannot be trained; encode the captions "
                         "without area, mask, strength, timestep range, ControlNet or hook nodes")
    for path, leaf in _leaves(options):
        if path.startswith("['pooled_output']") and not leaf.dtype.is_floating_point:
            raise ValueError(f"{where}: conditioning entry {key}: pooled_output is {leaf.dtype}; it must be "
                             "floating point (re-encode the dataset)")


def non_finite_entries(latent_keys: Sequence[str], latents: torch.Tensor, caption_keys: Sequence[str],
                       conditionings: Sequence[Any]) -> list[str]:
    """Name the entries of a batch that hold NaN or infinite values (``"latent <key>"``, ``"conditioning
    <key> at <path>"``); empty when every value is finite."""
    found = []
    for key, row in zip(latent_keys, latents):
        if not torch.isfinite(row).all():
            found.append(f"latent {key}")
    for key, value in zip(caption_keys, conditionings):
        for path, leaf in _leaves(value):
            if isinstance(leaf, torch.Tensor) and leaf.is_floating_point() and not torch.isfinite(leaf).all():
                found.append(f"conditioning {key} at {path or 'top'}")
                break
    return found

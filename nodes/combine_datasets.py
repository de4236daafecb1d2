"""Node "Combine Datasets": several datasets trained together, each with its own repeats, of one cache or several.

kohya's dataset config lists subsets with ``num_repeats``; here each pair of sockets adds one dataset and its
repeats, and the node chains (its output into another one's ``dataset_a``) for any number of datasets. The output
only names the datasets (:class:`~.handles.CombinedDatasetHandle`); Train LoRA opens them and the library's
:func:`~dataset_cache.dataset_mix.mix_datasets` multiplies the repeats in.
"""

from __future__ import annotations

from typing import Any

from comfy_api.latest import io, ui

from ..dataset_cache.dataset import MAX_EPOCH_OCCURRENCES, MAX_REPEATS
from ..dataset_cache.errors import CacheError
from ..dataset_cache.format.reader import open_cache
from .handles import CombinedDatasetHandle, StreamDataset, StreamDatasetHandle, combine

__all__ = ["CombineDatasets"]


def _handle(value: Any, what: str) -> StreamDatasetHandle | CombinedDatasetHandle:
    if not isinstance(value, (StreamDatasetHandle, CombinedDatasetHandle)):
        raise ValueError(f"{what}: expected a STREAM_DATASET from a StreamCache node (Encode Dataset, Load Lazy "
                         f"Cache, Save Streamable Cache or Combine Datasets), got {type(value).__name__}")
    return value


def _repeats(value: Any, what: str) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or not 1 <= value <= MAX_REPEATS:
        raise ValueError(f"{what} must be a whole number from 1 to {MAX_REPEATS}, got {value!r:.40}")
    return value


def _folder_repeats(root: str, name: str) -> tuple[int, int] | None:
    """(the largest repeats, the occurrences per epoch) of a dataset's samples as stored (kohya's
    ``<repeats>_<name>`` folders), or ``None`` when the cache or the dataset cannot be read (Train LoRA names it)."""
    try:
        with open_cache(root) as reader:
            samples = reader.dataset(name)
    except (CacheError, KeyError, OSError, ValueError):
        return None
    return max((s.repeats for s in samples), default=1), sum(s.repeats for s in samples)


def _check_totals(inputs: list[tuple[str, int, Any]]) -> None:
    """Refuse here, naming ``repeats_a`` / ``repeats_b``, what Train LoRA would refuse later: an image repeated
    more than ``MAX_REPEATS`` times per epoch (its folder's repeats × each Combine Datasets' repeats), or an epoch
    past ``MAX_EPOCH_OCCURRENCES``.

    ``inputs``: ``(input name, its repeats, its handle)``.
    """
    seen: dict[tuple[str, str], tuple[int, int] | None] = {}
    occurrences = 0
    for what, repeats, handle in inputs:
        for part in handle.parts:
            at = (part.cache_root, part.name)
            if at not in seen:
                seen[at] = _folder_repeats(*at)
            stored = seen[at]
            if stored is None:
                continue
            top, count = stored
            total = top * part.repeats * repeats
            if total > MAX_REPEATS:
                earlier = f" × {part.repeats} (an earlier Combine Datasets)" if part.repeats > 1 else ""
                raise ValueError(
                    f"{what} {repeats}: dataset {part.name!r} has images repeated {top} times by their folder "
                    f"(kohya's <repeats>_<name>){earlier}, so they would repeat {total} times per epoch, above the "
                    f"limit of {MAX_REPEATS}; set {what} to at most {max(1, MAX_REPEATS // (top * part.repeats))}")
            occurrences += count * part.repeats * repeats
    if occurrences > MAX_EPOCH_OCCURRENCES:
        names = " and ".join(f"{what} {repeats}" for what, repeats, _ in inputs)
        raise ValueError(f"{names}: the combined datasets make {occurrences} occurrences (images × repeats) per "
                         f"epoch, above the limit of {MAX_EPOCH_OCCURRENCES}; lower the repeats")


class CombineDatasets(io.ComfyNode):
    """Names several datasets (of any caches), with repeats, as one ``STREAM_DATASET`` for Train LoRA."""

    @classmethod
    def define_schema(cls) -> io.Schema:
        return io.Schema(
            node_id="StreamCache_CombineDatasets",
            display_name="Combine Datasets",
            category="StreamCache",
            description=(
                "Trains several datasets together, each repeated its own number of times per epoch (as kohya's "
                "dataset config); they may be in different caches. Chain the node for more than two datasets. Only "
                "Train LoRA takes the result."
            ),
            inputs=[
                StreamDataset.Input("dataset_a", tooltip="A dataset, or the output of another Combine Datasets."),
                io.Int.Input("repeats_a", default=1, min=1, max=MAX_REPEATS,
                             tooltip="How many times each image of dataset_a appears per epoch, multiplied with "
                             "its folder's own repeats (kohya's <repeats>_<name>)."),
                StreamDataset.Input("dataset_b", optional=True,
                                    tooltip="A second dataset, of this cache or another (optional)."),
                io.Int.Input("repeats_b", default=1, min=1, max=MAX_REPEATS, optional=True,
                             tooltip="How many times each image of dataset_b appears per epoch (times its "
                             "folder's repeats)."),
            ],
            outputs=[StreamDataset.Output(display_name="dataset",
                                          tooltip="The combined datasets, for Train LoRA (Stream Cache).")],
        )

    @classmethod
    def execute(cls, dataset_a: Any, repeats_a: int, dataset_b: Any = None, repeats_b: int = 1) -> io.NodeOutput:
        a = _handle(dataset_a, "dataset_a")
        b = None if dataset_b is None else _handle(dataset_b, "dataset_b")
        combined = combine(a, _repeats(repeats_a, "repeats_a"), b, _repeats(repeats_b, "repeats_b"))
        _check_totals([("repeats_a", repeats_a, a)] + ([("repeats_b", repeats_b, b)] if b is not None else []))
        text = f"{combined.name} ({combined.where()})"
        return io.NodeOutput(combined, ui=ui.PreviewText(text))

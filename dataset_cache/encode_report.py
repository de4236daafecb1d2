"""What one encode run did: :class:`EncodeReport`, the counts, timings and notes that the Encode Dataset node shows
and the logs keep.

A module of its own because its readers (the node, the benchmarks, the logs) need the account of a run, not the
machinery that made it (:mod:`.encode_run`).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import NamedTuple

from .errors import SourceFailure
from .format.compaction import CompactReport
from .units import format_bytes

__all__ = ["CaptionExample", "EncodeReport"]


class CaptionExample(NamedTuple):
    """What one sample trains with, for the report: its source, its distinct caption texts' count, and the first of
    them (:func:`.encode_jobs.caption_example`)."""

    source: str
    distinct: int
    texts: tuple[str, ...]


@dataclass
class EncodeReport:
    """What :func:`.encode_run.run_encode` did. Source counts are files; entry counts are distinct entries.

    Attributes:
        dataset: the dataset's name.
        samples: samples in the stored dataset.
        new / changed / unchanged / removed: source file counts from the plan.
        encoded_latents / encoded_conditionings: entries this run encoded and committed.
        reused: distinct entries the dataset needed that were already in the cache.
        failed: unusable source files (plan time and encode time).
        skipped: samples left out of the dataset because of a failure.
        failures: each failure (file + reason).
        bytes_written: bytes of the shards committed by this run (before compaction).
        seconds: wall time of :func:`.encode_run.run_encode`.
        stopped: ``should_stop()`` ended the run early; run again to encode the rest.
        sourceless: the source folder is gone; the dataset was kept as stored.
        compaction: what the final compaction did, when it ran.
        timings: seconds spent in ``encoder`` calls, blocked on ``decode`` (``decode_wait``), decoding across the
            worker threads (``decode_cpu``), adding, checkpointing and committing (``commit``; in the background
            during the encode, see ``run_encode``), waiting for a background checkpoint (``commit_wait``), storing
            the dataset and compacting (``finish``), and waiting for the write lock (``lock_wait``).
        log_syncs: fsyncs of the recovery log (each bounds what a power loss can take).
        notes: settings this run had to change, for the user (fewer images per VAE call for large buckets).
        encoded_masks: loss masks this run made and committed.
        encoded_mirrors: mirrored latents among ``encoded_latents``.
        encoded_references: reference images' latents among ``encoded_latents`` (mirrored ones included).
        encoded_empty_caption: this run encoded the empty caption.
        variants: what the stored dataset holds (:func:`.encode_jobs.variant_counts`): distinct ``captions``,
            ``mirrors``, ``masks``, ``masked_samples``, ``empty_caption`` (0/1), ``shuffle_variants`` (with
            ``tag_dropout``, ``wildcards`` when set) and, with ``flip="always"``, ``flipped``.
        short_clips: clips that give fewer frames than asked, each ``"<relpath>: <taken> of <asked> frames
            (why)"`` (the plan's; ``notes`` names the first of them).
        caption_example: the plan's (:attr:`.encode_jobs.EncodePlan.caption_example`): a sample's caption texts,
            shown in the summary so what shuffles, tag dropout and wildcards make is seen before training.
    """

    dataset: str
    samples: int = 0
    new: int = 0
    changed: int = 0
    unchanged: int = 0
    removed: int = 0
    encoded_latents: int = 0
    encoded_conditionings: int = 0
    reused: int = 0
    failed: int = 0
    skipped: int = 0
    failures: list[SourceFailure] = field(default_factory=list)
    bytes_written: int = 0
    seconds: float = 0.0
    stopped: bool = False
    sourceless: bool = False
    compaction: CompactReport | None = None
    timings: dict[str, float] = field(default_factory=dict)
    log_syncs: int = 0
    notes: list[str] = field(default_factory=list)
    encoded_masks: int = 0
    encoded_mirrors: int = 0
    encoded_references: int = 0
    encoded_empty_caption: bool = False
    variants: dict[str, int | float] = field(default_factory=dict)
    short_clips: tuple[str, ...] = ()
    caption_example: CaptionExample | None = None

    @property
    def encoded(self) -> int:
        """Entries encoded by this run (latents + conditionings + masks)."""
        return self.encoded_latents + self.encoded_conditionings + self.encoded_masks

    def variants_line(self) -> str | None:
        """One line on the variants (shuffles, mirrors, masks, reference images, empty caption): made this run / in
        the dataset;
        ``None`` when the dataset has none."""
        v = self.variants
        parts = []
        if v.get("shuffle_variants"):
            dropout = f" with tag dropout {v['tag_dropout']:g}" if v.get("tag_dropout") else ""
            parts.append(f"{v['shuffle_variants']} tag shuffles{dropout} per caption line ({v.get('captions', 0)} "
                         "distinct caption texts in the dataset)")
        if v.get("wildcards"):
            parts.append("wildcards: each combination of a caption line's {a|b} options is a caption variant")
        if v.get("mirrors") or self.encoded_mirrors:
            parts.append(f"mirrors: {self.encoded_mirrors} encoded, {v.get('mirrors', 0)} in the dataset")
        if v.get("flipped"):
            parts.append(f"flip always: all {v['flipped']} samples stored mirrored (training never sees the "
                         "originals)")
        if v.get("masks") or self.encoded_masks:
            parts.append(f"masks: {self.encoded_masks} made, {v.get('masks', 0)} in the dataset "
                         f"({v.get('masked_samples', 0)} of {self.samples} samples masked)")
        if v.get("references") or self.encoded_references:
            parts.append(f"reference images: {self.encoded_references} encoded, {v.get('references', 0)} in the "
                         f"dataset ({v.get('referenced_samples', 0)} of {self.samples} samples with one)")
        if v.get("empty_caption") or self.encoded_empty_caption:
            parts.append("empty caption: " + ("encoded" if self.encoded_empty_caption else "cached"))
        return "variants: " + "; ".join(parts) if parts else None

    def summary(self) -> str:
        """A short human-readable account (a few lines) for logs and the UI."""
        if self.sourceless:
            head = (f"dataset {self.dataset!r}: source folder is gone ({self.removed} source files removed); "
                    f"{self.samples} samples are served from the cache as stored")
            return head
        lines = [
            f"dataset {self.dataset!r}: {self.samples} samples" + (" (STOPPED: run again to encode the rest)"
                                                                    if self.stopped else ""),
            f"encoded {self.encoded_latents} latents and {self.encoded_conditionings} conditionings"
            + (f" and made {self.encoded_masks} masks" if self.encoded_masks else "") + ", "
            f"reused {self.reused} cached entries, wrote {format_bytes(self.bytes_written)} in {self.seconds:.1f}s",
            f"sources: {self.new} new, {self.changed} changed, {self.unchanged} unchanged, {self.removed} removed",
        ]
        variants = self.variants_line()
        if variants:
            lines.append(variants)
        if self.caption_example is not None:
            example = self.caption_example
            lines.append(f"caption variants of {example.source} ({len(example.texts)} of {example.distinct}): "
                         + " · ".join(repr(t[:80] + ("…" if len(t) > 80 else "")) for t in example.texts))
        if self.failures:
            lines.append(f"{self.failed} failed, {self.skipped} samples skipped; first: "
                         f"{self.failures[0].relpath}: {self.failures[0].reason}")
        if self.compaction is not None and self.compaction.findings():
            lines.append(f"cache: {self.compaction.findings()}")
        lines.extend(f"NOTE: {n}" for n in self.notes)
        return "\n".join(lines)

"""What a dataset's variants are and what they cost: counts and tensor bytes per role, from headers alone.

A sample names its latent, possibly a mirrored latent, a loss mask and a reference image's latents, its
caption variants (lines and their shuffled-tag variants) and the empty caption of caption dropout. Every one is
an ordinary content-keyed entry, so "what do my flips cost" is a question about which keys play which role; this
module answers it for reports (Encode Dataset, Cache Info, ``python -m dataset_cache info``) without reading any
tensor.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Protocol

from .dataset import Sample
from .errors import CacheError
from .units import format_bytes

if TYPE_CHECKING:
    from .format.reader import CacheReader

__all__ = ["ROLES", "RoleSummary", "VariantSummary", "role_keys", "summarize_datasets", "summarize_variants"]

ROLES = ("latents", "mirrors", "masks", "captions", "empty_caption", "references")
"""The roles an entry plays in a dataset. Each role counts its own distinct keys: a key in two roles (a caption
line that is itself empty, and the dropout's empty caption) counts in both."""


class _Sizes(Protocol):
    def __contains__(self, key: object) -> bool: ...

    def entry_nbytes(self, key: str) -> int: ...


@dataclass(frozen=True)
class RoleSummary:
    """Distinct entries of one role, the tensor bytes they take, and how many of them the cache lacks."""

    entries: int = 0
    bytes: int = 0
    missing: int = 0


@dataclass(frozen=True)
class VariantSummary:
    """The entries of one dataset by role (see :data:`ROLES`).

    Attributes:
        samples: samples in the dataset.
        roles: role -> its distinct entries, bytes and missing entries.
        settings: the variant settings the dataset was encoded with, from its info (``flip`` — ``"always"`` or
            ``"random"`` —, ``shuffle_variants``, ``keep_tokens``, ``tag_dropout``, ``wildcards``, ``masks``,
            ``empty_caption``), for the report;
            absent ones are at their defaults.
    """

    samples: int
    roles: Mapping[str, RoleSummary]
    settings: Mapping[str, Any]

    @property
    def has_variants(self) -> bool:
        """Whether any sample names a mirror, a mask, the empty caption or a reference image, or has several caption
        variants."""
        return any(self.roles[r].entries for r in ("mirrors", "masks", "empty_caption", "references")) or (
            self.roles["captions"].entries > self.samples)

    def describe(self) -> dict[str, Any]:
        """Plain JSON: ``{"samples", "settings", <role>: {"entries", "bytes", "missing"}}``."""
        return {"samples": self.samples, "settings": dict(self.settings),
                **{r: vars(self.roles[r]).copy() for r in ROLES}}

    def lines(self) -> list[str]:
        """One line per role present, e.g. ``mirrors: 120 entries, 7.5 MiB``, after the variant settings if any."""
        out = []
        if self.settings:
            out.append("variant settings: " + ", ".join(f"{k} {v}" for k, v in self.settings.items()))
        for role in ROLES:
            s = self.roles[role]
            if not s.entries:
                continue
            noun = "entry" if s.entries == 1 else "entries"
            text = f"{role.replace('_', ' ')}: {s.entries} {noun}, {format_bytes(s.bytes)}"
            out.append(text + (f" ({s.missing} not in the cache)" if s.missing else ""))
        return out


_SETTING_NAMES = ("flip", "shuffle_variants", "keep_tokens", "tag_dropout", "wildcards", "masks", "empty_caption")


def role_keys(samples: Sequence[Sample]) -> dict[str, set[str]]:
    """Each role's distinct entry keys (see :data:`ROLES`), from the sample list alone."""
    return {
        "latents": {s.latent for s in samples},
        "mirrors": {s.mirror for s in samples if s.mirror is not None},
        "masks": {s.mask for s in samples if s.mask is not None},
        "captions": {k for s in samples for k in s.captions},
        "empty_caption": {s.empty_caption for s in samples if s.empty_caption is not None},
        "references": {k for s in samples for k in (s.reference, s.reference_mirror) if k is not None},
    }


def summarize_variants(reader: _Sizes, samples: Sequence[Sample], info: Mapping[str, Any] | None = None
                       ) -> VariantSummary:
    """Count each role's distinct entries and their tensor bytes (``reader.entry_nbytes``: headers only).

    Args:
        reader: an open cache (:class:`~dataset_cache.format.reader.CacheReader`).
        samples: the dataset's samples.
        info: the dataset's info (its ``settings`` name the variant settings it was encoded with).
    """
    roles: dict[str, RoleSummary] = {}
    for role, keys in role_keys(samples).items():
        present = [k for k in keys if k in reader]
        roles[role] = RoleSummary(len(keys), sum(reader.entry_nbytes(k) for k in present), len(keys) - len(present))
    stored = (info or {}).get("settings")
    stored = stored if isinstance(stored, Mapping) else {}
    settings = {k: stored[k] for k in _SETTING_NAMES if k in stored}
    bucket = stored.get("bucket")
    if isinstance(bucket, Mapping) and bucket.get("flip") not in (None, False):  # Encode Dataset keeps it there
        settings["flip"] = "always" if bucket["flip"] is True else bucket["flip"]
    return VariantSummary(len(samples), roles, settings)


def summarize_datasets(reader: CacheReader) -> dict[str, VariantSummary | CacheError]:
    """:func:`summarize_variants` of every dataset of an open cache, by name; a dataset file that cannot be read
    gives its error instead (the reports name it and go on with the others)."""
    out: dict[str, VariantSummary | CacheError] = {}
    for name, record in reader.datasets().items():
        try:
            out[name] = summarize_variants(reader, reader.dataset(name), record.info)
        except CacheError as exc:
            out[name] = exc
    return out

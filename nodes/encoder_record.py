"""Which encoders a plan names without loading them: the record of the loader nodes that made them.

A warm re-run of Encode Dataset must decide what is missing before ComfyUI runs the VAE and CLIP loaders (they
are lazy inputs). Each run records, in the dataset's info, the identity of the upstream loader node (its class
and inputs, :func:`.fingerprints.upstream_identity`) beside the real fingerprint of the encoder it made, and the
VAE's temporal and spatial compression; the next run assumes those. A wrong assumption only makes a key missing,
so the encoder is then requested: an entry is never stored under a wrong key. ``STREAMCACHE_TRUST_UPSTREAM=0``
turns assumptions off. Why, and the trade-offs: docs/ARCHITECTURE.md ("Encode Dataset: deciding before loading").
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from ..dataset_cache import read_state, update_dataset_info
from ..dataset_cache.errors import CacheError, CacheNotFoundError
from .encoders import frame_stride, spatial_factor
from .fingerprints import clip_fingerprint, upstream_identity, vae_fingerprint
from .paths import env_flag

__all__ = ["FACTOR_KEY", "RECORD_KEY", "RECORD_LIMIT", "STRIDE_KEY", "TRUST_UPSTREAM_ENV", "Encoders",
           "choose_encoders", "store_record"]

log = logging.getLogger("streamcache.encode_dataset")

TRUST_UPSTREAM_ENV = "STREAMCACHE_TRUST_UPSTREAM"
"""Set to ``0`` to always load the encoders instead of assuming recorded fingerprints."""
RECORD_KEY = "upstream_encoders"
"""Dataset-info key of the ``{"vae"|"clip": {upstream identity: fingerprint}}`` record."""
STRIDE_KEY = "vae_frame_stride"
"""Key, inside the ``RECORD_KEY`` record, of ``{vae fingerprint: temporal compression}``: a warm re-run of a clip
folder keys its clips without loading the VAE (frame counts depend on its temporal compression)."""
FACTOR_KEY = "vae_spatial_factor"
"""Key, inside the ``RECORD_KEY`` record, of ``{vae fingerprint: spatial compression}``: a warm re-run whose only
change is a mask file makes the mask (at the latent's resolution) without loading the VAE."""
RECORD_LIMIT = 8
"""Identities remembered per encoder: switching between a few VAEs or text encoders stays load-free."""
_UNRESOLVED = "unresolved:{}"  # a fingerprint no entry was ever keyed with: every key it yields is missing


@dataclass
class Encoders:
    """The fingerprints a plan uses, where they came from, and the upstream identities of the inputs."""

    vae_fp: str
    text_fp: str
    vae_identity: str | None
    clip_identity: str | None
    vae_loaded: bool
    clip_loaded: bool
    record: dict[str, dict[str, Any]]
    frame_stride: int | None = None
    mask_factor: int | None = None


def _record_of(info: Any) -> dict[str, dict[str, Any]]:
    record = info.get(RECORD_KEY) if isinstance(info, dict) else None
    return {k: dict(v) for k, v in record.items() if isinstance(v, dict)} if isinstance(record, dict) else {}


def _recorded(root: Path, dataset: str) -> tuple[dict[str, dict[str, Any]], dict[str, dict[str, Any]]]:
    """The ``{encoder: {identity: fingerprint}}`` record of the dataset, and every dataset's record of the cache
    merged (the dataset's own first, then the others by name): encoders are the cache's, not one dataset's, so a
    new dataset name loads no encoder only to fingerprint it. Empty when there is none."""
    try:
        state = read_state(root)
    except CacheNotFoundError:
        return {}, {}
    except CacheError as exc:
        log.warning("%s: cannot read the encoder record (%s); encoders will be loaded", root, exc)
        return {}, {}
    current = state.datasets.get(dataset)
    own = _record_of(current.info if current is not None else None)
    known = {name: dict(entries) for name, entries in own.items()}
    for name in sorted(state.datasets):
        if name != dataset:
            for encoder, entries in _record_of(state.datasets[name].info).items():
                mine = known.setdefault(encoder, {})
                for identity, value in entries.items():
                    mine.setdefault(identity, value)
    return own, known


def choose_encoders(root: Path, dataset: str, vae: Any, clip: Any, dynprompt: Any, node_id: str | None
                    ) -> Encoders:
    """The fingerprints a plan uses: an encoder that is here gives its own; one ComfyUI has not run (a lazy input
    not requested yet) is assumed from the record of the loader that would make it (``dynprompt``, ``node_id``:
    the prompt and this node), or is unresolved, so that every key it names is missing and it is requested."""
    ids = {name: upstream_identity(dynprompt, node_id, name) for name in ("vae", "clip")}
    record, known = _recorded(root, dataset)
    trusted = known if env_flag(TRUST_UPSTREAM_ENV, True) else {}

    def pick(name: str, obj: Any, compute: Callable[[Any], str]) -> str:
        if obj is not None:
            return compute(obj)
        ident = ids[name]
        assumed = (trusted.get(name) or {}).get(ident) if ident else None
        return assumed if isinstance(assumed, str) and assumed else _UNRESOLVED.format(name)

    vae_fp = pick("vae", vae, vae_fingerprint)
    if vae is not None:
        stride: int | None = frame_stride(vae)
        factor = spatial_factor(vae)
    else:  # assumed fingerprint: its recorded stride and factor (None: unknown, so clips and masks ask for the VAE)
        recorded = (trusted.get(STRIDE_KEY) or {}).get(vae_fp)
        stride = recorded if type(recorded) is int and recorded >= 0 else None
        recorded = (trusted.get(FACTOR_KEY) or {}).get(vae_fp)
        factor = recorded if type(recorded) is int and 1 <= recorded <= 64 else None
    return Encoders(vae_fp, pick("clip", clip, clip_fingerprint), ids["vae"],
                     ids["clip"], vae is not None, clip is not None, record, stride, factor)


def store_record(root: Path, dataset: str, enc: Encoders) -> None:
    """Record ``identity -> real fingerprint`` of the encoders this run loaded in the dataset's info, and those it
    assumed from another dataset's record of the cache (so this dataset's record stands on its own).

    The record read before the run is the base: storing a changed dataset rewrites its info, and the identities
    of encoders this run did not need must survive that. An assumption the record already holds is not written
    again, so a warm run writes nothing.
    """
    record = {k: dict(v) for k, v in enc.record.items()}

    def remember(name: str, key: str, value: Any, loaded: bool) -> None:  # newest first, at most RECORD_LIMIT
        if not loaded and record.get(name, {}).get(key) == value:
            return
        entries = {key: value, **{k: v for k, v in record.get(name, {}).items() if k != key}}
        record[name] = dict(list(entries.items())[:RECORD_LIMIT])

    for name, ident, fp, loaded in (("vae", enc.vae_identity, enc.vae_fp, enc.vae_loaded),
                                    ("clip", enc.clip_identity, enc.text_fp, enc.clip_loaded)):
        if ident and (loaded or not fp.startswith(_UNRESOLVED.format(""))):
            remember(name, ident, fp, loaded)
    resolved = enc.vae_loaded or not enc.vae_fp.startswith(_UNRESOLVED.format(""))
    if resolved and enc.frame_stride is not None:  # 0 too: an image VAE refuses clips without loading
        remember(STRIDE_KEY, enc.vae_fp, enc.frame_stride, enc.vae_loaded)
    if resolved and enc.mask_factor is not None:
        remember(FACTOR_KEY, enc.vae_fp, enc.mask_factor, enc.vae_loaded)
    if record:
        update_dataset_info(root, dataset, RECORD_KEY, record)

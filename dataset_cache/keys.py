"""Content keys of latent and conditioning entries, and file-content hashing.

A key names an entry by *what produced it*, never by where its source lives: a latent key is the hash of the
source image's bytes, every setting that changes the pixels the VAE sees, and the VAE's identity; a conditioning
key is the hash of the final caption text, the text encoder's identity and its encode settings. Identical images
at different paths therefore share one latent, identical caption lines share one conditioning, and moving or
renaming files costs no encode, while any change to content, settings or model yields a new key (never a stale hit).

Keys are xxh3-128 digests (32 lowercase hex chars) of a canonical encoding: compact JSON, keys sorted, of
``[KEY_SCHEMA, kind, fields]``. JSON quotes and escapes every string, so no two different field tuples encode to
the same bytes (``("ab", "c")`` and ``("a", "bc")`` cannot collide), and ``KEY_SCHEMA`` lets a later release change
what goes into a key without ever matching keys made by this one.

Encoder fingerprints:
    A fingerprint is an opaque string (use :func:`fingerprint`) that must change whenever the encoder would map the
    same input to different output. It must cover:

    * the weights: a content hash of the checkpoint file(s), or of the state dict, not a file name;
    * everything applied on top of them: patches and LoRAs with their strengths (and their order when it matters),
      hooks, model-sampling or tokenizer overrides, clip-skip / layer selection;
    * dtype-affecting settings: the compute/storage dtype, quantization (fp8 / nf4 / gguf type), attention
      backend or upcasting options that change results beyond bitwise noise;
    * for a VAE, its tiling settings when tiled encodes are used.

    Things that do not change output (device index, batch size when the encoder is batch-invariant, file paths)
    should be left out so they do not invalidate a cache for nothing.
"""

from __future__ import annotations

import json
import math
import os
import threading
from collections.abc import Mapping, Sequence
from typing import TYPE_CHECKING, Any

import xxhash

if TYPE_CHECKING:  # only for annotations: buckets imports nothing of this module, but keep keys a leaf
    from .buckets import CropPlan

__all__ = [
    "KEY_SCHEMA",
    "HASH_CHUNK_BYTES",
    "canonical_bytes",
    "content_key",
    "latent_key",
    "conditioning_key",
    "mask_key",
    "MASK_RULES",
    "fingerprint",
    "hash_bytes",
    "hash_file",
    "is_key",
    "PlanKeys",
]

KEY_SCHEMA = 1
"""Version of the key derivation. Bump it when the fields or their encoding change: old keys then never match."""

HASH_CHUNK_BYTES = 1 << 20
"""1 MiB reads: large enough that syscall overhead is negligible, small enough not to hold big images in memory."""

_HEX = frozenset("0123456789abcdef")
_local = threading.local()  # per-thread read buffer of hash_file
_readv = getattr(os, "readv", None)


def _normalize(value: Any, where: str) -> Any:
    """Return ``value`` as plain JSON types, refusing values whose JSON form is not canonical or one-to-one."""
    if value is None or isinstance(value, (bool, int, str)):
        return value
    if isinstance(value, float):
        if not math.isfinite(value):
            raise ValueError(f"{where}: non-finite float {value!r} cannot be part of a key; use a string instead")
        return value
    if isinstance(value, (list, tuple)):
        return [_normalize(item, f"{where}[{i}]") for i, item in enumerate(value)]
    if isinstance(value, Mapping):
        out = {}
        for k, item in value.items():
            if not isinstance(k, str):
                raise TypeError(f"{where}: dict key {k!r} is {type(k).__name__}; key fields need str dict keys")
            out[k] = _normalize(item, f"{where}[{k!r}]")
        return out
    raise TypeError(
        f"{where}: {type(value).__name__} cannot be part of a key; pass None, bool, int, finite float, str, "
        "list/tuple or dict with str keys"
    )


def canonical_bytes(kind: str, fields: Mapping[str, Any]) -> bytes:
    """Return the canonical, versioned encoding of ``fields`` hashed into a key of ``kind``.

    Tuples encode like lists; dict keys are sorted; floats use Python's shortest round-trip repr.

    Raises:
        TypeError: a field holds a value with no canonical JSON form.
        ValueError: a field holds NaN or infinity.
    """
    if not isinstance(kind, str) or not kind:
        raise ValueError(f"key kind must be a non-empty str, got {kind!r}")
    if not isinstance(fields, Mapping):
        raise TypeError(f"key fields must be a mapping of str to values, got {type(fields).__name__}")
    doc = [KEY_SCHEMA, kind, _normalize(fields, kind)]
    text = json.dumps(doc, sort_keys=True, separators=(",", ":"), ensure_ascii=True, allow_nan=False)
    return text.encode("ascii")


def content_key(kind: str, fields: Mapping[str, Any]) -> str:
    """Return the 32-hex-char xxh3-128 key of ``fields`` under ``kind`` (see :func:`canonical_bytes`)."""
    return xxhash.xxh3_128_hexdigest(canonical_bytes(kind, fields))


def is_key(value: object) -> bool:
    """Return True when ``value`` looks like a content key (32 lowercase hex chars)."""
    return isinstance(value, str) and len(value) == 32 and _HEX.issuperset(value)


def _require_key(value: str, name: str) -> None:
    if not is_key(value):
        raise ValueError(f"{name} must be a 32-char lowercase hex xxh3-128 digest (see hash_file), got {value!r}")


def _require_fingerprint(value: str, name: str) -> None:
    if not isinstance(value, str) or not value:
        raise ValueError(f"{name} must be a non-empty str describing the encoder (see keys.fingerprint)")


def latent_key(
    source_hash: str, pixels: Mapping[str, Any], vae_fingerprint: str, *, extra: Mapping[str, Any] | None = None
) -> str:
    """Return the key of the latent encoded from one source image.

    Args:
        source_hash: :func:`hash_file` of the image file's bytes (not its path: moved files keep their key).
        pixels: every setting that changes the pixels fed to the VAE, e.g. ``CropPlan.key_fields()`` from
            :mod:`.buckets` (bucket size, resize size and method, crop box, flip, decode rules).
        vae_fingerprint: identity of the VAE and its settings (see the module docstring).
        extra: anything else the caller stores in the entry that changes its value (e.g. an alpha-mask mode).
    """
    _require_key(source_hash, "source_hash")
    _require_fingerprint(vae_fingerprint, "vae_fingerprint")
    fields = {"source": source_hash, "pixels": dict(pixels), "vae": vae_fingerprint, "extra": dict(extra or {})}
    return content_key("latent", fields)


def conditioning_key(
    text: str, encoder_fingerprint: str, *, settings: Mapping[str, Any] | None = None
) -> str:
    """Return the key of the conditioning encoded from one caption.

    Args:
        text: the final prompt string exactly as given to the text encoder (after every caption transform),
            so identical lines share one entry wherever they appear.
        encoder_fingerprint: identity of the text encoder and its patches (see the module docstring).
        settings: encode settings that change the output (e.g. padding/trimming, max length, mean-pooling).
    """
    if not isinstance(text, str):
        raise TypeError(f"caption text must be str, got {type(text).__name__}")
    _require_fingerprint(encoder_fingerprint, "encoder_fingerprint")
    fields = {"text": text, "encoder": encoder_fingerprint, "settings": dict(settings or {})}
    return content_key("conditioning", fields)


MASK_RULES = "pil:exif-orient,L-or-alpha,resize-to-image,plan,center-crop-to-factor,area-mean,round;v1"
"""Names the rules of :func:`.imaging.load_mask` inside every mask key; change it whenever they change a value."""


def mask_key(source_hash: str, mode: str, pixels: Mapping[str, Any], factor: int) -> str:
    """Return the key of a loss-mask entry (``{"mask": Tensor[1, 1, h, w] uint8}`` at latent resolution).

    A mask is keyed by what makes its value, never by the latent's key or the VAE's identity, so an edited mask
    file re-encodes only the mask, and a new VAE of the same spatial factor reuses every mask.

    Args:
        source_hash: :func:`hash_file` of the mask file (``mode="masklabel"``) or of the image (``"alpha"``).
        mode: where the mask comes from: ``"masklabel"`` or ``"alpha"``.
        pixels: the crop plan's key fields of the latent the mask belongs to (``CropPlan.key_fields()``).
        factor: the VAE's spatial compression (pixels per latent cell along a side, 8 for SD/SDXL/Flux).
    """
    _require_key(source_hash, "source_hash")
    if type(factor) is not int or factor < 1:
        raise ValueError(f"mask factor (the VAE's spatial compression) must be an int >= 1, got {factor!r}")
    fields = {"source": source_hash, "mode": mode, "pixels": dict(pixels), "factor": factor, "rules": MASK_RULES}
    return content_key("mask", fields)


def fingerprint(
    weights: str,
    *,
    patches: Sequence[tuple[str, float]] = (),
    dtype: str | None = None,
    settings: Mapping[str, Any] | None = None,
) -> str:
    """Return a stable fingerprint of an encoder from its parts (a content key of kind ``"encoder"``).

    Args:
        weights: a content hash of the encoder's weights (file or state-dict hash), not a path.
        patches: ``(patch content hash, strength)`` per applied patch or LoRA, in application order.
        dtype: the dtype (or quantization) the encoder computes in, e.g. ``"bf16"``.
        settings: other output-changing settings (clip-skip, tiling, attention upcast...).
    """
    if not isinstance(weights, str) or not weights:
        raise ValueError("fingerprint: weights must be a non-empty content hash of the encoder weights")
    fields = {
        "weights": weights,
        "patches": [[str(name), float(strength)] for name, strength in patches],
        "dtype": dtype,
        "settings": dict(settings or {}),
    }
    return content_key("encoder", fields)


def hash_bytes(data: bytes | bytearray | memoryview) -> str:
    """Return the xxh3-128 hex digest of ``data``."""
    return xxhash.xxh3_128_hexdigest(data)


def hash_file(path: str | os.PathLike[str], *, chunk_bytes: int = HASH_CHUNK_BYTES) -> str:
    """Return the xxh3-128 hex digest of a file's content, read in ``chunk_bytes`` pieces.

    Streaming keeps memory flat for large images. Reads go into one reused buffer per thread with plain
    ``os.open``/``os.readv`` where available (no file object, no allocation per file): hashing 100k small captions is
    dominated
    by the open/read/close syscalls, not by Python. Safe to call from several threads.

    Raises:
        OSError: the file cannot be opened or read (the caller reports it as a source failure).
    """
    buf = getattr(_local, "buffer", None)
    if buf is None or len(buf) != chunk_bytes:
        buf = _local.buffer = memoryview(bytearray(chunk_bytes))
    h = xxhash.xxh3_128()
    if _readv is None:  # Windows: no os.readv
        with open(path, "rb", buffering=0) as f:
            while n := f.readinto(buf):
                h.update(buf[:n])
        return h.hexdigest()
    fd = os.open(path, os.O_RDONLY)
    try:
        while n := _readv(fd, [buf]):
            h.update(buf[:n])
    finally:
        os.close(fd)
    return h.hexdigest()


class PlanKeys:
    """The latent and conditioning keys of one encode plan: exactly :func:`latent_key` / :func:`conditioning_key`,
    computed faster for many keys (a big folder's plan).

    Only the source hash (latent) or the text (conditioning) varies between the keys of one plan, so the canonical
    bytes are built once per crop plan / fingerprint around a sentinel and the varying part is spliced in. The first
    key made from each template is compared with :func:`latent_key` / :func:`conditioning_key`; on any
    difference (a future change of the key derivation) the slow path is used for good.
    """

    _HASH = "0f" * 16
    _TEXT = "\x00streamcache-sentinel\x00"

    def __init__(self, vae_fingerprint: str, text_fingerprint: str) -> None:
        self.vae, self.text = vae_fingerprint, text_fingerprint
        self._latent: dict[CropPlan, tuple[bytes, bytes] | None] = {}
        self._cond: tuple[bytes, bytes] | None = None
        self._cond_checked = False
        self._texts: dict[str, str] = {}

    @staticmethod
    def _split(doc: bytes, sentinel: bytes) -> tuple[bytes, bytes] | None:
        parts = doc.split(sentinel)
        return (parts[0], parts[1]) if len(parts) == 2 else None

    def latent(self, source_hash: str, plan: CropPlan) -> str:
        if plan not in self._latent:
            fields = {"source": self._HASH, "pixels": plan.key_fields(), "vae": self.vae, "extra": {}}
            tpl = self._split(canonical_bytes("latent", fields), self._HASH.encode())
            key = latent_key(source_hash, plan.key_fields(), self.vae)
            if tpl is None or xxhash.xxh3_128_hexdigest(tpl[0] + source_hash.encode() + tpl[1]) != key:
                tpl = None
            self._latent[plan] = tpl
            return key
        tpl = self._latent[plan]
        if tpl is None or len(source_hash) != 32:
            return latent_key(source_hash, plan.key_fields(), self.vae)
        return xxhash.xxh3_128_hexdigest(tpl[0] + source_hash.encode("ascii") + tpl[1])

    def conditioning(self, text: str) -> str:
        key = self._texts.get(text)
        if key is not None:
            return key
        if not self._cond_checked:
            fields = {"text": self._TEXT, "encoder": self.text, "settings": {}}
            self._cond = self._split(canonical_bytes("conditioning", fields), json.dumps(self._TEXT).encode())
            key = conditioning_key(text, self.text)
            if self._cond is None or self._fast_text(text) != key:
                self._cond = None
            self._cond_checked = True
        elif self._cond is None:
            key = conditioning_key(text, self.text)
        else:
            key = self._fast_text(text)
        self._texts[text] = key
        return key

    def _fast_text(self, text: str) -> str:
        assert self._cond is not None
        if text.isascii() and text.isprintable() and '"' not in text and "\\" not in text:
            quoted = f'"{text}"'  # what json.dumps gives for printable ASCII without quotes or backslashes
        else:
            quoted = json.dumps(text)
        return xxhash.xxh3_128_hexdigest(self._cond[0] + quoted.encode("ascii") + self._cond[1])

"""Encoder fingerprints from ComfyUI objects, and the "upstream identity" of a lazily evaluated encoder input.

A cache key says which encoder produced an entry (see :mod:`dataset_cache.keys`), so the fingerprint of a VAE or
text encoder must change whenever it would encode the same input differently, must not change when it would
not (device, offload state, load order), and must be cheap enough to compute on every run.

**Weights.** Hashing every byte of a text encoder costs seconds on a GPU (the weights must cross to the host)
and would differ with the device anyway if done differently per device. Instead every tensor of the state dict
contributes its name, dtype and shape plus a fixed *sample* of its bytes: the whole tensor when it is at most
:data:`FULL_TENSOR_BYTES`, else :data:`SAMPLE_WINDOWS` windows of :data:`WINDOW_BYTES` spread evenly from the
first to the last byte. The sample is gathered on the tensor's device and only the sample is copied, so the cost
is about the number of tensors (~5 ms for CLIP-L on a CPU) and the result is the same on every device.
Fine-tunes rewrite whole tensors, so two different checkpoints differ in the sample with overwhelming
probability; an edit of a few single bytes between the sampled windows would go unnoticed (never the case for
real model files). A patched weight that ComfyUI wrote into the module in place is hashed from its backup, so
the base weights hash the same whether or not the patches are currently applied.

**Patches.** Every entry of ``ModelPatcher.patches`` (LoRAs, diffs, merges) contributes a digest of its key, its
adapter type, its tensors (sampled the same way), ``strength_model``, offset and function, with its
``strength_patch``, in application order. ``object_patches``, weight wrappers and injections contribute their
names and types (their tensors are not walked: they are rare for VAEs and text encoders).

**Settings.** The compute dtype, the module classes, clip-skip (``layer_idx``), tokenizer options and whether
hooks are attached. Left out on purpose: devices, file paths, offload state.

The upstream identity (:func:`upstream_identity`) describes *how* an encoder input would be produced — the
linked node's class, its constant inputs, recursively, and size + mtime of every model file those inputs name —
without running anything. ``Encode Dataset`` records, next to the fingerprint it computed, the identity of the
graph that produced the encoder, so a later run with the same identity can assume the same fingerprint and skip
loading the encoder altogether (see :mod:`.encode_dataset`).

The module also holds the cheap state digests the nodes' ``fingerprint_inputs`` use: :func:`folder_digest` (a
stat-only listing of an image folder), :func:`cache_identity` (a cache's committed state, from manifest and
journal) and :class:`OwnWrites` (so a node's own writes to a cache do not count as a change).
"""

from __future__ import annotations

import json
import logging
import os
from collections.abc import Hashable, Mapping
from typing import Any, TypeGuard

import folder_paths
import torch
import xxhash

from ..dataset_cache import CacheError, CacheNotFoundError, read_state
from ..dataset_cache.keys import fingerprint
from ..dataset_cache.listing import CAPTION_EXTENSION, list_folder

__all__ = [
    "FULL_TENSOR_BYTES",
    "SAMPLE_WINDOWS",
    "WINDOW_BYTES",
    "tensor_digest",
    "weights_digest",
    "patch_digests",
    "vae_fingerprint",
    "clip_fingerprint",
    "upstream_identity",
    "folder_digest",
    "cache_identity",
    "OwnWrites",
]

log = logging.getLogger("streamcache.fingerprints")

FULL_TENSOR_BYTES = 4096
"""Tensors up to this size are hashed whole (biases, norms, small convs: most tensors by count)."""
SAMPLE_WINDOWS = 32
"""Windows sampled from a larger tensor: enough to catch any real change of weights, cheap to gather."""
WINDOW_BYTES = 64
"""Bytes per window: a cache line, so a window costs one memory fetch."""

MODEL_FILE_EXTENSIONS = (".safetensors", ".sft", ".ckpt", ".pt", ".pth", ".bin", ".gguf", ".pkl", ".onnx")
"""Constant inputs ending like this are looked up as model files for the upstream identity."""
_FOLDER_HINTS = {
    "vae_name": ("vae",), "clip_name": ("text_encoders",), "clip_name1": ("text_encoders",),
    "clip_name2": ("text_encoders",), "clip_name3": ("text_encoders",), "clip_name4": ("text_encoders",),
    "ckpt_name": ("checkpoints",), "unet_name": ("diffusion_models",), "lora_name": ("loras",),
}
"""Where ComfyUI's own loaders look for each input; other inputs are searched in every registered folder."""
_MAX_DEPTH = 32


# ------------------------------------------------------------------------------------------------ tensors


def _sample_bytes(t: torch.Tensor) -> bytes:
    raw = t.detach()
    if not raw.is_contiguous():
        raw = raw.contiguous()
    raw = raw.reshape(-1).view(torch.uint8)
    n = raw.numel()
    if n <= FULL_TENSOR_BYTES:
        return raw.cpu().numpy().tobytes()
    last = n - WINDOW_BYTES
    starts = torch.tensor([i * last // (SAMPLE_WINDOWS - 1) for i in range(SAMPLE_WINDOWS)], dtype=torch.long)
    index = (starts[:, None] + torch.arange(WINDOW_BYTES)[None, :]).reshape(-1)
    return raw.index_select(0, index.to(raw.device)).cpu().numpy().tobytes()


def _update_tensor(h: Any, t: torch.Tensor) -> None:
    h.update(f"{t.dtype};{tuple(t.shape)};".encode())
    if t.is_meta:
        h.update(b"meta;")
        return
    try:
        h.update(_sample_bytes(t))
    except (RuntimeError, TypeError) as exc:  # tensor subclasses (quantized weights) that refuse a byte view
        log.debug("fingerprint: hashing %s by shape only (%s)", type(t).__name__, exc)
        h.update(f"{type(t).__qualname__};unsampled;".encode())


def tensor_digest(t: torch.Tensor) -> str:
    """A device-independent digest of a tensor's dtype, shape and sampled bytes (see the module docstring)."""
    h = xxhash.xxh3_128()
    _update_tensor(h, t)
    return h.hexdigest()


def weights_digest(patcher: Any) -> str:
    """Digest of the base weights of ``patcher.model`` (in-place patched weights are read from their backup)."""
    backup = getattr(patcher, "backup", {}) or {}
    hook_backup = getattr(patcher, "hook_backup", {}) or {}
    h = xxhash.xxh3_128()
    state = patcher.model.state_dict()
    for name in sorted(state):
        t = state[name]
        if name in backup:
            t = backup[name].weight
        elif name in hook_backup:
            t = hook_backup[name][0]
        h.update(f"{name};".encode())
        _update_tensor(h, t)
    return h.hexdigest()


# ------------------------------------------------------------------------------------------------ patches


def _qualname(obj: Any) -> str:
    if isinstance(obj, type):
        return f"{obj.__module__}.{obj.__qualname__}"
    name = getattr(obj, "__qualname__", None)
    if isinstance(name, str):
        return f"{getattr(obj, '__module__', '')}.{name}"
    return f"{type(obj).__module__}.{type(obj).__qualname__}"


def _update_value(h: Any, v: Any, depth: int = 0) -> None:
    """Feed a patch value (tensors, adapters, tuples of them, numbers) into ``h``, tagged by type."""
    if depth > _MAX_DEPTH:
        h.update(b"<deep>;")
    elif isinstance(v, torch.Tensor):
        h.update(b"T")
        _update_tensor(h, v)
    elif v is None or isinstance(v, (bool, int, float, str)):
        h.update(f"{type(v).__name__}:{v!r};".encode())
    elif isinstance(v, torch.dtype):
        h.update(f"dtype:{v};".encode())
    elif isinstance(v, (list, tuple)):
        h.update(f"{type(v).__name__}[{len(v)}](".encode())
        for item in v:
            _update_value(h, item, depth + 1)
        h.update(b")")
    elif isinstance(v, Mapping):
        h.update(f"dict[{len(v)}](".encode())
        for k in sorted(v, key=str):
            h.update(f"{k!s};".encode())
            _update_value(h, v[k], depth + 1)
        h.update(b")")
    elif hasattr(v, "weights"):  # comfy.weight_adapter adapters: LoRA, LoHa, LoKr, OFT, ...
        h.update(f"adapter:{_qualname(v)}(".encode())
        _update_value(h, v.weights, depth + 1)
        h.update(b")")
    else:
        h.update(f"obj:{_qualname(v)};".encode())


def patch_digests(patcher: Any) -> list[tuple[str, float]]:
    """``(digest, strength_patch)`` of every weight patch of ``patcher``, by key then application order."""
    out: list[tuple[str, float]] = []
    patches = getattr(patcher, "patches", {}) or {}
    for key in sorted(patches, key=str):
        for i, patch in enumerate(patches[key]):
            strength_patch, value, strength_model, offset, function = (tuple(patch) + (None,) * 5)[:5]
            h = xxhash.xxh3_128()
            h.update(f"{key};{i};{float(strength_model or 0.0)!r};{offset!r};".encode())
            h.update(f"{_qualname(function) if function is not None else None};".encode())
            _update_value(h, value)
            out.append((h.hexdigest(), float(strength_patch)))
    return out


def _plain(v: Any) -> Any:
    """A JSON-safe, deterministic stand-in for a setting value (types by name, no addresses)."""
    if v is None or isinstance(v, (bool, int, str)):
        return v
    if isinstance(v, float):
        return repr(v)
    if isinstance(v, (torch.dtype, torch.device)):
        return str(v)
    if isinstance(v, (list, tuple)):
        return [_plain(x) for x in v]
    if isinstance(v, Mapping):
        return {str(k): _plain(x) for k, x in sorted(v.items(), key=lambda kv: str(kv[0]))}
    return _qualname(v)


def _patcher_settings(patcher: Any) -> dict[str, Any]:
    return {
        "object_patches": _plain(dict(getattr(patcher, "object_patches", {}) or {})),
        "weight_wrappers": _plain({k: [_qualname(w) for w in ws]
                                   for k, ws in (getattr(patcher, "weight_wrapper_patches", {}) or {}).items()}),
        "injections": sorted(map(str, getattr(patcher, "injections", {}) or {})),
        "hooks": getattr(patcher, "forced_hooks", None) is not None,
    }


# ------------------------------------------------------------------------------------------------ encoders


def vae_fingerprint(vae: Any) -> str:
    """Fingerprint of a ComfyUI ``VAE`` (comfy/sd.py): weights, patches, compute dtype, model class."""
    patcher = vae.patcher
    settings = {
        "model": _qualname(vae.first_stage_model),
        "latent_channels": _plain(getattr(vae, "latent_channels", None)),
        **_patcher_settings(patcher),
    }
    return fingerprint(weights_digest(patcher), patches=patch_digests(patcher),
                       dtype=str(getattr(vae, "vae_dtype", None)), settings=settings)


def clip_fingerprint(clip: Any) -> str:
    """Fingerprint of a ComfyUI ``CLIP`` (comfy/sd.py): weights, patches (LoRAs), clip-skip, tokenizer options."""
    patcher = clip.patcher
    model = clip.cond_stage_model
    dtypes = getattr(model, "dtypes", None)
    settings = {
        "model": _qualname(model),
        "tokenizer": _qualname(clip.tokenizer),
        "layer_idx": _plain(getattr(clip, "layer_idx", None)),
        "tokenizer_options": _plain(getattr(clip, "tokenizer_options", {}) or {}),
        "clip_schedule": bool(getattr(clip, "use_clip_schedule", False)),
        "hooks_to_conds": getattr(clip, "apply_hooks_to_conds", None) is not None,
        **_patcher_settings(patcher),
    }
    dtype = ",".join(sorted(map(str, dtypes))) if dtypes else None
    return fingerprint(weights_digest(patcher), patches=patch_digests(patcher), dtype=dtype, settings=settings)


# ------------------------------------------------------------------------------------------------ upstream


def _is_link(v: Any) -> TypeGuard[list[Any]]:
    return (isinstance(v, list) and len(v) == 2 and isinstance(v[0], str)
            and isinstance(v[1], (int, float)) and not isinstance(v[1], bool))


def _model_file(input_name: str, value: str) -> list[Any] | None:
    """``[folder, size, mtime_ns]`` of the model file a constant input names, or None when it names none."""
    if not value.lower().endswith(MODEL_FILE_EXTENSIONS) or "\x00" in value:
        return None
    hinted = _FOLDER_HINTS.get(input_name, ())
    others = sorted(set(folder_paths.folder_names_and_paths) - set(hinted) - {"custom_nodes", "configs"})
    for folder in (*hinted, *others):
        try:
            path = folder_paths.get_full_path(folder, value)
        except (KeyError, OSError, ValueError):
            path = None
        if path:
            st = os.stat(path)
            return [folder, st.st_size, st.st_mtime_ns]
    return None


def _describe(dynprompt: Any, node_id: str, depth: int, path: frozenset[str]) -> Any:
    if depth > _MAX_DEPTH or node_id in path:
        return ["<cycle or too deep>", node_id]
    try:
        node = dynprompt.get_node(node_id)
    except Exception:  # NodeNotFoundError: ComfyUI's own type, not importable from a stable place
        return ["<missing>", node_id]
    inputs: dict[str, Any] = {}
    for name, value in sorted((node.get("inputs") or {}).items()):
        if _is_link(value):
            inputs[name] = ["<link>", int(value[1]),
                            _describe(dynprompt, value[0], depth + 1, path | {node_id})]
        else:
            entry: dict[str, Any] = {"value": _plain(value)}
            if isinstance(value, str) and (found := _model_file(name, value)):
                entry["file"] = found
            inputs[name] = entry
    return {"class_type": node.get("class_type"), "inputs": inputs}


def upstream_identity(dynprompt: Any, node_id: str | None, input_name: str) -> str | None:
    """A digest of how input ``input_name`` of node ``node_id`` would be produced, without running anything.

    It covers the linked node's class and constant inputs, recursively through its own links, and size + mtime of
    every model file a constant input names (looked up with ``folder_paths.get_full_path``). Returns None when
    there is no prompt to inspect or the input is not linked: the caller must then load the real object.

    Not covered: files a loader finds by other means than a file-name input (e.g. ``VAELoader``'s ``taesd``
    pseudo-name reads ``vae_approx``), and upstream nodes whose output changes with no input changing. Both only
    matter when such a file is edited in place; the fingerprint of the real object is recorded anew whenever the
    encoder does get loaded.
    """
    if dynprompt is None or node_id is None:
        return None
    try:
        link = (dynprompt.get_node(node_id).get("inputs") or {}).get(input_name)
    except Exception:  # the node is not in this prompt (direct calls in tests)
        return None
    if not _is_link(link):
        return None
    desc = [int(link[1]), _describe(dynprompt, link[0], 0, frozenset({node_id}))]
    text = json.dumps(desc, sort_keys=True, separators=(",", ":"), default=str)
    return xxhash.xxh3_128_hexdigest(text.encode())


# ------------------------------------------------------------------------------------------------ node inputs


def folder_digest(folder: str | os.PathLike[str], caption_extension: str = CAPTION_EXTENSION) -> str:
    """Digest of an image folder's listing: relative path, size and mtime of every image and caption file (those
    of ``caption_extension``).

    One ``os.scandir`` per directory and no file opened (:func:`dataset_cache.listing.list_folder`), so it is cheap
    enough for ``fingerprint_inputs``, which ComfyUI calls on every queue.

    Raises:
        DatasetFolderError: the folder is missing or holds no image.
    """
    listing = list_folder(folder, threads=1, caption_extension=caption_extension)
    h = xxhash.xxh3_128()
    h.update(f"{listing.root}\0".encode())
    for relpath, size, mtime_ns in listing.files():
        h.update(f"{relpath}\0{size}\0{mtime_ns}\n".encode())
    return h.hexdigest()


def cache_identity(cache_root: str | os.PathLike[str], dataset: str | None = None) -> str:
    """Identity of a cache's committed state (manifest generation, journal length, and the dataset's file).

    Reads the manifest and the journal only (no shard header). It changes with every commit, compaction and
    dataset change, and a cache deleted and encoded again never repeats it (dataset files carry random ids).
    ``"absent"`` when there is no cache; ``"unreadable: ..."`` when the manifest or journal is damaged.
    """
    try:
        state = read_state(cache_root)
    except CacheNotFoundError:
        return "absent"
    except CacheError as exc:
        return f"unreadable: {exc}"
    parts = [str(state.generation), state.journal, str(state.journal_bytes)]
    if dataset is not None:
        info = state.datasets.get(dataset)
        parts.append(info.file if info is not None else "-")
    return ":".join(parts)


class OwnWrites:
    """Per-process memory that lets ``fingerprint_inputs`` ignore the cache changes a node's own run made.

    ComfyUI computes a node's fingerprint *before* running it. A node that fingerprints the cache it writes would
    see a changed cache on the next queue and run again, and so would everything downstream (training). After a
    successful run, :meth:`remember` maps the state the run left behind to the value returned before the run:
    an untouched cache keeps that value, any other change (source files, another process, a clean) gives a new
    one. Nothing persists across restarts, where ComfyUI's own cache is empty anyway.
    """

    def __init__(self) -> None:
        self._returned: dict[Hashable, tuple[str, str]] = {}  # key -> (inputs, value returned)
        self._after: dict[Hashable, tuple[str, str, str]] = {}  # key -> (inputs, cache state after the run, value)

    def fingerprint(self, key: Hashable, inputs: str, cache_state: str) -> str:
        """The value for ``fingerprint_inputs``: a digest of ``inputs`` and ``cache_state``, unless the state is
        exactly what this node's last run with these inputs left behind."""
        after = self._after.get(key)
        if after is not None and after[:2] == (inputs, cache_state):
            value = after[2]
        else:
            value = xxhash.xxh3_128_hexdigest(f"{inputs}\0{cache_state}".encode())
        self._returned[key] = (inputs, value)
        return value

    def remember(self, key: Hashable, inputs: str, cache_state: str) -> None:
        """Record the state a successful run left; ``inputs`` recomputed now (a change during the run counts)."""
        returned = self._returned.get(key)
        if returned is not None and returned[0] == inputs:
            self._after[key] = (inputs, cache_state, returned[1])

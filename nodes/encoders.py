"""ComfyUI's VAE and CLIP as the encoder callables the library takes, and their release after an encode.

The library (:func:`dataset_cache.encode_run.run_encode`) encodes through plain callables and never sees a ComfyUI
model. What a callable must know of ComfyUI's objects lives here: whether a VAE reads a batch as the frames of one
clip (a video VAE), its spatial and temporal compression, how many CLIP windows a caption may use, and how the
encoders are unloaded so that training gets the device.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

import comfy.model_management
import torch

__all__ = ["MAX_TOKEN_WINDOWS", "clip_encoder", "cut_token_windows", "frame_stride", "image_encoder",
           "reads_batch_as_frames", "release", "spatial_factor", "text_encoder"]


def spatial_factor(vae: Any) -> int | None:
    """Pixels per latent cell along a side for ``vae``, as ComfyUI's VAE reports it (``spacial_compression_encode``:
    8 for SD/SDXL/Flux, 16 for some video VAEs); ``None`` when it reports nothing usable (masks then cannot be
    made at its latent resolution, and the encode says so)."""
    try:
        value = vae.spacial_compression_encode()
    except Exception:
        return None
    return int(value) if isinstance(value, int) and 1 <= value <= 64 else None


def reads_batch_as_frames(vae: Any) -> bool:
    """Whether ComfyUI's ``VAE`` treats a batch of images as the frames of one clip (a video VAE such as WAN's),
    as its own ``VAE.encode`` decides: ``latent_dim == 3`` unless ``not_video``."""
    return getattr(vae, "latent_dim", 2) == 3 and not getattr(vae, "not_video", False)


def frame_stride(vae: Any) -> int:
    """How a clip's frame count must step for ``vae``: its temporal compression as ComfyUI's VAE reports it
    (``temporal_compression_decode()``: 4 for WAN, so clips of ``1 + 4m`` frames), 1 for a video VAE that reports
    none, and 0 for an image VAE (it cannot encode a clip)."""
    if not reads_batch_as_frames(vae):
        return 0
    try:
        value = vae.temporal_compression_decode()
    except Exception:
        value = None
    return int(value) if isinstance(value, (int, float)) and value >= 1 else 1


def clip_encoder(vae: Any) -> Callable[[torch.Tensor], dict[str, torch.Tensor]]:
    """The library's clip encoder: one clip's frames ``[T, H, W, 3]`` → its latent ``[1, C, T', h, w]``."""
    def encode(frames: torch.Tensor) -> dict[str, torch.Tensor]:  # [T, H, W, 3]: one clip → [1, C, T', h, w]
        return {"samples": vae.encode(frames[:, :, :, :3])}
    return encode


def image_encoder(vae: Any) -> Callable[[torch.Tensor], list[dict[str, torch.Tensor]]]:
    """The library's image encoder: a batch of images ``[B, H, W, C]`` → one latent each; a VAE that reads a batch
    as the frames of one clip (:func:`reads_batch_as_frames`) gets one call per image."""
    if reads_batch_as_frames(vae):  # one call per image, each a one-frame clip: [1, C, 1, h, w]
        def encode_each(images: torch.Tensor) -> list[dict[str, torch.Tensor]]:
            return [{"samples": vae.encode(images[i:i + 1, :, :, :3])} for i in range(images.shape[0])]
        return encode_each

    def encode(images: torch.Tensor) -> list[dict[str, torch.Tensor]]:
        latents = vae.encode(images[:, :, :, :3])
        return [{"samples": latents[i:i + 1]} for i in range(latents.shape[0])]
    return encode


MAX_TOKEN_WINDOWS = 3
"""77-token windows of one caption line that reach a CLIP-style text encoder: 225 tokens, kohya's longest
``max_token_length``. ComfyUI's CLIP tokenizers split a long prompt into windows and encode every one; T5 and LLM
tokenizers return a single window and are bounded by the library's character limit instead."""


def cut_token_windows(tokens: Any) -> tuple[Any, bool]:
    """Keep at most :data:`MAX_TOKEN_WINDOWS` windows of each of a CLIP tokenizer's outputs; say whether any
    was cut. Anything that is not a list of windows (other tokenizers' formats) is passed through."""
    if not isinstance(tokens, dict):
        return tokens, False
    cut = False
    out = {}
    for name, windows in tokens.items():
        if isinstance(windows, list) and len(windows) > MAX_TOKEN_WINDOWS and all(
                isinstance(w, list) for w in windows):
            windows, cut = windows[:MAX_TOKEN_WINDOWS], True
        out[name] = windows
    return out, cut


def text_encoder(clip: Any, cut_texts: list[str] | None = None) -> Callable[[Sequence[str]], list[Any]]:
    """The library's text encoder: texts → ComfyUI conditionings, each text's CLIP windows cut to
    :data:`MAX_TOKEN_WINDOWS` (a cut text is appended to ``cut_texts`` for the report)."""
    def encode(texts: Sequence[str]) -> list[Any]:
        out = []
        for text in texts:
            tokens, cut = cut_token_windows(clip.tokenize(text))
            if cut and cut_texts is not None:
                cut_texts.append(text)
            out.append(clip.encode_from_tokens_scheduled(tokens))
        return out
    return encode


def release(*encoders: Any) -> None:
    """Unload the encoders this node used (ComfyUI's model management), so training gets the device memory.

    Models whose load device is the CPU are left alone: unloading frees no memory there (the offload device is
    the same RAM) and would only make the next encode load them again.
    """
    unloaded = False
    for enc in encoders:
        patcher = getattr(enc, "patcher", None)
        device = getattr(patcher, "load_device", None)
        if patcher is not None and getattr(device, "type", "cpu") != "cpu":
            comfy.model_management.unload_model_and_clones(patcher)
            unloaded = True
    if unloaded:
        comfy.model_management.soft_empty_cache()

"""C5 of ``scripts/bench-comfy``: ComfyUI's own ``MakeTrainingDataset`` before and after a 1% edit, counting its
encoder calls.

Why a module of its own: the built-in node has no cache, so this figure is what our incremental encode (L5) is
compared with; it runs in the driver's process, with the tiny VAE and CLIP.
"""

from __future__ import annotations

import time
from pathlib import Path
from typing import Any

from .comfyui import add_model_folders
from .comfyui import comfy_nodes as comfyui_nodes

__all__ = ["builtin_reencode"]


def builtin_reencode(work: Path, models: str, n: int) -> dict[str, Any]:
    """Run the real MakeTrainingDataset twice (before and after a 1% edit) and count its encoder calls."""
    import torch

    import comfy_extras.nodes_dataset as nd
    comfy_nodes = comfyui_nodes()

    add_model_folders(models)
    (clip,) = comfy_nodes.CLIPLoader().load_clip("tiny_clip_l.safetensors", "stable_diffusion")
    (vae,) = comfy_nodes.VAELoader().load_vae("tiny_taesd.safetensors")
    counts = {"vae": 0, "clip": 0}
    ov, oc = vae.encode, clip.encode_from_tokens_scheduled

    def venc(*a: Any, **k: Any) -> Any:
        counts["vae"] += 1
        return ov(*a, **k)

    def cenc(*a: Any, **k: Any) -> Any:
        counts["clip"] += 1
        return oc(*a, **k)

    vae.encode, clip.encode_from_tokens_scheduled = venc, cenc
    g = torch.Generator().manual_seed(0)
    images = [torch.rand(1, 64, 64, 3, generator=g) for _ in range(n)]
    texts = [f"a photo of item {i}" for i in range(n)]
    out = {}
    with torch.inference_mode():
        t = time.perf_counter()
        nd.MakeTrainingDataset.execute(images, [vae], [clip], texts)
        out["first_s"] = time.perf_counter() - t
        out["first_vae"], out["first_clip"] = counts["vae"], counts["clip"]
        k = max(1, n // 100)
        for j in range(k):
            texts[j * (n // k)] = f"an edited caption {j}"
        images += [torch.rand(1, 64, 64, 3, generator=g) for _ in range(k)]
        texts += [f"a new image {j}" for j in range(k)]
        counts.update(vae=0, clip=0)
        t = time.perf_counter()
        nd.MakeTrainingDataset.execute(images, [vae], [clip], texts)
        out["edit_s"] = time.perf_counter() - t
        out["edit_vae"], out["edit_clip"], out["edited"], out["added"] = counts["vae"], counts["clip"], k, k
    out["n"] = n
    return out

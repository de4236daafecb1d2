"""Tiny random-weight modules of model families beyond SD1.5, built in-process with ComfyUI's own classes.

Unlike :mod:`support.tiny_models` (files generated once and cached, for a server), these are small enough to
build inside a test under ComfyUI's python (a tiny WAN 2.1 VAE has 3.6M parameters and builds in well under a
second), then saved into a model folder the test registers with ``folder_paths``, so ComfyUI's own loaders
read them. Weights come from :func:`support.tiny_models._fill` (small values, every key of ``state_dict()``).
"""

from __future__ import annotations

from pathlib import Path

__all__ = ["WAN21_VAE_CONFIG", "WAN21_T2V_CONFIG", "save_wan21_vae", "save_wan21_t2v"]

WAN21_VAE_CONFIG = {
    "dim": 16, "z_dim": 16, "dim_mult": [1, 2, 4, 4], "num_res_blocks": 2, "attn_scales": [],
    "temperal_downsample": [False, True, True], "image_channels": 3, "conv_out_channels": 3, "dropout": 0.0,
}
"""A WAN 2.1 VAE at ``dim=16`` (the real one: 96). ComfyUI's VAE detection reads ``dim`` and the image channels
from the weights and fixes the rest (``z_dim`` 16, the multipliers, temporal downsampling), so only ``dim``
shrinks. Latents: ``[1, 16, 1 + (frames - 1) // 4, h / 8, w / 8]``."""


def save_wan21_vae(folder: Path, name: str = "tiny_wan21_vae.safetensors", seed: int = 5) -> Path:
    """Write a tiny WAN 2.1 VAE that ``VAELoader`` accepts into ``folder``; return its path."""
    import comfy.ldm.wan.vae
    from safetensors.torch import save_file

    from .tiny_models import _fill

    module = comfy.ldm.wan.vae.WanVAE(**WAN21_VAE_CONFIG)
    state = _fill(module.state_dict(), seed)
    if set(state) != set(module.state_dict()):
        raise AssertionError("WAN 2.1 VAE: state dict keys differ from the module's")
    folder.mkdir(parents=True, exist_ok=True)
    path = folder / name
    save_file({k: v.contiguous() for k, v in state.items()}, str(path),
              metadata={"generator": "comfyui-streamcache tests/support/tiny_families.py"})
    return path


WAN21_T2V_CONFIG = {"model_type": "t2v", "dim": 128, "ffn_dim": 256, "num_heads": 1, "num_layers": 1}
"""A WAN 2.1 text-to-video transformer with one block at width 128 (0.9M parameters). ComfyUI's detection reads
the width, FFN width, block count and channels from the weights and sets ``num_heads = dim // 128``, so 128 is
the narrowest width it accepts; the text width stays UMT5's 4096."""


def save_wan21_t2v(folder: Path, name: str = "tiny_wan21_t2v.safetensors", seed: int = 7) -> Path:
    """Write a tiny WAN 2.1 t2v diffusion model that ``UNETLoader`` accepts into ``folder``; return its path."""
    import comfy.ldm.wan.model
    import comfy.ops
    import torch
    from safetensors.torch import save_file

    from .tiny_models import _fill

    module = comfy.ldm.wan.model.WanModel(**WAN21_T2V_CONFIG, operations=comfy.ops.disable_weight_init,
                                          device="meta")
    state = _fill({k: torch.empty(v.shape) for k, v in module.state_dict().items()}, seed)
    folder.mkdir(parents=True, exist_ok=True)
    path = folder / name
    save_file({k: v.contiguous() for k, v in state.items()}, str(path),
              metadata={"generator": "comfyui-streamcache tests/support/tiny_families.py"})
    return path

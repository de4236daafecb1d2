"""Tiny random-weight diffusion models of every family the pack trains, built with ComfyUI's own classes.

Unlike :mod:`support.tiny_models` (a cached SD1.5 set for servers), these are built inside a test under
ComfyUI's python in seconds and saved into a model folder the test registers with ``folder_paths``, so
ComfyUI's own ``UNETLoader`` reads them and its model detection decides the family. Each
:class:`Family` holds the smallest config the detection still maps to that family (what it reads from the
weights and what it fixes is noted per family), the latent shape its VAE gives, and conditionings of the shapes
and keys its real text encoders give. Text encoders are not built: ComfyUI fixes their size (T5-XXL, UMT5-XXL,
Qwen2.5-VL-7B, Gemma2-2B are gigabytes), so the training side is tested from conditionings of the right shape.
Weights come from :func:`support.tiny_models._fill`: every key of ``state_dict()``, small values.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from .tiny_models import UNET_CONFIG

__all__ = ["FAMILIES", "Family", "WAN21_VAE_CONFIG", "save_family_model", "save_taesd16", "save_wan21_vae"]


def _cond(tokens: int, width: int, **extra: Any) -> Callable[[Any, int], list]:
    """A conditioning factory: ``[[Tensor[1, tokens, width], extra]]``; ``tokens=0`` means "as given"."""
    def make(gen: Any, n_tokens: int) -> list:
        import torch

        n = tokens or n_tokens
        options = {k: (v(gen, n) if callable(v) else v) for k, v in extra.items()}
        return [[torch.randn(1, n, width, generator=gen) * 0.5, options]]
    return make


def _pooled(width: int) -> Callable[[Any, int], Any]:
    def make(gen: Any, _n: int) -> Any:
        import torch

        return torch.randn(1, width, generator=gen) * 0.5
    return make


def _mask(gen: Any, n: int) -> Any:
    import torch

    return torch.ones(1, n, dtype=torch.long)


def _reference(shape: tuple[int, ...]) -> Callable[[Any, int], Any]:
    def make(gen: Any, _n: int) -> Any:
        import torch

        return [torch.randn(shape, generator=gen)]
    return make


FLUX_CONFIG = {
    "image_model": "flux", "axes_dim": [16, 56, 56], "num_heads": 1, "mlp_ratio": 4.0, "theta": 10000,
    "out_channels": 16, "qkv_bias": True, "txt_ids_dims": [], "in_channels": 16, "hidden_size": 128,
    "context_in_dim": 4096, "patch_size": 2, "vec_in_dim": 768, "depth": 1, "depth_single_blocks": 1,
    "guidance_embed": True, "yak_mlp": False, "txt_norm": False,
}
"""Flux with heads = width / 128 (the fixed rope axes): one head of 128, one double and one single block."""


@dataclass(frozen=True)
class Family:
    """One model family: how to build its tiny diffusion model, and what its latents and conditionings are.

    Attributes:
        name: short id used in test names.
        model_class: ``type(model.model).__name__`` ComfyUI gives the loaded model (checks the detection).
        unet_config: the config ComfyUI's detection derives from the weights of the tiny model.
        latent: shape of one latent entry (``[1, C, H, W]``, or ``[1, C, T, H, W]`` for video VAEs) at 64×64 px.
        conditioning: ``(generator, tokens) -> conditioning`` as the family's text encoder returns it.
        fixed_tokens: whether the encoder pads every prompt to one length (CLIP, T5 in ComfyUI) or not (LLMs).
        train: Train LoRA options the family needs (Flux needs gradient checkpointing: see families-notes).
        heavy: the tiny model is still hundreds of MB (ComfyUI fixes its width); built once per test module.
        vae: which tiny VAE stands for the family's in the encode test (``"taesd"``: the 4-channel TAESD of
            :mod:`support.tiny_models`; ``"taesd16"``: a 16-channel TAESD, the shape of TAEF1/TAESD3; ``"wan21"``:
            :data:`WAN21_VAE_CONFIG`).
        text_encoders: the family's real text encoders (what an encode of its captions needs).
        title: the family's name in the README's matrix.
        builtin_fails: how ComfyUI's own ``TrainLoraNode`` fails on this family ("": it trains it); the tests
            check it still fails that way, so a ComfyUI that fixes it shows up.
    """

    name: str
    model_class: str
    unet_config: dict[str, Any]
    latent: tuple[int, ...]
    conditioning: Callable[[Any, int], list]
    fixed_tokens: bool = True
    train: dict[str, Any] = field(default_factory=dict)
    heavy: bool = False
    vae: str = "taesd16"
    text_encoders: str = ""
    builtin_fails: str = ""
    title: str = ""


FAMILIES: dict[str, Family] = {f.name: f for f in (
    # SD1.5: the set of support.tiny_models (width 320 and context 768 fixed, one level). 13.6M params.
    Family("sd15", "BaseModel", UNET_CONFIG, (1, 4, 8, 8), _cond(77, 768), vae="taesd", text_encoders="CLIP-L",
           title="SD1.5"),
    # SDXL: detection reads every UNet dimension but only matches configs ComfyUI lists; Segmind Vega's
    # (SDXL's architecture, conditioning and model class with transformer depths [0,0,1,1,2,2]) is the
    # smallest. Width 320 and context 2048 are fixed; output blocks may carry no transformer. 75M params.
    Family("sdxl", "SDXL", {
        "use_checkpoint": False, "image_size": 32, "use_spatial_transformer": True, "legacy": False,
        "num_classes": "sequential", "adm_in_channels": 2816, "in_channels": 4, "out_channels": 4,
        "model_channels": 320, "num_res_blocks": [2, 2, 2], "channel_mult": [1, 1, 1],
        "transformer_depth": [0, 0, 1, 1, 2, 2], "transformer_depth_output": [0] * 9,
        "transformer_depth_middle": -2, "use_linear_in_transformer": True, "context_dim": 2048,
        "num_head_channels": 64, "use_temporal_resblock": False, "use_temporal_attention": False,
    }, (1, 4, 8, 8), _cond(77, 2048, pooled_output=_pooled(1280)), vae="taesd", text_encoders="CLIP-L + CLIP-G",
           title="SDXL (Segmind Vega's layout of the SDXL UNet)"),
    # SD3 (MMDiT): width = 64 * depth, read from the weights; 2 blocks, width 128. 2.4M params.
    Family("sd3", "SD3", {
        "in_channels": 16, "out_channels": 16, "patch_size": 2, "depth": 2, "input_size": None,
        "adm_in_channels": 2048, "pos_embed_max_size": 64, "num_patches": 64 * 64,
        "context_embedder_config": {"target": "torch.nn.Linear", "params": {"in_features": 4096, "out_features": 128}},
        "pos_embed_scaling_factor": None, "x_block_self_attn_layers": [],
    }, (1, 16, 8, 8), _cond(154, 4096, pooled_output=_pooled(2048)), text_encoders="CLIP-L + CLIP-G + T5-XXL",
           title="SD3"),
    # Flux: see FLUX_CONFIG. Guidance is a per-sample value in the conditioning, as FluxGuidance sets it.
    Family("flux", "Flux", FLUX_CONFIG, (1, 16, 8, 8), _cond(256, 4096, pooled_output=_pooled(768), guidance=3.5),
           train={"gradient_checkpointing": True}, text_encoders="CLIP-L + T5-XXL", title="Flux"),
    # Flux Kontext (edit): the same model; the conditioning carries the image to edit as reference latents.
    Family("flux_kontext", "Flux", FLUX_CONFIG, (1, 16, 8, 8),
           _cond(256, 4096, pooled_output=_pooled(768), guidance=2.5, reference_latents=_reference((1, 16, 8, 8))),
           train={"gradient_checkpointing": True}, text_encoders="CLIP-L + T5-XXL",
           title="Flux Kontext (reference latents in the conditioning)",
           # its process_cond_list walks into lists of tensors (the reference latents) down to 0-d tensors
           builtin_fails="iteration over a 0-d tensor"),
    # WAN 2.1 t2v: heads = width / 128; one block at width 128; UMT5 prompts are padded to 512 tokens.
    Family("wan21", "WAN21", {
        "image_model": "wan2.1", "model_type": "t2v", "dim": 128, "out_dim": 16, "num_heads": 1, "ffn_dim": 256,
        "num_layers": 1, "patch_size": (1, 2, 2), "freq_dim": 256, "window_size": (-1, -1), "qk_norm": True,
        "cross_attn_norm": True, "eps": 1e-6, "in_dim": 16,
    }, (1, 16, 1, 8, 8), _cond(512, 4096), vae="wan21", text_encoders="UMT5-XXL",
           title="WAN 2.1 (images as one-frame clips)"),
    # Qwen-Image: only the block count and input channels are read; width 3072 is fixed. 380M params.
    Family("qwen_image", "QwenImage", {"image_model": "qwen_image", "in_channels": 64, "num_layers": 1},
           (1, 16, 1, 8, 8), _cond(0, 3584), fixed_tokens=False, heavy=True, vae="wan21",
           text_encoders="Qwen2.5-VL-7B", title="Qwen-Image"),
    # Lumina 2: width is tied to Gemma2-2B's 2304 (the detection keys its head layout on it). 427M params.
    Family("lumina2", "Lumina2", {
        "image_model": "lumina2", "patch_size": 2, "in_channels": 16, "dim": 2304, "cap_feat_dim": 2304,
        "n_layers": 1, "qk_norm": True, "n_heads": 24, "n_kv_heads": 8, "axes_dims": [32, 32, 32],
        "axes_lens": [300, 512, 512], "rope_theta": 10000.0, "ffn_dim_multiplier": 4.0,
    }, (1, 16, 8, 8), _cond(0, 2304, attention_mask=_mask), fixed_tokens=False, heavy=True,
           text_encoders="Gemma2-2B", title="Lumina 2"),
)}


def save_family_model(family: Family, folder: Path, seed: int = 11) -> Path:
    """Write ``family``'s tiny diffusion model into ``folder`` (for ``UNETLoader``); return its path."""
    import comfy.model_detection
    import torch
    from safetensors.torch import save_file

    from .tiny_models import _fill

    config = comfy.model_detection.model_config_from_unet_config(dict(family.unet_config))
    if config is None:
        raise AssertionError(f"{family.name}: ComfyUI's detection knows no model for this config")
    module = config.get_model({}, device=torch.device("meta")).diffusion_model
    state = _fill({k: torch.empty(v.shape) for k, v in module.state_dict().items()}, seed)
    folder.mkdir(parents=True, exist_ok=True)
    path = folder / f"tiny_{family.name}.safetensors"
    save_file({k: v.contiguous() for k, v in state.items()}, str(path),
              metadata={"generator": "comfyui-streamcache tests/support/tiny_families.py"})
    return path


WAN21_VAE_CONFIG = {
    "dim": 16, "z_dim": 16, "dim_mult": [1, 2, 4, 4], "num_res_blocks": 2, "attn_scales": [],
    "temperal_downsample": [False, True, True], "image_channels": 3, "conv_out_channels": 3, "dropout": 0.0,
}
"""A WAN 2.1 VAE (also Qwen-Image's) at ``dim=16`` (the real one: 96). ComfyUI's VAE detection reads ``dim`` and
the image channels from the weights and fixes the rest, so only ``dim`` shrinks. 3.6M params. Latents:
``[1, 16, 1 + (frames - 1) // 4, h / 8, w / 8]``."""


def save_wan21_vae(folder: Path, name: str = "tiny_wan21_vae.safetensors", seed: int = 5) -> Path:
    """Write a tiny WAN 2.1 VAE that ``VAELoader`` accepts into ``folder``; return its path."""
    import comfy.ldm.wan.vae

    return _save_filled(comfy.ldm.wan.vae.WanVAE(**WAN21_VAE_CONFIG), folder / name, seed)


def save_taesd16(folder: Path, name: str = "tiny_taesd16.safetensors", seed: int = 6) -> Path:
    """Write a 16-channel TAESD (the shape of TAEF1, Flux's and Lumina 2's tiny VAE, and of TAESD3) that
    ``VAELoader`` accepts into ``folder``; ComfyUI reads the latent channels from the weights. 2.4M params."""
    from comfy.taesd.taesd import TAESD

    return _save_filled(TAESD(latent_channels=16), folder / name, seed)


def _save_filled(module: Any, path: Path, seed: int) -> Path:
    """Fill ``module``'s weights deterministically (``tiny_models._fill``) and save them as ``path``."""
    from safetensors.torch import save_file

    from .tiny_models import _fill

    state = _fill(module.state_dict(), seed)
    path.parent.mkdir(parents=True, exist_ok=True)
    save_file({k: v.contiguous() for k, v in state.items()}, str(path),
              metadata={"generator": "comfyui-streamcache tests/support/tiny_families.py"})
    return path


BLOCK_COUNTS: dict[str, tuple[int, int]] = {
    "sd15": (1, 2), "sdxl": (1, 2), "sd3": (2, 4), "flux": (2, 4), "flux_kontext": (2, 4), "wan21": (2, 4),
    "qwen_image": (2, 4), "lumina2": (2, 4),
}
"""Two sizes of each family for :func:`build_family_patcher` (UNets: res blocks per level, so units double)."""


def _sized_config(family: Family, blocks: int) -> tuple[dict[str, Any], int | None]:
    """What changes in ``family``'s config for ``blocks`` blocks at a small width (built directly, not detected
    from weights: the detection fixes the widths of Qwen-Image and Lumina 2 at gigabytes), and how many joint
    blocks to keep (SD3: its width is 64 × depth, so two sizes of one width are one model cut down)."""
    cfg: dict[str, Any] = {}
    if family.name == "sd15":
        cfg.update(num_res_blocks=[blocks], transformer_depth=[1] * blocks, transformer_depth_output=[0] * (blocks + 1))
    elif family.name == "sdxl":
        cfg.update(num_res_blocks=[blocks] * 3, transformer_depth=[0] * blocks + [1] * blocks + [1] * blocks,
                   transformer_depth_output=[0] * (3 * (blocks + 1)))
    elif family.name == "sd3":
        cfg.update(depth=4, context_embedder_config={"target": "torch.nn.Linear",
                                                     "params": {"in_features": 4096, "out_features": 4 * 64}})
        return cfg, blocks
    elif family.name in ("flux", "flux_kontext"):
        cfg.update(depth=blocks, depth_single_blocks=blocks)
    elif family.name == "wan21":
        cfg["num_layers"] = blocks
    elif family.name == "qwen_image":
        cfg.update(num_layers=blocks, num_attention_heads=1, attention_head_dim=128)
    elif family.name == "lumina2":
        cfg.update(n_layers=blocks, dim=192, n_heads=2, n_kv_heads=1)
    return cfg, None


def build_family_patcher(family: Family, blocks: int, seed: int = 11) -> Any:
    """A ComfyUI ``ModelPatcher`` of ``family``'s model class with ``blocks`` blocks (:data:`BLOCK_COUNTS`) and
    deterministic weights, on the CPU; its clones (``force_deepcopy``, as the trainers make) rebuild it."""
    import comfy.model_detection
    import comfy.model_patcher
    import torch

    from .tiny_models import _fill

    config = comfy.model_detection.model_config_from_unet_config(dict(family.unet_config))
    if config is None:
        raise AssertionError(f"{family.name}: ComfyUI's detection knows no model for this config")
    sized, keep = _sized_config(family, blocks)
    config.unet_config = {**config.unet_config, **sized}
    model = config.get_model({})
    dm = model.diffusion_model
    if keep is not None:
        dm.joint_blocks = torch.nn.ModuleList([dm.joint_blocks[i] for i in (0, *range(4 - keep + 1, 4))])
    dm.load_state_dict(_fill(dm.state_dict(), seed))
    cpu = torch.device("cpu")
    patcher = comfy.model_patcher.ModelPatcher(model, load_device=cpu, offload_device=cpu)
    patcher.cached_patcher_init = (_rebuild, (family.name, blocks, seed))
    return patcher


def _rebuild(name: str, blocks: int, seed: int, disable_dynamic: bool = False) -> Any:
    return build_family_patcher(FAMILIES[name], blocks, seed)

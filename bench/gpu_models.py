"""Full-size random-weight models for ``scripts/bench-gpu``, built from ComfyUI's own classes without a download.

A diffusion model is made on the ``meta`` device with ComfyUI's class and config (only its keys and shapes are
read), a state dict of random tensors of those keys and shapes is generated on the device it will train on (fast
even for 12B parameters), and ComfyUI's ``comfy.sd.load_diffusion_model_state_dict`` loads it: ComfyUI's detection
then names the family from the shapes, as it would for a real file (the harness checks the name). Values:
N(0, 0.5/√fan_in) for matrices, ones for 1-D weights, zeros for biases, so activations stay O(1).

``ModelPatcher.clone(force_deepcopy=True)``, which both trainers call, re-creates the model through
``cached_patcher_init``, which only ComfyUI's file loaders set: :func:`build_diffusion_model` registers a factory
that loads the same state dict again (as ``UNETLoader``'s factory reads the file again). The state dict then shares
the base model's storage, so the host holds the weights twice (base + the training clone), not three times.

VAEs and text encoders are made the same way (the module on ``meta`` for its keys, random values, ComfyUI's
``comfy.sd.VAE`` / ``load_text_encoder_state_dicts`` to load them). Nothing here imports ComfyUI at module level:
the specs are plain data, read by the report and the unit tests without ComfyUI.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Any

__all__ = ["FamilySpec", "FULL_FAMILIES", "VaeSpec", "FULL_VAES", "random_state_dict", "meta_shapes",
           "build_diffusion_model", "build_vae", "build_text_encoder", "conditioning", "param_count"]


@dataclass(frozen=True)
class FamilySpec:
    """One family's diffusion model and the shapes of one training sample.

    Attributes:
        name: short id (``--only`` selects by it).
        title: the name in the report.
        model_class: ``type(model.model).__name__`` ComfyUI's detection must give the loaded model.
        unet_config: the config ComfyUI's detection reads from the weights (``model_config_from_unet_config``).
        latent: one sample's latent ``[1, C, H, W]`` (``[1, C, T, H, W]`` for video).
        tokens, width: the conditioning ``[1, tokens, width]`` its text encoder gives.
        pooled: width of the pooled output (``None``: none).
        extras: other conditioning options (Flux's guidance, Lumina 2's attention mask as ``"mask"``).
        shape_note: the sample in words (``"1024², batch"`` etc. follow in the report).
        params_b: parameters in billions, for the report and the budget (checked against the built model).
    """

    name: str
    title: str
    model_class: str
    unet_config: dict[str, Any]
    latent: tuple[int, ...]
    tokens: int
    width: int
    pooled: int | None = None
    extras: dict[str, Any] = field(default_factory=dict)
    shape_note: str = ""
    params_b: float = 0.0

    def sample_bytes(self, itemsize: int = 2) -> int:
        """Bytes of one cached sample (latent + conditioning + pooled) at ``itemsize`` bytes a value."""
        return itemsize * (math.prod(self.latent) + self.tokens * self.width + (self.pooled or 0))


_SD15 = {
    "use_checkpoint": False, "image_size": 32, "out_channels": 4, "use_spatial_transformer": True, "legacy": False,
    "adm_in_channels": None, "in_channels": 4, "model_channels": 320, "num_res_blocks": [2, 2, 2, 2],
    "transformer_depth": [1, 1, 1, 1, 1, 1, 0, 0], "channel_mult": [1, 2, 4, 4], "transformer_depth_middle": 1,
    "use_linear_in_transformer": False, "context_dim": 768, "num_heads": 8,
    "transformer_depth_output": [1, 1, 1, 1, 1, 1, 1, 1, 1, 0, 0, 0],
    "use_temporal_attention": False, "use_temporal_resblock": False,
}
_SDXL = {
    "use_checkpoint": False, "image_size": 32, "out_channels": 4, "use_spatial_transformer": True, "legacy": False,
    "num_classes": "sequential", "adm_in_channels": 2816, "in_channels": 4, "model_channels": 320,
    "num_res_blocks": [2, 2, 2], "transformer_depth": [0, 0, 2, 2, 10, 10], "channel_mult": [1, 2, 4],
    "transformer_depth_middle": 10, "use_linear_in_transformer": True, "context_dim": 2048, "num_head_channels": 64,
    "transformer_depth_output": [0, 0, 0, 2, 2, 2, 10, 10, 10], "use_temporal_attention": False,
    "use_temporal_resblock": False,
}
_FLUX_DEV = {
    "image_model": "flux", "in_channels": 16, "out_channels": 16, "patch_size": 2, "vec_in_dim": 768,
    "context_in_dim": 4096, "hidden_size": 3072, "mlp_ratio": 4.0, "num_heads": 24, "depth": 19,
    "depth_single_blocks": 38, "axes_dim": [16, 56, 56], "theta": 10000, "qkv_bias": True, "guidance_embed": True,
    "txt_ids_dims": [], "yak_mlp": False, "txt_norm": False,
}
_WAN21_1_3B = {
    "image_model": "wan2.1", "model_type": "t2v", "dim": 1536, "ffn_dim": 8960, "num_heads": 12, "num_layers": 30,
    "in_dim": 16, "out_dim": 16, "patch_size": (1, 2, 2), "freq_dim": 256, "window_size": (-1, -1), "qk_norm": True,
    "cross_attn_norm": True, "eps": 1e-6,
}
_QWEN_IMAGE = {"image_model": "qwen_image", "in_channels": 64, "num_layers": 60}
_LUMINA2 = {
    "image_model": "lumina2", "patch_size": 2, "in_channels": 16, "dim": 2304, "cap_feat_dim": 2304, "n_layers": 26,
    "qk_norm": True, "n_heads": 24, "n_kv_heads": 8, "axes_dims": [32, 32, 32], "axes_lens": [300, 512, 512],
    "rope_theta": 10000.0, "ffn_dim_multiplier": 4.0,
}

FULL_FAMILIES: dict[str, FamilySpec] = {f.name: f for f in (
    FamilySpec("sd15", "SD1.5", "BaseModel", _SD15, (1, 4, 64, 64), 77, 768, shape_note="512²", params_b=0.86),
    FamilySpec("sdxl", "SDXL", "SDXL", _SDXL, (1, 4, 128, 128), 77, 2048, pooled=1280, shape_note="1024²",
               params_b=2.57),
    FamilySpec("flux", "Flux-dev", "Flux", _FLUX_DEV, (1, 16, 128, 128), 512, 4096, pooled=768,
               extras={"guidance": 3.5}, shape_note="1024²", params_b=11.9),
    FamilySpec("wan21", "WAN 2.1 t2v 1.3B", "WAN21", _WAN21_1_3B, (1, 16, 9, 60, 104), 512, 4096,
               shape_note="33 frames 480×832", params_b=1.42),
    FamilySpec("lumina2", "Lumina 2", "Lumina2", _LUMINA2, (1, 16, 128, 128), 256, 2304, extras={"mask": True},
               shape_note="1024²", params_b=2.61),
    FamilySpec("qwen_image", "Qwen-Image", "QwenImage", _QWEN_IMAGE, (1, 16, 1, 128, 128), 256, 3584,
               shape_note="1024²", params_b=20.4),
)}
"""The families at their real sizes (ComfyUI's detection names each one from meta-device shapes: see the CPU
test). Conditioning widths are their text encoders': CLIP-L 768, CLIP-L+G 2048 (+ pooled 1280), T5-XXL 4096 (Flux:
512 tokens, + CLIP-L pooled 768), UMT5-XXL 4096 × 512, Gemma2-2B 2304, Qwen2.5-VL-7B 3584."""


@dataclass(frozen=True)
class VaeSpec:
    """One family's VAE for the encode benchmark: the module ComfyUI's ``comfy.sd.VAE`` would build.

    Attributes:
        name: short id.
        title: the name in the report.
        kind: ``"kl"`` (``AutoencoderKL``: SD/SDXL, 4 channels, with quant convs), ``"kl16"`` (Flux's: 16 channels,
            ``AutoencodingEngine``, no quant convs) or ``"wan21"`` (``WanVAE``).
        size: images ``(height, width)`` encoded.
        text: which text encoder the row uses (``"clip_l"`` or ``"clip_l+t5xxl"``).
        wan_dim: ``WanVAE``'s ``dim`` (96 at full size; ComfyUI reads it from the weights, so the CPU test
            shrinks it; the AutoencoderKL's width is fixed by ComfyUI: 84M parameters whatever the test).
    """

    name: str
    title: str
    kind: str
    size: tuple[int, int]
    text: str = "clip_l"
    wan_dim: int = 96


FULL_VAES: dict[str, VaeSpec] = {v.name: v for v in (
    VaeSpec("sd15", "SD1.5 (SD VAE, CLIP-L)", "kl", (512, 512)),
    VaeSpec("sdxl", "SDXL (SDXL VAE, CLIP-L)", "kl", (1024, 1024)),
    VaeSpec("flux", "Flux (16-ch VAE, CLIP-L + T5-XXL fp8)", "kl16", (1024, 1024), text="clip_l+t5xxl"),
    VaeSpec("wan21", "WAN 2.1 (WAN VAE, images as 1 frame, CLIP-L + T5-XXL fp8)", "wan21", (480, 832),
            text="clip_l+t5xxl"),
)}


# ------------------------------------------------------------------------------------------------ tensors
def meta_shapes(module: Any) -> dict[str, tuple[int, ...]]:
    """Key → shape of every entry of ``module.state_dict()`` (a module built on ``meta`` allocates nothing)."""
    return {k: tuple(v.shape) for k, v in module.state_dict().items()}


def param_count(shapes: dict[str, tuple[int, ...]]) -> int:
    return sum(math.prod(s) for s in shapes.values())


def random_state_dict(shapes: dict[str, tuple[int, ...]], dtype: Any, device: Any, seed: int,
                      to: Any = "cpu") -> dict[str, Any]:
    """Random values of ``shapes`` generated on ``device`` in ``dtype`` (fp8: drawn in bf16, then cast), moved to
    ``to``. Biases zero, 1-D and 0-D weights one, the rest N(0, 0.5/√fan_in)."""
    import torch

    gen = torch.Generator(device=device).manual_seed(seed)
    draw = dtype if dtype in (torch.float32, torch.float16, torch.bfloat16) else torch.bfloat16
    out = {}
    for key in sorted(shapes):
        shape = shapes[key]
        if key.endswith("bias"):
            value = torch.zeros(shape, dtype=draw, device=device)
        elif len(shape) <= 1:
            value = torch.ones(shape, dtype=draw, device=device)
        else:
            value = torch.randn(shape, generator=gen, dtype=draw, device=device)
            value.mul_(0.5 / math.sqrt(math.prod(shape[1:])))
        out[key] = value.to(device=to, dtype=dtype)
    return out


# ------------------------------------------------------------------------------------------------ builders
def diffusion_shapes(spec: FamilySpec) -> dict[str, tuple[int, ...]]:
    """The diffusion model's keys and shapes, from ComfyUI's class on ``meta``."""
    import torch

    import comfy.model_detection

    config = comfy.model_detection.model_config_from_unet_config(dict(spec.unet_config))
    if config is None:
        raise ValueError(f"{spec.name}: ComfyUI's detection knows no model for this config")
    return meta_shapes(config.get_model({}, device=torch.device("meta")).diffusion_model)


def _rebuild(state_dict: dict[str, Any], disable_dynamic: bool = False) -> Any:
    """``cached_patcher_init`` factory: the model again from the same state dict (as ``load_diffusion_model``)."""
    import comfy.sd

    return comfy.sd.load_diffusion_model_state_dict(dict(state_dict), disable_dynamic=disable_dynamic)


def build_diffusion_model(spec: FamilySpec, device: Any, dtype: Any, seed: int = 1) -> Any:
    """A ComfyUI ``ModelPatcher`` of ``spec``'s model with random weights, detected by ComfyUI from the state dict.

    Raises:
        RuntimeError: ComfyUI's detection named another model class than ``spec.model_class``.
    """
    import comfy.sd

    state = random_state_dict(diffusion_shapes(spec), dtype, device, seed)
    model = comfy.sd.load_diffusion_model_state_dict(dict(state))  # a copy: loading pops the keys it takes
    found = type(model.model).__name__ if model is not None else None
    if found != spec.model_class:
        raise RuntimeError(f"{spec.name}: ComfyUI's detection gave {found}, expected {spec.model_class}")
    _share_storage(state, model.model.diffusion_model.state_dict())
    model.cached_patcher_init = (_rebuild, (state,))
    return model


def _share_storage(state: dict[str, Any], loaded: dict[str, Any]) -> None:
    """Point ``state``'s tensors at the loaded model's where key, shape and dtype agree (frees the copies)."""
    for key, value in list(state.items()):
        twin = loaded.get(key)
        if twin is not None and twin.shape == value.shape and twin.dtype == value.dtype:
            state[key] = twin.detach()


def vae_module(spec: VaeSpec) -> Any:
    """``spec``'s VAE module, built with ComfyUI's classes on ``meta`` (the configs ``comfy.sd.VAE`` uses)."""
    import torch

    with torch.device("meta"):
        if spec.kind == "wan21":
            import comfy.ldm.wan.vae

            return comfy.ldm.wan.vae.WanVAE(
                dim=spec.wan_dim, z_dim=16, dim_mult=[1, 2, 4, 4], num_res_blocks=2, attn_scales=[],
                temperal_downsample=[False, True, True], image_channels=3, conv_out_channels=3, dropout=0.0)
        from comfy.ldm.models.autoencoder import AutoencoderKL, AutoencodingEngine

        z = 4 if spec.kind == "kl" else 16
        dd = {"double_z": True, "z_channels": z, "resolution": 256, "in_channels": 3, "out_ch": 3, "ch": 128,
              "ch_mult": [1, 2, 4, 4], "num_res_blocks": 2, "attn_resolutions": [], "dropout": 0.0}
        if spec.kind == "kl":
            return AutoencoderKL(ddconfig=dd, embed_dim=4)
        target = "comfy.ldm.modules.diffusionmodules.model."
        return AutoencodingEngine(
            regularizer_config={"target": "comfy.ldm.models.autoencoder.DiagonalGaussianRegularizer"},
            encoder_config={"target": target + "Encoder", "params": dd},
            decoder_config={"target": target + "Decoder", "params": dd})


def build_vae(spec: VaeSpec, device: Any, seed: int = 3) -> Any:
    """A ComfyUI ``VAE`` of ``spec`` with random fp32 weights (``comfy.sd.VAE`` picks its working dtype)."""
    import torch

    import comfy.sd

    return comfy.sd.VAE(sd=random_state_dict(meta_shapes(vae_module(spec)), torch.float32, device, seed))


def text_encoder_shapes(which: str) -> dict[str, tuple[int, ...]]:
    """CLIP-L's (``"clip_l"``) or T5-XXL's (``"t5xxl"``) keys and shapes, from ComfyUI's classes on ``meta``."""
    import json
    from pathlib import Path

    import torch

    import comfy.clip_model
    import comfy.ops
    import comfy.text_encoders.t5

    root = Path(comfy.clip_model.__file__).resolve().parent
    if which == "clip_l":
        config = json.loads((root / "sd1_clip_config.json").read_text())
        module = comfy.clip_model.CLIPTextModel(config, torch.float32, "meta", comfy.ops.manual_cast)
        return {k: s for k, s in meta_shapes(module).items() if k.startswith("text_model.")}
    config = json.loads((root / "text_encoders" / "t5_config_xxl.json").read_text())
    return meta_shapes(comfy.text_encoders.t5.T5(config, torch.float32, "meta", comfy.ops.manual_cast))


def build_text_encoder(parts: str, device: Any, clip_l: dict[str, Any] | None = None, seed: int = 5) -> Any:
    """A ComfyUI ``CLIP`` of random weights: ``"clip_l"`` (SD's CLIPLoader type) or ``"clip_l+t5xxl"`` (Flux's
    DualCLIPLoader; T5-XXL stored in fp8 e4m3fn, as the ``t5xxl_fp8_e4m3fn`` file users load). ``clip_l`` reuses a
    CLIP-L state dict made earlier."""
    import torch

    import comfy.sd

    clip_sd = clip_l if clip_l is not None else random_state_dict(text_encoder_shapes("clip_l"), torch.float16,
                                                                   device, seed)
    if parts == "clip_l":
        return comfy.sd.load_text_encoder_state_dicts([dict(clip_sd)], clip_type=comfy.sd.CLIPType.STABLE_DIFFUSION)
    t5 = random_state_dict(text_encoder_shapes("t5xxl"), torch.float8_e4m3fn, device, seed + 1)
    return comfy.sd.load_text_encoder_state_dicts([dict(clip_sd), t5], clip_type=comfy.sd.CLIPType.FLUX)


# ------------------------------------------------------------------------------------------------ samples
def conditioning(spec: FamilySpec, gen: Any, dtype: Any) -> list:
    """One conditioning of ``spec``'s shapes: ``[[Tensor[1, tokens, width], options]]``."""
    import torch

    options: dict[str, Any] = {}
    if spec.pooled:
        options["pooled_output"] = torch.randn(1, spec.pooled, generator=gen).to(dtype)
    for key, value in spec.extras.items():
        if key == "mask":
            options["attention_mask"] = torch.ones(1, spec.tokens, dtype=torch.long)
        else:
            options[key] = value
    return [[(torch.randn(1, spec.tokens, spec.width, generator=gen) * 0.5).to(dtype), options]]


def latent(spec: FamilySpec, gen: Any, dtype: Any) -> dict[str, Any]:
    import torch

    return {"samples": torch.randn(spec.latent, generator=gen).to(dtype)}


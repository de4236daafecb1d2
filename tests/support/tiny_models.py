"""Tiny random-weight models of real architectures, generated once and cached outside the repository.

ComfyUI only accepts model files whose shapes match an architecture it knows, so the smallest usable set is
(found by trying what ComfyUI's model detection accepts):

* an SD1.5-shaped UNet: 320 channels, one level, one SpatialTransformer with 768-wide cross-attention
  (13.6M params) → ``diffusion_models/`` for ``UNETLoader``;
* CLIP-L, whose size ComfyUI fixes (123.6M params, ~241 MB in fp16) → ``text_encoders/`` for ``CLIPLoader``;
* TAESD (2.4M params) → ``vae/`` for ``VAELoader``;
* one checkpoint holding all three → ``checkpoints/`` for ``CheckpointLoaderSimple``.

The modules are built with ComfyUI's own classes, so this file's generator runs under ComfyUI's python
(``python tiny_models.py OUT_DIR``, with ``COMFYUI_PATH`` set); :func:`ensure_tiny_models` does that in a
subprocess and caches the result under :func:`support.paths.cache_home`, keyed by a hash of the recipe so a
change of the recipe regenerates. Every state dict is complete: its keys are exactly the module's
``state_dict()`` keys, because ComfyUI leaves missing weights as uninitialised memory.
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path

__all__ = ["TinyModels", "ensure_tiny_models", "UNET_CONFIG"]

UNET_FILE = "diffusion_models/tiny_sd15_unet.safetensors"
CLIP_FILE = "text_encoders/tiny_clip_l.safetensors"
VAE_FILE = "vae/tiny_taesd.safetensors"
CHECKPOINT_FILE = "checkpoints/tiny_sd15.safetensors"
MANIFEST = "MANIFEST.json"

UNET_CONFIG = {
    "use_checkpoint": False, "image_size": 32, "use_spatial_transformer": True, "legacy": False,
    "adm_in_channels": None, "in_channels": 4, "out_channels": 4, "model_channels": 320,
    "num_res_blocks": [1], "channel_mult": [1], "transformer_depth": [1], "transformer_depth_output": [0, 0],
    "transformer_depth_middle": -2, "use_linear_in_transformer": False, "context_dim": 768,
    "use_temporal_resblock": False, "use_temporal_attention": False,
}
"""The smallest UNet that ComfyUI's model detection still calls SD1.5 (``model_channels`` and ``context_dim``
must equal SD1.5's; everything else is read from weight shapes)."""


@dataclass(frozen=True)
class TinyModels:
    """Paths of a generated tiny model set (``root`` is laid out like ComfyUI's ``models/`` folder)."""

    root: Path

    @property
    def unet(self) -> Path:
        return self.root / UNET_FILE

    @property
    def clip(self) -> Path:
        return self.root / CLIP_FILE

    @property
    def vae(self) -> Path:
        return self.root / VAE_FILE

    @property
    def checkpoint(self) -> Path:
        return self.root / CHECKPOINT_FILE

    def name(self, which: str) -> str:
        """The file name a ComfyUI loader widget takes (e.g. ``name("unet")`` → ``tiny_sd15_unet.safetensors``)."""
        return getattr(self, which).name


_GENERATOR_MARK = "# Generator: runs under ComfyUI's python only."


def recipe_version() -> str:
    """Hash of the recipe (generator code, UNet config, file names): a change lands in a fresh cache folder,
    while edits elsewhere in this file (docs, helpers) keep using the models already generated."""
    source = Path(__file__).read_text(encoding="utf-8")
    recipe = source[source.index(_GENERATOR_MARK):] + repr(UNET_CONFIG)
    recipe += repr((UNET_FILE, CLIP_FILE, VAE_FILE, CHECKPOINT_FILE))
    return hashlib.sha256(recipe.encode()).hexdigest()[:12]


def ensure_tiny_models(comfy_path: Path, comfy_python: Path, cache_dir: Path | None = None) -> TinyModels:
    """Return the cached tiny model set, generating it first (~20 s, ~0.6 GB) when absent.

    Generation writes into a temporary sibling folder and renames it into place, so an interrupted or
    concurrent run never leaves a half-written set behind.
    """
    from .paths import cache_home

    base = (cache_dir or cache_home() / "tiny-models")
    final = base / recipe_version()
    if (final / MANIFEST).is_file():
        return TinyModels(final)
    base.mkdir(parents=True, exist_ok=True)
    tmp = base / f".tmp-{os.getpid()}-{recipe_version()}"
    shutil.rmtree(tmp, ignore_errors=True)
    env = {**os.environ, "COMFYUI_PATH": str(comfy_path)}
    proc = subprocess.run([str(comfy_python), __file__, str(tmp)], env=env, capture_output=True, text=True)
    if proc.returncode != 0:
        shutil.rmtree(tmp, ignore_errors=True)
        raise RuntimeError(f"tiny model generation failed (exit {proc.returncode}):\n{proc.stdout}\n{proc.stderr}")
    try:
        tmp.rename(final)
    except OSError:  # another process won the race; its set is identical
        shutil.rmtree(tmp, ignore_errors=True)
    return TinyModels(final)


# ---------------------------------------------------------------------------------------------------------
# Generator: runs under ComfyUI's python only.


def _fill(state_dict: dict, seed: int) -> dict:
    """Deterministic weights for a ComfyUI module whose parameters are uninitialised ``torch.empty``.

    Norm scales are 1, biases 0, embeddings N(0, 0.02), other weights N(0, 0.5/sqrt(fan_in)) so activations
    stay O(1) through the network; 0-d parameters (TAESD's ``vae_scale``/``vae_shift``) keep their values.
    """
    import torch

    gen = torch.Generator().manual_seed(seed)
    out = {}
    for key in sorted(state_dict):
        t = state_dict[key]
        if t.ndim == 0:
            value = t.detach().clone().float()
        elif key.endswith("bias"):
            value = torch.zeros(t.shape)
        elif t.ndim == 1:
            value = torch.ones(t.shape)
        elif "embedding" in key:
            value = torch.randn(t.shape, generator=gen) * 0.02
        else:
            fan_in = t[0].numel()
            value = torch.randn(t.shape, generator=gen) * (0.5 / fan_in ** 0.5)
        out[key] = value
    return out


def _generate(out: Path) -> None:
    comfy_path = Path(os.environ["COMFYUI_PATH"]).resolve()
    sys.path.insert(0, str(comfy_path))
    from comfy.cli_args import args

    args.cpu = True
    import comfy.clip_model
    import comfy.ops
    import comfy.supported_models
    import torch
    from comfy.taesd.taesd import TAESD
    from safetensors.torch import save_file

    unet_module = comfy.supported_models.SD15(dict(UNET_CONFIG)).get_model({}).diffusion_model
    clip_config = json.loads((comfy_path / "comfy" / "sd1_clip_config.json").read_text())
    clip_module = comfy.clip_model.CLIPTextModel(clip_config, torch.float32, "cpu", comfy.ops.manual_cast)
    vae_module = TAESD(latent_channels=4)

    parts = {}
    for name, module, seed, dtype in (
        ("unet", unet_module, 1, torch.float32),
        ("clip", clip_module, 2, torch.float16),
        ("vae", vae_module, 3, torch.float32),
    ):
        sd = _fill(module.state_dict(), seed)
        if set(sd) != set(module.state_dict()):
            raise AssertionError(f"{name}: state dict keys differ from the module's")
        parts[name] = {k: v.to(dtype).contiguous() for k, v in sd.items()}

    checkpoint = {}
    checkpoint.update({f"model.diffusion_model.{k}": v for k, v in parts["unet"].items()})
    # SD1.5 checkpoints carry no text projection (ComfyUI ignores its absence for SD1.5); keep that shape.
    checkpoint.update({f"cond_stage_model.transformer.{k}": v for k, v in parts["clip"].items()
                       if k.startswith("text_model.")})
    checkpoint.update({f"first_stage_model.{k}": v for k, v in parts["vae"].items()})

    files = {UNET_FILE: parts["unet"], CLIP_FILE: parts["clip"], VAE_FILE: parts["vae"], CHECKPOINT_FILE: checkpoint}
    for rel, sd in files.items():
        path = out / rel
        path.parent.mkdir(parents=True, exist_ok=True)
        save_file(sd, str(path), metadata={"generator": "comfyui-streamcache tests/support/tiny_models.py"})
    manifest = {
        "recipe": recipe_version(),
        "files": {rel: {"keys": len(sd), "params": sum(v.numel() for v in sd.values())} for rel, sd in files.items()},
        "unet_config": UNET_CONFIG,
    }
    (out / MANIFEST).write_text(json.dumps(manifest, indent=2))


if __name__ == "__main__":
    if len(sys.argv) != 2:
        sys.exit("usage: COMFYUI_PATH=<ComfyUI> <ComfyUI python> tiny_models.py OUT_DIR")
    _generate(Path(sys.argv[1]))

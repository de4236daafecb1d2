"""A tiny WAN 2.1 (diffusion model and VAE, :mod:`support.tiny_families`) placed in a server's model folders.

The e2e server reads its models from the tiny model set (:mod:`support.tiny_models`); the WAN files are built
under ComfyUI's python (they need ComfyUI's classes) and added to that set's ``vae/`` and ``diffusion_models/``
folders beside the SD1.5 ones, each written to a temporary name and renamed into place, so concurrent or
interrupted runs never leave a half-written file. They are generated once per set and reused.
"""

from __future__ import annotations

import os
import subprocess
from pathlib import Path

from .paths import TESTS_DIR

__all__ = ["WAN_VAE", "WAN_MODEL", "ensure_wan_models"]

WAN_VAE = "tiny_wan21_vae.safetensors"
WAN_MODEL = "tiny_wan21.safetensors"

_SCRIPT = """
import os, sys
from pathlib import Path
sys.path.insert(0, os.environ["COMFYUI_PATH"]); sys.path.insert(0, os.environ["STREAMCACHE_TESTS"])
from comfy.cli_args import args
args.cpu = True
from support.tiny_families import FAMILIES, save_family_model, save_wan21_vae
vae_dir, dm_dir, tag = Path(sys.argv[1]), Path(sys.argv[2]), sys.argv[3]
vae = save_wan21_vae(vae_dir, name=f".tmp-{tag}-vae.safetensors")
model = save_family_model(FAMILIES["wan21"], dm_dir)
os.replace(model, dm_dir / f".tmp-{tag}-model.safetensors")
"""


def ensure_wan_models(models_root: Path, comfy_path: Path, comfy_python: Path) -> tuple[str, str]:
    """Make sure ``models_root`` holds the tiny WAN VAE and diffusion model; return their file names."""
    vae, model = models_root / "vae" / WAN_VAE, models_root / "diffusion_models" / WAN_MODEL
    if vae.is_file() and model.is_file():
        return WAN_VAE, WAN_MODEL
    tag = f"{os.getpid()}"
    work = models_root / "diffusion_models" / f".tmp-wan-{tag}"  # save_family_model names its file itself
    env = {**os.environ, "COMFYUI_PATH": str(comfy_path), "STREAMCACHE_TESTS": str(TESTS_DIR)}
    proc = subprocess.run([str(comfy_python), "-c", _SCRIPT, str(vae.parent), str(work), tag], env=env,
                          capture_output=True, text=True)
    if proc.returncode != 0:
        raise RuntimeError(f"tiny WAN generation failed (exit {proc.returncode}):\n{proc.stdout}\n{proc.stderr}")
    os.replace(vae.parent / f".tmp-{tag}-vae.safetensors", vae)
    os.replace(work / f".tmp-{tag}-model.safetensors", model)
    work.rmdir()
    return WAN_VAE, WAN_MODEL

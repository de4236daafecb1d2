"""The pieces of ComfyUI's own trainer this pack drives: its training module, LoRA files, dtypes, model release.

Everything here calls ComfyUI; the rest of the trainer only calls these.
"""

from __future__ import annotations

import importlib
import logging
import re
import sys
from collections.abc import Callable, Sequence
from types import ModuleType
from typing import Any, cast

import torch

import comfy.model_management
import comfy.utils
import node_helpers

from .lora_files import NONE, lora_path

__all__ = ["bypass_setup", "check_latent_channels", "draw_new_adapters_on_cpu", "load_existing_lora",
           "nodes_train_module", "release", "resume_exactly", "training_dtypes"]

log = logging.getLogger("streamcache.train")

_NODES_TRAIN_NEEDS = ("_setup_lora_adapters", "_create_optimizer", "_create_loss_function", "unpatch")


def nodes_train_module() -> ModuleType:
    """ComfyUI's live ``comfy_extras/nodes_train`` module (the one its "Train LoRA" node runs from).

    ComfyUI imports ``comfy_extras`` files under their path as module name, so ``import comfy_extras.nodes_train``
    would create a second copy; the live one is found through the registered node class, and the plain import is
    the fallback when the built-in nodes are not loaded (scripts, tests).

    Raises:
        RuntimeError: ComfyUI's training module lacks a function this pack calls (a ComfyUI version that
            changed its private training helpers).
    """
    module: ModuleType | None = None
    nodes = sys.modules.get("nodes")
    node_class = getattr(nodes, "NODE_CLASS_MAPPINGS", {}).get("TrainLoraNode") if nodes else None
    if node_class is not None:
        module = sys.modules.get(node_class.__module__)
    if module is None:
        module = importlib.import_module("comfy_extras.nodes_train")
    missing = [name for name in _NODES_TRAIN_NEEDS if not callable(getattr(module, name, None))]
    if missing:
        raise RuntimeError(
            f"ComfyUI's training module {module.__name__} has no {', '.join(missing)}: this ComfyUI version "
            "changed its LoRA training helpers; update ComfyUI-StreamCache (or use a ComfyUI it supports)"
        )
    return module


def load_existing_lora(name: str) -> tuple[dict[str, torch.Tensor], int | None]:
    """Weights and step count of a LoRA of ``existing_lora``'s list (:mod:`.lora_files`; ``"[None]"``: none, 0 steps).

    The step count is read from ``SaveLoRA``'s file name (``<prefix>_<steps>_steps_<counter>_.safetensors``); any
    other name gives ``None`` instead of failing (the built-in node raises on such names). A saved training state
    (:mod:`.resume`) overrides it.
    """
    if name == NONE:
        return {}, 0
    path = lora_path(name)  # a loras folder's file, or one of the output folder's ("... [output]")
    match = re.search(r"(\d+)_steps_", name)
    return comfy.utils.load_torch_file(path, safe_load=True), int(match.group(1)) if match else None


def resume_exactly(lora_sd: dict[str, torch.Tensor], existing: dict[str, torch.Tensor]) -> None:
    """Start from every value of the existing LoRA, not only its up/down matrices.

    ComfyUI's adapter setup re-creates ``diff``/``diff_b`` (norm and bias deltas) as zeros and reads ``alpha`` from a
    key it never saves (``<module>.weight.alpha``), so a continued LoRA would silently lose those; copying the
    saved tensors over the freshly built parameters (same names, as ``SaveLoRA`` wrote them) continues exactly.
    """
    with torch.no_grad():
        for key, param in lora_sd.items():
            saved = existing.get(key)
            if saved is not None and saved.shape == param.shape:
                param.copy_(saved.to(param.dtype))


def set_alpha(lora_sd: dict[str, torch.Tensor], existing: dict[str, torch.Tensor], alpha: float,
              existing_name: str = "") -> list[str]:
    """Give every new adapter ``alpha`` (``<module>.alpha``: its difference is scaled by ``alpha / rank``); return
    the notes (a continued LoRA keeps the alphas it was trained with, and its summary says so when they differ).

    ComfyUI's trainer makes every adapter with alpha 1.0, so its scale is ``1 / rank``; kohya's ``network_alpha``
    and the LyCORIS algorithms' ``alpha`` set it (``alpha`` = ``rank``: scale 1). The saved LoRA holds the alpha, so
    every loader applies the scale it trained with. Call after :func:`resume_exactly` (and the CPU redraw).
    """
    kept = set()
    with torch.no_grad():
        for key, param in lora_sd.items():
            if not key.endswith(".alpha"):
                continue
            if key in existing:
                kept.add(float(existing[key]))
            else:
                param.fill_(alpha)
    differ = ", ".join(f"{a:g}" for a in sorted(a for a in kept if a != alpha)[:3])
    if differ and alpha != 1.0:
        return [f"existing_lora {existing_name!r} keeps the alpha it was trained with ({differ}), not lora_alpha "
                f"{alpha:g}: its scale is part of what it learned"]
    return []


def draw_new_adapters_on_cpu(train: ModuleType, mp: Any, lora_sd: dict[str, torch.Tensor],
                             existing: dict[str, torch.Tensor], algorithm: str, adapter_dtype: torch.dtype,
                             rank: int) -> bool:
    """Give a new LoRA the initial values the CPU's generator draws, wherever ComfyUI put the model.

    ComfyUI's ``create_train`` draws a new adapter on its weight's device: with the model already on a GPU (ComfyUI's
    ``--highvram``, or by itself where free VRAM exceeds free RAM) one seed would start another LoRA than on the CPU,
    and on one machine another one depending on where the model happened to be. Called right after the adapters
    were made, with the generator seeded as it was for them, this draws them again with ComfyUI's own
    ``create_train`` on CPU stand-ins of the weights (``torch.empty``: only their shape and device are read, never
    their values) in the same module order, and copies the values in. Returns whether anything was drawn again.
    """
    if existing:
        return False  # a continued LoRA is loaded, not drawn
    modules = [(n, m) for n, m in mp.model.named_modules()
               if hasattr(m, "weight_function") and getattr(m, "weight", None) is not None and m.weight.ndim >= 2]
    if all(m.weight.device.type == "cpu" for _n, m in modules):
        return False
    make = getattr(train, "adapter_maps", {}).get(algorithm)
    if make is None or not callable(getattr(make, "create_train", None)):
        log.warning("Train LoRA: ComfyUI's training module has no %s adapter maker to draw it on the CPU with; the "
                    "new %s was drawn on %s, where the model was", algorithm, algorithm, modules[0][1].weight.device)
        return False
    _draw_again(make, modules, lora_sd, adapter_dtype, rank)
    return True


def _draw_again(make: Any, modules: Sequence[tuple[str, torch.nn.Module]], lora_sd: dict[str, torch.Tensor],
                adapter_dtype: torch.dtype, rank: int) -> None:
    """``make.create_train`` on a CPU stand-in of each module's weight, in order; the values copied into
    ``lora_sd`` (a parameter ComfyUI did not make is left alone)."""
    with torch.no_grad():
        for name, module in modules:
            weight = cast(torch.Tensor, module.weight)  # a Linear's or Conv's weight
            stand_in = torch.empty(weight.shape, dtype=weight.dtype)
            drawn = make.create_train(stand_in, rank=rank, alpha=1.0).to(adapter_dtype)
            for part, value in drawn.named_parameters():
                target = lora_sd.get(f"{name}.{part}")
                if target is not None and target.shape == value.shape:
                    target.copy_(value)


def training_dtypes(mp: Any, training_dtype: str, lora_dtype: str) -> tuple[torch.dtype, torch.dtype, bool]:
    """(autocast dtype, adapter dtype, use a GradScaler) with the built-in node's rules; sets the compute dtype."""
    adapter_dtype = node_helpers.string_to_torch_dtype(lora_dtype)
    if training_dtype != "none":
        dtype = node_helpers.string_to_torch_dtype(training_dtype)
        mp.set_model_compute_dtype(dtype)
        return dtype, adapter_dtype, False
    if mp.model.get_dtype() == torch.float16:  # GradScaler handles fp16 gradients only, not bf16 adapters
        return torch.float16, adapter_dtype, adapter_dtype != torch.bfloat16
    return torch.bfloat16, adapter_dtype, False


def check_latent_channels(mp: Any, buckets: Sequence[tuple[int, ...]]) -> None:
    expected = getattr(getattr(mp.model, "latent_format", None), "latent_channels", None)
    found = sorted({b[0] for b in buckets})
    if expected is not None and found != [expected]:
        raise ValueError(
            f"the dataset's latents have {found} channel(s) but the model expects {expected}: the cache was "
            "encoded with another model family's VAE; encode the dataset with this model's VAE"
        )



def release(mp: Any) -> None:
    """Unload the training clone now (device memory back, weight wrappers removed) instead of at the next GC."""
    try:
        loaded = comfy.model_management.current_loaded_models
        for entry in [lm for lm in loaded if lm.model is mp]:
            entry.model_unload()
            loaded.remove(entry)
    except Exception:  # a ComfyUI that changed its loaded-model list: the clone is freed when collected
        log.debug("could not unload the training clone explicitly", exc_info=True)


def bypass_setup(train: ModuleType) -> Callable[..., tuple[dict[str, torch.Tensor], list[Any], Any]]:
    """ComfyUI's bypass-mode adapter setup (adapters applied by forward hooks), or a ValueError naming the input
    when this ComfyUI has none."""
    setup = getattr(train, "_setup_lora_adapters_bypass", None)
    if setup is None:
        raise ValueError("bypass_mode is on, but this ComfyUI's training code has no bypass mode "
                         "(comfy_extras/nodes_train.py _setup_lora_adapters_bypass): update ComfyUI or turn "
                         "bypass_mode off")
    return setup

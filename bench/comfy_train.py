"""C2 of ``scripts/bench-comfy``: the training datasets, and one training run timed in a child process.

Why apart from the driver: :func:`child_train` runs alone in a fresh interpreter (``run_comfyui.py --child train``)
so that every trainer starts from ComfyUI imported and the model loaded, and its peak RSS is its own. The trainers:
ours (``train_lora``, what ``StreamCache_TrainLoRA`` runs), the bound (ours with every batch read before the loop)
and the built-in ``LoadTrainingDataset`` → ``ResolutionBucket`` → ``TrainLoraNode(bucket_mode=True)``.
"""

from __future__ import annotations

import gc
import importlib
import time
from pathlib import Path
from typing import Any

from .common import keys_of, rss_mib
from .comfyui import add_model_folders, comfy_setup
from .comfyui import comfy_nodes as comfyui_nodes
from .gpu_train import in_memory_loader

__all__ = ["TRAIN_LATENT", "TRAIN_OPTS", "clip_template", "prep_train", "child_train"]

TRAIN_LATENT = (1, 4, 16, 16)  # 128 px: the tiny UNet's step stays well under a second on a CPU core
TRAIN_OPTS = {"batch_size": 4, "grad_accumulation_steps": 1, "learning_rate": 1e-4, "rank": 4,
              "optimizer": "AdamW", "loss_function": "MSE", "seed": 7, "training_dtype": "fp32",
              "lora_dtype": "fp32", "algorithm": "LoRA", "gradient_checkpointing": False, "checkpoint_depth": 1,
              "offloading": False, "existing_lora": "[None]"}


def clip_template(models: str) -> Any:
    """One real CLIP-L conditioning from the tiny text encoder (fp16), the template of every training sample."""
    import torch

    comfy_nodes = comfyui_nodes()

    add_model_folders(models)
    (clip,) = comfy_nodes.CLIPLoader().load_clip("tiny_clip_l.safetensors", "stable_diffusion")
    with torch.inference_mode():
        (cond,) = comfy_nodes.CLIPTextEncode().encode(clip, "a photo of a test pattern")
    c, extra = cond[0]
    return c.detach().to(torch.float16).clone(), extra["pooled_output"].detach().to(torch.float16).clone()


def prep_train(work: Path, n: int, clip_cond: Any) -> dict[str, str]:
    """N samples of a 16x16 latent + a CLIP-L conditioning (77x768 + pooled 768, fp16: ~120 KB a sample), written
    by the built-in SaveTrainingDataset and by our CacheWriter."""
    import torch

    import comfy_extras.nodes_dataset as nd
    from dataset_cache.dataset import Sample
    from dataset_cache.format import CacheWriter

    g = torch.Generator().manual_seed(1)
    base_c, base_p = clip_cond
    name = f"train-builtin-{n}"
    ours = work / f"train-ours-{n}"
    lats, conds, samples = [], [], []
    with CacheWriter(ours) as w:
        for i in range(n):
            lat = {"samples": torch.randn(TRAIN_LATENT, generator=g)}
            c = base_c.clone()
            c.view(-1)[:2] = torch.tensor([i & 0xFFF, i >> 12], dtype=c.dtype) * 1e-3
            cond = [[c, {"pooled_output": base_p.clone()}]]
            lk, ck = keys_of(i)
            w.add(lk, lat, kind="latent")
            w.add(ck, cond, kind="conditioning")
            samples.append(Sample(lk, (ck,)))
            lats.append(lat)
            conds.append(cond)
        w.set_dataset("train", samples)
    with torch.inference_mode():
        nd.SaveTrainingDataset.execute(latents=lats, conditioning=conds, folder_name=[name], shard_size=[1000])
    return {"builtin": name, "ours": str(ours)}


def child_train(kind: str, target: str, steps: int, work: Path, models: str) -> dict[str, Any]:
    """Train ``steps`` steps as ``kind`` ("ours" / "bound" / "builtin") from ``target`` in this fresh process: time
    to the first step, the step times from the third on, wall time and RSS."""
    comfy_setup(work)
    import torch

    comfy_nodes = comfyui_nodes()

    add_model_folders(models)
    torch.manual_seed(0)
    (model,) = comfy_nodes.UNETLoader().load_unet("tiny_sd15_unet.safetensors", "default")
    ends: list[float] = []
    import comfy_extras.nodes_train  # noqa: F401 - imported before the clock

    gc.collect()
    r0 = rss_mib()[0]
    t0 = time.perf_counter()
    with torch.inference_mode():
        if kind == "builtin":
            _train_builtin(model, target, steps, ends)
        else:
            _train_ours(kind, model, target, steps, ends)
    wall = time.perf_counter() - t0
    gc.collect()
    r1, peak = rss_mib()
    steps_dt = [b - a for a, b in zip(ends, ends[1:])]
    return {"first_s": ends[0] - t0 if ends else None, "steps": len(ends), "step_s": steps_dt[2:],
            "wall_s": wall, "peak_mib": peak, "r0_mib": r0, "rss_end_mib": r1}


def _train_builtin(model: Any, target: str, steps: int, ends: list[float]) -> None:
    """The built-in chain on the dataset folder ``target``; the end of each forward/backward appended to ``ends``."""
    import comfy_extras.nodes_dataset as nd
    import comfy_extras.nodes_train as nt

    orig = nt.TrainSampler.fwd_bwd

    def fwd_bwd(self: Any, *a: Any, **k: Any) -> Any:
        out = orig(self, *a, **k)
        ends.append(time.perf_counter())
        return out

    nt.TrainSampler.fwd_bwd = fwd_bwd
    lat, cond = nd.LoadTrainingDataset.execute(target).result
    blat, bcond = nd.ResolutionBucket.execute(lat, cond).result
    opts = {k: [v] for k, v in TRAIN_OPTS.items()}
    opts["existing_lora"] = ["[None]"]
    nt.TrainLoraNode.execute(
        [model], blat, bcond, steps=[steps], quantized_backward=[False], bucket_mode=[True],
        bypass_mode=[False], **opts)


def _train_ours(kind: str, model: Any, target: str, steps: int, ends: list[float]) -> None:
    """Our trainer on the cache ``target`` ("bound": every batch read first); each step's end appended to ``ends``."""
    from support.pack import import_pack

    pack = import_pack()
    lt = importlib.import_module(f"{pack.__name__}.nodes.training")
    handles = importlib.import_module(f"{pack.__name__}.nodes.handles")
    # one step more than timed: the loop reads a step's loss once the next step is queued, so its last report
    # follows the one before at once (no step) and is left out
    if kind == "bound":
        lt.run.PrefetchLoader = in_memory_loader(lt.run.PrefetchLoader, steps + 1)
    reader, samples = handles.StreamDatasetHandle(target, "train").open()
    try:
        settings = lt.TrainSettings(steps=steps + 1, prefetch_batches=2, loader_threads=0, **TRAIN_OPTS)
        # the trainer's public per-step callback marks the end of each step (one batch a step here)
        lt.train_lora(model, reader, samples, settings,
                      on_step=lambda _report: ends.append(time.perf_counter()))
    finally:
        reader.close()
    del ends[steps:]

"""Training the same cases on two devices in child processes, for ``tests/comfy/test_train_cuda.py``.

The in-process ComfyUI suite runs on the CPU (``args.cpu`` is set before ``comfy.model_management`` is imported),
so a run on CUDA needs a ComfyUI process of its own: :func:`prepare` writes every case's tiny model and caches
here, once, :func:`run_children` starts one child per device (``support.train_child``), each training every case
in sequence through the pack's Train LoRA node, and :func:`load_run` reads back what a child wrote. Both children
read the same files, so whatever differs between their LoRAs comes from the device.

Each :class:`Case` covers branches the trainer takes on the device: image and video latents, conditionings with
their extras (pooled output, guidance, reference latents, attention masks and rows run as separate model calls),
loss masks and mirrored rows, regularization rows with their loss weight, batches that hold rows of two caches.
"""

from __future__ import annotations

import hashlib
import json
import os
import subprocess
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from .tiny_families import FAMILIES, save_family_model
from .train_child import BOOTSTRAP

__all__ = ["CASES", "COMMON", "Case", "Run", "load_run", "prepare", "run_children", "variant"]

COMMON = {
    "batch_size": 2, "grad_accumulation_steps": 1, "steps": 3, "learning_rate": 1e-3, "rank": 4, "optimizer": "SGD",
    "loss_function": "MSE", "seed": 11, "training_dtype": "fp32", "lora_dtype": "fp32", "algorithm": "LoRA",
    "gradient_checkpointing": False, "checkpoint_depth": 1, "offloading": False, "existing_lora": "[None]",
    "prefetch_batches": 2, "loader_threads": 0,
}
"""Train LoRA's options for every case (a case's own override them): 3 steps at batch 2, fp32, SGD (its update is
``lr`` times the gradient, so a difference in any batch's gradient shows in the LoRA as it is)."""

TOKENS = (7, 12, 12, 20)  # caption lengths (LLM encoders do not pad): rows of 7 and 12 tokens cannot be joined


@dataclass(frozen=True)
class Case:
    """One training run of the comparison.

    Attributes:
        name: the case's id (test ids, the child's output folder).
        family: the tiny model family (``support.tiny_families.FAMILIES``).
        data: the cache it trains from: ``"buckets"`` (4 samples in 2 buckets with the family's conditionings),
            ``"video"`` (the same with 2-frame clip latents), ``"masks_mirrors"`` (every sample with a mirror, three
            with a loss mask), ``"reg_two_caches"`` (two datasets of two caches combined, and a regularization set).
        options: Train LoRA options on top of :data:`COMMON` and the family's own.
        lora: ``"random"``: the run continues a LoRA file of random up and down matrices (every parameter has a
            gradient from step 1); ``"fresh"``: the node creates the LoRA, as by default.
        high_vram: on CUDA, ComfyUI loads the model onto the device from the start (its ``--highvram`` state, which it
            also takes by itself where the free device memory exceeds the free RAM), so the LoRA the node creates is
            created there.
        validate: the run measures a validation loss on its own dataset (``val_dataset``; the images need not be
            held out to compare two devices).
        expect: what the batches must show for the case to cover its branch: ``"saved"`` (the summary names a save
            during the run), ``"sampled"`` (it names the sample images), ``"validated"`` (validation losses before
            the first step and after the last), ``"mirrored_mask"``, ``"reg_rows"``, ``"two_caches"``, ``"groups"``
            (a batch run as several model calls), ``"video"``, or a conditioning option (``"option:guidance"``).
    """

    name: str
    family: str
    data: str = "buckets"
    options: dict[str, Any] = field(default_factory=dict)
    lora: str = "random"
    high_vram: bool = False
    validate: bool = False
    expect: tuple[str, ...] = ()

    def settings(self) -> dict[str, Any]:
        return {**COMMON, **FAMILIES[self.family].train, **self.options}


CASES: tuple[Case, ...] = (
    # the node's default optimizer; a save after step 2 (the LoRA and AdamW's state off the device mid-run); a
    # learning-rate schedule set into the optimizer each step, logit-normal timesteps and a noise offset (drawn on
    # the loader's workers, copied to the device with the batch), gradients clipped and the weights averaged on the
    # device, and measured a validation loss of the average (swapped into the parameters on the device)
    Case("sd15_adamw", "sd15", options={"optimizer": "AdamW", "learning_rate": 1e-4, "save_every": 2,
                                        "lr_schedule": "cosine", "warmup_steps": 1,
                                        "timestep_sampling": "logit-normal", "noise_offset": 0.05,
                                        "max_grad_norm": 1.0, "ema_decay": 0.9},
         validate=True, expect=("saved", "validated")),
    # the LoRA the node creates by default, drawn where the model already is (--highvram), on the layers
    # train_layers chooses (adapters on the cross-attention only: ComfyUI's own, drawn again on the CPU); the loss
    # on the model's prediction (each row's scale drawn on a loader worker), multi-resolution noise (drawn there
    # too) and a sample image before the first step and after the last (ComfyUI's "ddim" on the device, which
    # reseeds torch's generators: the sampling restores the device's and the CPU's)
    Case("sd15_fresh_lora", "sd15", lora="fresh", high_vram=True,
         options={"train_layers": "attn2", "loss_target": "prediction", "multires_noise_iterations": 4,
                  "sample_count": 1, "sample_steps": 2, "sample_sampler": "ddim"},
         expect=("sampled",)),
    Case("sd15_masks_mirrors", "sd15", "masks_mirrors", options={"unmasked_weight": 0.1},
         expect=("mirrored_mask",)),
    Case("sd15_reg_two_caches", "sd15", "reg_two_caches", options={"reg_ratio": 1.0, "reg_weight": 0.5, "seed": 3,
                                                                   "min_snr_gamma": 5.0},
         expect=("reg_rows", "two_caches")),
    # Prodigy (its step size from the two sums it reads once a step) and adapters made with another alpha
    Case("sdxl_pooled", "sdxl", options={"optimizer": "Prodigy", "learning_rate": 1.0, "lora_alpha": 8.0},
         expect=("option:pooled_output",)),
    Case("flux_guidance", "flux", expect=("option:pooled_output", "option:guidance")),
    # noised in part of the schedule only (min_timestep / max_timestep: the draws mapped into its percents)
    Case("flux_kontext_reference", "flux_kontext", options={"min_timestep": 200, "max_timestep": 900},
         expect=("option:guidance", "option:reference_latents")),
    Case("lumina2_attention_mask", "lumina2", expect=("option:attention_mask", "groups")),
    Case("wan21_video", "wan21", "video", expect=("video",)),
    # every block its own checkpoint on the device: torch's non-reentrant form (exact) and the reentrant one (fast);
    # memory "no offload", pinned: what auto checkpoints depends on the batch size and the memory free (at batch 1
    # it would keep these tiny models' blocks whole: the uncheckpointed path of the cases above)
    Case("sd15_checkpointed", "sd15", options={"gradient_checkpointing": True, "memory": "no offload"}),
    Case("flux_fast_checkpoint", "flux", options={"gradient_checkpointing": True, "checkpoint_mode": "fast",
                                                  "memory": "no offload"}, expect=("option:guidance",)),
)


# ------------------------------------------------------------------------------------------------ the caches
def _writer(root: Path) -> Any:
    from dataset_cache.format.writer import CacheWriter

    return CacheWriter(root)


def _sample(latent: str, caption: str, **kw: Any) -> Any:
    from dataset_cache.dataset import Sample

    return Sample(latent, (caption,), **kw)


def _key(tag: str, i: int) -> str:
    """A 32-hex-digit entry key; the tag keeps the kinds' and caches' keys apart."""
    return hashlib.blake2b(f"{tag}{i}".encode(), digest_size=16).hexdigest()


def _buckets(case: Case, root: Path, frames: int = 0) -> dict[str, Any]:
    """Four samples: three of the family's latent shape and one a half wider (a second bucket)."""
    import torch

    fam = FAMILIES[case.family]
    latent = fam.latent if not frames else (*fam.latent[:2], frames, *fam.latent[-2:])
    wide = (*latent[:-1], latent[-1] * 3 // 2)
    gen = torch.Generator().manual_seed(1)
    samples = []
    with torch.inference_mode(), _writer(root) as writer:
        for i, (shape, tokens) in enumerate(zip((latent, latent, latent, wide), TOKENS)):
            writer.add(_key("l", i), {"samples": torch.randn(shape, generator=gen)}, kind="latent")
            writer.add(_key("c", i), fam.conditioning(gen, tokens), kind="conditioning")
            samples.append(_sample(_key("l", i), _key("c", i), source=f"img{i}.png"))
        writer.set_dataset("train", samples)
    return {"dataset": {"parts": [[str(root), "train", 1]]}}


def _masks_mirrors(case: Case, root: Path) -> dict[str, Any]:
    """Four 64×64 samples, each with its mirrored latent; three with a loss mask of every byte value's kind (0, 255,
    in between) that is not its own mirror image, so a mirrored row's mask must be flipped to match."""
    import torch

    fam = FAMILIES[case.family]
    gen = torch.Generator().manual_seed(2)
    samples = []
    with torch.inference_mode(), _writer(root) as writer:
        for i in range(4):
            latent = torch.randn(fam.latent, generator=gen)
            writer.add(_key("l", i), {"samples": latent}, kind="latent")
            writer.add(_key("m", i), {"samples": latent.flip(-1)}, kind="latent")
            writer.add(_key("c", i), fam.conditioning(gen, 77), kind="conditioning")
            mask = None
            if i < 3:
                values = torch.randint(0, 256, (1, 1, *fam.latent[-2:]), generator=gen, dtype=torch.uint8)
                values[..., : fam.latent[-1] // 2] = 0  # the left half left out, the right half weighted
                values[..., -1] = 255
                writer.add(_key("k", i), {"mask": values}, kind="mask")
                mask = _key("k", i)
            samples.append(_sample(_key("l", i), _key("c", i), source=f"img{i}.png", mirror=_key("m", i), mask=mask))
        writer.set_dataset("train", samples)
    return {"dataset": {"parts": [[str(root), "train", 1]]}}


def _reg_two_caches(case: Case, root: Path) -> dict[str, Any]:
    """Cache A holds "train" (3 samples), cache B "more" (2) and "reg" (2), all one bucket: the main dataset is
    train + more (two caches), the regularization set is B's "reg"."""
    import torch

    fam = FAMILIES[case.family]
    gen = torch.Generator().manual_seed(3)
    caches = {"a": root / "a", "b": root / "b"}
    keys: dict[str, list[str]] = {"a": [], "b": []}
    for cache, datasets in (("a", (("train", 3),)), ("b", (("more", 2), ("reg", 2)))):
        with torch.inference_mode(), _writer(caches[cache]) as writer:
            for name, count in datasets:
                samples = []
                for i in range(count):
                    lat, cap = _key(f"{cache}{name}l", i), _key(f"{cache}{name}c", i)
                    writer.add(lat, {"samples": torch.randn(fam.latent, generator=gen)}, kind="latent")
                    writer.add(cap, fam.conditioning(gen, 77), kind="conditioning")
                    samples.append(_sample(lat, cap, source=f"{name}{i}.png"))
                    keys[cache].append(lat)
                writer.set_dataset(name, samples)
    return {"dataset": {"parts": [[str(caches["a"]), "train", 1], [str(caches["b"]), "more", 1]]},
            "reg": {"parts": [[str(caches["b"]), "reg", 1]]}, "cache_keys": [keys["a"], keys["b"]]}


_DATA = {"buckets": _buckets, "video": lambda case, root: _buckets(case, root, frames=2),
         "masks_mirrors": _masks_mirrors, "reg_two_caches": _reg_two_caches}


def prepare(cases: tuple[Case, ...], folder: Path, models: dict[str, Path] | None = None) -> list[dict[str, Any]]:
    """Write each case's tiny model (once per family) and caches under ``folder``; return the plan's cases.

    ``models`` (family → model file) is filled as models are written, so several calls share them.
    """
    from .pack import import_library

    import_library()  # the cache writer, as top-level ``dataset_cache``
    models = {} if models is None else models
    planned = []
    for case in cases:
        if case.family not in models:
            models[case.family] = save_family_model(FAMILIES[case.family], folder / "models")
        data = _DATA[case.data](case, folder / "caches" / case.name)
        if case.validate:
            data["val"] = data["dataset"]
        planned.append({"name": case.name, "model": str(models[case.family]), "options": case.settings(),
                        "lora": case.lora, "lora_seed": 5, "high_vram": case.high_vram, **data})
    return planned


def variant(planned: dict[str, Any], name: str, **options: Any) -> dict[str, Any]:
    """A planned case trained with other options (same model and caches), under another name."""
    return {**planned, "name": name, "options": {**planned["options"], **options}}


# ------------------------------------------------------------------------------------------------ the children
def run_children(comfy_path: Path, python: Path, folder: Path, plans: dict[str, tuple[str, list[dict[str, Any]]]],
                 threads: dict[str, int], timeout: float = 900) -> dict[str, Path]:
    """Start one child per entry of ``plans`` (label → (device, planned cases)) at once and wait for them all.

    ``threads``: torch's intra-op threads per device (two children on the CPU share its cores). Returns label →
    output folder.

    Raises:
        RuntimeError: a child failed or timed out (its output's tail in the message).
    """
    support = Path(__file__).resolve().parent
    procs = {}
    outs = {}
    for label, (device, cases) in plans.items():
        out = folder / label
        out.mkdir(parents=True)
        plan = out / "plan.json"
        plan.write_text(json.dumps({"comfyui": str(comfy_path), "threads": threads, "cases": cases}, indent=1))
        cwd = out / "cwd"  # an empty folder: nothing there can shadow a module
        cwd.mkdir()
        env = {**os.environ, "PYTHONUNBUFFERED": "1"}
        log = (out / "log.txt").open("w")
        procs[label] = (subprocess.Popen([str(python), "-c", BOOTSTRAP, str(support), str(plan), device,
                                          str(out)], cwd=cwd, env=env, stdout=log, stderr=subprocess.STDOUT), log)
        outs[label] = out
    failures = []
    for label, (proc, log) in procs.items():
        try:
            rc = proc.wait(timeout=timeout)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()
            rc = "timed out"
        log.close()
        if rc != 0:
            tail = (outs[label] / "log.txt").read_text(errors="replace")[-4000:]
            failures.append(f"child {label!r} ({plans[label][0]}) exited {rc}:\n{tail}")
    if failures:
        raise RuntimeError("\n".join(failures))
    return outs


@dataclass
class Run:
    """What one child did for one case (``report["error"]`` when it failed)."""

    report: dict[str, Any]
    initial: dict[str, Any] = field(default_factory=dict)
    grads: list[dict[str, Any]] = field(default_factory=list)
    lora: dict[str, Any] = field(default_factory=dict)
    device: dict[str, Any] = field(default_factory=dict)


def load_run(out: Path, name: str) -> Run:
    """Read back what the child writing ``out`` did for case ``name``."""
    from safetensors.torch import load_file

    report = json.loads((out / name / "report.json").read_text())
    device = json.loads((out / "device.json").read_text())
    if "error" in report:
        return Run(report, device=device)
    grads = load_file(str(out / name / "grads.safetensors"))
    steps: list[dict[str, Any]] = [{} for _ in range(len(report["losses"]))]
    for key, value in grads.items():
        step, param = key.split("/", 1)
        steps[int(step[4:]) - 1][param] = value
    return Run(report, load_file(str(out / name / "initial.safetensors")), steps,
               load_file(str(out / name / "lora.safetensors")), device)

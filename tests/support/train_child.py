"""The child process of the device comparison (``tests/comfy/test_train_cuda.py``): ComfyUI on ONE device trains
every case of a plan through the pack's Train LoRA node and writes down what it did.

A child process because ComfyUI picks its device once, when ``comfy.model_management`` is imported (the in-process
suite imports it with ``args.cpu`` set). :func:`support.device_training.run_children` starts this module as
``<ComfyUI's python> -c <bootstrap> SUPPORT PLAN DEVICE OUT`` in an empty folder, which ``-c`` puts first on
``sys.path``: neither the pack root (whose ``nodes/`` would shadow ComfyUI's ``nodes.py``) nor ``tests/support``
(whose ``server.py`` would shadow ComfyUI's) is on it; the bootstrap registers ``support`` from its folder, as
``bench/run_comfyui.py`` does.

Both devices load the same fp32 weights (``--fp32-unet``: on a GPU ComfyUI would store them in fp16 or bf16) and
compute in fp32; on CUDA, TF32 is off for matmuls and cuDNN convolutions (PyTorch allows it for cuDNN by default),
so both devices compute in IEEE fp32 and differ only in the order of their sums.

Per case it writes ``OUT/<case>/``: ``lora.safetensors`` (the node's LoRA), ``initial.safetensors`` (every LoRA
parameter just before the first optimizer step), ``grads.safetensors`` (``step<t>/<key>``: every gradient the
optimizer saw) and ``report.json`` (losses, the node's summary, each batch's plan and where its tensors were, the
number of model calls per batch, or the error). A failing case is recorded and the next one runs.
"""

from __future__ import annotations

import gc
import json
import sys
import time
import traceback
from pathlib import Path
from typing import Any

__all__ = ["BOOTSTRAP", "main"]

BOOTSTRAP = """
import importlib.util, sys
folder = sys.argv.pop(1)
spec = importlib.util.spec_from_file_location("support", folder + "/__init__.py", submodule_search_locations=[folder])
module = importlib.util.module_from_spec(spec)
sys.modules["support"] = module
spec.loader.exec_module(module)
from support.train_child import main
raise SystemExit(main(sys.argv[1:]))
"""
"""What ``python -c`` runs: ``argv[1]`` is the ``tests/support`` folder, the rest goes to :func:`main`."""


def _setup_comfy(comfy_path: Path, device: str, work: Path) -> Any:
    """Import ComfyUI for ``device`` with private folders; return ``torch``."""
    sys.path.insert(0, str(comfy_path))
    from comfy.cli_args import args

    args.cpu = device == "cpu"
    args.fp32_unet = True  # UNETLoader's "default" would store the weights in fp16/bf16 on a GPU
    import torch

    if device == "cuda":
        torch.backends.cuda.matmul.allow_tf32 = False  # IEEE fp32, as on the CPU
        torch.backends.cudnn.allow_tf32 = False  # PyTorch's default is True for convolutions
    import comfy.model_management
    import folder_paths

    found = comfy.model_management.get_torch_device().type
    if found != device:
        raise RuntimeError(f"ComfyUI chose the device {found!r}, this child was asked for {device!r}")
    for sub in ("models", "output", "input", "temp", "loras"):
        (work / sub).mkdir(parents=True, exist_ok=True)
    folder_paths.models_dir = str(work / "models")
    folder_paths.set_output_directory(str(work / "output"))
    folder_paths.set_input_directory(str(work / "input"))
    folder_paths.set_temp_directory(str(work / "temp"))
    folder_paths.add_model_folder_path("loras", str(work / "loras"), is_default=True)
    return torch


class _Recorder:
    """Spies on the trainer (nothing it computes changes): the optimizer's view of each step, each batch's plan and
    devices, the number of model calls per batch."""

    def __init__(self, torch: Any, training: Any) -> None:
        from torch.optim.optimizer import register_optimizer_step_pre_hook

        self.torch = torch
        self.initial: list[Any] = []
        self.grads: list[list[Any]] = []
        self.no_grad: list[list[int]] = []
        self.batches: list[dict[str, Any]] = []
        self.adapters_on = ""
        self._groups: list[int] = []
        register_optimizer_step_pre_hook(self._before_step)
        loop, conditioner = training.loop.StepLoop, training.conditioning.Conditioner
        real_step, real_condition, real_load = loop._fwd_bwd, conditioner.__call__, training.run.load
        recorder = self

        def load(*args: Any, **kwargs: Any) -> Any:
            run = real_load(*args, **kwargs)
            recorder.adapters_on = next(iter(run.lora_sd.values())).device.type  # where the adapters were made
            return run

        def fwd_bwd(self: Any, batch: Any, index: int) -> float:
            record = recorder._batch(batch)
            loss = real_step(self, batch, index)
            record["model_calls"] = recorder._groups[-1]
            return loss

        def condition(self: Any, *args: Any, **kwargs: Any) -> Any:
            groups = real_condition(self, *args, **kwargs)
            recorder._groups.append(len(groups))
            return groups

        loop._fwd_bwd = fwd_bwd
        conditioner.__call__ = condition
        training.run.load = load

    def reset(self) -> None:
        self.initial, self.grads, self.no_grad, self.batches, self._groups = [], [], [], [], []
        self.adapters_on = ""

    def _before_step(self, optimizer: Any, _args: Any, _kwargs: Any) -> None:
        params = [p for group in optimizer.param_groups for p in group["params"]]
        if not self.grads:
            self.initial = [p.detach().to("cpu", copy=True) for p in params]
        self.grads.append([p.grad.detach().to("cpu", copy=True) if p.grad is not None
                           else self.torch.zeros(p.shape, dtype=p.dtype) for p in params])
        self.no_grad.append([i for i, p in enumerate(params) if p.grad is None])

    def _batch(self, batch: Any) -> dict[str, Any]:
        plan = batch.plan
        devices: set[str] = set()
        options: set[str] = set()

        def walk(value: Any) -> None:
            if isinstance(value, self.torch.Tensor):
                devices.add(value.device.type)
            elif isinstance(value, (list, tuple)):
                for v in value:
                    walk(v)
            elif isinstance(value, dict):
                for v in value.values():
                    walk(v)

        for conditioning in batch.conditioning:
            walk(conditioning)
            options.update(conditioning[0][1])
        record = {
            "epoch": plan.epoch, "index": plan.index, "latent_keys": list(plan.latent_keys),
            "caption_keys": list(plan.caption_keys), "mirrored": list(plan.mirrored), "mask_keys": list(plan.mask_keys),
            "weights": list(plan.weights), "latents": list(batch.latents.shape), "options": sorted(options),
            "devices": {"latents": batch.latents.device.type, "conditioning": sorted(devices),
                        "masks": None if batch.masks is None else batch.masks.device.type},
        }
        self.batches.append(record)
        return record


def _handle(handles: Any, spec: dict[str, Any] | None) -> Any:
    if spec is None:
        return None
    parts = [handles.DatasetRef(root, name, repeats) for root, name, repeats in spec["parts"]]
    if len(parts) == 1 and parts[0].repeats == 1:
        return handles.StreamDatasetHandle(parts[0].cache_root, parts[0].name)
    return handles.CombinedDatasetHandle(tuple(parts))


def _random_lora(torch: Any, model: Any, rank: int, seed: int, path: Path) -> None:
    """A LoRA file for every module the trainer adapts, with random up AND down matrices (drawn on the CPU, so the
    same on every device): every parameter then has a gradient from the first step on."""
    from safetensors.torch import save_file

    gen = torch.Generator().manual_seed(seed)
    lora = {}
    for name, module in model.model.named_modules():
        weight = getattr(module, "weight", None)
        if hasattr(module, "weight_function") and weight is not None and weight.ndim >= 2:
            lora[f"{name}.lora_up.weight"] = torch.randn(weight.shape[0], rank, generator=gen) * 0.05
            lora[f"{name}.lora_down.weight"] = torch.randn(rank, weight.shape[1:].numel(), generator=gen) * 0.05
    save_file(lora, str(path))


def _train(torch: Any, pack: Any, case: dict[str, Any], work: Path) -> Any:
    """Load the case's model with ComfyUI's UNETLoader and run Train LoRA on it as ComfyUI runs a node."""
    import comfy.model_management as management
    import folder_paths
    import nodes

    handles = sys.modules[f"{pack.__name__}.nodes.handles"]
    node = sys.modules[f"{pack.__name__}.nodes.train_lora"].TrainLoRA
    model_file = Path(case["model"])
    folder_paths.add_model_folder_path("diffusion_models", str(model_file.parent))
    vram_state = management.vram_state
    if case["high_vram"] and management.get_torch_device().type == "cuda":
        management.vram_state = management.VRAMState.HIGH_VRAM  # what --highvram sets when ComfyUI starts
    try:
        (model,) = nodes.UNETLoader().load_unet(model_file.name, "default")
        options = dict(case["options"])
        if case["lora"] == "random":
            name = f"start_{case['name']}.safetensors"  # no step count in the name: the run starts at step 0
            _random_lora(torch, model, options["rank"], case["lora_seed"], work / "loras" / name)
            options["existing_lora"] = name
        with torch.inference_mode():  # as ComfyUI runs every node
            return node.execute(model, _handle(handles, case["dataset"]), reg_dataset=_handle(handles, case.get("reg")),
                                val_dataset=_handle(handles, case.get("val")), **options)
    finally:
        management.vram_state = vram_state


def _write(recorder: _Recorder, result: Any, out: Path, seconds: float) -> None:
    """The LoRA, the recorded tensors and the report of one case into ``out``."""
    from safetensors.torch import save_file

    lora, loss_map, steps = result.result[:3]
    keys = list(lora)
    if len(recorder.initial) != len(keys):
        raise RuntimeError(f"the optimizer holds {len(recorder.initial)} parameters, the LoRA {len(keys)}")
    out.mkdir(parents=True, exist_ok=True)
    save_file({k: v.contiguous() for k, v in lora.items()}, str(out / "lora.safetensors"))
    save_file(dict(zip(keys, recorder.initial)), str(out / "initial.safetensors"))
    save_file({f"step{t}/{k}": g for t, grads in enumerate(recorder.grads, 1) for k, g in zip(keys, grads)},
              str(out / "grads.safetensors"))
    ui = result.ui if isinstance(result.ui, dict) else result.ui.as_dict()
    report = {"losses": loss_map["loss"], "val_losses": loss_map.get("val_loss", []), "steps": steps,
              "summary": ui["text"][0], "batches": recorder.batches,
              "no_grad": [[keys[i] for i in step] for step in recorder.no_grad], "adapters_on": recorder.adapters_on,
              "seconds": round(seconds, 1)}
    (out / "report.json").write_text(json.dumps(report, indent=1))


def main(argv: list[str]) -> int:
    """``PLAN DEVICE OUT``: train every case of the JSON plan on ``DEVICE`` (``cpu``/``cuda``) into ``OUT``."""
    plan_path, device, out_arg = argv
    plan = json.loads(Path(plan_path).read_text())
    out = Path(out_arg)
    work = out / "_comfy"
    torch = _setup_comfy(Path(plan["comfyui"]), device, work)
    torch.set_num_threads(plan["threads"][device])
    from support.pack import import_pack

    pack = import_pack()
    training = sys.modules[f"{pack.__name__}.nodes.training"]
    recorder = _Recorder(torch, training)
    import comfy.model_management

    for case in plan["cases"]:
        recorder.reset()
        start = time.perf_counter()
        try:
            _write(recorder, _train(torch, pack, case, work), out / case["name"], time.perf_counter() - start)
        except Exception:
            (out / case["name"]).mkdir(parents=True, exist_ok=True)
            (out / case["name"] / "report.json").write_text(json.dumps({"error": traceback.format_exc()}))
        gc.collect()
        comfy.model_management.soft_empty_cache()
    flags = {"torch": torch.__version__, "threads": torch.get_num_threads()}
    if device == "cuda":  # read after the runs: nothing turned TF32 back on
        flags.update(name=torch.cuda.get_device_name(), matmul_tf32=torch.backends.cuda.matmul.allow_tf32,
                     cudnn_tf32=torch.backends.cudnn.allow_tf32)
    (out / "device.json").write_text(json.dumps(flags))
    return 0

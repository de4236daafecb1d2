"""Adafactor (``dataset_cache/adafactor.py``) against ``transformers.optimization.Adafactor`` (the reference kohya's
sd-scripts and FluxGym use; transformers is one of ComfyUI's requirements, so this runs under ComfyUI's python), and
``optimizer`` Adafactor through Train LoRA on the real ComfyUI (CPU, tiny SD1.5)."""

from __future__ import annotations

import importlib
from pathlib import Path
from types import ModuleType
from typing import Any

import pytest
import torch
from support.train_options import SHORT_RUN, save_lora, summary, train

SHAPES = [(32, 4), (4, 48), (8, 4, 3, 3), (32,), ()]
"""A LoRA's up and down, a convolution's down as a 4-D kernel, a norm's diff, an alpha."""
SETTINGS = {
    "kohya's": {"lr": 1e-3, "relative_step": False, "scale_parameter": False, "warmup_init": False},
    "transformers' defaults": {"lr": None},
    "scaled, first moment, decay": {"lr": 1e-3, "relative_step": False, "scale_parameter": True, "beta1": 0.9,
                                    "weight_decay": 0.01, "warmup_init": False},
    "warm-up": {"lr": None, "warmup_init": True},
}


def _params(dtype: torch.dtype) -> list[torch.nn.Parameter]:
    g = torch.Generator().manual_seed(0)
    return [torch.nn.Parameter(torch.randn(s, generator=g).to(dtype)) for s in SHAPES]


def _steps(make: Any, dtype: torch.dtype, steps: int = 5) -> list[list[torch.Tensor]]:
    """The parameters after each of ``steps`` steps with the same seeded gradients."""
    params = _params(dtype)
    optimizer = make(params)
    g = torch.Generator().manual_seed(1)
    out = []
    for _ in range(steps):
        for p in params:
            p.grad = torch.randn(p.shape, generator=g).to(dtype)
        optimizer.step()
        out.append([p.detach().clone() for p in params])
    return out


@pytest.mark.parametrize("name", list(SETTINGS))
def test_each_step_is_transformers(pack: ModuleType, name: str) -> None:
    """The same elementwise operations on the same fp32 values in the same order, and on the CPU the same norm
    kernel per tensor (the fused norm's fallback), so the weights after each step are transformers' bit for bit, in
    fp32 and in bf16 (each step rounds the same fp32 result). The one difference is a weight decay: ours multiplies
    the weight by the step size and then by the decay, transformers by their product, so the term ``wd·α·p``
    (1e-5 of the weight) may round once differently: 1e-6 relative in fp32; in bf16 that can move a value on a
    rounding boundary one bf16 step (2⁻⁸ relative)."""
    from transformers.optimization import Adafactor as Reference

    ours = importlib.import_module(f"{pack.__name__}.dataset_cache.adafactor").Adafactor
    settings = SETTINGS[name]
    decayed = bool(settings.get("weight_decay"))
    for dtype, rtol in ((torch.float32, 1e-6), (torch.bfloat16, 2 ** -7)):
        want = _steps(lambda p: Reference(p, **settings), dtype)
        got = _steps(lambda p: ours(p, **settings), dtype)
        for step, (w, o) in enumerate(zip(want, got)):
            for shape, a, b in zip(SHAPES, w, o):
                assert a.dtype == b.dtype == dtype
                if decayed:
                    torch.testing.assert_close(b, a, rtol=rtol, atol=1e-7, msg=f"{name} {dtype} {step} {shape}")
                else:
                    assert torch.equal(b, a), (name, dtype, step, shape)
        if dtype == torch.float32:  # (warm-up's first steps, 1e-6·t, are below a bf16 weight's resolution)
            assert not torch.equal(got[-1][0], _params(dtype)[0])  # it moved


def test_the_state_is_factored_and_reads_back_nothing(pack: ModuleType) -> None:
    """A matrix keeps its row and column means (the slots' shapes ``factored_shapes`` gives, what a saved state is
    checked against), a vector its whole moment; the step count lives in the parameter group; no step reads a
    tensor's value back to the host (counted with a dispatch mode: no ``.item()``-like op)."""
    from torch.utils._python_dispatch import TorchDispatchMode

    module = importlib.import_module(f"{pack.__name__}.dataset_cache.adafactor")
    params = _params(torch.float32)
    optimizer = module.Adafactor(params, **SETTINGS["scaled, first moment, decay"])
    for p in params:
        p.grad = torch.ones_like(p)

    class Reads(TorchDispatchMode):
        reads = 0

        def __torch_dispatch__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
            Reads.reads += "_local_scalar_dense" in str(func)
            return func(*args, **(kwargs or {}))

    with Reads():
        optimizer.step()
        optimizer.step()
    assert Reads.reads == 0
    assert optimizer.param_groups[0]["step"] == 2
    for p, shape in zip(params, SHAPES):
        state = optimizer.state[p]
        assert {k: tuple(v.shape) for k, v in state.items() if k != "exp_avg"} == module.factored_shapes(shape)
        assert tuple(state["exp_avg"].shape) == shape
    for bad in ({"lr": 1e-3}, {"lr": None, "relative_step": False}, {"lr": 1e-3, "relative_step": False,
                                                                      "warmup_init": True}, {"lr": -1.0}):
        with pytest.raises(ValueError, match="Adafactor: "):
            module.Adafactor(params, **bad)









BASE = {**SHORT_RUN, "optimizer": "Adafactor", "learning_rate": 1e-3}
"""This file's short run: Adafactor at kohya's Flux rate."""


def _train(node: type, model: Any, dataset: Any, **options: Any) -> Any:
    return train(node, model, dataset, BASE, **options)


@pytest.mark.parametrize(("args", "lora_dtype"), [("", "fp32"), ("beta1=0.9 scale_parameter=True", "fp32"),
                                                  ("beta1=0.9", "bf16")])
def test_train_lora_with_adafactor_continues_bit_for_bit(train_node: type, models: tuple, six_images: Any,
                                                         lora_folder: Path, args: str, lora_dtype: str) -> None:
    """kohya's settings by default (learning_rate is the step size), or with a first moment and scaled steps: 3
    steps, Save LoRA Weights, 3 more from the file == 6 at once, bit for bit (the factored moments come back from
    the training state, the step count from its parameter group). A bf16 LoRA's moments are fp32 and come back fp32
    (torch's load_state_dict rounded them to bf16 once, and every later step then kept them in bf16)."""
    whole = _train(train_node, models[0], six_images, steps=6, optimizer_args=args, lora_dtype=lora_dtype).result
    first = _train(train_node, models[0], six_images, optimizer_args=args, lora_dtype=lora_dtype)
    assert "training state saved as" in summary(first)
    name = save_lora(first.result[0], first.result[2], "loras/adafactor")
    rest = _train(train_node, models[0], six_images, existing_lora=name, optimizer_args=args, lora_dtype=lora_dtype)
    assert "Adafactor state restored" in summary(rest) and "NOTE" not in summary(rest)
    assert first.result[1]["loss"] + rest.result[1]["loss"] == whole[1]["loss"]
    assert all(torch.equal(rest.result[0][k], whole[0][k]) for k in whole[0])
    assert any(not torch.equal(whole[0][k], first.result[0][k]) for k in whole[0])


def test_adafactors_own_step_size_is_named_and_bad_settings_refused(train_node: type, models: tuple,
                                                                     six_images: Any) -> None:
    out = _train(train_node, models[0], six_images, steps=1, optimizer_args="relative_step=True scale_parameter=True")
    assert "relative_step=True finds its own step size" in summary(out)
    assert out.result[0].metadata["ss_optimizer"] == "Adafactor(relative_step=True,scale_parameter=True)"
    for args, message in (("warmup_init=True", "warmup_init=True needs relative_step=True"),
                          ("decay_rate=0.5", "invalid decay_rate 0.5"),
                          ("betas=0.9,0.99", "Adafactor has no setting 'betas'; its settings: eps, clip_threshold")):
        with pytest.raises(ValueError, match=message):
            _train(train_node, models[0], six_images, optimizer_args=args)

"""``optimizer`` Lion8bit through Train LoRA on the real ComfyUI (CPU, tiny SD1.5): the run steps with our
``dataset_cache.lion8bit.Lion8bit`` (bitsandbytes' arithmetic, checked against it in ``tests/unit/test_lion8bit.py``)
with bitsandbytes' defaults or ``optimizer_args``, a continued run trains what one uninterrupted run trains, bit for
bit, its 8-bit state saved and read back, and bad settings are refused by name."""

from __future__ import annotations

import importlib
from pathlib import Path
from types import ModuleType
from typing import Any

import pytest
import torch
from support.train_options import SHORT_RUN, save_lora, summary, train

BASE = {**SHORT_RUN, "optimizer": "Lion8bit", "learning_rate": 1e-4}
EIGHT_BIT = "min_8bit_size=128"
"""The tiny model's LoRA tensors hold 128 to 1,280 weights: under bitsandbytes' 4,096 all would keep fp32 moments,
so the runs that must show the 8-bit state lower the threshold (a bitsandbytes setting too)."""


def _train(node: type, model: Any, dataset: Any, **options: Any) -> Any:
    return train(node, model, dataset, BASE, **options)


def test_the_run_steps_with_our_lion8bit_and_its_settings(pack: ModuleType, train_node: type, models: tuple,
                                                          six_images: Any, monkeypatch: pytest.MonkeyPatch) -> None:
    """The optimizer the run makes is ours with bitsandbytes' defaults (betas 0.9 and 0.99, no weight decay) or the
    given settings; tensors of at least ``min_8bit_size`` weights keep uint8 code indices, the others an fp32
    moment; the LoRA file names the optimizer as kohya's ``ss_optimizer`` does."""
    module = importlib.import_module(f"{pack.__name__}.dataset_cache.lion8bit")
    made: list[Any] = []
    step = module.Lion8bit.step

    def spy(self: Any, closure: Any = None) -> Any:
        made.append(self)
        return step(self, closure)

    monkeypatch.setattr(module.Lion8bit, "step", spy)
    plain = _train(train_node, models[0], six_images, steps=1)
    group = made[-1].param_groups[0]
    assert (group["weight_decay"], group["betas"], group["lr"]) == (0.0, (0.9, 0.99), 1e-4)
    assert plain.result[0].metadata["ss_optimizer"] == "Lion8bit"
    chosen = _train(train_node, models[0], six_images, steps=1,
                    optimizer_args=f"weight_decay=0.1 betas=0.8,0.95 {EIGHT_BIT}")
    group = made[-1].param_groups[0]
    assert (group["weight_decay"], group["betas"], group["min_8bit_size"]) == (0.1, (0.8, 0.95), 128)
    kinds = {("exp_avg_q" in s, p.numel() >= 128) for p, s in made[-1].state.items()}
    assert kinds == {(True, True), (False, False)}
    assert (chosen.result[0].metadata["ss_optimizer"]  # optimizer_args' numbers are floats, as written back
            == "Lion8bit(weight_decay=0.1,betas=(0.8, 0.95),min_8bit_size=128.0)")


@pytest.mark.parametrize("lora_dtype", ["fp32", "bf16"])
def test_train_lora_with_lion8bit_continues_bit_for_bit(train_node: type, models: tuple, six_images: Any,
                                                        lora_folder: Path, lora_dtype: str) -> None:
    """3 steps, Save LoRA Weights, 3 more from the file == 6 at once, bit for bit: the code indices, block scales,
    fp32 moments and per-tensor step counts come back from the training state (a bf16 LoRA's scales and moments as
    fp32)."""
    opts = {"optimizer_args": EIGHT_BIT, "lora_dtype": lora_dtype}
    whole = _train(train_node, models[0], six_images, steps=6, **opts).result
    first = _train(train_node, models[0], six_images, **opts)
    assert "training state saved as" in summary(first)
    name = save_lora(first.result[0], first.result[2], "loras/lion8bit")
    rest = _train(train_node, models[0], six_images, existing_lora=name, **opts)
    assert "Lion8bit state restored" in summary(rest) and "NOTE" not in summary(rest)
    assert first.result[1]["loss"] + rest.result[1]["loss"] == whole[1]["loss"]
    assert all(torch.equal(rest.result[0][k], whole[0][k]) for k in whole[0])
    assert any(not torch.equal(whole[0][k], first.result[0][k]) for k in whole[0])


def test_bad_lion8bit_settings_are_refused_before_anything_loads(train_node: type, six_images: Any) -> None:
    for args, message in (("eps=1e-8", "Lion8bit has no setting 'eps'; its settings: betas, weight_decay, "
                                       "min_8bit_size"),
                          ("betas=0.9,1.0", r"Lion8bit: invalid betas\[1\] 1.0"),
                          ("weight_decay=-1", "Lion8bit: invalid weight_decay -1")):
        with pytest.raises(ValueError, match=message):
            _train(train_node, "not a model: refused before it is used", six_images, optimizer_args=args)

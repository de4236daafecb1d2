"""``optimizer`` AdamW8bit and Lion8bit through Train LoRA on the real ComfyUI (CPU, tiny SD1.5): the run steps with
our ``dataset_cache.adamw8bit.AdamW8bit`` or ``dataset_cache.lion8bit.Lion8bit`` (bitsandbytes' arithmetic, checked
against it in ``tests/unit/test_adamw8bit.py`` and ``test_lion8bit.py``) with bitsandbytes' defaults or
``optimizer_args``, a continued run trains what one uninterrupted run trains, bit for bit, its 8-bit state saved and
read back, and bad settings are refused by name. (A run continued twice: ``test_continued_twice.py``.)"""

from __future__ import annotations

import importlib
from dataclasses import dataclass
from pathlib import Path
from types import ModuleType
from typing import Any

import pytest
import torch
from support.train_options import SHORT_RUN, save_lora, summary, train

EIGHT_BIT = "min_8bit_size=128"
"""The tiny model's LoRA tensors hold 128 to 1,280 weights: under bitsandbytes' 4,096 all would keep fp32 moments,
so the runs that must show the 8-bit state lower the threshold (a bitsandbytes setting too)."""


@dataclass(frozen=True)
class Case:
    """One optimizer: its module, rate, bitsandbytes' defaults, settings to give and the ones it refuses."""

    name: str
    module: str
    rate: float
    defaults: dict[str, Any]
    given: str
    given_back: dict[str, Any]
    refused: tuple[tuple[str, str], ...]


CASES = [
    Case("AdamW8bit", "adamw8bit", 1e-3, {"weight_decay": 0.01, "betas": (0.9, 0.999)},
         "weight_decay=0.1 betas=0.8,0.99", {"weight_decay": 0.1, "betas": (0.8, 0.99)},
         (("percentile_clipping=5", "AdamW8bit has no setting 'percentile_clipping'; its settings: betas, eps, "
                                    "weight_decay, min_8bit_size"),
          ("betas=1.0,0.999", r"AdamW8bit: invalid betas\[0\] 1.0"),
          ("min_8bit_size=0", "AdamW8bit: invalid min_8bit_size 0"))),
    Case("Lion8bit", "lion8bit", 1e-4, {"weight_decay": 0.0, "betas": (0.9, 0.99)},
         "weight_decay=0.1 betas=0.8,0.95", {"weight_decay": 0.1, "betas": (0.8, 0.95)},
         (("eps=1e-8", "Lion8bit has no setting 'eps'; its settings: betas, weight_decay, min_8bit_size"),
          ("betas=0.9,1.0", r"Lion8bit: invalid betas\[1\] 1.0"),
          ("weight_decay=-1", "Lion8bit: invalid weight_decay -1"))),
]


@pytest.fixture(params=CASES, ids=[c.name for c in CASES])
def case(request: pytest.FixtureRequest) -> Case:
    return request.param


def _train(node: type, model: Any, dataset: Any, case: Case, **options: Any) -> Any:
    return train(node, model, dataset, {**SHORT_RUN, "optimizer": case.name, "learning_rate": case.rate}, **options)


def test_the_run_steps_with_our_optimizer_and_its_settings(pack: ModuleType, train_node: type, models: tuple,
                                                           six_images: Any, case: Case,
                                                           monkeypatch: pytest.MonkeyPatch) -> None:
    """The optimizer the run makes is ours with bitsandbytes' defaults or the given settings; tensors of at least
    ``min_8bit_size`` weights keep uint8 code indices, the others fp32 moments; the LoRA file names the optimizer as
    kohya's ``ss_optimizer`` does."""
    cls = getattr(importlib.import_module(f"{pack.__name__}.dataset_cache.{case.module}"), case.name)
    made: list[Any] = []
    step = cls.step

    def spy(self: Any, closure: Any = None) -> Any:
        made.append(self)
        return step(self, closure)

    monkeypatch.setattr(cls, "step", spy)
    plain = _train(train_node, models[0], six_images, case, steps=1)
    group = made[-1].param_groups[0]
    assert {k: group[k] for k in case.defaults} == case.defaults and group["lr"] == case.rate
    assert plain.result[0].metadata["ss_optimizer"] == case.name
    chosen = _train(train_node, models[0], six_images, case, steps=1, optimizer_args=f"{case.given} {EIGHT_BIT}")
    group = made[-1].param_groups[0]
    assert {k: group[k] for k in case.given_back} == case.given_back and group["min_8bit_size"] == 128
    kinds = {("exp_avg_q" in s, p.numel() >= 128) for p, s in made[-1].state.items()}
    assert kinds == {(True, True), (False, False)}
    back = case.given_back
    assert (chosen.result[0].metadata["ss_optimizer"]  # optimizer_args' numbers are floats, as written back
            == f"{case.name}(weight_decay={back['weight_decay']},betas={back['betas']},min_8bit_size=128.0)")


@pytest.mark.parametrize("lora_dtype", ["fp32", "bf16"])
def test_a_continued_run_trains_bit_for_bit_what_one_run_trains(train_node: type, models: tuple, six_images: Any,
                                                                lora_folder: Path, case: Case,
                                                                lora_dtype: str) -> None:
    """3 steps, Save LoRA Weights, 3 more from the file == 6 at once, bit for bit: the code indices, block scales,
    fp32 moments and per-tensor step counts come back from the training state (a bf16 LoRA's scales and moments as
    fp32)."""
    opts = {"optimizer_args": EIGHT_BIT, "lora_dtype": lora_dtype}
    whole = _train(train_node, models[0], six_images, case, steps=6, **opts).result
    first = _train(train_node, models[0], six_images, case, **opts)
    assert "training state saved as" in summary(first)
    name = save_lora(first.result[0], first.result[2], f"loras/{case.module}")
    rest = _train(train_node, models[0], six_images, case, existing_lora=name, **opts)
    assert f"{case.name} state restored" in summary(rest) and "NOTE" not in summary(rest)
    assert first.result[1]["loss"] + rest.result[1]["loss"] == whole[1]["loss"]
    assert all(torch.equal(rest.result[0][k], whole[0][k]) for k in whole[0])
    assert any(not torch.equal(whole[0][k], first.result[0][k]) for k in whole[0])


def test_bad_settings_are_refused_before_anything_loads(train_node: type, six_images: Any, case: Case) -> None:
    for args, message in case.refused:
        with pytest.raises(ValueError, match=message):
            _train(train_node, "not a model: refused before it is used", six_images, case, optimizer_args=args)

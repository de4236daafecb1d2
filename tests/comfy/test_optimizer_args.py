"""Train LoRA's optimizer_args (kohya's) on the real ComfyUI, CPU, tiny SD1.5: the settings reach the optimizer the
run steps with (ComfyUI's class for its names, ours for Prodigy and Lion), settings equal to the defaults train
the LoRA of no settings bit for bit, a continued run keeps its optimizer's state when it can and says when it
cannot, bad text is refused by name before anything loads, and the LoRA file says them as kohya writes them."""

from __future__ import annotations

import importlib
import json
from pathlib import Path
from types import ModuleType
from typing import Any

import pytest
import torch
from support.train_options import save_lora, train






@pytest.fixture
def made(pack: ModuleType, monkeypatch: pytest.MonkeyPatch) -> list[Any]:
    """The optimizers the runs make, as they step."""
    optimizers = importlib.import_module(f"{pack.__name__}.nodes.training.optimizers")
    run = importlib.import_module(f"{pack.__name__}.nodes.training.run")
    out: list[Any] = []
    create = optimizers.create_optimizer

    def recorded(*args: Any) -> Any:
        out.append(create(*args))
        return out[-1]

    monkeypatch.setattr(run, "create_optimizer", recorded)
    return out



def _equal(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> bool:
    return set(a) == set(b) and all(torch.equal(a[k], b[k]) for k in a)


def test_the_settings_reach_the_optimizer_the_run_steps_with(train_node: type, models: tuple, six_images: Any,
                                                             made: list[Any]) -> None:
    """AdamW's, SGD's, Prodigy's and Lion's settings in their parameter groups (the learning rate still the
    input's); AdamW stays torch's AdamW (ComfyUI's choice) though torch's AdamW refuses its own defaults back."""
    cases = [
        ("AdamW", '"weight_decay=0.2" "betas=0.8,0.95" eps=1e-6 amsgrad=True',
         {"weight_decay": 0.2, "betas": (0.8, 0.95), "eps": 1e-6, "amsgrad": True}),
        ("SGD", "momentum=0.9 nesterov=True", {"momentum": 0.9, "nesterov": True}),
        ("Prodigy", "d_coef=0.5 weight_decay=0", {"d_coef": 0.5, "weight_decay": 0.0, "use_bias_correction": True}),
        ("Lion", "betas=0.95,0.98 weight_decay=0.1", {"betas": (0.95, 0.98), "weight_decay": 0.1}),
    ]
    for optimizer, text, want in cases:
        rate = 1.0 if optimizer == "Prodigy" else 1e-3
        out = train(train_node, models[0], six_images, optimizer=optimizer, learning_rate=rate, optimizer_args=text,
                     steps=2).result
        group = made[-1].param_groups[0]
        assert {k: group[k] for k in want} == want and group["lr"] == rate, optimizer
        assert type(made[-1]).__name__ == optimizer
        assert all(torch.isfinite(torch.tensor(out[1]["loss"])))


def test_settings_equal_to_the_defaults_train_the_same_lora_and_others_another(train_node: type, models: tuple,
                                                                              six_images: Any) -> None:
    plain = train(train_node, models[0], six_images).result
    same = train(train_node, models[0], six_images, optimizer_args="weight_decay=0.01 betas=0.9,0.999 eps=1e-8").result
    assert _equal(same[0], plain[0]) and same[1]["loss"] == plain[1]["loss"]
    other = train(train_node, models[0], six_images, optimizer_args="weight_decay=0.5 betas=0.5,0.9").result
    assert not _equal(other[0], plain[0])
    sgd = train(train_node, models[0], six_images, optimizer="SGD", learning_rate=0.05).result
    momentum = train(train_node, models[0], six_images, optimizer="SGD", learning_rate=0.05,
                      optimizer_args="momentum=0.9").result
    assert sgd[1]["loss"][0] == momentum[1]["loss"][0] and not _equal(sgd[0], momentum[0])  # from step 2 on


def test_bad_settings_are_refused_by_name_before_anything_loads(train_node: type, models: tuple, six_images: Any,
                                                                pack: ModuleType,
                                                                monkeypatch: pytest.MonkeyPatch) -> None:
    run = importlib.import_module(f"{pack.__name__}.nodes.training.run")

    def never(*_args: Any, **_kwargs: Any) -> Any:
        raise AssertionError("the model was loaded")

    monkeypatch.setattr(run, "load", never)
    cases = [
        ({"optimizer_args": "d_coef=2"}, "AdamW has no setting 'd_coef'; its settings: betas, eps, weight_decay"),
        ({"optimizer_args": "lr=1e-4"}, "lr is the learning_rate input"),
        ({"optimizer_args": "weight_decay"}, "'weight_decay' is not name=value"),
        ({"optimizer_args": "betas=1.5,0.9"}, r"AdamW refuses betas=1.5,0.9: Invalid beta"),
        ({"optimizer_args": "momentum=0.9 nesterov=True dampening=0.5", "optimizer": "SGD"},
         "SGD refuses .*Nesterov momentum requires a momentum and zero dampening"),
        ({"optimizer_args": "amsgrad=yes"}, "amsgrad='yes' is not a number"),
        ({"optimizer_args": "eps=1e-8", "optimizer": "Lion"}, "Lion has no setting 'eps'"),
        ({"optimizer_args": "d_coef=0", "optimizer": "Prodigy", "learning_rate": 1.0},
         "Prodigy refuses d_coef=0: Prodigy: invalid d_coef 0"),
    ]
    for options, message in cases:
        with pytest.raises(ValueError, match=message):
            train(train_node, models[0], six_images, **options)


def test_a_continued_run_keeps_its_state_under_the_settings_and_starts_fresh_when_they_change_its_slots(
        train_node: type, models: tuple, six_images: Any, lora_folder: Path) -> None:
    """3 steps, Save LoRA Weights, 3 more with the same settings == 6 at once, bit for bit (the moments come back
    from the training state; the settings are this run's input). Continuing with ``amsgrad`` on, whose AdamW keeps
    one more slot, would fail at its first step with the saved state: it starts fresh instead and says so."""
    args = {"optimizer_args": "weight_decay=0.1 betas=0.8,0.9"}
    whole = train(train_node, models[0], six_images, steps=6, **args).result
    first = train(train_node, models[0], six_images, steps=3, **args).result
    name = save_lora(first[0], first[2], "loras/args")
    rest = train(train_node, models[0], six_images, steps=3, existing_lora=name, **args).result
    assert first[1]["loss"] + rest[1]["loss"] == whole[1]["loss"] and _equal(rest[0], whole[0])
    changed = train(train_node, models[0], six_images, steps=1, existing_lora=name,
                     optimizer_args="weight_decay=0.1 betas=0.8,0.9 amsgrad=True")
    (text,) = changed.ui["text"] if isinstance(changed.ui, dict) else changed.ui.as_dict()["text"]
    assert "its saved optimizer state does not fit this run (it keeps exp_avg, exp_avg_sq, step, AdamW with this " \
           "run's optimizer_args keeps exp_avg, exp_avg_sq, max_exp_avg_sq, step); AdamW starts fresh" in text
    assert all(torch.isfinite(torch.tensor(changed.result[1]["loss"])))


def test_the_lora_file_names_the_settings_as_kohya_writes_them(train_node: type, models: tuple,
                                                               six_images: Any) -> None:
    lora = train(train_node, models[0], six_images, steps=1, optimizer_args="weight_decay=0.1 betas=0.9,0.99").result[0]
    assert lora.metadata["ss_optimizer"] == "AdamW(weight_decay=0.1,betas=(0.9, 0.99))"
    assert json.loads(lora.metadata["streamcache.settings"])["optimizer_args"] == "weight_decay=0.1 betas=0.9,0.99"
    plain = train(train_node, models[0], six_images, steps=1).result[0]
    assert plain.metadata["ss_optimizer"] == "AdamW"

"""Train LoRA's ``train_layers`` on the real ComfyUI, CPU, with the tiny SD1.5-shaped models: only the layers its
patterns choose get adapters (ComfyUI's own adapters, weight wrappers or bypass hooks), a LoRA continued keeps its
layers, and a choice that is empty or would drop a continued LoRA's layers is refused before training.

A LoRA key is its layer's name plus the adapter's part (``.lora_up.weight``, ``.diff``, ``.diff_b``), and no part
holds a pattern used here, so "the keys of the layers ``attn2`` chooses" are the keys holding ``attn2``.
"""

from __future__ import annotations

import importlib
from pathlib import Path
from types import ModuleType
from typing import Any

import pytest
import torch
from support.encoded import write_comfy_encoded
from support.train_options import save_lora

REQUIRED = {  # the node's required inputs; every optional one keeps its default unless a test says otherwise
    "batch_size": 2, "grad_accumulation_steps": 1, "steps": 2, "learning_rate": 3e-3, "rank": 4,
    "optimizer": "AdamW", "loss_function": "MSE", "seed": 7, "training_dtype": "fp32", "lora_dtype": "fp32",
    "algorithm": "LoRA", "gradient_checkpointing": False, "checkpoint_depth": 1, "offloading": False,
    "existing_lora": "[None]", "loader_threads": 0,
}


@pytest.fixture(scope="module")
def node(pack: ModuleType) -> type:
    return importlib.import_module(f"{pack.__name__}.nodes.train_lora").TrainLoRA


@pytest.fixture(scope="module")
def dataset(pack: ModuleType, comfy_nodes: ModuleType, models: tuple, handles: ModuleType,
            tmp_path_factory: pytest.TempPathFactory) -> Any:
    _, clip, vae = models
    root = tmp_path_factory.mktemp("train_layers") / "cache"
    write_comfy_encoded(pack, comfy_nodes, clip, vae, root, [(64, 64)] * 4, seed=3)
    return handles.StreamDatasetHandle(str(root), "train")


def _train(node: type, model: Any, dataset: Any, **options: Any) -> Any:
    with torch.inference_mode():  # ComfyUI executes every node under inference mode
        return node.execute(model, dataset, **{**REQUIRED, **options})


def _summary(out: Any) -> str:
    (text,) = out.ui["text"] if isinstance(out.ui, dict) else out.ui.as_dict()["text"]
    return str(text)


@pytest.fixture(scope="module")
def every_key(node: type, models: tuple, dataset: Any) -> set[str]:
    """The keys of a LoRA of every layer (train_layers empty: ComfyUI's own trainer's)."""
    return set(_train(node, models[0], dataset, steps=1).result[0])


def test_only_the_chosen_layers_get_adapters_and_train(node: type, models: tuple, dataset: Any,
                                                       every_key: set[str]) -> None:
    out = _train(node, models[0], dataset, train_layers="attn2")
    lora = out.result[0]
    wanted = {k for k in every_key if "attn2" in k}
    assert wanted and len(wanted) < len(every_key) / 4
    assert set(lora) == wanted
    # they trained: ComfyUI zero-inits one matrix of each pair, and 2 AdamW steps moved it
    assert all(torch.isfinite(v).all() for v in lora.values())
    assert all(lora[k].abs().max() > 0 for k in lora if k.endswith("lora_down.weight"))
    layers = [n for n, m in models[0].model.named_modules() if hasattr(m, "weight_function")]
    chosen = [n for n in layers if "attn2" in n]
    assert f"trains {len(chosen)} of the model's {len(layers)} layers (train_layers 'attn2')" in _summary(out)


def test_leading_minus_leaves_layers_out_and_plain_and_minus_combine(node: type, models: tuple, dataset: Any,
                                                                     every_key: set[str]) -> None:
    no_norms = _train(node, models[0], dataset, steps=1, train_layers="-norm").result[0]
    assert set(no_norms) == {k for k in every_key if "norm" not in k}
    self_attention = _train(node, models[0], dataset, steps=1, train_layers="attn, -attn2").result[0]
    assert set(self_attention) == {k for k in every_key if "attn" in k and "attn2" not in k}
    assert any("attn1" in k for k in self_attention)


def test_a_pattern_in_no_layer_name_is_noted_and_the_others_choose(node: type, models: tuple, dataset: Any,
                                                                   every_key: set[str]) -> None:
    out = _train(node, models[0], dataset, steps=1, train_layers="attn2,\n atn1")
    assert set(out.result[0]) == {k for k in every_key if "attn2" in k}
    assert "train_layers: 'atn1' is in no layer's name (a typo?)" in _summary(out)


def test_a_choice_of_no_layer_or_a_bad_pattern_is_refused_before_training(node: type, models: tuple,
                                                                           dataset: Any) -> None:
    with pytest.raises(ValueError, match=r"train_layers 'nowhere' selects none of the model's \d+ layers; layer "
                                         r"names read like 'time_embed\.0', 'input_blocks\."):
        _train(node, models[0], dataset, steps=1, train_layers="nowhere")
    with pytest.raises(ValueError, match="train_layers pattern '-' leaves out nothing"):
        _train(node, models[0], dataset, steps=1, train_layers="attn2, -")


def test_a_lora_of_chosen_layers_continues_exactly_and_one_of_more_layers_is_not_cut(
        node: type, models: tuple, dataset: Any, lora_folder: Path) -> None:
    """2 steps of the cross-attention, Save LoRA Weights, 2 more with the same train_layers == 4 at once, bit for bit
    (CPU, fp32: the training state's optimizer moments fit the chosen layers). Continuing a LoRA of every layer with
    train_layers 'attn2' would output a LoRA without its other layers: refused, naming both inputs."""
    whole = _train(node, models[0], dataset, steps=4, train_layers="attn2").result
    first = _train(node, models[0], dataset, steps=2, train_layers="attn2").result
    name = save_lora(first[0], first[2], "loras/attn2")
    rest = _train(node, models[0], dataset, steps=2, train_layers="attn2", existing_lora=name).result
    assert rest[2] == 4 and first[1]["loss"] + rest[1]["loss"] == whole[1]["loss"]
    assert set(rest[0]) == set(whole[0]) and all(torch.equal(rest[0][k], whole[0][k]) for k in whole[0])

    full = _train(node, models[0], dataset, steps=1).result
    every = save_lora(full[0], full[2], "loras/every")
    with pytest.raises(ValueError, match=rf"existing_lora '{every}' has weights for \d+ layer\(s\) train_layers "
                                         r"'attn2' leaves out \(such as 'diffusion_model\..*'\): the LoRA this run "
                                         "outputs would lose them"):
        _train(node, models[0], dataset, steps=1, train_layers="attn2", existing_lora=every)


def test_bypass_mode_gives_the_same_layers_adapters(node: type, models: tuple, dataset: Any,
                                                    every_key: set[str]) -> None:
    lora = _train(node, models[0], dataset, steps=1, train_layers="attn2", bypass_mode=True).result[0]
    assert set(lora) == {k for k in every_key if "attn2" in k}



def test_pieces_match_names_inside_the_diffusion_model(node: type, models: tuple, dataset: Any,
                                                       every_key: set[str]) -> None:
    """Every layer's full name starts with ``diffusion_model.``: a piece such as ``ff`` (the feed-forward layers)
    must not choose every layer through it, and a piece copied from a LoRA file's keys, that start included, still
    chooses its layers."""
    ff = _train(node, models[0], dataset, steps=1, train_layers="ff").result[0]
    assert set(ff) == {k for k in every_key if ".ff." in k} and len(ff) < len(every_key) / 4
    copied = _train(node, models[0], dataset, steps=1,
                    train_layers="diffusion_model.output_blocks.0, -diffusion_model.output_blocks.0.0.in_layers"
                    ).result[0]
    assert set(copied) == {k for k in every_key if k.startswith("diffusion_model.output_blocks.0.")
                           and not k.startswith("diffusion_model.output_blocks.0.0.in_layers")}
    assert copied and any(".in_layers" in k for k in every_key if k.startswith("diffusion_model.output_blocks.0."))

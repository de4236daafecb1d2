"""Train LoRA's network_dropout, rank_dropout and module_dropout (kohya's) on the real ComfyUI, CPU, tiny SD1.5.

What a run with dropout must do: drop only while a batch trains (whole adapters for samples and validation), draw
the same masks every time and in a continued run those of the run that never stopped, let the backward pass see the
masks the forward drew (a checkpointed block's recompute included), compute each dropped change as kohya's LoRA
module does, leave ComfyUI's adapters as they were after the run, and refuse rates that cannot act, naming them.
"""

from __future__ import annotations

import importlib
from pathlib import Path
from types import ModuleType
from typing import Any

import pytest
import torch
from support.train_options import SHORT_RUN, save_lora, train

WEIGHTS = {"rank_dropout": 0.5, "module_dropout": 0.3}  # what acts where the adapters change the weights
HIDDEN = {"network_dropout": 0.3, "rank_dropout": 0.5, "module_dropout": 0.3, "bypass_mode": True}  # beside them


def _module(pack: ModuleType, name: str) -> ModuleType:
    return importlib.import_module(f"{pack.__name__}.{name}")






BASE = {**SHORT_RUN, "steps": 4}
"""This file's short run: 4 steps (a continued run trains 2 + 2)."""

def _train(node: type, model: Any, dataset: Any, **options: Any) -> Any:
    return train(node, model, dataset, BASE, **options)


def _equal(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> bool:
    return set(a) == set(b) and all(torch.equal(a[k], b[k]) for k in a)


@pytest.fixture(scope="module")
def plain(train_node: type, models: tuple, six_images: Any) -> Any:
    return _train(train_node, models[0], six_images).result


@pytest.mark.parametrize("rates", [WEIGHTS, HIDDEN], ids=["weights", "bypass"])
def test_dropout_trains_another_lora_and_the_same_one_every_time(train_node: type, models: tuple, six_images: Any,
                                                                  plain: Any, rates: dict[str, Any]) -> None:
    """The masks are seeded by the run's seed and the batch: the same run twice is the same LoRA bit for bit, and
    not the LoRA trained without dropout."""
    a = _train(train_node, models[0], six_images, **rates).result
    b = _train(train_node, models[0], six_images, **rates).result
    assert _equal(a[0], b[0]) and a[1]["loss"] == b[1]["loss"]
    assert all(torch.isfinite(torch.tensor(a[1]["loss"])))
    assert not _equal(a[0], plain[0])
    other_seed = _train(train_node, models[0], six_images, **rates, seed=8).result
    assert not _equal(a[0], other_seed[0])


@pytest.mark.parametrize("rates", [WEIGHTS, HIDDEN], ids=["weights", "bypass"])
def test_a_checkpointed_block_recomputes_with_the_masks_its_forward_drew(
        pack: ModuleType, train_node: type, models: tuple, six_images: Any, rates: dict[str, Any],
        monkeypatch: pytest.MonkeyPatch) -> None:
    """With every block checkpointed, the backward pass recomputes each block's forward: torch restores the global
    generators the masks come from, so it draws the same ones and the run is the one without checkpointing, bit
    for bit (the same fp32 operations in the same order; new masks would change the gradients wholesale)."""
    training = _module(pack, "nodes.training")
    draws: list[int] = []  # the masks drawn by each run

    def counting(draw: Any) -> Any:
        def counted(*args: Any, **kwargs: Any) -> torch.Tensor:
            draws[-1] += 1
            return draw(*args, **kwargs)
        return counted

    for name in ("dropped_ranks", "dropped_hidden"):
        monkeypatch.setattr(training.dropout, name, counting(getattr(training.dropout, name)))
    draws.append(0)
    whole = _train(train_node, models[0], six_images, **rates).result
    draws.append(0)
    checkpointed = _train(train_node, models[0], six_images, **rates, gradient_checkpointing=True, memory="auto").result
    assert draws[1] > draws[0] > 0  # the recomputes drew again
    assert whole[1]["loss"] == checkpointed[1]["loss"]
    assert _equal(whole[0], checkpointed[0])


@pytest.mark.parametrize("memory", ["stream blocks", "stream blocks + host activations", "auto + keep blocks whole"])
def test_every_memory_plan_trains_the_same_lora_with_dropout(train_node: type, models: tuple, six_images: Any,
                                                             memory: str) -> None:
    """The plans that stream the blocks' weights, keep their activations on the host, or keep some blocks whole (not
    recomputed) train, with all three dropouts, the LoRA of every block checkpointed, bit for bit: each recompute
    draws what its forward drew, whichever blocks are recomputed."""
    every = _train(train_node, models[0], six_images, **HIDDEN, gradient_checkpointing=True,
                   memory="no offload").result
    other = _train(train_node, models[0], six_images, **HIDDEN, gradient_checkpointing=True, memory=memory).result
    assert every[1]["loss"] == other[1]["loss"] and _equal(every[0], other[0])


def test_a_continued_run_draws_the_masks_of_the_run_that_never_stopped(train_node: type, models: tuple, six_images: Any,
                                                                      lora_folder: Path) -> None:
    """2 steps, saved by Save LoRA Weights, 2 more from the file == 4 steps at once, bit for bit: the masks come
    from the batch's global number, as the noise does."""
    whole = _train(train_node, models[0], six_images, **HIDDEN).result
    first = _train(train_node, models[0], six_images, **HIDDEN, steps=2).result
    name = save_lora(first[0], first[2], "loras/dropout")
    rest = _train(train_node, models[0], six_images, **HIDDEN, steps=2, existing_lora=name).result
    assert rest[2] == 4
    assert first[1]["loss"] + rest[1]["loss"] == whole[1]["loss"]
    assert _equal(rest[0], whole[0])


def test_samples_and_validation_see_the_whole_adapters(pack: ModuleType, train_node: type, models: tuple,
                                                       six_images: Any, monkeypatch: pytest.MonkeyPatch) -> None:
    """Dropout draws only in a training batch's forward and backward: never while the run measures its validation
    loss (the same loss code, without gradients) or makes its sample images, and the adapters are ComfyUI's own
    classes again after the run."""
    training = _module(pack, "nodes.training")
    losses: list[tuple[bool, bool]] = []  # (with gradients, drawing) of every batch loss
    samples: list[bool] = []
    adapters: list[Any] = []
    batch_loss, take = training.loop.StepLoop.batch_loss, training.samples.Sampling.take
    attach = training.dropout.AdapterDropout._attach

    def on_attach(self: Any, given: list[Any]) -> None:
        adapters.extend(given)
        attach(self, given)

    def on_loss(self: Any, *args: Any, **kwargs: Any) -> Any:
        losses.append((torch.is_grad_enabled(), self.dropout.drawing))
        return batch_loss(self, *args, **kwargs)

    def on_take(self: Any, *args: Any) -> Any:
        samples.append(any(a._streamcache_dropout.drawing for a in adapters))
        return take(self, *args)

    monkeypatch.setattr(training.dropout.AdapterDropout, "_attach", on_attach)
    monkeypatch.setattr(training.loop.StepLoop, "batch_loss", on_loss)
    monkeypatch.setattr(training.samples.Sampling, "take", on_take)
    _train(train_node, models[0], six_images, **HIDDEN, steps=2, val_split=0.34, val_every=1, sample_count=1,
           sample_every=1, sample_steps=2)
    assert [d for g, d in losses if g] == [True, True]  # the two training batches
    assert [d for g, d in losses if not g] and not any(d for g, d in losses if not g)  # the validation batches
    assert samples and not any(samples)
    assert len(adapters) > 10 and all(type(a).__module__.startswith("comfy.") for a in adapters)
    assert not any(hasattr(a, "_streamcache_dropout") for a in adapters)


def test_dropout_settings_that_cannot_act_are_refused_by_name(train_node: type, models: tuple, six_images: Any) -> None:
    cases = [
        ({"network_dropout": 0.1}, "network_dropout drops a LoRA's hidden units.*turn bypass_mode on"),
        ({"rank_dropout": 0.2, "algorithm": "LoHa"}, "rank_dropout drop a LoRA's ranks; algorithm is LoHa"),
        ({"network_dropout": 0.1, "bypass_mode": True, "algorithm": "LoKr"}, "algorithm is LoKr"),
        ({"module_dropout": 1.0}, r"module_dropout must be a number from 0 \(none\) to 0.9, got 1.0"),
        ({"rank_dropout": float("nan")}, "rank_dropout must be a number"),
        ({"network_dropout": -0.1, "bypass_mode": True}, "network_dropout must be a number"),
    ]
    for options, message in cases:
        with pytest.raises(ValueError, match=message):
            _train(train_node, models[0], six_images, **options)


def test_module_dropout_trains_any_algorithm(train_node: type, models: tuple, six_images: Any) -> None:
    """module_dropout leaves a layer's whole change out, whatever the adapter: LoHa, and OFT in bypass mode (its
    change is the output's rotation, ``g``, left out with the rest)."""
    for options in ({"algorithm": "LoHa"}, {"algorithm": "OFT", "bypass_mode": True}):
        with_dropout = _train(train_node, models[0], six_images, **options, module_dropout=0.5, steps=2).result
        without = _train(train_node, models[0], six_images, **options, steps=2).result
        assert all(torch.isfinite(torch.tensor(with_dropout[1]["loss"])))
        assert not _equal(with_dropout[0], without[0]), options


def test_the_lora_file_says_its_dropout_as_kohya_writes_it(train_node: type, models: tuple, six_images: Any) -> None:
    import json

    out = _train(train_node, models[0], six_images, **HIDDEN, steps=1).result[0]
    metadata = out.metadata
    assert metadata["ss_network_dropout"] == "0.3"
    assert json.loads(metadata["ss_network_args"]) == {"algo": "lora", "rank_dropout": "0.5",
                                                       "module_dropout": "0.3"}
    plain = _train(train_node, models[0], six_images, steps=1).result[0].metadata
    assert plain["ss_network_dropout"] == "0.0" and json.loads(plain["ss_network_args"]) == {"algo": "lora"}


def _lora(pack: ModuleType, layer: torch.nn.Module, rank: int, rates: Any, seed: int = 1) -> tuple[Any, Any]:
    """ComfyUI's training LoRA of ``layer`` (its down drawn too, so the change is not 0), hooked as bypass mode
    hooks it (its layer kind known), with a run's dropout of ``rates``; (the adapter, the dropout)."""
    from comfy.weight_adapter import BypassForwardHook, LoRAAdapter

    torch.manual_seed(seed)
    adapter = LoRAAdapter.create_train(layer.weight.detach(), rank, 1.0)
    adapter.alpha.data.fill_(2.0)
    torch.nn.init.normal_(adapter.lora_down.weight)
    BypassForwardHook(layer, adapter)
    dropout = _module(pack, "nodes.training.dropout").AdapterDropout(rates, seed, [adapter])
    return adapter, dropout


def _factors(parts: list[torch.Tensor], whole: torch.Tensor) -> torch.Tensor:
    """The c that makes ``whole`` = Σ c_r · parts[r] (least squares, float64)."""
    a = torch.stack([p.reshape(-1) for p in parts], dim=1).double()
    return torch.linalg.lstsq(a, whole.reshape(-1, 1).double()).solution.reshape(-1)


def _is_dropout(c: torch.Tensor, p: float) -> bool:
    """Each factor is a dropped (0) or a kept and scaled (1/(1 - p)) one: within fp32 rounding of sums of a few
    dozen terms, far inside 1e-3."""
    return bool(torch.all(torch.minimum(c.abs(), (c - 1 / (1 - p)).abs()) < 1e-3))


def test_a_dropped_rank_is_kohyas_in_both_modes(pack: ModuleType) -> None:
    """rank_dropout 0.5: the change a LoRA adds is Σ_r c_r · (its rank r's part), each c_r 0 or 1/(1 - 0.5) = 2 —
    one draw per model call where the change is made in the weight, one per image beside the layer (bypass) — and
    outside a training batch the change is ComfyUI's own, bit for bit."""
    adapter_dropout = _module(pack, "dataset_cache.adapter_dropout")
    layer = torch.nn.Linear(8, 6)
    adapter, dropout = _lora(pack, layer, 4, adapter_dropout.DropoutRates(rank=0.5))
    up, down, w = adapter.lora_up.weight.detach(), adapter.lora_down.weight.detach(), layer.weight.detach()
    parts = [(adapter.alpha / 4 * torch.outer(up[:, r], down[r])).detach() for r in range(4)]
    own = type(adapter).__mro__[2]  # ComfyUI's LoraDiff, behind the dropping class
    x = torch.randn(3, 5, 8)
    with torch.no_grad():
        assert torch.equal(adapter(w), own.__call__(adapter, w))
        assert torch.equal(adapter.h(x, layer(x)), own.h(adapter, x, layer(x)))
        seen = []
        for index in range(6):
            with dropout.batch(index, torch.device("cpu")):
                c = _factors(parts, adapter(w) - w)
                assert _is_dropout(c, 0.5), c
                seen.append(tuple(c.round().tolist()))
                out = adapter.h(x, layer(x))
                for image in range(3):
                    hidden = [(x[image] @ down[r:r + 1].T) @ up[:, r:r + 1].T * adapter.alpha / 4 for r in range(4)]
                    c = _factors(hidden, out[image])
                    assert _is_dropout(c, 0.5), c
                    seen.append(tuple(c.round().tolist()))
    assert len(set(seen)) > 4  # the draws differ between calls and images


def test_network_dropout_drops_hidden_units_and_convolutions_drop_per_image(pack: ModuleType) -> None:
    """network_dropout 0.5 beside a linear layer: each hidden unit of each token is 0 or twice itself. A
    convolution's LoRA (its down projection the layer's own kernel, stride and padding) adds ComfyUI's change
    outside a batch and, with rank_dropout, per image a 0-or-2 combination of its ranks' parts."""
    import comfy.weight_adapter.lora as comfy_lora

    adapter_dropout = _module(pack, "dataset_cache.adapter_dropout")
    layer = torch.nn.Linear(8, 6)
    adapter, dropout = _lora(pack, layer, 4, adapter_dropout.DropoutRates(network=0.5))
    up, down = adapter.lora_up.weight.detach(), adapter.lora_down.weight.detach()
    x = torch.randn(2, 5, 8)
    with torch.no_grad(), dropout.batch(0, torch.device("cpu")):
        out = adapter.h(x, layer(x))
    hidden = x @ down.T  # 2 × 5 × 4, each unit kept (× 2) or dropped
    solved = torch.linalg.lstsq(up.double(), (out / (adapter.alpha / 4)).double().reshape(-1, 6).T).solution.T
    solved, hidden = solved.reshape(2, 5, 4), hidden.double()
    dropped, kept = solved.abs(), (solved - 2 * hidden).abs()
    assert torch.all(torch.minimum(dropped, kept) < 1e-4 * hidden.abs().max())  # fp32 sums of 8 terms
    assert 0 < int((dropped < kept).sum()) < hidden.numel()

    conv = torch.nn.Conv2d(3, 5, 3, stride=2, padding=1)
    adapter, dropout = _lora(pack, conv, 4, adapter_dropout.DropoutRates(rank=0.5), seed=2)
    x = torch.randn(2, 3, 8, 8)
    with torch.no_grad():
        base = conv(x)
        assert torch.equal(adapter.h(x, base), comfy_lora.LoraDiff.h(adapter, x, base))
        parts = []
        for r in range(4):  # rank r's part: ComfyUI's change with the other ranks' up columns zeroed
            saved = adapter.lora_up.weight.clone()
            adapter.lora_up.weight[:, [i for i in range(4) if i != r]] = 0
            parts.append(comfy_lora.LoraDiff.h(adapter, x, base))
            adapter.lora_up.weight.copy_(saved)
        with dropout.batch(0, torch.device("cpu")):
            out = adapter.h(x, base)
    for image in range(2):
        c = _factors([p[image] for p in parts], out[image])
        assert _is_dropout(c, 0.5), c


def test_module_dropout_leaves_a_layers_whole_change_out(pack: ModuleType) -> None:
    """module_dropout 0.9: in a training batch a layer adds its whole change or none (its own weight, or its own
    output, exactly), chosen once per batch; about 9 batches in 10 none: 1000 batches of seeded draws, 900
    expected, a binomial's standard deviation 9.5, so 850-950 holds for any seed but a 5-sigma one (and this one
    is fixed). Outside a batch, and after the run, ComfyUI's change."""
    adapter_dropout = _module(pack, "dataset_cache.adapter_dropout")
    layer = torch.nn.Linear(8, 6)
    adapter, dropout = _lora(pack, layer, 4, adapter_dropout.DropoutRates(module=0.9))
    w, x = layer.weight.detach(), torch.randn(2, 8)
    whole = type(adapter).__mro__[2].__call__(adapter, w)
    skipped = 0
    with torch.no_grad():
        base = layer(x)
        added = type(adapter).__mro__[2].h(adapter, x, base)
        for index in range(1000):
            with dropout.batch(index, torch.device("cpu")):
                changed = [adapter(w) for _ in range(2)]
                out = adapter.g(base + adapter.h(x, base))  # as bypass mode's hook calls them
            skip = torch.equal(changed[0], w)
            assert all(torch.equal(c, w if skip else whole) for c in changed)  # one choice for the batch
            assert torch.equal(out, base if skip else base + added)
            skipped += skip
        assert torch.equal(adapter(w), whole)
    assert 850 <= skipped <= 950
    dropout.detach()
    assert type(adapter).__name__ == "LoraDiff" and torch.equal(adapter(w), whole)

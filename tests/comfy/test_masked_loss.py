"""Masked and weighted loss (issue #16: item 4's training half, and the per-row loss weight of item 5's reg images)
on the real ComfyUI, CPU, with the tiny SD1.5-shaped UNet of ``support.tiny_models``.

Each run is one SGD step of the pack's public ``train_lora`` on a two-sample cache. The loader is wrapped so its
batches carry what the dataset's mask entries and a regularization dataset will give them (``Batch.masks``,
``BatchPlan.weights``); those are built by the loader and sampler, tested on their own. Sigma and noise are drawn
per row from the row's latent key, so a row gets the same ones in a batch of two and alone.

What is checked for masks is the gradient of the loss with respect to the model's prediction (the x0 estimate that
ComfyUI's loss compares with the clean latent): the loss reaches the model and the LoRA only through it, so a zero
there means the masked half of the image teaches nothing. The gradient with respect to the noisy input would not
say that: the UNet's convolutions and attention spread every output element over the whole input. For row weights
the LoRA's own gradients are compared, with runs of one row alone.
"""

from __future__ import annotations

import dataclasses
import importlib
from collections.abc import Callable, Iterator
from types import ModuleType
from typing import Any

import pytest
import torch
from torch._subclasses.fake_tensor import FakeTensor
from torch.optim.optimizer import register_optimizer_step_pre_hook
from support.tiny_models import TinyModels

LATENT = (1, 4, 8, 8)  # a 64×64 image
SETTINGS = {
    "steps": 1, "batch_size": 2, "grad_accumulation_steps": 1, "learning_rate": 1e-3, "rank": 4, "optimizer": "SGD",
    "loss_function": "MSE", "seed": 7, "training_dtype": "fp32", "lora_dtype": "fp32", "algorithm": "LoRA",
    "gradient_checkpointing": False, "prefetch_batches": 2, "loader_threads": 0,
}
KEYS = ("a" * 32, "b" * 32)  # the two samples' latent keys


def _module(pack: ModuleType, name: str) -> ModuleType:
    return importlib.import_module(f"{pack.__name__}.{name}")


@pytest.fixture(scope="module")
def training(pack: ModuleType) -> ModuleType:
    return _module(pack, "nodes.training")


@pytest.fixture(scope="module")
def model(comfy_nodes: ModuleType, tiny_models: TinyModels) -> Any:
    (unet,) = comfy_nodes.UNETLoader().load_unet(tiny_models.name("unet"), "default")
    return unet


@pytest.fixture(scope="module")
def cache(pack: ModuleType, tmp_path_factory: pytest.TempPathFactory) -> Any:
    """A cache with dataset "both" (samples a and b, one bucket) and "a" / "b" (each alone); returns its root."""
    writer_mod = _module(pack, "dataset_cache.format.writer")
    sample_cls = _module(pack, "dataset_cache.dataset").Sample
    root = tmp_path_factory.mktemp("masked_loss") / "cache"
    gen = torch.Generator().manual_seed(5)
    samples = []
    with torch.inference_mode(), writer_mod.CacheWriter(root) as writer:
        for i, key in enumerate(KEYS):
            caption = f"{i + 10:032x}"
            writer.add(key, {"samples": torch.randn(LATENT, generator=gen)}, kind="latent")
            writer.add(caption, [[torch.randn(1, 77, 768, generator=gen), {}]], kind="conditioning")
            samples.append(sample_cls(key, (caption,), source=f"img{i}.png"))
        writer.set_dataset("both", samples)
        writer.set_dataset("a", samples[:1])
        writer.set_dataset("b", samples[1:])
        mask = "c" * 32
        writer.add(mask, {"mask": torch.full((1, 1, *LATENT[-2:]), 255, dtype=torch.uint8)}, kind="mask")
        writer.set_dataset("masked", [dataclasses.replace(s, mask=mask) for s in samples])
    return root


@dataclasses.dataclass
class Step:
    """What one training step saw and did."""

    loss: float
    rows: tuple[str, ...]  # the batch's latent keys, in row order
    pred: torch.Tensor  # the model's prediction of the batch
    pred_grad: torch.Tensor  # d loss / d prediction
    lora_grads: list[torch.Tensor]  # every LoRA parameter's gradient before the optimizer step


MaskFor = Callable[[Any], torch.Tensor]


def _half_mask(batch: Any) -> torch.Tensor:
    """Left half of the latent 0 (left out), right half 1, for every row."""
    rows, _, h, w = batch.latents.shape
    mask = torch.ones(rows, 1, h, w)
    mask[..., : w // 2] = 0.0
    return mask


def _step(training: ModuleType, model: Any, cache: Any, monkeypatch: pytest.MonkeyPatch, dataset: str = "both", *,
          masks: MaskFor | None = None, weights: dict[str, float] | Callable[[Any], tuple[float, ...]] | None = None,
          run: Callable[..., Any] | None = None, **options: Any) -> Step:
    """One step of ``train_lora`` (or of ``run(model, dataset_name, settings_dict)``: the node) on ``dataset``, its
    batch given ``masks(batch)`` and the row weights ``weights[latent key]`` (or ``weights(plan)``)."""
    plans: list[Any] = []
    preds: list[torch.Tensor] = []
    grads: list[list[torch.Tensor]] = []
    real_loader, real_forward = training.run.PrefetchLoader, training.conditioning.ModelCall.__call__

    class Loader:  # the real loader; its batches get the masks and weights the dataset will give them
        def __init__(self, *args: Any, **kwargs: Any) -> None:
            kwargs.pop("per_batch")  # the loop draws at each step then: the draw below reads the latest plan
            self.inner = real_loader(*args, **kwargs)

        def __iter__(self) -> Iterator[Any]:
            for batch in self.inner:
                plan = batch.plan
                if weights is not None:
                    rows = weights(plan) if callable(weights) else tuple(weights[k] for k in plan.latent_keys)
                    plan = dataclasses.replace(plan, weights=rows)
                plans.append(plan)
                yield dataclasses.replace(batch, plan=plan, masks=masks(batch) if masks else None)

        def close(self) -> None:
            self.inner.close()

    def draw(self: Any, shape: tuple[int, ...], _index: int) -> tuple[torch.Tensor, torch.Tensor]:
        keys = plans[-1].latent_keys  # per row, from its latent key: the same in any batch
        sigma = torch.tensor([float(self.model_sampling.percent_to_sigma(0.3 + 0.4 * (k == KEYS[1]))) for k in keys])
        noise = torch.cat([torch.randn(1, *shape[1:], generator=torch.Generator().manual_seed(int(k[:8], 16)))
                           for k in keys])
        return sigma, noise

    def forward(self: Any, xt: torch.Tensor, sigma: torch.Tensor, kwargs: dict[str, Any]) -> torch.Tensor:
        pred = real_forward(self, xt, sigma, kwargs)
        if isinstance(pred, FakeTensor):  # the memory plan's probe: shapes only, before the first step
            return pred
        pred.retain_grad()
        preds.append(pred)
        return pred

    def hook(optimizer: Any, _args: Any, _kwargs: Any) -> None:
        grads.append([p.grad.detach().clone() if p.grad is not None else torch.zeros_like(p)
                      for group in optimizer.param_groups for p in group["params"]])

    settings = {**SETTINGS, "batch_size": 2 if dataset == "both" else 1, **options}
    with monkeypatch.context() as patch:
        patch.setattr(training.run, "PrefetchLoader", Loader)
        patch.setattr(training.loop.StepLoop, "_draw", draw)
        patch.setattr(training.conditioning.ModelCall, "__call__", forward)
        handle = register_optimizer_step_pre_hook(hook)
        try:
            if run is not None:
                losses = run(model, dataset, settings)
            else:
                handles = importlib.import_module(training.__name__.rsplit(".", 1)[0] + ".handles")
                reader, samples = handles.StreamDatasetHandle(str(cache), dataset).open()
                try:
                    with torch.inference_mode():  # as ComfyUI runs nodes
                        losses = training.train_lora(model, reader, samples, training.TrainSettings(**settings)
                                                     ).losses
                finally:
                    reader.close()
        finally:
            handle.remove()
    assert len(plans) == len(preds) == len(grads) == len(losses) == 1
    (pred,) = preds
    assert pred.grad is not None and pred.dtype == torch.float32
    return Step(losses[0], plans[0].latent_keys, pred.detach(), pred.grad.detach(), grads[0])


def _row(step: Step, key: str) -> int:
    return step.rows.index(key)


# --------------------------------------------------------------------------------------------------------- masks
@pytest.mark.parametrize("loss_function", ["MSE", "L1", "Huber", "SmoothL1"])
def test_a_mask_that_leaves_out_half_the_latent_gives_that_half_no_gradient(
        training: ModuleType, model: Any, cache: Any, monkeypatch: pytest.MonkeyPatch, loss_function: str) -> None:
    """unmasked_weight 0: the left half of every row's prediction gets exactly zero gradient, the right half does
    get one, and the LoRA still learns (from the right half)."""
    step = _step(training, model, cache, monkeypatch, masks=_half_mask, unmasked_weight=0.0,
                 loss_function=loss_function)
    w = step.pred.shape[-1]
    assert torch.count_nonzero(step.pred_grad[..., : w // 2]) == 0
    right = step.pred_grad[..., w // 2:]
    assert torch.count_nonzero(right) > 0.99 * right.numel()  # (an L1 gradient is 0 where pred == target exactly)
    assert any(torch.count_nonzero(g) for g in step.lora_grads)
    assert step.loss > 0


@pytest.mark.parametrize("loss_function", ["MSE", "Huber"])
def test_unmasked_weight_scales_the_left_out_halfs_contribution(
        training: ModuleType, model: Any, cache: Any, monkeypatch: pytest.MonkeyPatch, loss_function: str) -> None:
    """With unmasked_weight u the masked-out half's loss counts u times: loss(u) = loss(0) + u·(loss(1) − loss(0))
    (unmasked_weight 1: the mask has no effect), and that half's prediction gradient is u times the unmasked one."""
    runs = {u: _step(training, model, cache, monkeypatch, masks=_half_mask, unmasked_weight=u,
                     loss_function=loss_function) for u in (0.0, 0.25, 1.0)}
    plain = _step(training, model, cache, monkeypatch, loss_function=loss_function)
    assert runs[1.0].loss == plain.loss and torch.equal(runs[1.0].pred_grad, plain.pred_grad)
    assert runs[0.0].loss < plain.loss
    u = 0.25
    assert runs[u].loss == pytest.approx(runs[0.0].loss + u * (plain.loss - runs[0.0].loss), rel=1e-5)
    w = plain.pred.shape[-1]
    for step in runs.values():
        assert step.rows == plain.rows and torch.equal(step.pred, plain.pred)  # the same batch, draws and forward
    torch.testing.assert_close(runs[u].pred_grad[..., : w // 2], u * plain.pred_grad[..., : w // 2],
                               rtol=1e-5, atol=0)
    torch.testing.assert_close(runs[u].pred_grad[..., w // 2:], plain.pred_grad[..., w // 2:], rtol=1e-5, atol=0)


@pytest.mark.parametrize("loss_function", ["MSE", "L1", "Huber", "SmoothL1"])
def test_all_ones_masks_give_comfyuis_loss(training: ModuleType, model: Any, cache: Any,
                                           monkeypatch: pytest.MonkeyPatch, loss_function: str) -> None:
    """A mask of ones weighs every element 1: the per-element loss (ComfyUI's loss module with reduction 'none',
    so Huber's delta and SmoothL1's beta are its own), averaged, equals ComfyUI's loss of the plain path."""
    ones = _step(training, model, cache, monkeypatch, masks=lambda b: torch.ones(b.latents.shape[0], 1, 8, 8),
                 loss_function=loss_function)
    plain = _step(training, model, cache, monkeypatch, loss_function=loss_function)
    assert ones.loss == pytest.approx(plain.loss, rel=1e-6)
    torch.testing.assert_close(ones.pred_grad, plain.pred_grad, rtol=1e-5, atol=1e-12)
    for g, ref in zip(ones.lora_grads, plain.lora_grads):
        torch.testing.assert_close(g, ref, rtol=1e-4, atol=1e-6 * (float(ref.abs().max()) or 1.0))


def test_masked_loss_off_ignores_the_masks(training: ModuleType, model: Any, cache: Any,
                                           monkeypatch: pytest.MonkeyPatch) -> None:
    off = _step(training, model, cache, monkeypatch, masks=_half_mask, masked_loss=False, unmasked_weight=0.0)
    plain = _step(training, model, cache, monkeypatch)
    assert off.loss == plain.loss and torch.equal(off.pred_grad, plain.pred_grad)
    assert all(torch.equal(g, ref) for g, ref in zip(off.lora_grads, plain.lora_grads))


def test_masks_on_the_node(pack: ModuleType, training: ModuleType, model: Any, cache: Any,
                           monkeypatch: pytest.MonkeyPatch) -> None:
    """Train LoRA's masked_loss and unmasked_weight reach the training step."""
    node = _module(pack, "nodes.train_lora").TrainLoRA
    handles = _module(pack, "nodes.handles")
    base = {"checkpoint_depth": 1, "offloading": False, "existing_lora": "[None]"}

    def run(mdl: Any, dataset: str, settings: dict[str, Any]) -> list[float]:
        with torch.inference_mode():
            out = node.execute(mdl, handles.StreamDatasetHandle(str(cache), dataset), **{**base, **settings})
        return out.result[1]["loss"]

    on = _step(training, model, cache, monkeypatch, masks=_half_mask, run=run, unmasked_weight=0.0)
    off = _step(training, model, cache, monkeypatch, masks=_half_mask, run=run, masked_loss=False)
    w = on.pred.shape[-1]
    assert torch.count_nonzero(on.pred_grad[..., : w // 2]) == 0 < torch.count_nonzero(off.pred_grad[..., : w // 2])
    default = _step(training, model, cache, monkeypatch, masks=_half_mask, run=run)  # unmasked_weight 0.1
    torch.testing.assert_close(default.pred_grad[..., : w // 2], 0.1 * off.pred_grad[..., : w // 2],
                               rtol=1e-5, atol=0)


@pytest.mark.parametrize(("options", "says"), [
    ({}, "rows: 2 trained, 2 with a mask"),
    ({"masked_loss": False}, "rows: 2 trained, 2 with a mask not applied (masked_loss off)"),
    ({"unmasked_weight": 1.0}, "rows: 2 trained, 2 with a mask not applied (unmasked_weight 1)"),
])
def test_the_summary_counts_masks_only_where_they_weigh_the_loss(pack: ModuleType, model: Any, cache: Any,
                                                                 options: dict[str, Any], says: str) -> None:
    """#27 item 6: with masked_loss off the summary said "2 with a mask" although no mask reached the loss."""
    node = _module(pack, "nodes.train_lora").TrainLoRA
    handles = _module(pack, "nodes.handles")
    base = {"checkpoint_depth": 1, "offloading": False, "existing_lora": "[None]", **SETTINGS}
    with torch.inference_mode():
        out = node.execute(model, handles.StreamDatasetHandle(str(cache), "masked"), **{**base, **options})
    (summary,) = out.ui["text"]
    assert f"{says}; training state saved" in summary, summary


def test_masks_go_to_the_training_dtype(training: ModuleType, model: Any, cache: Any,
                                       monkeypatch: pytest.MonkeyPatch) -> None:
    """Masks in another dtype (float64 here) weigh the fp32 loss as float32 masks do."""
    wide = _step(training, model, cache, monkeypatch, masks=lambda b: _half_mask(b).double(), unmasked_weight=0.3)
    single = _step(training, model, cache, monkeypatch, masks=_half_mask, unmasked_weight=0.3)
    assert wide.loss == single.loss and torch.equal(wide.pred_grad, single.pred_grad)


def test_masks_of_another_size_are_a_clear_error(training: ModuleType, model: Any, cache: Any,
                                                 monkeypatch: pytest.MonkeyPatch) -> None:
    with pytest.raises(ValueError, match=r"loss masks of batch 0 of epoch 0 have shape \(2, 1, 4, 4\), its latents "
                                         r"need \(2, 1, 8, 8\).*encode the dataset's masks again"):
        _step(training, model, cache, monkeypatch, masks=lambda b: torch.ones(2, 1, 4, 4))


def test_unmasked_weight_outside_0_to_1_is_refused(training: ModuleType) -> None:
    for bad in (-0.1, 1.5, float("nan")):
        with pytest.raises(ValueError, match=f"unmasked_weight must be between 0 and 1.*got {bad}"):
            training.TrainSettings(unmasked_weight=bad).validate()
    for fine in (0.0, 0.1, 1.0):
        training.TrainSettings(unmasked_weight=fine).validate()


# --------------------------------------------------------------------------------------------------- row weights
def test_row_weights_scale_each_rows_contribution_exactly(training: ModuleType, model: Any, cache: Any,
                                                          monkeypatch: pytest.MonkeyPatch) -> None:
    """The batch loss is the mean over its rows of (row weight × the row's mean loss), kohya's reduction: weights
    (1, 0) give half the loss and half the LoRA gradient of row a trained alone (a batch of one), and any weights
    (w_a, w_b) give (w_a·g_a + w_b·g_b) / 2."""
    alone = {k: _step(training, model, cache, monkeypatch, dataset=name) for k, name in zip(KEYS, ("a", "b"))}
    only_a = _step(training, model, cache, monkeypatch, weights={KEYS[0]: 1.0, KEYS[1]: 0.0})
    assert sorted(only_a.rows) == sorted(KEYS)
    assert only_a.loss == pytest.approx(alone[KEYS[0]].loss / 2, rel=1e-5)
    # the rows' predictions match their predictions alone (the same sigma, noise and caption per row)
    for key, step in alone.items():
        torch.testing.assert_close(only_a.pred[_row(only_a, key)], step.pred[0], rtol=1e-4, atol=1e-5)
    assert torch.count_nonzero(only_a.pred_grad[_row(only_a, KEYS[1])]) == 0
    nonzero = 0
    for g, ref in zip(only_a.lora_grads, alone[KEYS[0]].lora_grads):
        scale = float(ref.abs().max()) or 1.0
        torch.testing.assert_close(g, ref / 2, rtol=1e-4, atol=1e-5 * scale)
        nonzero += bool(torch.count_nonzero(ref))
    assert nonzero > 0

    w = {KEYS[0]: 0.25, KEYS[1]: 3.0}
    mixed = _step(training, model, cache, monkeypatch, weights=w)
    expected_loss = sum(w[k] * alone[k].loss for k in KEYS) / 2
    assert mixed.loss == pytest.approx(expected_loss, rel=1e-5)
    for i, g in enumerate(mixed.lora_grads):
        ref = sum(w[k] * alone[k].lora_grads[i] for k in KEYS) / 2
        torch.testing.assert_close(g, ref, rtol=1e-4, atol=1e-5 * (float(ref.abs().max()) or 1.0))


def test_row_weights_and_masks_multiply(training: ModuleType, model: Any, cache: Any,
                                        monkeypatch: pytest.MonkeyPatch) -> None:
    """A reg row (weight 2) with a mask: each element weighs row weight × (u + (1 − u)·mask)."""
    u = 0.5
    both = _step(training, model, cache, monkeypatch, masks=_half_mask, unmasked_weight=u,
                 weights={KEYS[0]: 2.0, KEYS[1]: 1.0})
    plain = _step(training, model, cache, monkeypatch)
    w = plain.pred.shape[-1]
    expected = plain.pred_grad.clone()
    expected[..., : w // 2] *= u
    expected[_row(plain, KEYS[0])] *= 2.0
    assert both.rows == plain.rows
    torch.testing.assert_close(both.pred_grad, expected, rtol=1e-5, atol=0)


def test_all_weights_one_run_comfyuis_own_loss_call(training: ModuleType, model: Any, cache: Any,
                                                    monkeypatch: pytest.MonkeyPatch) -> None:
    """Row weights of 1 and no masks take the plain path (ComfyUI's loss module as it is): bit-identical."""
    ones = _step(training, model, cache, monkeypatch, weights={KEYS[0]: 1.0, KEYS[1]: 1.0})
    plain = _step(training, model, cache, monkeypatch)
    assert ones.loss == plain.loss and torch.equal(ones.pred_grad, plain.pred_grad)


def test_a_plan_with_the_wrong_number_of_weights_is_a_clear_error(training: ModuleType, model: Any, cache: Any,
                                                                  monkeypatch: pytest.MonkeyPatch) -> None:
    with pytest.raises(ValueError, match="has 2 rows but 3 loss weights"):
        _step(training, model, cache, monkeypatch,
              weights=lambda plan: (0.5, 1.0, 1.0))  # a sampler bug the step must name


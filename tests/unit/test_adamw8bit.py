"""``dataset_cache.adamw8bit``: bitsandbytes' AdamW8bit step, checked bit for bit against steps bitsandbytes took on
the CPU with its PyTorch quantizer (``tests/unit/data/adamw8bit-reference-v1.safetensors``, written by
``scripts/bnb8bit_reference.py``), and the properties a run needs: chunks that change nothing, layouts kept,
per-tensor step counts, no value read back, fp32 state kept fp32 when a run continues."""

from __future__ import annotations

import json
import re
from pathlib import Path
from typing import Any

import pytest
import torch
from safetensors import safe_open

from bench.bench_step_extras import count
from dataset_cache import blockwise8bit
from dataset_cache.adamw8bit import AdamW8bit, moment_shapes

REFERENCE = Path(__file__).parent / "data" / "adamw8bit-reference-v1.safetensors"
SLOT_NAMES = {"state1": "exp_avg_q", "state2": "exp_avg_sq_q", "absmax1": "exp_avg_absmax",
              "absmax2": "exp_avg_sq_absmax"}
"""bitsandbytes' slot names -> ours (an fp32 tensor's state1/state2 are our exp_avg/exp_avg_sq)."""


def _reference() -> tuple[dict[str, torch.Tensor], dict[str, str]]:
    with safe_open(str(REFERENCE), "pt") as f:
        return {k: f.get_tensor(k) for k in f.keys()}, dict(f.metadata())


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
@pytest.mark.parametrize("run", ["defaults", "decay"])
def test_each_step_is_bitsandbytes(run: str, dtype: torch.dtype) -> None:
    """Three steps over 8-bit tensors of whole and partial blocks, a small tensor with fp32 moments and a vector: the
    weights, the moments' code indices and block scales, and the small tensors' moments equal bitsandbytes' bit for
    bit (fp32 and bf16 weights)."""
    tensors, meta = _reference()
    shapes, steps, settings = json.loads(meta["shapes"]), int(meta["steps"]), json.loads(meta["runs"])[run]
    params = [torch.nn.Parameter(tensors[f"start/{i}"].to(dtype, copy=True)) for i in range(len(shapes))]
    optimizer = AdamW8bit(params, **{**settings, "betas": tuple(settings.get("betas", (0.9, 0.999)))})
    for t in range(steps):
        for i, p in enumerate(params):
            p.grad = tensors[f"grad/{t}/{i}"].to(dtype)
        optimizer.step()
    name = f"{run}/{str(dtype).removeprefix('torch.')}"
    for i, p in enumerate(params):
        assert torch.equal(p.detach(), tensors[f"{name}/param/{i}"]), (name, shapes[i])
        state = optimizer.state[p]
        small = "exp_avg" in state
        for theirs in ("state1", "state2") if small else SLOT_NAMES:
            ours = {"state1": "exp_avg", "state2": "exp_avg_sq"}[theirs] if small else SLOT_NAMES[theirs]
            assert torch.equal(state[ours], tensors[f"{name}/{theirs}/{i}"]), (name, shapes[i], ours)
        assert state["step"] == steps


def test_the_state_shapes_and_kinds_follow_the_size() -> None:
    """A tensor of 4,096 elements or more keeps uint8 indices and a scale per block of 256 (the last partial); a
    smaller one fp32 moments; no step reads a value back to the host (counted as the step benchmarks count)."""
    shapes = [(64, 64), (70, 61), (63, 64), (5,)]
    params = [torch.nn.Parameter(torch.zeros(s)) for s in shapes]
    optimizer = AdamW8bit(params)
    for p in params:
        p.grad = torch.ones_like(p)
    optimizer.step()  # the first step makes the layout (its mask copied to the device once)
    assert count(optimizer.step)[1] == 0
    assert moment_shapes((70, 61)) == {"exp_avg_q": (70, 61), "exp_avg_absmax": (17,), "exp_avg_sq_q": (70, 61),
                                       "exp_avg_sq_absmax": (17,)}
    for p, shape in zip(params, shapes):
        state = optimizer.state[p]
        assert {k: tuple(v.shape) for k, v in state.items() if k != "step"} == moment_shapes(shape)
        assert all(v.dtype == (torch.uint8 if k.endswith("_q") else torch.float32)
                   for k, v in state.items() if k != "step")
        assert state["step"] == 2


def test_chunks_change_nothing(monkeypatch: pytest.MonkeyPatch) -> None:
    """Tensors updated a few per chunk (a chunk of 2,048 elements) end bit for bit where one chunk takes them."""
    def run() -> list[torch.Tensor]:
        g = torch.Generator().manual_seed(5)
        params = [torch.nn.Parameter(torch.randn(s, generator=g)) for s in ((40, 128), (33, 129), (4096,))]
        optimizer = AdamW8bit(params, lr=1e-2)
        for _ in range(3):
            for p in params:
                p.grad = torch.randn(p.shape, generator=g)
            optimizer.step()
        return [p.detach() for p in params]

    whole = run()
    monkeypatch.setattr(blockwise8bit, "CHUNK", 2048)
    assert all(torch.equal(a, b) for a, b in zip(whole, run()))


def test_a_weight_whose_data_is_replaced_is_still_updated() -> None:
    """The step keeps flat views of the weights and moments between steps; a weight given new storage (``.data``
    replaced, as some code swapping weights does) is written, not its old storage: the run equals one without the
    swap."""
    def run(swap: bool) -> list[torch.Tensor]:
        g = torch.Generator().manual_seed(9)
        params = [torch.nn.Parameter(torch.randn(s, generator=g)) for s in ((64, 80), (3, 3))]
        optimizer = AdamW8bit(params, lr=1e-2)
        for step in range(3):
            if swap and step == 2:
                for p in params:
                    p.data = p.data.clone()
            for p in params:
                p.grad = torch.randn(p.shape, generator=g)
            optimizer.step()
        return [p.detach().clone() for p in params]

    assert all(torch.equal(a, b) for a, b in zip(run(False), run(True)))


def test_a_tensor_without_a_gradient_keeps_its_step_count() -> None:
    """bitsandbytes counts steps per tensor: one left out of a step (no gradient) is not moved and its bias
    corrections then follow its own count; the others' update is the same as without it."""
    g = torch.Generator().manual_seed(6)
    start = [torch.randn(64, 64, generator=g), torch.randn(64, 64, generator=g)]
    grads = [torch.randn(64, 64, generator=g) for _ in range(2)]
    both = [torch.nn.Parameter(s.clone()) for s in start]
    alone = torch.nn.Parameter(start[0].clone())
    optimizer, single = AdamW8bit(both), AdamW8bit([alone])
    for step, grad in enumerate(grads):
        both[0].grad, alone.grad = grad.clone(), grad.clone()
        both[1].grad = grad.clone() if step == 1 else None
        optimizer.step()
        single.step()
    assert torch.equal(both[0], alone)
    assert optimizer.state[both[0]]["step"] == 2 and optimizer.state[both[1]]["step"] == 1


def test_steps_of_changing_sets_of_tensors_keep_few_layouts_and_change_nothing(monkeypatch: pytest.MonkeyPatch
                                                                               ) -> None:
    """A run whose layers skip batches (``module_dropout``) steps another set of tensors each time: at most
    ``KEPT_LAYOUTS`` layouts are kept, and the weights equal those of a run that lays them out anew every step."""
    def run() -> tuple[list[torch.Tensor], int]:
        g = torch.Generator().manual_seed(10)
        params = [torch.nn.Parameter(torch.randn(s, generator=g)) for s in ((40, 128), (33, 129), (9, 9), (6,))]
        optimizer = AdamW8bit(params, lr=1e-2)
        for step in range(12):
            for i, p in enumerate(params):
                p.grad = torch.randn(p.shape, generator=g) if (step >> i) & 1 or i == step % 4 else None
            optimizer.step()
        return [p.detach().clone() for p in params], len(optimizer._layouts)

    results = {}
    for limit in (100, 2, 1):  # never dropped; dropped and made again; made anew every step
        monkeypatch.setattr(blockwise8bit, "KEPT_LAYOUTS", limit)
        results[limit], count = run()
        assert count == min(limit, 5)  # 12 steps stepping 5 sets (8-bit and small tensors apart)
    assert all(torch.equal(a, b) for limit in (2, 1) for a, b in zip(results[100], results[limit]))


def test_a_continued_bf16_run_steps_as_the_uninterrupted_one() -> None:
    """The state saved after two steps and loaded into a new optimizer (code indices uint8, scales and small moments
    fp32, as saved) gives the same third step, bit for bit."""
    g = torch.Generator().manual_seed(7)
    starts = [torch.randn(s, generator=g).to(torch.bfloat16) for s in ((64, 96), (12, 12))]
    grads = [[torch.randn(s.shape, generator=g).to(torch.bfloat16) for s in starts] for _ in range(3)]
    whole = [torch.nn.Parameter(s.clone()) for s in starts]
    optimizer = AdamW8bit(whole, lr=0.05)
    for step in grads[:2]:
        for p, grad in zip(whole, step):
            p.grad = grad.clone()
        optimizer.step()
    resumed = [torch.nn.Parameter(p.detach().clone()) for p in whole]
    other = AdamW8bit(resumed, lr=0.05)
    other.load_state_dict(optimizer.state_dict())
    assert {k: v.dtype for k, v in other.state[resumed[1]].items() if k != "step"} == {
        "exp_avg": torch.float32, "exp_avg_sq": torch.float32}
    for params, opt in ((whole, optimizer), (resumed, other)):
        for p, grad in zip(params, grads[2]):
            p.grad = grad.clone()
        opt.step()
    assert all(torch.equal(a, b) for a, b in zip(whole, resumed))


@pytest.mark.parametrize(("settings", "name"), [({"lr": -1.0}, "lr"), ({"betas": (1.0, 0.999)}, "betas[0]"),
                                               ({"betas": (0.9, float("nan"))}, "betas[1]"), ({"eps": -1.0}, "eps"),
                                               ({"weight_decay": -0.1}, "weight_decay"),
                                               ({"min_8bit_size": 0}, "min_8bit_size"),
                                               ({"min_8bit_size": 100.5}, "min_8bit_size")])
def test_bad_settings_are_refused_by_name(settings: dict[str, Any], name: str) -> None:
    with pytest.raises(ValueError, match=re.escape(f"AdamW8bit: invalid {name} ")):
        AdamW8bit([torch.nn.Parameter(torch.zeros(3))], **settings)

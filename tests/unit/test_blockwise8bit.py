"""The 8-bit block-wise machinery AdamW8bit and Lion8bit share (``dataset_cache.blockwise8bit``): the dynamic codes
as bitsandbytes builds them, rounding to the nearest code, the partial block's scaling; and, for each of the two, the
properties a run needs of the shared step: chunks and kept layouts that change nothing, views that follow a replaced
weight, per-tensor step counts, a continued bf16 run."""

from __future__ import annotations

from collections.abc import Callable

import pytest
import torch

from dataset_cache import blockwise8bit
from dataset_cache.adamw8bit import AdamW8bit
from dataset_cache.blockwise8bit import BLOCK, Blockwise8bit, dynamic_code
from dataset_cache.lion8bit import Lion8bit

Make = Callable[[list[torch.nn.Parameter], float], Blockwise8bit]


@pytest.fixture(params=["AdamW8bit", "Lion8bit"])
def make(request: pytest.FixtureRequest) -> Make:
    """Makes the optimizer over parameters at a learning rate."""
    cls = {"AdamW8bit": AdamW8bit, "Lion8bit": Lion8bit}[request.param]
    return lambda params, lr: cls(params, lr=lr)


def test_the_codes_are_dynamic_tree_codes() -> None:
    """256 ascending values each; signed: 127 negative, 0, 127 positive below 1, and 1; unsigned: 0, 254 values in
    (0, 1), and 1; each decade 10⁻⁶..1 holds twice the values of the one below (Dettmers' dynamic tree code)."""
    for signed in (True, False):
        code = dynamic_code(signed)
        assert code.shape == (BLOCK,) and bool((code[1:] > code[:-1]).all())
        assert float(code[-1]) == 1.0 and 0.0 in code.tolist()
        positive = code[(code > 0) & (code < 1)]
        assert len(positive) == (127 if signed else 254)
        counts = [int(((positive >= 10.0 ** (k - 7)) & (positive < 10.0 ** (k - 6))).sum()) for k in range(1, 7)]
        assert all(b == 2 * a for a, b in zip(counts, counts[1:])), counts
        if signed:
            assert torch.equal(code[:127], -positive.flip(0))


def test_a_moment_is_rounded_to_the_nearest_code_value() -> None:
    """Quantizing blocks of values spread over many magnitudes gives, for every value, the code index nearest to it
    over its block's largest magnitude (checked against all 256 codes: the index, or one equally near)."""
    g = torch.Generator().manual_seed(3)
    values = torch.randn(8, BLOCK, generator=g) * torch.logspace(-6, 0, 8).unsqueeze(1)
    values[2, 5:] = 0.0
    layout = blockwise8bit.Layout([torch.zeros(8 * BLOCK)])
    for code, moment in ((dynamic_code(True), values), (dynamic_code(False), values.abs())):
        indices, scales = layout.quantize(moment, (code[:-1] + code[1:]) / 2)
        scaled = moment / moment.abs().amax(1, keepdim=True)
        distance = (scaled.reshape(-1, 1) - code).abs()
        chosen = distance.gather(1, indices.long().unsqueeze(1)).squeeze(1)
        assert torch.equal(chosen, distance.min(1).values)
        assert torch.equal(scales, moment.abs().amax(1))


def test_a_partial_block_is_divided_by_its_scale_and_a_whole_one_multiplied_by_its_inverse() -> None:
    """bitsandbytes' PyTorch quantizer scales a tensor's last, partial block by division and the others by the
    inverse's product, which can put a value on either side of a midpoint: here one (found by search, 0.7 the block's
    largest magnitude) whose two roundings differ, quantized in a partial and in a whole block."""
    code = dynamic_code(True)
    bounds = (code[:-1] + code[1:]) / 2
    largest, value = torch.tensor(0.7), torch.tensor(-0.6606249809265137)
    divided = int(torch.bucketize((value / largest).reshape(1), bounds))
    multiplied = int(torch.bucketize((value * (1.0 / largest)).reshape(1), bounds))
    assert divided != multiplied
    for size, want in ((2, divided), (BLOCK, multiplied)):
        moment = torch.zeros(1, BLOCK)
        moment[0, :2] = torch.stack([largest, value])
        indices, _ = blockwise8bit.Layout([torch.zeros(size)]).quantize(moment, bounds)
        assert int(indices[1]) == want, size


def test_chunks_change_nothing(make: Make, monkeypatch: pytest.MonkeyPatch) -> None:
    """Tensors updated a few per chunk (a chunk of 2,048 elements) end bit for bit where one chunk takes them."""
    def run() -> list[torch.Tensor]:
        g = torch.Generator().manual_seed(5)
        params = [torch.nn.Parameter(torch.randn(s, generator=g)) for s in ((40, 128), (33, 129), (4096,))]
        optimizer = make(params, 1e-2)
        for _ in range(3):
            for p in params:
                p.grad = torch.randn(p.shape, generator=g)
            optimizer.step()
        return [p.detach() for p in params]

    whole = run()
    monkeypatch.setattr(blockwise8bit, "CHUNK", 2048)
    assert all(torch.equal(a, b) for a, b in zip(whole, run()))


def test_a_weight_whose_data_is_replaced_is_still_updated(make: Make) -> None:
    """The step keeps flat views of the weights and moments between steps; a weight given new storage (``.data``
    replaced, as some code swapping weights does) is written, not its old storage: the run equals one without the
    swap."""
    def run(swap: bool) -> list[torch.Tensor]:
        g = torch.Generator().manual_seed(9)
        params = [torch.nn.Parameter(torch.randn(s, generator=g)) for s in ((64, 80), (3, 3))]
        optimizer = make(params, 1e-2)
        for step in range(3):
            if swap and step == 2:
                for p in params:
                    p.data = p.data.clone()
            for p in params:
                p.grad = torch.randn(p.shape, generator=g)
            optimizer.step()
        return [p.detach().clone() for p in params]

    assert all(torch.equal(a, b) for a, b in zip(run(False), run(True)))


def test_a_tensor_without_a_gradient_keeps_its_step_count(make: Make) -> None:
    """bitsandbytes counts steps per tensor: one left out of a step (no gradient) is not moved and (AdamW8bit) its
    bias corrections then follow its own count; the others' update is the same as without it."""
    g = torch.Generator().manual_seed(6)
    start = [torch.randn(64, 64, generator=g), torch.randn(64, 64, generator=g)]
    grads = [torch.randn(64, 64, generator=g) for _ in range(2)]
    both = [torch.nn.Parameter(s.clone()) for s in start]
    alone = torch.nn.Parameter(start[0].clone())
    optimizer, single = make(both, 1e-3), make([alone], 1e-3)
    for step, grad in enumerate(grads):
        both[0].grad, alone.grad = grad.clone(), grad.clone()
        both[1].grad = grad.clone() if step == 1 else None
        optimizer.step()
        single.step()
    assert torch.equal(both[0], alone)
    assert optimizer.state[both[0]]["step"] == 2 and optimizer.state[both[1]]["step"] == 1


def test_steps_of_changing_sets_of_tensors_keep_few_layouts_and_change_nothing(make: Make,
                                                                               monkeypatch: pytest.MonkeyPatch) -> None:
    """A run whose layers skip batches (``module_dropout``) steps another set of tensors each time: at most
    ``KEPT_LAYOUTS`` layouts are kept, and the weights equal those of a run that lays them out anew every step."""
    def run() -> tuple[list[torch.Tensor], int]:
        g = torch.Generator().manual_seed(10)
        params = [torch.nn.Parameter(torch.randn(s, generator=g)) for s in ((40, 128), (33, 129), (9, 9), (6,))]
        optimizer = make(params, 1e-2)
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


def test_a_continued_bf16_run_steps_as_the_uninterrupted_one(make: Make) -> None:
    """The state saved after two steps and loaded into a new optimizer (code indices uint8, scales and small moments
    fp32, as saved) gives the same third step, bit for bit."""
    g = torch.Generator().manual_seed(7)
    starts = [torch.randn(s, generator=g).to(torch.bfloat16) for s in ((64, 96), (12, 12))]
    grads = [[torch.randn(s.shape, generator=g).to(torch.bfloat16) for s in starts] for _ in range(3)]
    whole = [torch.nn.Parameter(s.clone()) for s in starts]
    optimizer = make(whole, 0.05)
    for step in grads[:2]:
        for p, grad in zip(whole, step):
            p.grad = grad.clone()
        optimizer.step()
    resumed = [torch.nn.Parameter(p.detach().clone()) for p in whole]
    other = make(resumed, 0.05)
    other.load_state_dict(optimizer.state_dict())
    for p in resumed:  # 8-bit: indices uint8, scales fp32; small: fp32 moments
        assert all(v.dtype == (torch.uint8 if k.endswith("_q") else torch.float32)
                   for k, v in other.state[p].items() if k != "step")
    assert not any(k.endswith("_q") for k in other.state[resumed[1]])
    for params, opt in ((whole, optimizer), (resumed, other)):
        for p, grad in zip(params, grads[2]):
            p.grad = grad.clone()
        opt.step()
    assert all(torch.equal(a, b) for a, b in zip(whole, resumed))

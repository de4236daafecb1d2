"""The 8-bit block-wise machinery AdamW8bit and Lion8bit share (``dataset_cache.blockwise8bit``): the dynamic codes
as bitsandbytes builds them, rounding to the nearest code, and the partial block's scaling."""

from __future__ import annotations

import torch

from dataset_cache import blockwise8bit
from dataset_cache.blockwise8bit import BLOCK, dynamic_code


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

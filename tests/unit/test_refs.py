"""LazyTensor refuses every use but metadata and materialize(); materialize() batches per reader."""

from __future__ import annotations

import copy
import operator
import pickle

import numpy as np
import pytest
import torch

from dataset_cache.errors import MaterializeRequired
from dataset_cache.refs import LazyTensor, is_lazy, materialize


class FakeSource:
    def __init__(self):
        self.calls = []

    def _read_lazy(self, lazies):
        self.calls.append(len(lazies))
        return [torch.full(tuple(lz.shape), float(lz._loc), dtype=lz.dtype) for lz in lazies]


@pytest.fixture
def lazy():
    return LazyTensor(FakeSource(), 7, torch.Size([1, 4, 8, 8]), torch.float16, "abc")


def test_metadata_without_io(lazy):
    assert lazy.shape == (1, 4, 8, 8) and lazy.dtype == torch.float16 and lazy.nbytes == 512
    assert lazy.ndim == 4 and lazy.dim() == 4 and lazy.size(1) == 4 and lazy.numel() == 256
    assert lazy.element_size() == 2 and lazy.entry == "abc"
    assert "LazyTensor(shape=[1, 4, 8, 8]" in repr(lazy)
    assert lazy._source.calls == []
    assert {lazy: 1}[lazy] == 1  # hashable by identity


MISUSES = {
    "add": lambda x: x + 1, "radd": lambda x: 1 + x, "iadd": lambda x: operator.iadd(x, 1), "mul": lambda x: x * 2,
    "matmul": lambda x: x @ x, "neg": lambda x: -x, "lt": lambda x: x < 1, "eq": lambda x: x == 1,
    "index": lambda x: x[0], "setitem": lambda x: x.__setitem__(0, 1), "bool": bool, "len": len, "iter": iter,
    "float": float, "int": int, "contains": lambda x: 1 in x, "pickle": pickle.dumps, "deepcopy": copy.deepcopy,
    "copy": copy.copy, "torch.add": lambda x: torch.add(x, 1), "torch.stack": lambda x: torch.stack([x, x]),
    "tensor+lazy": lambda x: torch.ones(1) + x, "torch.cat": lambda x: torch.cat([torch.ones(1), x]),
    "as_tensor": torch.as_tensor, "numpy": np.asarray, "method": lambda x: x.to("cpu"), "attr": lambda x: x.device,
    "setattr": lambda x: setattr(x, "shape", 1), "call": lambda x: x(),
}


@pytest.mark.parametrize("name", sorted(MISUSES))
def test_every_other_use_raises_materialize_required(lazy, name):
    with pytest.raises(MaterializeRequired, match=r"call materialize\(\) first"):
        MISUSES[name](lazy)


def test_hasattr_stays_well_behaved(lazy):
    assert not hasattr(lazy, "to") and hasattr(lazy, "materialize")


def test_materialize_one_and_structures(lazy):
    t = lazy.materialize()
    assert t.shape == (1, 4, 8, 8) and t.dtype == torch.float16 and float(t.flatten()[0]) == 7.0
    src = FakeSource()
    a = LazyTensor(src, 1, torch.Size([2]), torch.float32, "a")
    b = LazyTensor(src, 2, torch.Size([]), torch.bfloat16, "b")
    value = [[a, {"pooled_output": b, "x": (a, 3)}], "s"]
    assert is_lazy(value) and not is_lazy([1, (2,), {"t": torch.ones(1)}])
    got = materialize(value)
    assert src.calls == [3]  # one batch for all leaves of one source
    assert torch.equal(got[0][0], torch.ones(2)) and got[0][1]["pooled_output"].dtype == torch.bfloat16
    assert type(got[0][1]["x"]) is tuple and got[0][1]["x"][1] == 3 and got[1] == "s"
    assert value[0][0] is a  # input untouched
    plain = {"t": torch.ones(1)}
    assert materialize(plain) is plain

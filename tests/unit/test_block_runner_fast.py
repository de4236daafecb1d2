"""The block runners' opt-in "fast" checkpoint (``BlockRunners(reentrant=True)``: torch's reentrant checkpoint).

Against the default (non-reentrant) form, on the CPU in fp32: the same losses bit for bit (the forward runs the
same kernels on the same values), every gradient that is not summed over several blocks bit for bit, and the
gradient of a tensor every block reads equal within the bound of reassociating its per-use terms (derived at
:func:`test_fast_matches_exact_within_the_reassociation_bound`). Also: fast really takes the reentrant path; a
call with no grad-requiring tensor falls back (its block's parameters still get gradients); outputs nested in
lists and dicts keep their gradients; saved-tensor hooks in force around the backward (host activations) are not
applied to the recompute's tensors; a streamed block's weights are entered and left as in the default form.
"""

from __future__ import annotations

import contextlib
import sys
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.utils.checkpoint
from torch import nn

from dataset_cache import block_runner
from dataset_cache.block_runner import BlockRunners
from dataset_cache.host_activations import HostActivations
from dataset_cache.transfers import SyncTransfers

sys.path.insert(0, str(Path(__file__).parent))
import test_weight_stream as ws  # its model, stand-in device and setup

DIM = 8
BLOCKS = 5
EPS = torch.finfo(torch.float32).eps


class Block(nn.Module):
    """Reads the shared ``emb`` twice (as a UNet block reads its timestep embedding, or attention its context
    through k and v): its gradient is summed over uses within the block, then over blocks. ``taps``: each use
    goes through a same-shape view whose gradient hook records the use's own term (the same numbers: a view's
    backward is a reshape)."""

    def __init__(self, gen: torch.Generator) -> None:
        super().__init__()
        self.fc1 = nn.Linear(DIM, DIM)
        self.fc2 = nn.Linear(DIM, DIM)
        with torch.no_grad():
            for p in self.parameters():
                p.copy_(torch.randn(p.shape, generator=gen) * 0.5)

    def forward(self, x: torch.Tensor, emb: torch.Tensor, taps: list[torch.Tensor] | None = None) -> torch.Tensor:
        first, second = (_tap(emb, taps), _tap(emb, taps)) if taps is not None else (emb, emb)
        h = torch.tanh(self.fc1(x + first))
        return x + self.fc2(h) * (1.0 + second)


def _tap(emb: torch.Tensor, taps: list[torch.Tensor]) -> torch.Tensor:
    view = emb.view_as(emb)
    view.register_hook(lambda g: taps.append(g.detach().clone()))
    return view


class Model(nn.Module):
    def __init__(self, seed: int = 0) -> None:
        super().__init__()
        gen = torch.Generator().manual_seed(seed)
        self.emb = nn.Parameter(torch.randn(DIM, generator=gen))
        self.blocks = nn.ModuleList([Block(gen) for _ in range(BLOCKS)])

    def forward(self, x: torch.Tensor, taps: list[torch.Tensor] | None = None) -> torch.Tensor:
        for block in self.blocks:
            x = block(x, self.emb, taps=taps) if taps is not None else block(x, self.emb)
        return x


def _inputs() -> torch.Tensor:
    return torch.randn(3, 4, DIM, generator=torch.Generator().manual_seed(1)).requires_grad_(True)


def _step(*, checkpoint: bool = True, reentrant: bool = False, around: Callable[[], Any] = contextlib.nullcontext
          ) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """One forward and backward of a fresh model (``around``: entered around both); the loss and every gradient
    (the input's under ``"x"``)."""
    model = Model()
    runners = BlockRunners(list(model.blocks), checkpoint=checkpoint, reentrant=reentrant)
    x = _inputs()
    try:
        with around():
            loss = model(x).square().mean()
            loss.backward()
    finally:
        runners.remove()
    grads = {n: p.grad for n, p in model.named_parameters()}
    assert all(g is not None for g in grads.values())
    return loss.detach(), {**grads, "x": x.grad}  # type: ignore[dict-item]


@contextlib.contextmanager
def _spy(monkeypatch: pytest.MonkeyPatch) -> Iterator[list[bool]]:
    """The ``use_reentrant`` of every checkpoint the runners take."""
    seen: list[bool] = []
    real = torch.utils.checkpoint.checkpoint

    def checkpoint(*args: Any, use_reentrant: bool, **kwargs: Any) -> Any:
        seen.append(use_reentrant)
        return real(*args, use_reentrant=use_reentrant, **kwargs)

    with monkeypatch.context() as patch:
        patch.setattr(torch.utils.checkpoint, "checkpoint", checkpoint)
        yield seen


def test_fast_matches_exact_within_the_reassociation_bound(monkeypatch: pytest.MonkeyPatch) -> None:
    with _spy(monkeypatch) as modes:
        exact_loss, exact = _step()
        assert modes == [False] * BLOCKS
        modes.clear()
        fast_loss, fast = _step(reentrant=True)
        assert modes == [True] * BLOCKS  # fast really took the reentrant path, for every block
    plain_loss, plain = _step(checkpoint=False)
    assert torch.equal(exact_loss, fast_loss) and torch.equal(plain_loss, exact_loss)
    # Each block's own parameters (one use each) and the input are computed by the same kernels on the same values
    # in both forms (a block's backward is the same graph; only where it hangs changes): bit for bit.
    for name in exact:
        if name != "emb":
            assert torch.equal(exact[name], fast[name]), name
    # emb's gradient is the sum of the same U = 2 x BLOCKS terms (one per use, each computed identically) in two
    # association orders: use by use (exact), or per block then across blocks (fast). A recursive fp32 sum of U
    # terms is within gamma_(U-1) * sum|t| of the true sum (gamma_k = k*u/(1-k*u), u = eps/2), so the two are within
    # 2 * gamma_(U-1) * sum|t| < U * eps * sum|t| of each other, elementwise. The terms come from a plain pass that
    # taps every use.
    taps: list[torch.Tensor] = []
    model = Model()
    model(_inputs(), taps=taps).square().mean().backward()
    assert len(taps) == 2 * BLOCKS
    assert model.emb.grad is not None and torch.equal(model.emb.grad, plain["emb"])  # the taps change nothing
    bound = len(taps) * EPS * torch.stack(taps).abs().sum(0)
    assert bool(((exact["emb"] - fast["emb"]).abs() <= bound).all()), (exact["emb"] - fast["emb"], bound)
    assert torch.equal(exact["emb"], plain["emb"])  # exact stays bit-identical to no checkpoint at all


def test_a_call_without_grad_requiring_inputs_keeps_the_non_reentrant_form(monkeypatch: pytest.MonkeyPatch) -> None:
    """The reentrant checkpoint would return an output without a graph: the block's parameters would get no
    gradient. Nothing requires a gradient here but the blocks' own weights."""
    block = Block(torch.Generator().manual_seed(2))
    runners = BlockRunners([block], checkpoint=True, reentrant=True)
    try:
        with _spy(monkeypatch) as modes:
            block(torch.ones(2, DIM), torch.zeros(DIM)).sum().backward()
    finally:
        runners.remove()
    assert modes == [False]
    assert all(p.grad is not None and bool(p.grad.abs().sum() > 0) for p in block.parameters())


class Nested(nn.Module):
    """Returns its results nested in a dict and a list, next to values that are not tensors."""

    def __init__(self) -> None:
        super().__init__()
        self.fc = nn.Linear(DIM, DIM)

    def forward(self, x: torch.Tensor) -> dict[str, Any]:
        h = self.fc(x)
        return {"out": [torch.tanh(h), None, 3], "aux": {"sq": h.square()}, "name": "nested"}


def _nested_step(reentrant: bool) -> tuple[dict[str, Any], dict[str, torch.Tensor]]:
    torch.manual_seed(0)
    block = Nested()
    runners = BlockRunners([block], checkpoint=True, reentrant=reentrant)
    x = torch.randn(2, DIM, generator=torch.Generator().manual_seed(3)).requires_grad_(True)
    try:
        out = block(x)
        (out["out"][0].sum() + out["aux"]["sq"].mean()).backward()
    finally:
        runners.remove()
    return out, {"x": x.grad, **{n: p.grad for n, p in block.named_parameters()}}  # type: ignore[dict-item]


def test_nested_outputs_keep_their_structure_and_gradients() -> None:
    exact_out, exact = _nested_step(reentrant=False)
    fast_out, fast = _nested_step(reentrant=True)
    assert fast_out["out"][1:] == [None, 3] and fast_out["name"] == "nested"
    assert fast_out["out"][0].requires_grad and fast_out["aux"]["sq"].requires_grad
    assert torch.equal(fast_out["out"][0], exact_out["out"][0])
    # no tensor is read by several checkpoints here: the same gradients bit for bit
    assert exact.keys() == fast.keys() and all(torch.equal(exact[k], fast[k]) for k in exact)


def _counting_hooks(phase: list[str], packs: dict[str, int]) -> Callable[[], Any]:
    def pack(t: torch.Tensor) -> torch.Tensor:
        packs[phase[0]] += 1
        return t

    def around() -> Any:
        return torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t)
    return around


def test_hooks_around_the_backward_do_not_see_the_recompute(monkeypatch: pytest.MonkeyPatch) -> None:
    """As a test meter or host activations would if entered around the whole step: the recompute's tensors (a
    block's full activations, unpacked at once by its inner backward) are saved as they are."""
    phase, packs = ["forward"], {"forward": 0, "backward": 0}
    hooks = _counting_hooks(phase, packs)

    def step() -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
        model = Model()
        runners = BlockRunners(list(model.blocks), checkpoint=True, reentrant=True)
        x = _inputs()
        try:
            with hooks():
                phase[0] = "forward"
                loss = model(x).square().mean()
                phase[0] = "backward"
                loss.backward()
        finally:
            runners.remove()
        return loss.detach(), {n: p.grad for n, p in model.named_parameters()}  # type: ignore[misc]

    loss, grads = step()
    assert packs["forward"] > 0 and packs["backward"] == 0, packs
    _, fast = _step(reentrant=True)
    assert all(torch.equal(grads[n], fast[n]) for n in grads)
    # without the lift the same hooks see every tensor the recompute saves: what the test guards
    packs.update(forward=0, backward=0)
    monkeypatch.setattr(block_runner, "_hooks_lifted", contextlib.nullcontext)
    step()
    assert packs["backward"] > 0


def test_host_activations_offload_only_the_forwards_tensors() -> None:
    """HostActivations entered around forward and backward: what the recompute saves stays where it is; the
    results are those of a step without them."""
    host = HostActivations(SyncTransfers("cpu"), min_bytes=0)
    offloaded: list[int] = []

    @contextlib.contextmanager
    def around() -> Iterator[None]:
        with host.hooks():
            yield
        offloaded.append(host.offloaded_bytes)

    loss, grads = _step(reentrant=True, around=around)
    plain_loss, plain = _step(reentrant=True)
    assert torch.equal(loss, plain_loss) and all(torch.equal(grads[k], plain[k]) for k in grads)
    # forward alone: each checkpoint saves its inputs (x, emb), the loss its own few; the recompute adds nothing
    model = Model()
    runners = BlockRunners(list(model.blocks), checkpoint=True, reentrant=True)
    forward_only = HostActivations(SyncTransfers("cpu"), min_bytes=0)
    try:
        with forward_only.hooks():
            loss = model(_inputs()).square().mean()
        loss.backward()
    finally:
        runners.remove()
    assert offloaded == [forward_only.offloaded_bytes] and forward_only.offloaded_bytes > 0


def test_hooks_are_only_lifted_where_some_are_in_force() -> None:
    """An identity pair costs two Python calls per saved tensor: not pushed when no hooks are in force."""
    assert isinstance(block_runner._hooks_lifted(), contextlib.nullcontext)
    with torch.autograd.graph.saved_tensors_hooks(lambda t: t, lambda t: t):
        assert isinstance(block_runner._hooks_lifted(), torch.autograd.graph.saved_tensors_hooks)


class Order:
    """A streamer that records its calls."""

    def __init__(self) -> None:
        self.calls: list[tuple[str, int, bool]] = []

    def enter(self, index: int, *, recompute: bool) -> None:
        self.calls.append(("enter", index, recompute))

    def leave(self, index: int, *, recompute: bool) -> None:
        self.calls.append(("leave", index, recompute))


def test_streamer_enter_and_leave_around_forward_and_recompute() -> None:
    model = Model()
    runners = BlockRunners(list(model.blocks), checkpoint=True, reentrant=True)
    order = Order()
    runners.streamer, runners.streamed = order, {i: i for i in range(BLOCKS)}
    try:
        model(_inputs()).square().mean().backward()
    finally:
        runners.remove()
    forward = [(what, i, False) for i in range(BLOCKS) for what in ("enter", "leave")]
    recompute = [(what, i, True) for i in reversed(range(BLOCKS)) for what in ("enter", "leave")]
    assert order.calls == forward + recompute


def test_streamed_weights_with_fast_checkpoints_train_as_without_streaming() -> None:
    """The weight streamer's real ring (two slots, every block streamed) under the fast form: each block computes
    from a device slot in its forward and its recompute, and the losses and gradients equal the unstreamed fast
    run's bit for bit (a slot overwritten before the recompute's inner backward read it would change them)."""
    runs = []
    for streamed in ((), tuple(range(6))):
        model = ws.Model(blocks=6)
        transfers = ws.Recording()
        seen: list[int] = []

        def check(index: int, model: ws.Model = model, transfers: ws.Recording = transfers,
                  seen: list[int] = seen, streamed: tuple[int, ...] = streamed) -> Any:
            def hook(_module: nn.Module, _args: Any) -> None:
                on_device = [transfers.on_device(t) for _o, _n, t in ws.block_tensors(model.blocks[index])]
                assert all(on_device) if streamed else not any(on_device), index
                seen.append(index)
            return hook

        handles = [b.fc2.register_forward_pre_hook(check(i)) for i, b in enumerate(model.blocks)]
        with ws.setup(model, checkpoint=True, streamed=streamed, transfers=transfers) as (runners, _offload):
            runners.reentrant = True
            x = torch.randn(4, 8, ws.DIM, generator=torch.Generator().manual_seed(5)).requires_grad_(True)
            context = torch.randn(4, 8, ws.DIM, generator=torch.Generator().manual_seed(6))
            loss = model(x, context).square().mean()
            loss.backward()
        for h in handles:
            h.remove()
        assert seen == [0, 1, 2, 3, 4, 5, 5, 4, 3, 2, 1, 0]  # each forward, then each recompute
        assert len(transfers.device_buffers) == (2 if streamed else 0)
        runs.append((loss.detach(), [p.grad for p in model.adapters.parameters()]))
    (a, ga), (b, gb) = runs
    assert torch.equal(a, b) and all(g is not None and torch.equal(g, h) for g, h in zip(ga, gb))

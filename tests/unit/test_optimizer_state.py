"""dataset_cache.optimizer_state: a LoRA's training state as safetensors (no pickle), read back exactly, and every
hostile file refused with a reason: wrong shapes, NaN, missing keys, a header that lies, another LoRA's state."""

from __future__ import annotations

import dataclasses
import json
import math
import os
import struct
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

from dataset_cache.optimizer_state import (
    METADATA_KEY,
    TrainState,
    TrainStateError,
    capture_optimizer,
    check_average_fits,
    check_fits,
    lora_digest,
    optimizer_state_dict,
    read_train_state,
    write_train_state,
)
from dataset_cache.train_state_store import TrainStateStore

BIG = 1 << 30


def _params(seed: int = 0) -> dict[str, torch.nn.Parameter]:
    """LoRA-shaped parameters named as ComfyUI's LoRA keys (the order differs from the sorted one on purpose)."""
    g = torch.Generator().manual_seed(seed)
    return {
        "diffusion_model.b.lora_up.weight": torch.nn.Parameter(torch.randn(6, 2, generator=g)),
        "diffusion_model.a.lora_down.weight": torch.nn.Parameter(torch.randn(2, 5, generator=g)),
        "diffusion_model.a.alpha": torch.nn.Parameter(torch.tensor(2.0)),
    }


def _steps(optimizer: torch.optim.Optimizer, params: dict[str, torch.nn.Parameter], first: int, n: int) -> None:
    """``n`` steps of a fixed quadratic loss whose gradients depend on the step number only."""
    for step in range(first, first + n):
        g = torch.Generator().manual_seed(100 + step)
        loss = sum(((params[k] - torch.randn(params[k].shape, generator=g)) ** 2).sum() for k in sorted(params))
        optimizer.zero_grad()
        loss.backward()  # type: ignore[union-attr]
        optimizer.step()


def _make(name: str, params: dict[str, torch.nn.Parameter]) -> torch.optim.Optimizer:
    return {"AdamW": torch.optim.AdamW, "Adam": torch.optim.Adam, "SGD": torch.optim.SGD,
            "RMSprop": torch.optim.RMSprop}[name](params.values(), lr=0.01)


def _state(params: dict[str, torch.nn.Parameter], optimizer: torch.optim.Optimizer, name: str = "AdamW",
           **kw: object) -> TrainState:
    slots, groups = capture_optimizer(optimizer.state_dict(), list(params))
    lora = {k: v.detach() for k, v in params.items()}
    fields = {"steps": 3, "batches": 6, "sampler": {"epoch": 1}, "scaler": None, **kw}
    return TrainState(lora_digest(lora), name, fields["steps"], fields["batches"], slots, groups,  # type: ignore
                      fields["sampler"], fields["scaler"])  # type: ignore[arg-type]


@pytest.mark.parametrize("name", ["AdamW", "Adam", "RMSprop"])
def test_three_plus_three_steps_equal_six_bit_for_bit(tmp_path: Path, name: str) -> None:
    straight = _params()
    opt = _make(name, straight)
    _steps(opt, straight, 0, 6)

    first = _params()
    opt = _make(name, first)
    _steps(opt, first, 0, 3)
    state = _state(first, opt, name)
    write_train_state(tmp_path / "s.safetensors", state)
    lora = {k: v.detach().clone() for k, v in first.items()}  # what the LoRA file gives back

    # a new process: fresh parameters (from the LoRA), a fresh optimizer, in ANOTHER order
    again = {k: torch.nn.Parameter(lora[k].clone()) for k in reversed(list(lora))}
    read = read_train_state(tmp_path / "s.safetensors", digest=lora_digest(lora), max_bytes=BIG)
    assert (read.steps, read.batches, read.sampler, read.optimizer) == (3, 6, {"epoch": 1}, name)
    opt = _make(name, again)
    assert check_fits(read, name, again) is None
    opt.load_state_dict(optimizer_state_dict(read, list(again), opt.state_dict()))
    _steps(opt, again, 3, 3)
    assert all(torch.equal(again[k], straight[k]) for k in straight)


def test_the_file_is_plain_safetensors_named_by_parameter(tmp_path: Path) -> None:
    params = _params()
    opt = _make("AdamW", params)
    _steps(opt, params, 0, 2)
    write_train_state(tmp_path / "s.safetensors", _state(params, opt))
    tensors = load_file(str(tmp_path / "s.safetensors"))  # any safetensors reader opens it
    assert set(tensors) == {f"{slot}/{k}" for k in params for slot in ("step", "exp_avg", "exp_avg_sq")}
    assert torch.equal(tensors["exp_avg/diffusion_model.a.alpha"], opt.state[params["diffusion_model.a.alpha"]]
                       ["exp_avg"])
    assert not list(tmp_path.glob(".*.tmp"))  # written through a temp file, renamed


def test_the_digest_is_the_content(tmp_path: Path) -> None:
    lora = {k: v.detach() for k, v in _params().items()}
    save_file(lora, str(tmp_path / "a.safetensors"))
    assert lora_digest(load_file(str(tmp_path / "a.safetensors"))) == lora_digest(lora)  # a copy, any name
    changed = dict(lora)
    changed["diffusion_model.a.alpha"] = torch.tensor(2.0000002)
    assert lora_digest(changed) != lora_digest(lora)
    assert lora_digest({**lora, "diffusion_model.a.alpha": torch.tensor(2.0, dtype=torch.float64)}) != \
        lora_digest(lora)


# ------------------------------------------------------------------------------------------------ hostile files
@pytest.fixture
def saved(tmp_path: Path) -> tuple[Path, dict[str, torch.nn.Parameter], str]:
    params = _params()
    opt = _make("AdamW", params)
    _steps(opt, params, 0, 2)
    state = _state(params, opt)
    path = tmp_path / f"{state.lora_digest}.safetensors"
    write_train_state(path, state)
    return path, params, state.lora_digest


def _rewrite(path: Path, tensors: dict[str, torch.Tensor] | None = None, meta: dict | None = None) -> None:
    from safetensors import safe_open

    with safe_open(str(path), "pt") as f:
        metadata = dict(f.metadata())
        old = {k: f.get_tensor(k) for k in f.keys()}
    if meta is not None:
        metadata[METADATA_KEY] = json.dumps(meta)
    save_file(tensors if tensors is not None else old, str(path), metadata)


def _meta(path: Path) -> dict:
    from safetensors import safe_open

    with safe_open(str(path), "pt") as f:
        return json.loads(f.metadata()[METADATA_KEY])


def test_moments_of_another_shape_do_not_fit(saved) -> None:
    path, params, digest = saved
    tensors = load_file(str(path))
    key = "exp_avg/diffusion_model.b.lora_up.weight"
    _rewrite(path, {**tensors, key: tensors[key].T.contiguous()})
    state = read_train_state(path, digest=digest, max_bytes=BIG)  # a well-formed file ...
    assert check_fits(state, "AdamW", params) == ("its exp_avg of 'diffusion_model.b.lora_up.weight' has shape "
                                                  "[2, 6], the parameter [6, 2]")  # ... that does not fit
    assert check_fits(state, "SGD", params) == "it was saved for AdamW, this run uses SGD"
    fewer = {k: v for k, v in params.items() if "alpha" not in k}
    assert "it holds state for 'diffusion_model.a.alpha', which this run does not train" in str(
        check_fits(state, "AdamW", fewer))


@pytest.mark.parametrize("value", [float("nan"), float("inf")])
def test_nan_and_infinite_values_are_refused(saved, value: float) -> None:
    path, _params_, digest = saved
    tensors = load_file(str(path))
    key = "exp_avg_sq/diffusion_model.a.lora_down.weight"
    bad = tensors[key].clone()
    bad[0, 0] = value
    _rewrite(path, {**tensors, key: bad})
    with pytest.raises(TrainStateError, match=f"tensor '{key}' holds NaN or infinite values"):
        read_train_state(path, digest=digest, max_bytes=BIG)


@pytest.mark.parametrize(("change", "message"), [
    (lambda m: m.pop("steps"), "its metadata has no 'steps'"),
    (lambda m: m.pop("sampler"), "its metadata has no 'sampler'"),
    (lambda m: m.update(batches=-1), "its metadata's batches is not valid"),
    (lambda m: m.update(steps=2.5), "its metadata's steps is not valid"),
    (lambda m: m.update(optimizer="PagedAdEMAMix8bit"), "its metadata's optimizer is not valid"),
    (lambda m: m.update(format="other"), "is not a StreamCache training state"),
    (lambda m: m.update(version=2), "has version 2; this version reads 1"),
    (lambda m: m.update(lora_digest="0" * 32), "was written for another LoRA"),
    (lambda m: m.update(param_groups=[{"params": ["x", "x"]}]), "a parameter is listed in two parameter groups"),
    (lambda m: m.update(param_groups=[{"params": [0, 1]}]), "does not list its parameters by name"),
    (lambda m: m.update(lr_schedule=[]), "its metadata's lr_schedule is not valid"),
    (lambda m: m.update(lr_schedule={"kind": "cosine"}), "its metadata's lr_schedule is not valid"),
    (lambda m: m.update(lr_schedule={**_SCHEDULE, "warmup_steps": -1}), "its metadata's lr_schedule is not valid"),
    (lambda m: m.update(lr_schedule={**_SCHEDULE, "learning_rate": "1e-4"}), "its metadata's lr_schedule is not"),
])
def test_missing_or_lying_metadata_is_refused(saved, change, message: str) -> None:
    path, _params_, digest = saved
    meta = _meta(path)
    change(meta)
    _rewrite(path, meta=meta)
    with pytest.raises(TrainStateError, match=message):
        read_train_state(path, digest=digest, max_bytes=BIG)


_SCHEDULE = {"kind": "cosine", "learning_rate": 1e-4, "warmup_steps": 10, "total_steps": 100}


def test_the_schedule_a_run_trained_with_is_read_back_and_optional(saved) -> None:
    """A state records its run's learning-rate schedule (a continued run compares its own); a state written before
    it was recorded reads as ``None``; a later version's schedule kind is kept for the caller to judge, not refused."""
    path, _params_, digest = saved
    assert read_train_state(path, digest=digest, max_bytes=BIG).lr_schedule is None  # written without one
    state = read_train_state(path, digest=digest, max_bytes=BIG)
    write_train_state(path, dataclasses.replace(state, lr_schedule=_SCHEDULE))
    assert _meta(path)["lr_schedule"] == _SCHEDULE
    assert read_train_state(path, digest=digest, max_bytes=BIG).lr_schedule == _SCHEDULE
    later = {**_SCHEDULE, "kind": "one-cycle"}
    _rewrite(path, meta={**_meta(path), "lr_schedule": later})
    assert read_train_state(path, digest=digest, max_bytes=BIG).lr_schedule == later


def _averaged(params: dict[str, torch.nn.Parameter]) -> dict:
    return {"ema_decay": 0.99, "weights": {k: v.detach().clone() for k, v in params.items()},
            "average": {k: v.detach().double().add(0.5).float() for k, v in params.items()}}


def test_an_averaging_runs_weights_and_average_are_read_back_exactly(saved) -> None:
    """A run that averaged its weights saves the trained values and the fp32 average beside the optimizer's state
    (``weights/<key>``, ``average/<key>``, metadata ``ema_decay``); a state without them reads as before."""
    path, params, digest = saved
    plain = read_train_state(path, digest=digest, max_bytes=BIG)
    assert (plain.ema_decay, plain.weights, plain.average) == (None, {}, {})
    write_train_state(path, dataclasses.replace(plain, **_averaged(params)))
    assert _meta(path)["ema_decay"] == 0.99
    assert {k.partition("/")[0] for k in load_file(str(path))} >= {"weights", "average", "exp_avg"}
    state = read_train_state(path, digest=digest, max_bytes=BIG)
    expected = _averaged(params)
    assert state.ema_decay == 0.99 and state.slots.keys() == plain.slots.keys()
    for slot in ("weights", "average"):
        got = getattr(state, slot)
        assert got.keys() == expected[slot].keys()
        assert all(torch.equal(got[k], expected[slot][k]) for k in got)
    assert check_average_fits(state, params) is None
    fewer = {k: v for k, v in params.items() if "alpha" not in k}
    assert check_average_fits(state, fewer) == ("its weights name other parameters than this run trains (e.g. "
                                                "'diffusion_model.a.alpha')")
    wider = {**params, "diffusion_model.b.lora_up.weight": torch.zeros(6, 3)}
    assert check_average_fits(state, wider) == ("its weights of 'diffusion_model.b.lora_up.weight' has shape [6, 2], "
                                                "the parameter [6, 3]")


@pytest.mark.parametrize(("change", "message"), [
    (lambda t, m: m.update(ema_decay=1.0), "its metadata's ema_decay is not valid"),
    (lambda t, m: m.update(ema_decay="0.99"), "its metadata's ema_decay is not valid"),
    (lambda t, m: m.pop("ema_decay"), "tensor 'average/diffusion_model.a.alpha' is not <slot>/<parameter>"),
    (lambda t, m: t.pop("weights/diffusion_model.a.alpha"), "its weights/ and average/ tensors name different"),
    (lambda t, m: t.update({"average/diffusion_model.a.alpha": torch.tensor(math.nan)}), "holds NaN or infinite"),
])
def test_a_lying_average_is_refused(saved, change, message: str) -> None:
    path, params, digest = saved
    write_train_state(path, dataclasses.replace(read_train_state(path, digest=digest, max_bytes=BIG),
                                                **_averaged(params)))
    tensors, meta = load_file(str(path)), _meta(path)
    change(tensors, meta)
    _rewrite(path, tensors, meta)
    with pytest.raises(TrainStateError, match=message):
        read_train_state(path, digest=digest, max_bytes=BIG)


def test_a_file_without_our_metadata_or_with_bad_json_is_refused(saved) -> None:
    path, params, digest = saved
    save_file({k: v.detach() for k, v in params.items()}, str(path))  # e.g. a LoRA dropped into the folder
    with pytest.raises(TrainStateError, match="has no streamcache_train_state metadata"):
        read_train_state(path, digest=digest, max_bytes=BIG)
    save_file({"step/x": torch.tensor(1.0)}, str(path), {METADATA_KEY: "{not json"})
    with pytest.raises(TrainStateError, match="metadata is not valid JSON"):
        read_train_state(path, digest=digest, max_bytes=BIG)


@pytest.mark.parametrize(("key", "value", "message"), [
    ("momentum/diffusion_model.a.alpha", torch.tensor(1.0), "is not <slot>/<parameter> with a slot of AdamW"),
    ("exp_avg", torch.tensor(1.0), "is not <slot>/<parameter>"),
    ("step/diffusion_model.a.alpha", torch.tensor([1.0, 2.0]), "is a step count of shape \\[2\\], not a scalar"),
    ("step/diffusion_model.a.alpha", torch.tensor(-3.0), "is not a step count"),
    ("step/diffusion_model.a.alpha", torch.tensor(1.5), "is not a step count"),
    ("exp_avg/diffusion_model.a.alpha", torch.tensor(1, dtype=torch.uint8), "is torch.uint8, not floating point"),
])
def test_unknown_slots_and_bad_values_are_refused(saved, key: str, value: torch.Tensor, message: str) -> None:
    path, _params_, digest = saved
    _rewrite(path, {**load_file(str(path)), key: value})
    with pytest.raises(TrainStateError, match=message):
        read_train_state(path, digest=digest, max_bytes=BIG)


def _header(path: Path) -> tuple[dict, bytes]:
    raw = path.read_bytes()
    (n,) = struct.unpack("<Q", raw[:8])
    return json.loads(raw[8:8 + n]), raw[8 + n:]


def _write_raw(path: Path, header: dict, data: bytes) -> None:
    text = json.dumps(header).encode()
    path.write_bytes(struct.pack("<Q", len(text)) + text + data)


@pytest.mark.parametrize("lie", ["offsets past the end", "shape larger than its bytes", "dtype wider than its bytes",
                                 "header length past the file", "truncated data"])
def test_a_header_that_lies_about_the_data_is_refused(saved, lie: str) -> None:
    path, _params_, digest = saved
    header, data = _header(path)
    key = "exp_avg/diffusion_model.b.lora_up.weight"
    if lie == "offsets past the end":
        header[key]["data_offsets"][1] += 1 << 20
    elif lie == "shape larger than its bytes":
        header[key]["shape"] = [600, 2]
    elif lie == "dtype wider than its bytes":
        header[key]["dtype"] = "F64"
    if lie == "header length past the file":
        raw = path.read_bytes()
        path.write_bytes(struct.pack("<Q", len(raw) * 4) + raw[8:])
    elif lie == "truncated data":
        _write_raw(path, header, data[:-16])
    else:
        _write_raw(path, header, data)
    with pytest.raises(TrainStateError, match="is not a valid safetensors file"):
        read_train_state(path, digest=digest, max_bytes=BIG)


def test_too_large_links_and_missing_files_are_refused(saved, tmp_path: Path) -> None:
    path, _params_, digest = saved
    with pytest.raises(TrainStateError, match="more than the 100 this LoRA's state can take"):
        read_train_state(path, digest=digest, max_bytes=100)
    link = tmp_path / "link.safetensors"
    link.symlink_to(path)
    with pytest.raises(TrainStateError, match="cannot be opened"):
        read_train_state(link, digest=digest, max_bytes=BIG)
    with pytest.raises(TrainStateError, match="cannot be opened"):
        read_train_state(tmp_path / "gone.safetensors", digest=digest, max_bytes=BIG)


# -------------------------------------------------------------------------------------------------------- store
def test_the_store_finds_by_digest_and_never_follows_a_link(tmp_path: Path) -> None:
    params = _params()
    opt = _make("SGD", params)  # no state at all: the counts and the sampler position are still kept
    _steps(opt, params, 0, 1)
    state = _state(params, opt, "SGD")
    assert state.slots == {}
    store = TrainStateStore(tmp_path / "states")
    path, pruned = store.save(state)
    assert path == store.path_for(state.lora_digest) and pruned == []
    assert store.find(state.lora_digest) == path
    assert read_train_state(path, digest=state.lora_digest, max_bytes=BIG).steps == 3
    assert store.find("f" * 32) is None
    other = tmp_path / "elsewhere.safetensors"
    other.write_bytes(path.read_bytes())
    path.unlink()
    path.symlink_to(other)
    assert store.find(state.lora_digest) is None
    with pytest.raises(ValueError, match="not a LoRA digest"):
        store.path_for("../x")
    linked = TrainStateStore(tmp_path / "linked")
    (tmp_path / "linked").symlink_to(tmp_path / "states")
    with pytest.raises(OSError, match="symbolic link"):
        linked.save(state)


def test_remove_takes_a_state_file_of_its_folder_and_nothing_else(tmp_path: Path) -> None:
    """What a run's saves use to drop the state of their previous save: a regular file of this folder named as a
    state, never a link (nor what it points to), another folder's file or a file named otherwise."""
    folder = tmp_path / "states"
    store = TrainStateStore(folder)
    folder.mkdir()
    state = folder / ("a" * 32 + ".safetensors")
    state.write_bytes(b"x")
    elsewhere = tmp_path / ("b" * 32 + ".safetensors")
    elsewhere.write_bytes(b"x")
    odd = folder / "notes.safetensors"
    odd.write_bytes(b"x")
    target = tmp_path / "target"
    target.write_bytes(b"kept")
    link = folder / ("c" * 32 + ".safetensors")
    link.symlink_to(target)
    assert [store.remove(p) for p in (elsewhere, odd, link, folder / ("d" * 32 + ".safetensors"))] == [False] * 4
    assert elsewhere.exists() and odd.exists() and link.is_symlink() and target.read_bytes() == b"kept"
    assert store.remove(state) is True and not state.exists()


def test_the_store_stays_bounded_and_removes_only_its_own_files(tmp_path: Path) -> None:
    folder = tmp_path / "states"
    store = TrainStateStore(folder)
    params = _params()
    opt = _make("AdamW", params)
    _steps(opt, params, 0, 1)
    base = _state(params, opt)
    folder.mkdir()
    foreign = [folder / "notes.txt", folder / ("a" * 31 + ".safetensors"), folder / ("b" * 32 + ".safetensors.bak")]
    for f in foreign:
        f.write_text("user's file")
    orphan = folder / f".{'c' * 32}.safetensors.{'0' * 16}.tmp"
    fresh_orphan = folder / f".{'d' * 32}.safetensors.{'1' * 16}.tmp"
    orphan.write_bytes(b"x")
    fresh_orphan.write_bytes(b"x")
    os.utime(orphan, (1, 1))
    written = []
    for i in range(5):
        digest = f"{i:032x}"
        path, _ = store.save(TrainState(digest, "AdamW", i, i, base.slots, base.param_groups))
        os.utime(path, (1000 + i, 1000 + i))  # written in this order
        written.append(path)
    bounded = TrainStateStore(folder, max_files=3)
    bounded.touch(written[0])  # just used: kept
    removed = bounded.prune()
    assert sorted(p.name for p in folder.glob("*.safetensors") if len(p.name) == 44) == sorted(
        [written[0].name, written[3].name, written[4].name])
    assert sorted(removed) == sorted([written[1].name, written[2].name])
    assert all(f.exists() for f in foreign) and fresh_orphan.exists() and not orphan.exists()
    small = TrainStateStore(folder, max_files=10, max_bytes=written[4].stat().st_size)
    path, pruned = small.save(TrainState("e" * 32, "AdamW", 9, 9, base.slots, base.param_groups))
    assert path.exists() and len(pruned) == 3  # only the one just written fits the bytes


def test_nothing_is_removed_through_a_link(tmp_path: Path) -> None:
    """Pruning and removing never reach past a link: a folder that is a link to another (a user's folder of states)
    is neither pruned nor removed from, however far over its bounds; in the store's own folder a link named as a
    state is not counted or removed, and what it points to (outside the folder) stays. A file the store cannot
    read is not its business: only names and ``lstat`` decide, no file is opened."""
    real = tmp_path / "real"
    real.mkdir()
    states = [real / (f"{i:032x}" + ".safetensors") for i in range(3)]
    for i, path in enumerate(states):
        path.write_bytes(b"x" * 10)
        os.utime(path, (1000 + i, 1000 + i))
    (tmp_path / "linked").symlink_to(real)
    linked = TrainStateStore(tmp_path / "linked", max_files=1, max_bytes=1)
    assert linked.prune() == [] and linked.remove(linked.path_for(f"{0:032x}")) is False
    assert all(p.exists() for p in states)
    outside = tmp_path / "outside.safetensors"
    outside.write_bytes(b"kept")
    own = tmp_path / "own"
    own.mkdir()
    link = own / ("f" * 32 + ".safetensors")
    link.symlink_to(outside)
    assert TrainStateStore(own, max_files=0, max_bytes=0).prune() == []
    assert link.is_symlink() and outside.read_bytes() == b"kept"


def test_adafactors_factored_moments_fit_by_their_own_shapes(tmp_path: Path) -> None:
    """A matrix's Adafactor state is its row and column means (shapes [6] and [2] for a 6×2 up), which fit; a state
    whose row mean has another length, or a vector's moment where a matrix's row is expected, does not. Written,
    read back and continued: 3 + 3 steps equal 6 bit for bit, its step count restored from the groups."""
    from dataset_cache.adafactor import GROUP_STATE, Adafactor

    settings = {"lr": 0.01, "relative_step": False, "scale_parameter": False, "warmup_init": False, "beta1": 0.9}
    straight = _params()
    _steps(Adafactor(straight.values(), **settings), straight, 0, 6)
    first = _params()
    opt = Adafactor(first.values(), **settings)
    _steps(opt, first, 0, 3)
    state = _state(first, opt, "Adafactor")
    assert {k: list(v.shape) for k, v in state.slots["diffusion_model.b.lora_up.weight"].items()} == {
        "exp_avg_sq_row": [6], "exp_avg_sq_col": [2], "exp_avg": [6, 2]}
    assert check_fits(state, "Adafactor", first) is None
    path = tmp_path / f"{state.lora_digest}.safetensors"
    write_train_state(path, state)
    back = read_train_state(path, digest=state.lora_digest, max_bytes=BIG)
    rest = {k: torch.nn.Parameter(v.detach().clone()) for k, v in first.items()}
    opt = Adafactor(rest.values(), **settings)
    opt.load_state_dict(optimizer_state_dict(back, list(rest), opt.state_dict(), GROUP_STATE))
    assert opt.param_groups[0]["step"] == 3
    _steps(opt, rest, 3, 3)
    assert all(torch.equal(rest[k], straight[k]) for k in straight)
    wrong = dict(state.slots)
    wrong["diffusion_model.b.lora_up.weight"] = {**wrong["diffusion_model.b.lora_up.weight"],
                                                 "exp_avg_sq_row": torch.zeros(5)}
    assert check_fits(dataclasses.replace(state, slots=wrong), "Adafactor", first) == (
        "its exp_avg_sq_row of 'diffusion_model.b.lora_up.weight' has shape [5], the parameter [6, 2] (needing [6])")
    wrong["diffusion_model.b.lora_up.weight"] = {"exp_avg_sq": torch.zeros(6, 2)}
    assert "its exp_avg_sq of 'diffusion_model.b.lora_up.weight' has shape [6, 2]" in str(
        check_fits(dataclasses.replace(state, slots=wrong), "Adafactor", first))


def test_adamw8bits_code_indices_and_block_scales_fit_and_continue(tmp_path: Path) -> None:
    """AdamW8bit (``min_8bit_size`` 8: the 6×2 up and 2×5 down keep 8-bit moments, the alpha fp32 ones): uint8 code
    indices of the parameter's shape and one fp32 scale per block fit, are written and read back as they were, and
    3 + 3 steps equal 6 bit for bit, the continued run's state as fit to continue (its indices uint8); a scale list
    of another length, float indices or a uint8 moment are named."""
    from dataset_cache.adamw8bit import AdamW8bit

    straight = _params()
    _steps(AdamW8bit(straight.values(), lr=0.01, min_8bit_size=8), straight, 0, 6)
    first = _params()
    opt = AdamW8bit(first.values(), lr=0.01, min_8bit_size=8)
    _steps(opt, first, 0, 3)
    state = _state(first, opt, "AdamW8bit")
    up = "diffusion_model.b.lora_up.weight"
    assert {k: (v.dtype, list(v.shape)) for k, v in state.slots[up].items()} == {
        "step": (torch.int64, []), "exp_avg_q": (torch.uint8, [6, 2]), "exp_avg_absmax": (torch.float32, [1]),
        "exp_avg_sq_q": (torch.uint8, [6, 2]), "exp_avg_sq_absmax": (torch.float32, [1])}
    assert set(state.slots["diffusion_model.a.alpha"]) == {"step", "exp_avg", "exp_avg_sq"}
    assert check_fits(state, "AdamW8bit", first) is None
    path = tmp_path / f"{state.lora_digest}.safetensors"
    write_train_state(path, state)
    back = read_train_state(path, digest=state.lora_digest, max_bytes=BIG)
    assert all(torch.equal(back.slots[n][s], v) for n, slots in state.slots.items() for s, v in slots.items())
    rest = {k: torch.nn.Parameter(v.detach().clone()) for k, v in first.items()}
    opt = AdamW8bit(rest.values(), lr=0.01, min_8bit_size=8)
    opt.load_state_dict(optimizer_state_dict(back, list(rest), opt.state_dict()))
    _steps(opt, rest, 3, 3)
    assert all(torch.equal(rest[k], straight[k]) for k in straight)
    again = _state(rest, opt, "AdamW8bit")  # continued once more: the indices came back uint8, not as numbers
    assert again.slots[up]["exp_avg_q"].dtype == torch.uint8 and check_fits(again, "AdamW8bit", rest) is None
    for slot, value, why in (("exp_avg_absmax", torch.zeros(2), "has shape [2], the parameter [6, 2] (needing [1])"),
                             ("exp_avg_q", torch.zeros(6, 2), "is torch.float32, not uint8 (code indices)")):
        wrong = {**state.slots, up: {**state.slots[up], slot: value}}
        assert check_fits(dataclasses.replace(state, slots=wrong), "AdamW8bit", first) == (
            f"its {slot} of '{up}' {why}")
    wrong = {**state.slots, up: {**state.slots[up], "exp_avg_q": torch.zeros(6, 2)}}
    write_train_state(path, dataclasses.replace(state, slots=wrong))
    with pytest.raises(TrainStateError, match=r"tensor 'exp_avg_q/diffusion_model.b.lora_up.weight' is "
                                              r"torch.float32, not uint8 \(code indices\)"):
        read_train_state(path, digest=state.lora_digest, max_bytes=BIG)


def test_lion8bits_one_moment_fits_and_continues_and_adamw8bits_second_is_refused(tmp_path: Path) -> None:
    """Lion8bit (``min_8bit_size`` 8) keeps one moment: uint8 code indices and a scale per block, fp32 below the
    size; written and read back, 3 + 3 steps equal 6 bit for bit, and the continued run's state is as fit to
    continue (its indices uint8); a scale list of another length is named, and
    AdamW8bit's second moment is not a Lion8bit slot."""
    from dataset_cache.lion8bit import Lion8bit

    straight = _params()
    _steps(Lion8bit(straight.values(), lr=0.01, min_8bit_size=8), straight, 0, 6)
    first = _params()
    opt = Lion8bit(first.values(), lr=0.01, min_8bit_size=8)
    _steps(opt, first, 0, 3)
    state = _state(first, opt, "Lion8bit")
    up = "diffusion_model.b.lora_up.weight"
    assert {k: (v.dtype, list(v.shape)) for k, v in state.slots[up].items()} == {
        "step": (torch.int64, []), "exp_avg_q": (torch.uint8, [6, 2]), "exp_avg_absmax": (torch.float32, [1])}
    assert set(state.slots["diffusion_model.a.alpha"]) == {"step", "exp_avg"}
    assert check_fits(state, "Lion8bit", first) is None
    path = tmp_path / f"{state.lora_digest}.safetensors"
    write_train_state(path, state)
    back = read_train_state(path, digest=state.lora_digest, max_bytes=BIG)
    rest = {k: torch.nn.Parameter(v.detach().clone()) for k, v in first.items()}
    opt = Lion8bit(rest.values(), lr=0.01, min_8bit_size=8)
    opt.load_state_dict(optimizer_state_dict(back, list(rest), opt.state_dict()))
    _steps(opt, rest, 3, 3)
    assert all(torch.equal(rest[k], straight[k]) for k in straight)
    again = _state(rest, opt, "Lion8bit")  # continued once more: the indices came back uint8, not as numbers
    assert again.slots[up]["exp_avg_q"].dtype == torch.uint8 and check_fits(again, "Lion8bit", rest) is None
    wrong = {**state.slots, up: {**state.slots[up], "exp_avg_absmax": torch.zeros(3)}}
    assert check_fits(dataclasses.replace(state, slots=wrong), "Lion8bit", first) == (
        f"its exp_avg_absmax of '{up}' has shape [3], the parameter [6, 2] (needing [1])")
    wrong = {**state.slots, up: {**state.slots[up], "exp_avg_sq_q": torch.zeros(6, 2, dtype=torch.uint8)}}
    write_train_state(path, dataclasses.replace(state, slots=wrong))
    with pytest.raises(TrainStateError, match=r"tensor 'exp_avg_sq_q/diffusion_model.b.lora_up.weight' is not "
                                              r"<slot>/<parameter> with a slot of Lion8bit \(exp_avg, exp_avg_absmax, "
                                              r"exp_avg_q, step\)"):
        read_train_state(path, digest=state.lora_digest, max_bytes=BIG)

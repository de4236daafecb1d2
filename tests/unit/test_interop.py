"""Tests of dataset_cache.interop: ComfyUI dataset folders read safely, keyed, and converted.

The fixtures write both layouts exactly as ComfyUI's ``SaveTrainingDataset`` does (upstream master: ``torch.save``
shards; the ``streamabledataset`` branch: safetensors + ``{"__tref__": key}`` skeleton pickles, keys
``s{i}_lat_{n}`` / ``s{i}_cond_{n}`` with a running counter per shard, ``pickle.HIGHEST_PROTOCOL``). Checked once
by hand: for the same inputs they are byte-identical to the files the real ``SaveTrainingDataset.execute`` of
both branches writes.
"""

from __future__ import annotations

import copyreg
import json
import math
import os
import pickle
import subprocess
from pathlib import Path
from typing import Any

import pytest
import safetensors.torch
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from dataset_cache.comfy_folders import (
    COMFY_LAZY,
    COMFY_PICKLE,
    detect_comfy_dataset,
    inspect_comfy_dataset,
    iter_comfy_dataset,
)
from dataset_cache.errors import CacheCorruptError, CacheFormatError, CacheNotFoundError, UnstorableValueError
from dataset_cache.interop import convert_comfy_dataset, value_key
from dataset_cache.safe_pickle import load_skeleton_pickle

# ------------------------------------------------------------------------------------- ComfyUI layout writers


def save_comfy_pickle(folder: Path, latents: list, conds: list, shard_size: int) -> Path:
    """Write what upstream SaveTrainingDataset writes (torch.save shards + metadata.json)."""
    folder.mkdir(parents=True, exist_ok=True)
    n = len(latents)
    num_shards = (n + shard_size - 1) // shard_size
    for k in range(num_shards):
        a, b = k * shard_size, min((k + 1) * shard_size, n)
        with open(folder / f"shard_{k:04d}.pkl", "wb") as f:
            torch.save({"latents": latents[a:b], "conditioning": conds[a:b]}, f)
    with open(folder / "metadata.json", "w") as f:
        json.dump({"num_samples": n, "num_shards": num_shards, "shard_size": shard_size}, f, indent=2)
    return folder


def _split(obj: Any, out: dict, prefix: str) -> Any:
    if isinstance(obj, torch.Tensor):
        key = f"{prefix}_{len(out)}"
        out[key] = obj.detach().cpu().clone()
        return {"__tref__": key}
    if isinstance(obj, dict):
        return {k: _split(v, out, prefix) for k, v in obj.items()}
    if isinstance(obj, list):
        return [_split(v, out, prefix) for v in obj]
    if isinstance(obj, tuple):
        return tuple(_split(v, out, prefix) for v in obj)
    return obj


def save_comfy_lazy(folder: Path, latents: list, conds: list, shard_size: int) -> Path:
    """Write what the streamabledataset SaveTrainingDataset writes (format_version 2)."""
    folder.mkdir(parents=True, exist_ok=True)
    n = len(latents)
    num_shards = (n + shard_size - 1) // shard_size
    for k in range(num_shards):
        tensors: dict = {}
        skeletons = []
        for local, i in enumerate(range(k * shard_size, min((k + 1) * shard_size, n))):
            lat = _split(latents[i], tensors, f"s{local}_lat")
            cond = _split(conds[i], tensors, f"s{local}_cond")
            skeletons.append((lat, cond))
        safetensors.torch.save_file(tensors, str(folder / f"shard_{k:04d}.safetensors"))
        with open(folder / f"shard_{k:04d}.skeleton.pkl", "wb") as f:
            pickle.dump(skeletons, f, protocol=pickle.HIGHEST_PROTOCOL)
    meta = {"num_samples": n, "num_shards": num_shards, "shard_size": shard_size, "format_version": 2}
    with open(folder / "metadata.json", "w") as f:
        json.dump(meta, f, indent=2)
    return folder


def make_samples(n: int, *, seed: int = 0) -> tuple[list, list]:
    """Latents like MakeTrainingDataset's ([1,C,H,W] each, varied sizes/dtypes) and SD-style conditionings."""
    g = torch.Generator().manual_seed(seed)
    latents, conds = [], []
    for i in range(n):
        h, w = (8, 8) if i % 2 else (8, 12)
        dtype = [torch.float32, torch.float16, torch.bfloat16][i % 3]
        latents.append({"samples": torch.randn(1, 4, h, w, generator=g).to(dtype)})
        text = i % 3  # three distinct captions: conditionings repeat
        gc = torch.Generator().manual_seed(1000 + text)
        conds.append([[torch.randn(1, 7, 16, generator=gc), {
            "pooled_output": torch.randn(1, 16, generator=gc),
            "guidance": 3.5 + text,
            "label": f"caption {text}",
            "flag": bool(text),
            "none": None,
            "pair": (1, 2.0),
        }]])
    return latents, conds


def assert_same(a: Any, b: Any, where: str = "value") -> None:
    """Exact equality: types (list vs tuple), dict key order, dtypes, shapes, tensor bits, float bits."""
    assert type(a) is type(b), f"{where}: {type(a).__name__} != {type(b).__name__}"
    if isinstance(a, torch.Tensor):
        assert a.dtype == b.dtype and a.shape == b.shape, \
            f"{where}: {a.dtype}{tuple(a.shape)} != {b.dtype}{tuple(b.shape)}"
        a_bytes, b_bytes = (t.contiguous().reshape(-1).view(torch.uint8) for t in (a, b))
        assert torch.equal(a_bytes, b_bytes), where
    elif isinstance(a, dict):
        assert list(a) == list(b), f"{where}: keys {list(a)} != {list(b)}"
        for k in a:
            assert_same(a[k], b[k], f"{where}[{k!r}]")
    elif isinstance(a, (list, tuple)):
        assert len(a) == len(b), f"{where}: length {len(a)} != {len(b)}"
        for i, (x, y) in enumerate(zip(a, b)):
            assert_same(x, y, f"{where}[{i}]")
    elif isinstance(a, float) and math.isnan(a):
        assert math.isnan(b), where
    else:
        assert a == b, f"{where}: {a!r} != {b!r}"


@pytest.fixture(params=[COMFY_PICKLE, COMFY_LAZY])
def layout(request: pytest.FixtureRequest) -> str:
    return request.param


def save(layout: str, folder: Path, latents: list, conds: list, shard_size: int) -> Path:
    writer = save_comfy_pickle if layout == COMFY_PICKLE else save_comfy_lazy
    return writer(folder, latents, conds, shard_size)


# --------------------------------------------------------------------------------------- detection and reading


def test_detect_layouts(tmp_path: Path, layout: str) -> None:
    latents, conds = make_samples(3)
    folder = save(layout, tmp_path / "ds", latents, conds, 2)
    assert detect_comfy_dataset(folder) == layout
    info = inspect_comfy_dataset(folder)
    assert info.layout == layout and info.num_samples == 3 and len(info.shards) == 2
    assert info.bytes == sum(p.stat().st_size for p in folder.iterdir() if p.name != "metadata.json")


def test_detect_none_for_other_folders(tmp_path: Path) -> None:
    assert detect_comfy_dataset(tmp_path / "missing") is None
    assert detect_comfy_dataset(tmp_path) is None
    (tmp_path / "manifest.json").write_text("{}")
    assert detect_comfy_dataset(tmp_path) is None
    (tmp_path / "f.txt").write_text("x")
    assert detect_comfy_dataset(tmp_path / "f.txt") is None


def test_detect_without_metadata_uses_file_names(tmp_path: Path, layout: str) -> None:
    folder = save(layout, tmp_path / "ds", *make_samples(1), 1)
    (folder / "metadata.json").unlink()
    assert detect_comfy_dataset(folder) == layout
    with pytest.raises(CacheFormatError, match=r"metadata\.json: missing"):
        list(iter_comfy_dataset(folder))


def test_iter_yields_exact_values_in_order(tmp_path: Path, layout: str) -> None:
    latents, conds = make_samples(5)
    folder = save(layout, tmp_path / "ds", latents, conds, 2)
    got = list(iter_comfy_dataset(folder))
    assert len(got) == 5
    for i, (lat, cond) in enumerate(got):
        assert_same(lat, latents[i], f"latent {i}")
        assert_same(cond, conds[i], f"cond {i}")


def test_iter_reads_shard_by_shard(tmp_path: Path, layout: str) -> None:
    """The second shard is only opened once the first one is consumed: damage there surfaces late."""
    folder = save(layout, tmp_path / "ds", *make_samples(4), 2)
    shard1 = next(p for p in folder.iterdir() if p.name.startswith("shard_0001") and "skeleton" not in p.name)
    shard1.write_bytes(b"garbage")
    it = iter_comfy_dataset(folder)
    assert next(it) and next(it)  # shard 0 serves both of its samples
    with pytest.raises(CacheCorruptError, match="shard_0001"):
        next(it)


def test_shard_order_is_numeric_and_stale_shards_are_ignored(tmp_path: Path, layout: str, caplog) -> None:
    latents, conds = make_samples(6)
    folder = save(layout, tmp_path / "ds", latents, conds, 1)  # 6 shards
    save(layout, folder, latents[:3], conds[:3], 1)  # re-save smaller: shards 3..5 are stale
    got = list(iter_comfy_dataset(folder))
    assert len(got) == 3
    assert "ignoring 3 shard file(s)" in caplog.text


def test_more_than_9999_shards_sort_numerically(tmp_path: Path) -> None:
    from dataset_cache.comfy_folders import _shard_files

    for k in (10000, 9999, 2):
        (tmp_path / f"shard_{k:04d}.pkl").write_bytes(b"")
    pkl, lazy = _shard_files(tmp_path)
    assert sorted(pkl) == [2, 9999, 10000] and not lazy


def test_errors_name_the_file(tmp_path: Path, layout: str) -> None:
    with pytest.raises(CacheNotFoundError, match="no such directory"):
        inspect_comfy_dataset(tmp_path / "nope")
    with pytest.raises(CacheFormatError, match="not a ComfyUI dataset folder"):
        inspect_comfy_dataset(tmp_path)
    folder = save(layout, tmp_path / "ds", *make_samples(3), 1)
    meta = folder / "metadata.json"
    meta.write_text("{not json")
    with pytest.raises(CacheFormatError, match=r"metadata\.json: not valid JSON"):
        inspect_comfy_dataset(folder)
    meta.write_text(json.dumps({"num_samples": 3, "num_shards": 3}))
    with pytest.raises(CacheFormatError, match="'shard_size' must be a non-negative integer"):
        inspect_comfy_dataset(folder)
    version = {"format_version": 2} if layout == COMFY_LAZY else {}
    meta.write_text(json.dumps({"num_samples": 3, "num_shards": 2, "shard_size": 1, **version}))
    with pytest.raises(CacheFormatError, match="num_shards=2 does not fit"):
        inspect_comfy_dataset(folder)
    meta.write_text(json.dumps({"num_samples": 3, "num_shards": 3, "shard_size": 1, "format_version": 7}))
    with pytest.raises(CacheFormatError, match="format_version 7 is unknown"):
        inspect_comfy_dataset(folder)
    meta.write_text(json.dumps({"num_samples": 4, "num_shards": 4, "shard_size": 1, **version}))
    with pytest.raises(CacheFormatError, match="shard_0003.* is missing"):
        inspect_comfy_dataset(folder)
    meta.write_text(json.dumps({"num_samples": 3, "num_shards": 2, "shard_size": 2, **version}))
    with pytest.raises(CacheCorruptError, match=r"metadata\.json.*promises 3 samples but the shards hold 2"):
        list(iter_comfy_dataset(folder))


def test_truncated_shards_are_corrupt(tmp_path: Path, layout: str) -> None:
    folder = save(layout, tmp_path / "ds", *make_samples(2), 2)
    shard = sorted(p for p in folder.iterdir() if p.name.startswith("shard_") and "skeleton" not in p.name)[0]
    data = shard.read_bytes()
    shard.write_bytes(data[: len(data) // 2])
    with pytest.raises(CacheCorruptError, match=shard.name):
        list(iter_comfy_dataset(folder))


def test_lazy_missing_skeleton_and_dangling_reference(tmp_path: Path) -> None:
    folder = save_comfy_lazy(tmp_path / "ds", *make_samples(2), 2)
    skel = folder / "shard_0000.skeleton.pkl"
    data = skel.read_bytes()
    skel.unlink()
    with pytest.raises(CacheFormatError, match=r"shard_0000\.skeleton\.pkl: missing"):
        inspect_comfy_dataset(folder)
    skel.write_bytes(pickle.dumps([({"samples": {"__tref__": "s9_lat_99"}}, [])]))
    (folder / "metadata.json").write_text(json.dumps(
        {"num_samples": 1, "num_shards": 1, "shard_size": 2, "format_version": 2}))
    with pytest.raises(CacheCorruptError, match="references tensor 's9_lat_99'"):
        list(iter_comfy_dataset(folder))
    skel.write_bytes(pickle.dumps({"not": "a list"}))
    with pytest.raises(CacheFormatError, match="expected a list of"):
        list(iter_comfy_dataset(folder))
    skel.write_bytes(data[:20])
    with pytest.raises(CacheCorruptError, match="not a readable pickle"):
        list(iter_comfy_dataset(folder))


def test_pickle_shard_with_hook_objects_is_refused(tmp_path: Path) -> None:
    latents, conds = make_samples(1)
    conds[0][0][1]["hooks"] = _Hook()
    folder = save_comfy_pickle(tmp_path / "ds", latents, conds, 1)
    with pytest.raises(CacheFormatError,
                       match=r"shard_0000\.pkl: torch\.load\(weights_only=True\) refused global .*_Hook"):
        list(iter_comfy_dataset(folder))


class _Hook:
    """Stands for a ComfyUI hook object inside a conditioning dict."""


# ------------------------------------------------------------------------------------ restricted unpickling


class _Evil:
    """Pickles as a call of ``fn(*args)``: what a hostile dataset would ship."""

    def __init__(self, fn: Any, *args: Any) -> None:
        self.fn, self.args = fn, args

    def __reduce__(self) -> tuple:
        return self.fn, self.args


def _hostile_payloads(marker: Path) -> dict[str, bytes]:
    py = f"open({str(marker)!r}, 'w').write('pwned')"
    sk = lambda x: [({"samples": {"__tref__": "s0_lat_0"}}, [[x, {}]])]  # noqa: E731
    payloads = {
        "posix.system": pickle.dumps(sk(_Evil(os.system, f"touch {marker}")), protocol=pickle.HIGHEST_PROTOCOL),
        "builtins.eval": pickle.dumps(sk(_Evil(eval, py)), protocol=pickle.HIGHEST_PROTOCOL),
        "builtins.exec": pickle.dumps(sk(_Evil(exec, py)), protocol=0, fix_imports=False),
        "subprocess.Popen": pickle.dumps(sk(_Evil(subprocess.Popen, ["touch", str(marker)])), protocol=2,
                                     fix_imports=False),
        "torch._utils._rebuild_tensor_v2": pickle.dumps(sk(torch.zeros(2)), protocol=pickle.HIGHEST_PROTOCOL),
        "builtins.getattr": pickle.dumps(_Evil(getattr, _Evil(__import__, "os"), "system"), protocol=4),
        # INST opcode (protocol 0), which builds an instance by name without GLOBAL/STACK_GLOBAL
        "os.system": b"(S'touch " + str(marker).encode() + b"'\nios\nsystem\n.",
    }
    return payloads


@pytest.mark.parametrize("name", [
    "posix.system", "builtins.eval", "builtins.exec", "subprocess.Popen", "torch._utils._rebuild_tensor_v2",
    "builtins.getattr", "os.system",
])
def test_hostile_skeleton_pickles_are_refused_and_nothing_runs(tmp_path: Path, name: str) -> None:
    marker = tmp_path / "pwned"
    data = _hostile_payloads(marker)[name]
    path = tmp_path / "shard_0000.skeleton.pkl"
    path.write_bytes(data)
    with pytest.raises(CacheFormatError, match=rf"shard_0000\.skeleton\.pkl: refused to unpickle global '{name}'"):
        load_skeleton_pickle(path)
    assert not marker.exists()
    # the same pickle loaded the way ComfyUI loads it would have run (proves the payload is live)
    if name == "builtins.eval":
        pickle.loads(data)
        assert marker.exists()


def test_hostile_skeleton_inside_a_dataset_is_refused(tmp_path: Path) -> None:
    folder = save_comfy_lazy(tmp_path / "ds", *make_samples(1), 1)
    marker = tmp_path / "pwned"
    (folder / "shard_0000.skeleton.pkl").write_bytes(_hostile_payloads(marker)["posix.system"])
    with pytest.raises(CacheFormatError, match="refused to unpickle global 'posix.system'"):
        list(iter_comfy_dataset(folder))
    assert not marker.exists()


def test_extension_registry_and_persistent_ids_are_refused(tmp_path: Path) -> None:
    marker = tmp_path / "pwned"
    code = 0x7FFFFF01
    copyreg.add_extension("posix", "system", code)
    try:
        data = pickle.dumps(_Evil(os.system, f"touch {marker}"), protocol=2)
        assert b"\x84" in data  # EXT4 opcode, no GLOBAL
        path = tmp_path / "ext.pkl"
        path.write_bytes(data)
        with pytest.raises(CacheFormatError, match="refused to unpickle global 'posix.system'"):
            load_skeleton_pickle(path)
    finally:
        copyreg.remove_extension("posix", "system", code)
    assert not marker.exists()

    class P(pickle.Pickler):
        def persistent_id(self, obj: Any) -> Any:
            return "x" if isinstance(obj, str) else None

    path = tmp_path / "pid.pkl"
    with open(path, "wb") as f:
        P(f).dump(["s"])
    with pytest.raises(CacheCorruptError, match="persistent ids are not allowed"):
        load_skeleton_pickle(path)


def test_plain_containers_load(tmp_path: Path) -> None:
    value = [({"a": [1, 2.5, None, True, "s", b"b"]}, {1, 2}, frozenset({3}), (float("inf"),))]
    for protocol in range(0, pickle.HIGHEST_PROTOCOL + 1):
        path = tmp_path / f"p{protocol}.pkl"
        path.write_bytes(pickle.dumps(value, protocol=protocol))
        if protocol < 3:  # bytes pickle as _codecs.encode before protocol 3: refused, as it should be
            with pytest.raises(CacheFormatError, match="_codecs.encode"):
                load_skeleton_pickle(path)
        else:
            assert load_skeleton_pickle(path) == value


# --------------------------------------------------------------------------------------------- value_key


def test_value_key_is_stable_and_type_exact() -> None:
    t = torch.arange(6, dtype=torch.float32).reshape(2, 3)
    base = {"samples": t, "x": [1, (2, 3)]}
    k = value_key(base)
    assert len(k) == 32 and all(c in "0123456789abcdef" for c in k)
    assert value_key({"samples": t.clone(), "x": [1, (2, 3)]}) == k
    assert value_key({"samples": t.t().contiguous().t(), "x": [1, (2, 3)]}) == k  # layout does not matter
    variants = [
        {"samples": t, "x": [1, [2, 3]]},  # tuple -> list
        {"samples": t, "x": [1.0, (2, 3)]},  # int -> float
        {"samples": t, "x": [True, (2, 3)]},  # int -> bool
        {"x": [1, (2, 3)], "samples": t},  # key order
        {"samples": t.to(torch.float64), "x": [1, (2, 3)]},  # dtype
        {"samples": t.reshape(3, 2), "x": [1, (2, 3)]},  # shape
        {"samples": t + 1, "x": [1, (2, 3)]},  # bytes
        {"samples": t, "x": [1, (2, 3)], "y": None},
    ]
    keys = {value_key(v) for v in variants}
    assert len(keys) == len(variants) and k not in keys
    assert value_key(["ab", "c"]) != value_key(["a", "bc"])
    assert value_key(0.0) != value_key(-0.0)
    assert value_key(float("nan")) == value_key(float("nan"))


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float8_e4m3fn, torch.float8_e5m2, torch.bool,
                                   torch.int8, torch.uint8, torch.int64, torch.float16])
def test_value_key_handles_every_dtype_and_shape(dtype: torch.dtype) -> None:
    keys = {value_key(torch.zeros(2, 3).to(dtype)), value_key(torch.zeros(()).to(dtype)),
            value_key(torch.zeros(0, 3).to(dtype)), value_key(torch.zeros(3, 0).to(dtype))}
    assert len(keys) == 4


def test_value_key_refuses_unstorable_values_with_their_path() -> None:
    with pytest.raises(UnstorableValueError, match=r"conditioning\[0\]\[1\]\['hooks'\]: _Hook is not storable"):
        value_key([[torch.zeros(1), {"hooks": _Hook()}]], name="conditioning")
    with pytest.raises(UnstorableValueError, match=r"\[1\]: dict key of type int is not storable \(only str keys"):
        value_key({1: 2})
    with pytest.raises(UnstorableValueError, match="set is not storable"):
        value_key([{1}])


# ---------------------------------------------------------------------------------------------- conversion


def _read_dataset(cache: Path, name: str = "default") -> tuple[list, list[tuple[Any, Any]]]:
    from dataset_cache.format import open_cache

    with open_cache(cache) as reader:
        samples = reader.dataset(name)
        values = reader.read([k for s in samples for k in (s.latent, *s.captions)])
    return samples, [(values[2 * i], values[2 * i + 1]) for i in range(len(samples))]


def test_convert_round_trips_exactly(tmp_path: Path, layout: str) -> None:
    latents, conds = make_samples(7)
    src = save(layout, tmp_path / "src", latents, conds, 3)
    rep = convert_comfy_dataset(src, tmp_path / "cache", shard_bytes=4096)
    assert (rep.layout, rep.dataset, rep.source_samples, rep.samples) == (layout, "default", 7, 7)
    assert rep.new_entries == 7 + 3 and rep.reused_entries == 4  # three distinct captions
    samples, values = _read_dataset(tmp_path / "cache")
    ext = "pkl" if layout == COMFY_PICKLE else "safetensors"
    assert [s.source for s in samples] == [f"shard_{i // 3:04d}.{ext}#{i % 3}"
                                           for i in range(7)]
    for i, (lat, cond) in enumerate(values):
        assert_same(lat, latents[i], f"latent {i}")
        assert_same(cond, conds[i], f"cond {i}")
    assert len({s.captions[0] for s in samples}) == 3 and len({s.latent for s in samples}) == 7


def test_convert_again_adds_nothing(tmp_path: Path, layout: str) -> None:
    src = save(layout, tmp_path / "src", *make_samples(4), 2)
    first = convert_comfy_dataset(src, tmp_path / "cache")
    again = convert_comfy_dataset(src, tmp_path / "cache", name="second")
    assert again.new_entries == 0 and again.reused_entries == first.new_entries + first.reused_entries
    from dataset_cache.format import open_cache

    with open_cache(tmp_path / "cache") as reader:
        assert reader.dataset("default") == reader.dataset("second")
        info = reader.datasets()["default"].info
    assert info["source_format"] == layout and info["comfy_metadata"]["num_samples"] == 4


def test_convert_exotic_values_exactly(tmp_path: Path, layout: str) -> None:
    latent = {"samples": torch.randn(1, 4, 2, 3).to(torch.bfloat16), "type": "audio",
              "noise_mask": torch.ones(1, 1, 2, 3, dtype=torch.bool), "batch_index": [0]}
    cond = [[torch.randn(1, 3, 8).to(torch.float8_e4m3fn), {
        "pooled_output": torch.randn(1, 8).to(torch.float8_e5m2),
        "ints": torch.arange(5, dtype=torch.int64), "scalar": torch.tensor(2.5, dtype=torch.float64),
        "empty": torch.zeros(0, 4, dtype=torch.float16), "nan": float("nan"), "inf": float("-inf"),
        "nested": ((1, [2.0, None]), {"é ключ": "値"}), "big": 2**62, "neg": -0.0,
    }], [torch.zeros(1, 3, 8).to(torch.float8_e4m3fn), {"start_percent": 0.5}]]
    src = save(layout, tmp_path / "src", [latent], [cond], 1)
    convert_comfy_dataset(src, tmp_path / "cache")
    _, [(lat, con)] = _read_dataset(tmp_path / "cache")
    assert_same(lat, latent, "latent")
    assert_same(con, cond, "cond")
    assert math.copysign(1.0, con[0][1]["neg"]) == -1.0


def test_convert_splits_batched_latents(tmp_path: Path, layout: str) -> None:
    g = torch.Generator().manual_seed(3)
    shared = [[torch.randn(1, 5, 8, generator=g), {"pooled_output": torch.randn(1, 8, generator=g)}]]
    per_row = [[torch.randn(1, 5, 8, generator=g), {}], [torch.randn(1, 5, 8, generator=g), {}]]
    lat3 = {"samples": torch.randn(3, 4, 8, 8, generator=g), "type": "x"}
    lat2 = {"samples": torch.randn(2, 4, 8, 8, generator=g), "noise_mask": torch.rand(2, 1, 8, 8, generator=g),
            "batch_index": [5, 6]}
    lat1 = {"samples": torch.randn(1, 4, 8, 8, generator=g)}
    src = save(layout, tmp_path / "src", [lat3, lat2, lat1], [shared, per_row, shared], 2)
    rep = convert_comfy_dataset(src, tmp_path / "cache")
    assert (rep.source_samples, rep.samples) == (3, 6)
    samples, values = _read_dataset(tmp_path / "cache")
    for r in range(3):
        assert_same(values[r][0], {"samples": lat3["samples"][r : r + 1], "type": "x"})
        assert_same(values[r][1], shared)
    for r in range(2):
        assert_same(values[3 + r][0], {"samples": lat2["samples"][r : r + 1],
                                       "noise_mask": lat2["noise_mask"][r : r + 1], "batch_index": [5 + r]})
        assert_same(values[3 + r][1], [per_row[r]])
    assert_same(values[5], (lat1, shared))
    assert samples[0].captions == samples[1].captions == samples[5].captions
    assert samples[1].source.endswith("#0[1]") and samples[5].source.endswith("#0")


def test_convert_refuses_unpairable_batches(tmp_path: Path, layout: str) -> None:
    lat = {"samples": torch.zeros(3, 4, 2, 2)}
    cond = [[torch.zeros(1, 2, 2), {}], [torch.zeros(1, 2, 2), {}]]
    src = save(layout, tmp_path / "src", [lat], [cond], 1)
    with pytest.raises(CacheFormatError,
                       match=r"shard_0000\.\w+ sample 0: latent batch of 3 rows but conditioning has 2"):
        convert_comfy_dataset(src, tmp_path / "cache")
    src2 = save(layout, tmp_path / "src2", [{"latent": torch.zeros(1)}], [cond], 1)
    with pytest.raises(CacheFormatError, match="not a dict with a 'samples' tensor"):
        convert_comfy_dataset(src2, tmp_path / "cache")


def test_convert_unstorable_value_names_shard_and_path(tmp_path: Path, layout: str) -> None:
    latents, conds = make_samples(3)
    conds[2][0][1]["area"] = {1: 2}  # int dict key: loads fine from both layouts, not storable
    src = save(layout, tmp_path / "src", latents, conds, 2)
    with pytest.raises(UnstorableValueError, match=r"shard_0001\.\w+ sample 0: conditioning\[0\]\[1\]\['area'\]\[1\]: "
                       r"dict key of type int is not storable \(only str keys are storable\)$"):
        convert_comfy_dataset(src, tmp_path / "cache")
    from dataset_cache.format import open_cache

    with open_cache(tmp_path / "cache") as reader:
        assert reader.datasets() == {}  # the dataset is only written when every sample converted
        assert len(reader) == 4  # shard 0 was committed (2 latents + 2 captions)


def test_convert_bad_source_creates_nothing(tmp_path: Path) -> None:
    with pytest.raises(CacheFormatError, match="not a ComfyUI dataset folder"):
        convert_comfy_dataset(tmp_path, tmp_path / "cache")
    assert not (tmp_path / "cache").exists()


_DTYPES = [torch.float32, torch.float16, torch.bfloat16, torch.float8_e4m3fn, torch.int32, torch.uint8, torch.bool]
_tensors = st.builds(
    lambda shape, dtype, seed: (torch.randn(shape, generator=torch.Generator().manual_seed(seed)) * 4).to(dtype),
    st.lists(st.integers(0, 3), max_size=3).map(tuple), st.sampled_from(_DTYPES), st.integers(0, 2**16),
)
_leaves = (st.none() | st.booleans() | st.integers(-(2**63), 2**63 - 1) | st.floats() | st.text(max_size=8)
           | _tensors)
_values = st.recursive(_leaves, lambda inner: (
    st.lists(inner, max_size=3) | st.lists(inner, max_size=3).map(tuple)
    | st.dictionaries(st.text(max_size=6).filter(lambda k: k != "__tref__"), inner, max_size=3)
), max_leaves=8)


@settings(max_examples=25, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(extra=_values, layout_name=st.sampled_from([COMFY_PICKLE, COMFY_LAZY]))
def test_convert_round_trips_arbitrary_storable_values(extra: Any, layout_name: str) -> None:
    import tempfile

    latent = {"samples": torch.randn(1, 4, 2, 2), "extra": extra}
    cond = [[torch.randn(1, 3, 4), {"x": extra}]]
    with tempfile.TemporaryDirectory() as tmp:
        src = save(layout_name, Path(tmp) / "src", [latent], [cond], 1)
        convert_comfy_dataset(src, Path(tmp) / "cache")
        _, [(lat, con)] = _read_dataset(Path(tmp) / "cache")
    assert_same(lat, latent, "latent")
    assert_same(con, cond, "cond")

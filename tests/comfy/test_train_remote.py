"""Train LoRA with a rank on another machine (``devices="cpu:1 + 1 remote"``): the real ComfyUI is rank 0 in this
process, and ``scripts/join-training`` joins from "another machine" — a second ComfyUI setup of its own (its own
``--base-directory`` holding copies of the model file and of the cache), over the loopback.

The same rows, seed and thread counts as ``devices="cpu:2"`` (a local worker): the same computation, so the
same LoRA and losses exactly. And what the other machine lacks or holds in another version — the key, the model
file, the cache — ends the run with an error naming it, never a run on other weights or rows.
"""

from __future__ import annotations

import importlib
import os
import re
import shutil
import signal
import socket
import subprocess
from collections.abc import Iterator
from pathlib import Path
from types import ModuleType
from typing import Any

import pytest
import torch
from support.comfy_env import ComfyInstall
from support.comfy_folders import only_folder
from support.encoded import write_comfy_encoded
from support.joining import KEY, Joiner, free_port, other_machine, start_joiner
from support.processes import PROC_READABLE, wait_gone
from support.tiny_models import TinyModels
from support.train_options import SHORT_RUN, summary

OPTIONS = {**SHORT_RUN, "batch_size": 1, "learning_rate": 0.05, "optimizer": "SGD", "seed": 11}
SIZES = [(64, 64)] * 4 + [(64, 96)] * 2
NAME = "remote_ranks/people"

pytestmark = pytest.mark.skipif(not PROC_READABLE, reason="the no-orphan checks read /proc (Linux)")


def _module(pack: ModuleType, name: str) -> ModuleType:
    return importlib.import_module(f"{pack.__name__}.{name}")


@pytest.fixture(scope="module")
def cache(pack: ModuleType, comfy_nodes: ModuleType, models: tuple, cache_root: Path) -> Path:
    """The run's cache, in rank 0's streamcache folder (another machine finds it by its name there)."""
    root = cache_root / NAME
    shutil.rmtree(root, ignore_errors=True)
    write_comfy_encoded(pack, comfy_nodes, models[1], models[2], root, SIZES, seed=1)
    return root


@pytest.fixture
def other(tmp_path: Path, tiny_models: TinyModels, cache: Path) -> Path:
    """The other machine's ComfyUI base folder, with copies of the model file and of the cache."""
    return other_machine(tmp_path / "other", tiny_models.unet, {NAME: cache})


@pytest.fixture
def listening(monkeypatch: pytest.MonkeyPatch) -> int:
    """Rank 0's join settings: the loopback at a free port, the key, a wait that fails a test quickly."""
    port = free_port()
    monkeypatch.setenv("STREAMCACHE_JOIN_ADDRESS", f"127.0.0.1:{port}")
    monkeypatch.setenv("STREAMCACHE_JOIN_KEY", KEY)
    monkeypatch.setenv("STREAMCACHE_JOIN_TIMEOUT_S", "240")
    return port


@pytest.fixture
def joiners(comfy_install: ComfyInstall) -> Iterator[Any]:
    """Start ``scripts/join-training`` as the other machine would (:func:`support.joining.start_joiner`);
    returns its process and log; every one is ended after the test."""
    started: list[Joiner] = []

    def join(base: Path, port: int, key: str = KEY, wait_s: int = 240,
             repeat: bool = False) -> tuple[subprocess.Popen[bytes], Path]:
        joiner = start_joiner(comfy_install.path, base, port, key=key, wait_s=wait_s, repeat=repeat)
        started.append(joiner)
        return joiner.proc, joiner.log

    yield join
    for joiner in started:
        joiner.stop()


@pytest.fixture
def loras(tmp_path: Path) -> Iterator[Path]:
    """A private ``loras`` folder of rank 0's (the other machine has none)."""
    (tmp_path / "loras").mkdir()
    with only_folder("loras", tmp_path / "loras") as folder:
        yield folder


def _train(pack: ModuleType, model: Any, cache: Path, **options: Any) -> Any:
    train = _module(pack, "nodes.train_lora").TrainLoRA
    dataset = _module(pack, "nodes.handles").StreamDatasetHandle(str(cache), "train")
    with torch.inference_mode():  # as ComfyUI runs nodes
        return train.execute(model, dataset, **{**OPTIONS, **options})


def _ended(proc: subprocess.Popen[bytes], log: Path) -> tuple[int, str]:
    code = proc.wait(timeout=120)
    return code, log.read_text(errors="replace")


def test_a_rank_on_another_machine_trains_what_a_local_worker_trains(pack: ModuleType, models: tuple, cache: Path,
                                                                      other: Path, listening: int,
                                                                      joiners: Any) -> None:
    """Twice, through one ``--repeat`` join command (a fresh process for each run), which Ctrl+C ends."""
    out = _train(pack, models[0], cache, devices="cpu:2")
    local = out.result
    assert "trained on 2 ranks: 2 CPU processes; global batch 2 (1 per rank)" in summary(out)
    proc, log = joiners(other, listening, repeat=True)
    for _ in range(2):
        out = _train(pack, models[0], cache, devices="cpu:1 + 1 remote")
        joined = out.result
        assert (f"trained on 2 ranks: cpu:0 and 1 rank on other machines (rank 1 on {socket.gethostname()} at "
                "127.0.0.1); global batch 2 (1 per rank)") in summary(out)
        assert "may compute otherwise" not in summary(out)  # the same ComfyUI and PyTorch: nothing to note
        assert joined[0].keys() == local[0].keys()
        assert all(torch.equal(joined[0][k], local[0][k]) for k in local[0])
        assert joined[1]["loss"] == local[1]["loss"] and joined[2] == 3
        assert wait_gone(os.getpid(), timeout=30) == [] and not torch.distributed.is_initialized()
    proc.send_signal(signal.SIGINT)
    code, output = _ended(proc, log)
    assert code == 130, output
    assert output.count("joined the run at 127.0.0.1") == 2
    assert "that run ended (exit code 0); joining the next one" in output


def test_a_rank_whose_comfyui_or_torch_differs_is_noted_in_the_summary(pack: ModuleType, models: tuple, cache: Path,
                                                                        other: Path, listening: int, joiners: Any,
                                                                        monkeypatch: pytest.MonkeyPatch) -> None:
    distributed = _module(pack, "nodes.training.distributed")
    real = _module(pack, "nodes.training.machines").software()  # what the joining rank reports
    monkeypatch.setattr(distributed, "software", lambda: {**real, "ComfyUI": "0.0.1"})  # rank 0 runs another
    proc, log = joiners(other, listening)
    out = _train(pack, models[0], cache, devices="cpu:1 + 1 remote")
    assert _ended(proc, log)[0] == 0
    assert (f"rank 1 on {socket.gethostname()} at 127.0.0.1 runs ComfyUI {real['ComfyUI']} (rank 0: 0.0.1): its "
            "steps may compute otherwise than rank 0's; install the same versions on every machine") in summary(out)


def test_a_rank_on_another_machine_continues_rank_0s_existing_lora_without_a_copy(
        pack: ModuleType, models: tuple, cache: Path, other: Path, listening: int, joiners: Any, loras: Path) -> None:
    """The other machine has neither the LoRA nor its training state: both travel with the job, so the remote rank
    restores what rank 0 restores (the ranks compare it before the first step) and the run continues exactly as
    with a local worker."""
    from safetensors.torch import save_file

    first = _train(pack, models[0], cache, devices="cpu:2").result  # its training state saved by rank 0
    save_file(first[0], str(loras / "first_3_steps_00001_.safetensors"))
    options = {"devices": "cpu:1 + 1 remote", "existing_lora": "first_3_steps_00001_.safetensors"}
    proc, log = joiners(other, listening)
    out = _train(pack, models[0], cache, **options)
    code, output = _ended(proc, log)
    assert code == 0, output
    text = summary(out)
    assert "continued 'first_3_steps_00001_.safetensors' from its training state" in text, text
    local = _train(pack, models[0], cache, **{**options, "devices": "cpu:2"}).result
    assert out.result[2] == local[2] == 6
    assert all(torch.equal(out.result[0][k], local[0][k]) for k in local[0])
    assert out.result[1]["loss"] == local[1]["loss"]
    # placed in a folder of the run's own, deleted after it: nothing in that machine's folders, nothing left
    assert not (other / "output").exists() and not list((other / "models").rglob("first_3_steps*"))
    assert not list((other.parent / "join-tmp").iterdir())


def _refused(pack: ModuleType, model: Any, cache: Path, other: Path, listening: int, joiners: Any,
             reason: str) -> None:
    """A run with a rank joining from ``other`` fails with ``reason`` (a regex) under that rank's number; the join
    command ends with an error and nothing of the run is left."""
    proc, log = joiners(other, listening)
    with pytest.raises(Exception, match=f"failed on rank 1: {reason}"):
        _train(pack, model, cache, devices="cpu:1 + 1 remote")
    assert _ended(proc, log)[0] != 0
    assert wait_gone(os.getpid(), timeout=30) == [] and not torch.distributed.is_initialized()


def test_a_machine_without_the_model_file_is_named(pack: ModuleType, models: tuple, cache: Path, other: Path,
                                                   listening: int, joiners: Any, tiny_models: TinyModels) -> None:
    (other / "models" / "diffusion_models" / tiny_models.name("unet")).unlink()
    _refused(pack, models[0], cache, other, listening, joiners, "FileNotFoundError: this machine has no "
             f"diffusion_models model named '{tiny_models.name('unet')}'")


def test_a_machine_with_another_model_file_or_cache_of_that_name_is_named(
        pack: ModuleType, comfy_nodes: ModuleType, models: tuple, cache: Path, other: Path, listening: int,
        joiners: Any, tiny_models: TinyModels) -> None:
    copy = other / "models" / "diffusion_models" / tiny_models.name("unet")
    data = bytearray(copy.read_bytes())
    data[-1] ^= 0xFF  # the same name and size, another last weight
    copy.write_bytes(bytes(data))
    _refused(pack, models[0], cache, other, listening, joiners,
             "ValueError: this machine's diffusion_models model .* is not rank 0's")

    shutil.copy(tiny_models.unet, copy)
    there = other / "models" / "streamcache" / NAME
    shutil.rmtree(there)
    write_comfy_encoded(pack, comfy_nodes, models[1], models[2], there, SIZES, seed=2)  # other images
    _refused(pack, models[0], cache, other, listening, joiners,
             "ValueError: this machine's cache .* is not what rank 0 trains from")


def test_a_machine_with_other_code_of_the_pack_is_refused(pack: ModuleType, models: tuple, cache: Path, other: Path,
                                                          listening: int, joiners: Any,
                                                          monkeypatch: pytest.MonkeyPatch) -> None:
    machines = _module(pack, "nodes.training.machines")
    mine = machines.pack_code()
    assert mine.startswith(_module(pack, "dataset_cache").__version__ + "/")
    monkeypatch.setattr(machines, "_CODE", ["0.0.9/0123456789abcdef"])  # rank 0 runs another release
    _refused(pack, models[0], cache, other, listening, joiners, f"RuntimeError: this machine's ComfyUI-StreamCache "
             f"\\({mine}\\) is not rank 0's \\(0.0.9/0123456789abcdef\\): install the same version")


def test_a_joiner_with_another_key_is_refused_and_the_run_names_who_did_not_join(
        pack: ModuleType, models: tuple, cache: Path, other: Path, listening: int, joiners: Any,
        monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("STREAMCACHE_JOIN_TIMEOUT_S", "20")
    proc, log = joiners(other, listening, key="another key of sixteen characters")
    with pytest.raises(Exception, match=f"1 of 1 ranks from other machines did not join within 20 s.*port "
                       f"{listening}"):
        _train(pack, models[0], cache, devices="cpu:1 + 1 remote")
    code, output = _ended(proc, log)
    assert code != 0 and "different keys (STREAMCACHE_JOIN_KEY)" in output


def test_ranks_on_other_machines_need_a_key_and_caches_by_name(pack: ModuleType, models: tuple, cache: Path,
                                                               tmp_path: Path, listening: int,
                                                               monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("STREAMCACHE_JOIN_KEY", "short")
    with pytest.raises(ValueError, match="set STREAMCACHE_JOIN_KEY to the same secret of at least 16 characters"):
        _train(pack, models[0], cache, devices="cpu:1 + 1 remote")
    monkeypatch.setenv("STREAMCACHE_JOIN_KEY", KEY)
    outside = tmp_path / "outside"
    shutil.copytree(cache, outside)
    with pytest.raises(ValueError, match=f"the cache {outside} is in none of the streamcache folders"):
        _train(pack, models[0], outside, devices="cpu:1 + 1 remote")
    assert wait_gone(os.getpid(), timeout=30) == []


def test_a_join_command_waits_for_a_run_and_then_says_none_came(other: Path, listening: int, joiners: Any) -> None:
    proc, log = joiners(other, listening, wait_s=3)
    code, output = _ended(proc, log)
    assert code == 1, output
    assert f"waiting for a run at 127.0.0.1:{listening}" in output
    assert f"no run listened at 127.0.0.1:{listening} within 3 s" in output


def test_the_join_settings_are_read_and_bad_ones_named(pack: ModuleType) -> None:
    read = _module(pack, "nodes.training.distributed").join_settings
    settings = read({"STREAMCACHE_JOIN_KEY": KEY})
    assert (settings.host, settings.port, settings.key, settings.timeout_s) == ("0.0.0.0", 29440, KEY.encode(), 600)
    settings = read({"STREAMCACHE_JOIN_KEY": KEY, "STREAMCACHE_JOIN_ADDRESS": "10.0.0.5:7000",
                     "STREAMCACHE_JOIN_TIMEOUT_S": "30"})
    assert (settings.host, settings.port, settings.timeout_s) == ("10.0.0.5", 7000, 30.0)
    settings = read({"STREAMCACHE_JOIN_KEY": KEY, "STREAMCACHE_JOIN_ADDRESS": "7001"})
    assert (settings.host, settings.port) == ("0.0.0.0", 7001)
    for environ, message in [
        ({}, "set STREAMCACHE_JOIN_KEY to the same secret of at least 16 characters"),
        ({"STREAMCACHE_JOIN_KEY": KEY, "STREAMCACHE_JOIN_ADDRESS": "h:p"}, "STREAMCACHE_JOIN_ADDRESS='h:p'"),
        ({"STREAMCACHE_JOIN_KEY": KEY, "STREAMCACHE_JOIN_ADDRESS": "h:70000"}, "write host:port or a port"),
        ({"STREAMCACHE_JOIN_KEY": KEY, "STREAMCACHE_JOIN_ADDRESS": "[::1]:7002"}, "IPv6 addresses are not supported"),
        ({"STREAMCACHE_JOIN_KEY": KEY, "STREAMCACHE_JOIN_TIMEOUT_S": "-1"}, "STREAMCACHE_JOIN_TIMEOUT_S='-1': write a "
         "positive number of seconds"),
    ]:
        with pytest.raises(ValueError, match=re.escape(message)):
            read(environ)


def test_a_model_file_is_named_by_the_innermost_folder_that_holds_it(pack: ModuleType, tiny_models: TinyModels,
                                                                    tmp_path: Path) -> None:
    """A configuration listing a parent folder for another kind (here ``checkpoints`` at the tiny models' root, which
    holds ``diffusion_models/``) does not rename the file: the other machine looks it up as rank 0's loader did."""
    machines = _module(pack, "nodes.training.machines")
    with only_folder("checkpoints", tiny_models.root):
        (found,) = machines.elsewhere((str(tiny_models.unet), "default"), ()).files
    assert (found.kind, found.name, found.size) == ("diffusion_models", tiny_models.name("unet"),
                                                    tiny_models.unet.stat().st_size)
    with only_folder("checkpoints", tiny_models.root), only_folder("diffusion_models", tmp_path):
        (found,) = machines.elsewhere((str(tiny_models.unet),), ()).files  # the parent alone holds it
    assert (found.kind, found.name) == ("checkpoints", f"diffusion_models/{tiny_models.name('unet')}")

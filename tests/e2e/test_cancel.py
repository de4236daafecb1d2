"""Cancel (``POST /interrupt``) during encoding and during training, on the session's real server.

After each cancel the server keeps serving; a re-queued encode finishes without redoing the entries that were
committed before the cancel (read from the node's report), ``python -m dataset_cache verify`` passes on the
cache, and after a training cancel no loader thread is left in the server and a new training completes.
"""

from __future__ import annotations

import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
from support.client import ComfyClient, PromptResult
from support.datasets import Subset, make_kohya_folder
from support.examples import encode_prompt
from support.paths import PACK_ROOT
from support.server import ComfyServer
from support.tiny_models import TinyModels

websocket = pytest.importorskip("websocket", reason="websocket-client is needed to cancel at the right moment")

BIG = (Subset(2, "many", tuple((64, 64) for _ in range(8)), "png"),)
"""8 images with 9 distinct caption lines, encoded one per batch: 17 commits, several seconds of CPU work."""



def _run_and_interrupt(client: ComfyClient, prompt: dict[str, Any], when: Callable[[dict[str, Any]], bool],
                       timeout: float = 600.0) -> PromptResult:
    """Queue ``prompt``, POST /interrupt as soon as a websocket event satisfies ``when``, wait until it ended."""
    return client.run_and_act(prompt, when, lambda: client.post("/interrupt", {}), timeout=timeout)


def _interrupted_in(result: PromptResult) -> str:
    assert result.status == "error", result.history.get("status")
    messages = result.history["status"]["messages"]
    (data,) = [d for kind, d in messages if kind == "execution_interrupted"]
    return data["node_id"]


def _verify(cache: Path) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-m", "dataset_cache", "verify", str(cache)], cwd=PACK_ROOT,
                          capture_output=True, text=True, timeout=300)


def _threads(server: ComfyServer) -> int:
    """How many threads the server process has (``/proc``; -1 where that cannot be read).

    Python < 3.14 gives threads no OS names, so the loader's threads cannot be told apart by name: the check
    is that training plus a cancel leaves the server with no more threads than a finished training does.
    """
    pid = server._proc.pid if server._proc is not None else None
    tasks = Path(f"/proc/{pid}/task")
    return len(list(tasks.iterdir())) if pid is not None and tasks.is_dir() else -1


def _settled_threads(server: ComfyServer, at_most: int, wait: float = 10.0) -> int:
    deadline = time.monotonic() + wait
    count = _threads(server)
    while count > at_most and time.monotonic() < deadline:
        time.sleep(0.1)
        count = _threads(server)
    return count


def _alive(client: ComfyClient) -> None:
    result = client.run({"9": {"class_type": "StreamCache_CacheInfo", "inputs": {"cache": "still_alive"}}})
    assert result.status == "success"


def test_cancel_encoding_then_requeue_finishes_without_redoing(comfy_server: ComfyServer, client: ComfyClient,
                                                               tiny_models: TinyModels) -> None:
    make_kohya_folder(comfy_server.input_dir / "e2e_cancel_big", BIG)
    prompt = encode_prompt(tiny_models.name("vae"), tiny_models.name("clip"),
                           "e2e_cancel_big", "e2e_cancel", batch_size=1)

    def mid_encode(event: dict[str, Any]) -> bool:  # a few batches are committed, most are not
        data = event.get("data") or {}
        return event["type"] == "progress" and data.get("node") == "3" and 3 <= data["value"] < data["max"]

    cancelled = _run_and_interrupt(client, prompt, mid_encode)
    assert _interrupted_in(cancelled) == "3"
    _alive(client)

    cache = comfy_server.streamcache_dir / "e2e_cancel"
    check = _verify(cache)
    assert check.returncode == 0, check.stdout + check.stderr  # a cancelled encode leaves a healthy cache

    again = client.run(prompt)
    (report,) = again.outputs["3"]["streamcache_report"]
    total = 8 + 9  # 8 latents; captions: one shared, one with two variants, 6 unique lines
    assert report["samples"] == 8
    assert report["reused"] > 0, report  # what was committed before the cancel is not encoded again
    assert report["encoded"] + report["reused"] == total and report["encoded"] < total, report
    # no dataset was stored before: every file is still new (it once said "0 new, 16 unchanged"), and the
    # server's log says what the node says
    files = sum(1 for p in (comfy_server.input_dir / "e2e_cancel_big").rglob("*") if p.is_file())
    assert (report["new"], report["changed"], report["unchanged"], report["removed"]) == (files, 0, 0, 0), report
    (text,) = again.outputs["3"]["text"]
    (line,) = [ln for ln in text.splitlines() if ln.startswith("sources:")]
    logged = [ln for ln in Path(comfy_server.log_path).read_text(errors="replace").splitlines() if "sources:" in ln]
    assert logged and line in logged[-1], (line, logged[-3:])
    check = _verify(cache)
    assert check.returncode == 0, check.stdout + check.stderr


def _training_prompt(server: ComfyServer, tiny_models: TinyModels, folder: str, **options: Any
                     ) -> tuple[dict[str, Any], dict[str, Any]]:
    """Encode a 2-image folder, then train 5000 steps on it (a run to cancel), then plot its loss; returns the prompt
    and Train LoRA's inputs (``options`` over the defaults here), to change between queues."""
    make_kohya_folder(server.input_dir / folder, (Subset(1, "x", ((64, 64), (64, 64)), "png"),))
    prompt = encode_prompt(tiny_models.name("vae"), tiny_models.name("clip"), folder, folder, batch_size=4)
    prompt["4"] = {"class_type": "UNETLoader", "inputs": {"unet_name": tiny_models.name("unet"),
                                                          "weight_dtype": "default"}}
    train = {"model": ["4", 0], "dataset": ["3", 0], "batch_size": 1, "grad_accumulation_steps": 1,
             "steps": 5000, "learning_rate": 1e-3, "rank": 4, "optimizer": "AdamW", "loss_function": "MSE",
             "seed": 3, "training_dtype": "fp32", "lora_dtype": "fp32", "algorithm": "LoRA",
             "gradient_checkpointing": False, "checkpoint_depth": 1, "offloading": False,
             "existing_lora": "[None]", "prefetch_batches": 2, "loader_threads": 0, **options}
    prompt["5"] = {"class_type": "StreamCache_TrainLoRA", "inputs": train}
    prompt["6"] = {"class_type": "LossGraphNode", "inputs": {"loss": ["5", 1], "filename_prefix": folder}}
    return prompt, train


def test_cancel_training_then_a_new_training_completes(comfy_server: ComfyServer, client: ComfyClient,
                                                       tiny_models: TinyModels) -> None:
    prompt, train = _training_prompt(comfy_server, tiny_models, "e2e_cancel_train", seed=3, prefetch_batches=4,
                                     loader_threads=2)

    train["steps"] = 3  # first a short training that completes: thread pools exist, the thread count is known
    assert len(client.run(prompt).outputs["5"]["loss"]) == 3
    threads = _threads(comfy_server)
    train["steps"] = 5000

    def training(event: dict[str, Any]) -> bool:
        data = event.get("data") or {}
        return event["type"] == "streamcache.train" and data.get("step", 0) >= 2

    t0 = time.monotonic()
    cancelled = _run_and_interrupt(client, prompt, training)
    assert _interrupted_in(cancelled) == "5"
    assert time.monotonic() - t0 < 300, "the interrupt did not stop the 5000-step training"
    _alive(client)
    assert _settled_threads(comfy_server, threads) <= threads  # the loader's threads were joined

    train["steps"] = 4  # a new training on the same cache completes
    done = client.run(prompt)
    assert len(done.outputs["5"]["loss"]) == 4
    assert _settled_threads(comfy_server, threads) <= threads


def test_cancel_with_save_every_keeps_the_steps_it_finished_and_the_save_continues(
        comfy_server: ComfyServer, client: ComfyClient, tiny_models: TinyModels) -> None:
    """``save_every`` over HTTP: a Cancel mid-run leaves the save of the last finished step in ``output/loras`` (no
    periodic save comes first: every 1000 steps), the server's log names it, and queuing it as ``existing_lora``
    (this server lists ``output/loras``, as README's extra_model_paths recipe does) continues it from its training
    state; the node's progress text names each save."""
    import re

    prompt, train = _training_prompt(comfy_server, tiny_models, "e2e_cancel_save", seed=5, save_every=1000,
                                     save_prefix="loras/e2e_save")

    def training(event: dict[str, Any]) -> bool:
        return event["type"] == "streamcache.train" and (event.get("data") or {}).get("step", 0) >= 3

    cancelled = _run_and_interrupt(client, prompt, training)
    assert _interrupted_in(cancelled) == "5"
    saves = {int(m.group(1)): m.group(0) for m in (re.fullmatch(r"e2e_save_(\d+)_steps_\d{5}_\.safetensors", p.name)
                                                   for p in (comfy_server.output_dir / "loras").iterdir()) if m}
    (last,) = saves  # the stop's, after the steps that ran before the interrupt was seen
    assert last >= 3, saves
    assert f"the run stopped after step {last} (cancelled); the LoRA trained so far is saved as" \
        in comfy_server.log_text()
    train.update(steps=2, save_every=1, existing_lora=saves[last])  # 2: Plot Loss Graph needs two losses
    done = client.run(prompt)
    (summary,) = done.outputs["5"]["text"]
    assert f"continued {saves[last]!r} from its training state ({last} steps): AdamW state restored" in summary
    shown = [e["text"] for e in done.events_of("progress_text") if e["node"] == "5"]
    assert any(f"saved the LoRA at step {last + 1}: output/loras/e2e_save_{last + 1}_steps_" in t for t in shown), \
        shown

"""Running the shipped example workflows the way a user runs them in the UI: queue, then queue again.

The example workflows train a LoRA (or write a cache) and, in the same graph, use what the first part wrote:
Load LoRA picks the saved LoRA file, Load Lazy Cache the saved cache. ComfyUI validates every output when a
prompt is queued; outputs whose inputs name a file that does not exist yet are refused (``node_errors`` in a
200 reply) while the others run. :func:`run_example` does what the user does: queue, then queue the same prompt
again for the outputs that need the new files (``partial_execution_targets``), with Load LoRA pointed at the
LoRA file the first queue saved.

Shared by ``scripts/run-example`` and the e2e tests; HTTP only (any python will do).
"""

from __future__ import annotations

import copy
import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

from .client import ComfyClient, PromptError, PromptResult

__all__ = ["EXAMPLE_FOLDER", "EXAMPLE_SIZES", "MAIN_TEMPLATE", "SAVE_THEN_TRAIN_TEMPLATE", "ExampleRun",
           "drop_node_cache", "encode_prompt", "lora_names", "make_example_folder", "run_example", "run_prompt",
           "train_inputs"]

EXAMPLE_FOLDER = "streamcache_example"
"""The dataset folder (inside ComfyUI's input directory) that the example workflows encode."""
EXAMPLE_SIZES = ((64, 64), (64, 64), (96, 64), (64, 96))
"""(width, height) of the example's four images (three aspect buckets), kohya layout ``5_pattern/``, captioned."""
MAIN_TEMPLATE = "Train a LoRA from an image folder"
"""File name (without ``.json``) of the main example in ``example_workflows/`` and ``example_workflows/api/``. The
template browser shows a custom node pack's templates by file name (title and description alike), so the names
are sentences."""
SAVE_THEN_TRAIN_TEMPLATE = "Encode a folder into a cache then train from it"
"""The example that saves a cache with Save Streamable Cache and trains from it with Load Lazy Cache."""
LORA_LOADERS = ("LoraLoader", "LoraLoaderModelOnly")
LORA_SAVERS = ("SaveLoRA", "StreamCache_SaveLoRA")
"""ComfyUI's Save LoRA Weights and ours: a prompt with one of them and a LoRA loader samples with the LoRA it trains."""


def as_saved_before(prompt: dict[str, Any]) -> dict[str, Any]:
    """The current templates' prompt with ComfyUI's Save LoRA Weights where they now save with Save LoRA (Stream
    Cache): the templates changed node there (the LoRA file gets its training metadata, under the same name), while
    a workflow saved before keeps the node it has, which still runs. Everything else must be equal."""
    out: dict[str, Any] = {}
    for key, node in prompt.items():
        if node["class_type"] == "StreamCache_SaveLoRA":
            inputs = node["inputs"]
            node = {"class_type": "SaveLoRA",
                    "inputs": {"lora": inputs["lora"], "prefix": inputs["save_prefix"], "steps": inputs["steps"]}}
        out[key] = {"class_type": node["class_type"], "inputs": node["inputs"]}
    return out


def make_example_folder(input_dir: Any) -> Any:
    """Write the examples' kohya-style image folder into ``input_dir`` (same files every time); return its
    :class:`~support.datasets.KohyaFolder`. Needs Pillow (imported here: HTTP-only callers do without)."""
    from pathlib import Path

    from .datasets import Subset, make_kohya_folder

    return make_kohya_folder(Path(input_dir) / EXAMPLE_FOLDER, (Subset(5, "pattern", EXAMPLE_SIZES, "png"),))


def drop_node_cache(client: ComfyClient) -> None:
    """``POST /free`` (unload models, reset ComfyUI's node cache) and give the idle worker a moment to do it.

    The e2e modules share one server; a module that ran loaders must not leave their outputs cached for the next
    module, whose tests may check which nodes executed."""
    client.post("/free", {"unload_models": True, "free_memory": True})
    time.sleep(0.5)


def lora_names(client: ComfyClient) -> list[str]:
    """The LoRA file names the server's Load LoRA node offers right now."""
    spec = client.get("/object_info/LoraLoader")["LoraLoader"]["input"]["required"]["lora_name"]
    return list(spec[0] if isinstance(spec[0], list) else spec[1].get("options", []))


def encode_prompt(vae: str, clip: str, folder: str, cache: str, **inputs: Any) -> dict[str, Any]:
    """VAELoader + CLIPLoader -> Encode Dataset (node ``"3"``) with small-test settings; ``inputs`` override them."""
    return {
        "1": {"class_type": "VAELoader", "inputs": {"vae_name": vae}},
        "2": {"class_type": "CLIPLoader", "inputs": {"clip_name": clip, "type": "stable_diffusion",
                                                     "device": "default"}},
        "3": {"class_type": "StreamCache_EncodeDataset", "inputs": {
            "folder": folder, "cache": cache, "dataset_name": "default", "vae": ["1", 0], "clip": ["2", 0],
            "resolution": 64, "bucket_step": 32, "crop": "center", "caption_prefix": "", "caption_suffix": "",
            "batch_size": 4, "on_failure": "skip", **inputs}},
    }


def train_inputs(**overrides: Any) -> dict[str, Any]:
    """Train LoRA's widget inputs with small-test settings (fp32, rank 4, 3 steps of batch 1, no checkpointing);
    ``overrides`` replace or add inputs. The sockets (``model``, ``dataset``) are the caller's."""
    return {"batch_size": 1, "grad_accumulation_steps": 1, "steps": 3, "learning_rate": 1e-3, "rank": 4,
            "optimizer": "AdamW", "loss_function": "MSE", "seed": 1, "training_dtype": "fp32", "lora_dtype": "fp32",
            "algorithm": "LoRA", "gradient_checkpointing": False, "checkpoint_depth": 1, "offloading": False,
            "existing_lora": "[None]", "prefetch_batches": 2, "loader_threads": 0, **overrides}


def run_prompt(client: ComfyClient, prompt: dict[str, Any], *, targets: Sequence[str] | None = None,
               timeout: float = 600.0, check: bool = True) -> tuple[PromptResult | None, dict[str, Any]]:
    """Queue ``prompt`` (only ``targets`` when given), wait, return ``(result, node_errors)``.

    Unlike :meth:`ComfyClient.run`, outputs refused at validation are not an error while others run: their
    ``node_errors`` are returned (result ``None`` when every output was refused: then ``PromptError``).
    """
    body: dict[str, Any] = {"prompt": prompt, "client_id": client.client_id}
    if targets is not None:
        body["partial_execution_targets"] = list(targets)
    return client.run_body(body, timeout=timeout, check=check, allow_node_errors=True)


@dataclass
class ExampleRun:
    """What :func:`run_example` did."""

    prompt: dict[str, Any]
    """The prompt of the last queue (Load LoRA names patched)."""
    results: list[PromptResult] = field(default_factory=list)
    """One per queue: the first, and the second when some outputs had to wait for the first."""
    deferred: list[str] = field(default_factory=list)
    """Outputs refused by the first queue (they name files it wrote) and run by the second."""
    new_loras: list[str] = field(default_factory=list)
    """LoRA names that appeared in the server's list during the run (both queues)."""
    seconds: float = 0.0

    def outputs(self) -> dict[str, Any]:
        merged: dict[str, Any] = {}
        for result in self.results:
            merged.update(result.outputs)
        return merged

    def executed(self) -> set[str]:
        return {e["node"] for r in self.results for e in r.events_of("executing") if e.get("node") is not None}


def _links(node: dict[str, Any]) -> list[str]:
    return [v[0] for v in node["inputs"].values() if isinstance(v, list) and len(v) == 2 and isinstance(v[0], str)]


def _lora_branches(prompt: dict[str, Any]) -> list[str]:
    """Sink nodes fed by a Load LoRA node, when the prompt also saves a LoRA (they sample with the new file)."""
    if not any(n.get("class_type") in LORA_SAVERS for n in prompt.values()):
        return []
    linked = {src for n in prompt.values() for src in _links(n)}
    late = []
    for sink in (k for k in prompt if k not in linked):
        seen, todo = set(), [sink]
        while todo:
            node_id = todo.pop()
            if node_id in seen or node_id not in prompt:
                continue
            seen.add(node_id)
            todo.extend(_links(prompt[node_id]))
        if any(prompt[n]["class_type"] in LORA_LOADERS for n in seen):
            late.append(sink)
    return late


def run_example(client: ComfyClient, prompt: dict[str, Any], *, timeout: float = 600.0) -> ExampleRun:
    """Run an example prompt to completion: once, and again for the outputs that need the first run's files.

    A prompt that saves a LoRA and also loads one with Load LoRA samples with the LoRA it trains: the branches
    fed by Load LoRA wait for the second queue, with Load LoRA pointed at the file the first queue saved (also
    when a file of the default name exists already, from an earlier run). Outputs that ComfyUI refuses on the
    first queue for other reasons (Load Lazy Cache naming a cache the first queue writes) are queued again too.

    Raises:
        PromptError: refused entirely, an execution error, or outputs still refused on the second queue.
    """
    t0 = time.monotonic()
    prompt = copy.deepcopy(prompt)
    late = _lora_branches(prompt)
    before = set(lora_names(client))
    first_targets = [k for k in prompt if k not in late] if late else None
    first, errors = run_prompt(client, prompt, targets=first_targets, timeout=timeout)
    run = ExampleRun(prompt, [first])
    run.new_loras = sorted(set(lora_names(client)) - before)
    deferred = set(late) | {o for e in errors.values() for o in e.get("dependent_outputs", [])}
    if deferred:
        run.deferred = sorted(deferred, key=str)
        available = set(lora_names(client))
        for node in prompt.values():
            if node.get("class_type") not in LORA_LOADERS:
                continue
            if late and len(run.new_loras) == 1:
                node["inputs"]["lora_name"] = run.new_loras[0]
            elif node["inputs"].get("lora_name") not in available:
                raise PromptError(
                    f"Load LoRA names {node['inputs'].get('lora_name')!r}, which the server does not list, and "
                    f"the first queue added {len(run.new_loras)} LoRA files ({run.new_loras}); is ComfyUI's "
                    "output/loras folder one of its loras folders?", errors)
        second, still = run_prompt(client, prompt, targets=run.deferred, timeout=timeout)
        if still:
            raise PromptError("outputs still refused on the second queue", still)
        run.results.append(second)
        run.new_loras = sorted(set(lora_names(client)) - before)
    run.seconds = time.monotonic() - t0
    return run

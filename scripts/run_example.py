"""Run one example workflow end to end on a headless ComfyUI and report what it did (``scripts/run-example``).

By default it starts a private ComfyUI server (CPU, temporary folders, this pack symlinked in as a custom
node) with tiny generated models, writes a small kohya-style image folder (``input/streamcache_example``: four
captioned images in three aspect buckets) and runs the main job, ``example_workflows/api/Train a LoRA from an
image folder.json``: Encode Dataset → Train LoRA (Stream Cache) → Save LoRA (Stream Cache) + Plot Loss Graph, then
Load LoRA with the saved file → KSampler → VAE Decode → Save Image. Like a user in the UI, it queues the
workflow, and queues it again for the sampling branch, which needs the LoRA file the first queue wrote. It prints
the encode report, the loss, the LoRA file, the sample image and the seconds, then stops the server.

Any other workflow file (UI format, or API format) may be given instead. ``--models-dir`` uses real models (a
folder laid out like ComfyUI's ``models/``; the workflow's loader names must then be edited to match);
``--server`` uses a ComfyUI that is already running with the pack installed (the image folder must then exist
in its input directory, and its output/loras folder must be a LoRA folder for the sampling branch).
"""

from __future__ import annotations

import argparse
import json
import shutil
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "tests"))

from support.client import ComfyClient, PromptError  # noqa: E402
from support.comfy_env import find_comfyui, skip_reason  # noqa: E402
from support.examples import EXAMPLE_FOLDER, make_example_folder, run_example  # noqa: E402
from support.server import ComfyServer, ServerStartError  # noqa: E402
from support.tiny_models import ensure_tiny_models  # noqa: E402
from support.workflow import WorkflowError, ui_to_api  # noqa: E402

DEFAULT_WORKFLOW = ROOT / "example_workflows" / "api" / "Train a LoRA from an image folder.json"


def _parse() -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="scripts/run-example", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("workflow", nargs="?", type=Path, default=DEFAULT_WORKFLOW,
                   help="workflow file, UI or API format (default: %(default)s)")
    p.add_argument("--models-dir", type=Path, help="real models (a ComfyUI models/ layout) instead of tiny ones")
    p.add_argument("--server", help="URL of a running ComfyUI with the pack installed (no server is started)")
    p.add_argument("--workdir", type=Path, help="keep the server's folders and log here (default: temporary)")
    p.add_argument("--timeout", type=float, default=1800.0, help="seconds to wait for the workflow")
    return p.parse_args()


def _load_prompt(client: ComfyClient, workflow: Path) -> dict:
    data = json.loads(workflow.read_text(encoding="utf-8"))
    if isinstance(data.get("nodes"), list):  # UI format (what the frontend saves)
        return ui_to_api(data, client.object_info())
    return data  # API format


def _run(client: ComfyClient, workflow: Path, timeout: float, output_dir: Path | None = None) -> int:
    prompt = _load_prompt(client, workflow)
    print(f"workflow: {workflow.name}: " + ", ".join(f"{k}:{v['class_type']}" for k, v in prompt.items()))
    t0 = time.monotonic()
    try:
        run = run_example(client, prompt, timeout=timeout)
        failed = None
    except PromptError as exc:
        run, failed = None, exc
    seconds = time.monotonic() - t0
    if run is None:
        print(f"FAILED after {seconds:.1f} s: {failed}")
        return 1
    for i, result in enumerate(run.results, 1):
        cached = [n for e in result.events_of("execution_cached") for n in e.get("nodes", [])]
        print(f"queue {i}: {result.status}, prompt {result.prompt_id}"
              + (f", cached nodes {', '.join(cached)}" if cached else "")
              + (f" (the outputs {', '.join(run.deferred)} waited for files written by queue 1)" if i == 2 else ""))
    outputs = run.outputs()
    for node_id, output in outputs.items():
        kind = run.prompt.get(node_id, {}).get("class_type", node_id)
        title = f"[{node_id} {kind}]"
        if kind == "StreamCache_TrainLoRA" and output.get("loss"):
            losses = output["loss"]
            k = max(1, min(5, len(losses) // 2))
            print(f"{title} loss: {len(losses)} steps, mean of the first {k} {sum(losses[:k]) / k:.4f}, "
                  f"of the last {k} {sum(losses[-k:]) / k:.4f} (sigma is random per step: raw losses are noisy)")
        for text in output.get("text", []):
            print(f"{title} " + str(text).replace("\n", "\n    "))
        for image in output.get("images", []):
            where = Path(image.get("subfolder", "")) / image["filename"]
            base = output_dir if image.get("type") == "output" else None
            print(f"{title} image ({image.get('type')}): {base / where if base else where}")
    for node_id, node in run.prompt.items():
        if node["class_type"] in ("LoraLoader", "LoraLoaderModelOnly"):
            name = node["inputs"]["lora_name"]
            path = output_dir / "loras" / name if output_dir and (output_dir / "loras" / name).is_file() else name
            print(f"[{node_id} {node['class_type']}] sampled with the LoRA {path}")
    if run.new_loras:
        print("LoRA files written: " + ", ".join(
            str(output_dir / "loras" / n) if output_dir else n for n in run.new_loras))
    print(f"done in {seconds:.1f} s")
    return 0


def main() -> int:
    args = _parse()
    if args.server:
        print(f"server: {args.server} (already running)")
        print(f"(the workflow's image folder must exist in that server's input directory: {EXAMPLE_FOLDER}/)")
        return _run(ComfyClient(args.server), args.workflow, args.timeout)
    install = find_comfyui()
    if install is None:
        print(skip_reason(), file=sys.stderr)
        return 2
    print(f"ComfyUI: {install.path} (python {install.python})")
    if args.models_dir:
        models = args.models_dir.resolve()
        print(f"models: {models} (given)")
    else:
        t0 = time.monotonic()
        models = ensure_tiny_models(install.path, install.python).root
        print(f"models: tiny generated models in {models} ({time.monotonic() - t0:.1f} s)")
    workdir = args.workdir or Path(tempfile.mkdtemp(prefix="streamcache-example-"))
    workdir.mkdir(parents=True, exist_ok=True)
    try:
        with ComfyServer(install, workdir, models_dir=models) as server:
            print(f"server: {server.url} ready in {server.startup_seconds:.1f} s; caches in "
                  f"{server.streamcache_dir}; log {server.log_path}"
                  + ("" if args.workdir else " (removed at exit; --workdir keeps it)"))
            folder = make_example_folder(server.input_dir)
            print(f"dataset: {len(folder.images)} captioned images in {folder.root} (kohya layout)")
            return _run(server.client(), args.workflow, args.timeout, server.output_dir)
    except (ServerStartError, WorkflowError, PromptError, TimeoutError) as exc:
        print(f"run-example failed: {exc}", file=sys.stderr)
        return 1
    finally:
        if args.workdir is None:
            shutil.rmtree(workdir, ignore_errors=True)
        else:
            print(f"kept: {workdir}")


if __name__ == "__main__":
    sys.exit(main())

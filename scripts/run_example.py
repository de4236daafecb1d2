"""Run one example workflow end to end on a headless ComfyUI and report what it did (``scripts/run-example``).

By default it starts a private ComfyUI server (CPU, temporary folders, this pack symlinked in as a custom
node) with tiny generated models, converts the saved UI workflow to an API prompt, queues it, follows the
websocket, prints every node's UI output, and stops the server. ``--models-dir`` uses real models instead
(a folder laid out like ComfyUI's ``models/``); ``--server`` uses a ComfyUI that is already running with the
pack installed.
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
from support.server import ComfyServer, ServerStartError  # noqa: E402
from support.tiny_models import ensure_tiny_models  # noqa: E402
from support.workflow import WorkflowError, ui_to_api  # noqa: E402

DEFAULT_WORKFLOW = ROOT / "example_workflows" / "cache_info.json"


def _parse() -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="scripts/run-example", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("workflow", nargs="?", type=Path, default=DEFAULT_WORKFLOW,
                   help="UI workflow file (default: %(default)s)")
    p.add_argument("--models-dir", type=Path, help="real models (a ComfyUI models/ layout) instead of tiny ones")
    p.add_argument("--server", help="URL of a running ComfyUI with the pack installed (no server is started)")
    p.add_argument("--workdir", type=Path, help="keep the server's folders and log here (default: temporary)")
    p.add_argument("--timeout", type=float, default=1800.0, help="seconds to wait for the workflow")
    return p.parse_args()


def _run(client: ComfyClient, workflow: Path, timeout: float) -> int:
    prompt = ui_to_api(json.loads(workflow.read_text(encoding="utf-8")), client.object_info())
    print(f"workflow: {workflow.name}: " + ", ".join(f"{k}:{v['class_type']}" for k, v in prompt.items()))
    t0 = time.monotonic()
    result = client.run(prompt, timeout=timeout, check=False)
    print(f"status: {result.status} in {time.monotonic() - t0:.1f} s (prompt {result.prompt_id})")
    for event in result.events_of("execution_cached"):
        if event.get("nodes"):
            print(f"cached nodes: {', '.join(event['nodes'])}")
    for node_id, output in result.outputs.items():
        title = prompt.get(node_id, {}).get("class_type", node_id)
        for key, values in output.items():
            for value in values:
                text = value if isinstance(value, str) else json.dumps(value)
                print(f"[{node_id} {title}] {key}:\n  " + text.replace("\n", "\n  "))
    if result.status != "success":
        for kind, data in result.history.get("status", {}).get("messages", []):
            if kind == "execution_error":
                print(f"error in node {data.get('node_id')} ({data.get('node_type')}): "
                      f"{data.get('exception_type')}: {data.get('exception_message')}")
        return 1
    return 0


def main() -> int:
    args = _parse()
    if args.server:
        print(f"server: {args.server} (already running)")
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
            return _run(server.client(), args.workflow, args.timeout)
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

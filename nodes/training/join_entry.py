"""Join a Train LoRA run from another machine: one rank, on this machine's device, in a fresh interpreter.

Run by path with ComfyUI's Python (``scripts/join-training`` does), never imported: like ``worker_entry.py`` it
takes its own folder off ``sys.path`` first. Then: this machine's ComfyUI options are read (those after ``--``:
``--base-directory``, ``--extra-model-paths-config``, ``--cuda-device``, ``--lowvram``...) and its folders set up as
its ComfyUI sets them (``extra_model_paths.yaml``); rank 0 is connected with ``$STREAMCACHE_JOIN_KEY`` (tried
again every 2 s until a run listens, for ``--wait`` seconds); rank 0's options that change what the model
computes replace this machine's (:data:`CARRIED`); the pack is registered under the name rank 0 imported it as;
and ``worker.py`` runs the job, finding the model files and caches in this machine's folders (``machines.py``).
``--repeat`` joins run after run, each in a fresh interpreter.
"""

import argparse
import importlib
import importlib.util
import itertools
import os
import pickle
import re
import socket
import subprocess
import sys
import time
from types import ModuleType
from typing import Any

_HERE = os.path.dirname(os.path.abspath(__file__))
if sys.path and os.path.abspath(sys.path[0] or os.curdir) == _HERE:
    del sys.path[0]
_PACK_ROOT = os.path.dirname(os.path.dirname(_HERE))

KEY_ENV = "STREAMCACHE_JOIN_KEY"
CARRIED = re.compile(r"^(cpu|deterministic|fast|force_\w+|dont_upcast_attention|fp16_intermediates|"
                     r"supports_fp8_compute|disable_xformers|use_\w+_attention|\w+_unet)$")
"""ComfyUI options that change what the diffusion model computes: every rank takes rank 0's (the others — memory
modes, folders, the server — stay this machine's)."""
RETRY_S = 2.0


def _arguments(argv: list[str]) -> argparse.Namespace:
    parser = argparse.ArgumentParser(
        prog="join-training", description="Join a Train LoRA run whose devices end in '+ N remote' as one of its "
        "ranks, on this machine's device. Anything after '--' is this machine's ComfyUI options (--base-directory, "
        "--extra-model-paths-config, --cuda-device N, --lowvram, ...).")
    parser.add_argument("--main", required=True, metavar="HOST:PORT",
                        help="rank 0's machine and the port of its STREAMCACHE_JOIN_ADDRESS (29440 by default)")
    parser.add_argument("--comfyui", metavar="FOLDER", help="this machine's ComfyUI folder (default: the one this "
                        "pack is installed in)")
    parser.add_argument("--wait", type=float, default=3600.0, metavar="SECONDS",
                        help="how long to wait for a run to start listening (default 3600)")
    parser.add_argument("--repeat", action="store_true",
                        help="join run after run (each in a fresh process) until stopped with Ctrl+C")
    own, _, comfy = _split(argv)
    args = parser.parse_args(own)
    args.comfy_args = comfy
    host, _, port = args.main.rpartition(":")
    if not host or not port.isdigit():
        parser.error(f"--main {args.main!r}: write HOST:PORT, e.g. 10.0.0.5:29440")
    if ":" in host:
        parser.error(f"--main {args.main!r}: IPv6 addresses are not supported; give an IPv4 address or a host name")
    args.host, args.port = host, int(port)
    return args


def _split(argv: list[str]) -> tuple[list[str], str, list[str]]:
    if "--" in argv:
        i = argv.index("--")
        return argv[:i], "--", argv[i + 1:]
    return argv, "", []


def _comfyui_folder(given: str | None) -> str:
    folder = given or os.path.dirname(os.path.dirname(_PACK_ROOT))  # <ComfyUI>/custom_nodes/<pack>
    if not os.path.isfile(os.path.join(folder, "folder_paths.py")):
        print(f"join-training: {folder} is not a ComfyUI folder (no folder_paths.py): give --comfyui", file=sys.stderr)
        raise SystemExit(2)
    return os.path.abspath(folder)


def _own_comfyui(comfy_root: str, comfy_args: list[str]) -> Any:
    """This machine's ComfyUI options and folders, as its ``main.py`` would set them."""
    sys.path.insert(0, comfy_root)
    sys.argv = [os.path.join(comfy_root, "main.py"), *comfy_args]
    import comfy.options

    comfy.options.enable_args_parsing()
    from comfy.cli_args import args

    if args.cuda_device is not None:  # before torch is imported, as ComfyUI's main.py does
        os.environ["CUDA_VISIBLE_DEVICES"] = os.environ["HIP_VISIBLE_DEVICES"] = str(args.cuda_device)
    import folder_paths
    import utils.extra_config

    default_config = os.path.join(comfy_root, "extra_model_paths.yaml")
    if os.path.isfile(default_config):
        utils.extra_config.load_extra_path_config(default_config)
    for config in itertools.chain(*(args.extra_model_paths_config or [])):
        utils.extra_config.load_extra_path_config(config)
    for name, value in (("output", args.output_directory), ("input", args.input_directory),
                        ("temp", args.temp_directory)):
        if value:
            getattr(folder_paths, f"set_{name}_directory")(os.path.abspath(value))
    return args


def _standalone_workers() -> ModuleType:
    """The pack's ``workers`` module, loaded alone (it imports nothing of the pack or ComfyUI): the connection comes
    before the pack can be imported under rank 0's name."""
    spec = importlib.util.spec_from_file_location("streamcache_join_workers",
                                                  os.path.join(_PACK_ROOT, "dataset_cache", "workers.py"))
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module
    spec.loader.exec_module(module)
    return module


def _connect(workers: ModuleType, host: str, port: int, key: bytes, wait_s: float) -> Any:
    deadline = time.monotonic() + wait_s
    said = False
    while True:
        try:
            return workers.join(host, port, key, socket.gethostname())
        except PermissionError as exc:  # exit 2: --repeat does not try again with the same key
            print(f"join-training: {exc}", file=sys.stderr)
            raise SystemExit(2) from None
        except OSError as exc:  # refused, unreachable, a name not resolved yet: no run listens there yet
            if time.monotonic() >= deadline:
                raise SystemExit(f"join-training: no run listened at {host}:{port} within {wait_s:.0f} s ({exc}); "
                                 "queue a Train LoRA whose devices end in '+ N remote' there") from None
            if not said:
                print(f"join-training: waiting for a run at {host}:{port}...", file=sys.stderr, flush=True)
                said = True
            time.sleep(RETRY_S)


def _register_package(name: str, folder: str) -> None:
    spec = importlib.util.spec_from_file_location(name, os.path.join(folder, "__init__.py"),
                                                  submodule_search_locations=[folder])
    assert spec is not None, f"cannot load the pack from {folder}"
    sys.modules[name] = importlib.util.module_from_spec(spec)


def _repeat(argv: list[str]) -> int:
    """Join run after run, each in a fresh interpreter (a run leaves CUDA and ``torch.distributed`` state behind)."""
    own, dash, comfy = _split(argv)
    once = [sys.executable, os.path.abspath(__file__), *[a for a in own if a != "--repeat"], *([dash] if dash else []),
            *comfy]
    try:
        while True:
            code = subprocess.call(once)
            if code == 2:  # the arguments, the folder or the key: the next try would fail alike
                return code
            print(f"join-training: that run ended (exit code {code}); joining the next one", file=sys.stderr,
                  flush=True)
            if code:
                time.sleep(RETRY_S)  # a failure that repeats at once is not tried again in a tight loop
    except KeyboardInterrupt:
        return 130


def main(argv: list[str]) -> int:
    options = _arguments(argv)
    key = os.environ.get(KEY_ENV, "")
    if not key:
        print(f"join-training: set {KEY_ENV} to the key of rank 0's ComfyUI", file=sys.stderr)
        return 2
    comfy_root = _comfyui_folder(options.comfyui)
    if options.repeat:
        return _repeat(argv)
    args = _own_comfyui(comfy_root, options.comfy_args)
    workers = _standalone_workers()
    link = _connect(workers, options.host, options.port, key.encode(), options.wait)
    try:
        bootstrap, job = pickle.loads(link.receive()), link.receive()
    except (EOFError, OSError):
        print(f"join-training: rank 0 at {options.host}:{options.port} did not take this machine (every rank of "
              "its run had joined?)", file=sys.stderr)
        return 1
    link.watch_parent()  # from now on, rank 0 gone or saying stop ends this process at once
    for name, value in bootstrap["args"].items():
        if CARRIED.match(name):
            setattr(args, name, value)
    _register_package(bootstrap["pack"], _PACK_ROOT)
    importlib.import_module(f"{bootstrap['pack']}.nodes.paths").register_cache_folder()
    worker = importlib.import_module(f"{bootstrap['pack']}.nodes.training.worker")
    print(f"join-training: joined the run at {options.host}:{options.port}", file=sys.stderr, flush=True)
    return int(worker.main(link, job, host=options.host))


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))

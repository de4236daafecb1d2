"""Entry of a Train LoRA worker process (one per further device): run BY PATH by rank 0, never imported.

Why a script of its own: a worker is a fresh interpreter (never forked: ComfyUI has initialised CUDA), and
``multiprocessing``'s spawn would run ComfyUI's ``main.py`` again in it as ``__mp_main__``. Run by path, Python puts
this file's folder first on ``sys.path``, where ``settings.py``, ``run.py``, ... would become top-level modules: it
is taken off before anything else is imported. Then, in this order: ComfyUI's folder goes first on ``sys.path``
(as when ComfyUI runs); the pack's root package is registered under the name ComfyUI gave it, without running its
``__init__`` (which only serves ComfyUI's loader), so relative imports and the pickles rank 0 sends resolve; the
control connection is opened (``dataset_cache.workers``) and the two payloads received; ComfyUI's command-line
options and model folders are set from the first before any ComfyUI model code is imported; and
``nodes/training/worker.py`` runs the job, the second. The folders come from the environment (see
``distributed.py``).
"""

import importlib
import importlib.util
import os
import pickle
import sys

_HERE = os.path.dirname(os.path.abspath(__file__))
if sys.path and os.path.abspath(sys.path[0] or os.curdir) == _HERE:
    del sys.path[0]


def _register_package(name: str, folder: str) -> None:
    spec = importlib.util.spec_from_file_location(name, os.path.join(folder, "__init__.py"),
                                                  submodule_search_locations=[folder])
    assert spec is not None, f"cannot load the pack from {folder}"
    sys.modules[name] = importlib.util.module_from_spec(spec)


def _configure_comfyui(bootstrap: bytes) -> None:
    from comfy.cli_args import args

    settings = pickle.loads(bootstrap)
    for key, value in settings["args"].items():
        setattr(args, key, value)
    import folder_paths

    folder_paths.folder_names_and_paths.clear()
    folder_paths.folder_names_and_paths.update(settings["folders"])
    folder_paths.models_dir = settings["models_dir"]
    places = settings["places"]
    folder_paths.set_output_directory(places["output"])
    folder_paths.set_input_directory(places["input"])
    folder_paths.set_temp_directory(places["temp"])


def main() -> int:
    try:
        comfy_root = os.environ["STREAMCACHE_COMFYUI"]
        pack_root = os.environ["STREAMCACHE_PACK"]
        pack = os.environ["STREAMCACHE_PACK_MODULE"]
    except KeyError as exc:
        print(f"{__file__}: not started by Train LoRA (no {exc} in the environment)", file=sys.stderr)
        return 2
    sys.path.insert(0, comfy_root)
    _register_package(pack, pack_root)
    workers = importlib.import_module(f"{pack}.dataset_cache.workers")
    link = workers.connect()
    bootstrap, job = link.receive(), link.receive()
    link.watch_parent()  # from now on, rank 0 gone or saying stop ends this process at once
    _configure_comfyui(bootstrap)
    worker = importlib.import_module(f"{pack}.nodes.training.worker")
    return int(worker.main(link, job))


if __name__ == "__main__":
    sys.exit(main())

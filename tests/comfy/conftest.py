"""ComfyUI suite: the pack's nodes and ComfyUI's own loaders called in-process, on the CPU.

Needs ComfyUI's python (torch + torchvision + ComfyUI's requirements): ``scripts/test`` runs this suite with
``$COMFYUI_PYTHON``. ComfyUI's source tree goes first on ``sys.path`` and ``args.cpu`` is set before anything
imports ``comfy.model_management``. Without ComfyUI every test here is skipped with one line naming the
variables to set (see ``support.comfy_env``).

Folders: ComfyUI's input/output/temp and models folders are pointed at a private temporary folder, and the
tiny generated models (``support.tiny_models``) are added to the model search paths, so nothing is written
into the ComfyUI install.
"""

from __future__ import annotations

import importlib
import sys
from collections.abc import Iterator
from pathlib import Path
from types import ModuleType
from typing import Any

import pytest

_TESTS = str(Path(__file__).resolve().parents[1])
if _TESTS not in sys.path:
    sys.path.insert(0, _TESTS)

from support.collection import (  # noqa: E402
    add_marker_under,
    drop_suite,
    only_dropped,
    report_dropped,
    skip_cuda_tests_without_device,
    skip_pack_root_setup,
)
from support.comfy_env import ComfyInstall, find_comfyui, skip_reason  # noqa: E402
from support.tiny_models import TinyModels, ensure_tiny_models  # noqa: E402

_HERE = Path(__file__).resolve().parent
_INSTALL = find_comfyui()
_SKIP: str | None = None
if _INSTALL is None:
    _SKIP = skip_reason()
elif not _INSTALL.is_current_interpreter():
    _SKIP = (f"tests/comfy imports ComfyUI in-process and must run under its python: "
             f"{_INSTALL.python} -m pytest tests/comfy (scripts/test does this)")
else:
    if str(_INSTALL.path) not in sys.path:
        sys.path.insert(0, str(_INSTALL.path))
    from comfy.cli_args import args

    args.cpu = True  # before comfy.model_management is imported: no GPU probing


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    if _SKIP:
        drop_suite(config, items, _HERE, _SKIP)
    skip_pack_root_setup(items)
    skip_cuda_tests_without_device(items)
    add_marker_under(items, _HERE, "comfy")


def pytest_terminal_summary(terminalreporter: object) -> None:
    report_dropped(terminalreporter)


def pytest_sessionfinish(session: pytest.Session, exitstatus: int) -> None:
    only_dropped(session, exitstatus)


@pytest.fixture(scope="session")
def comfy_install() -> ComfyInstall:
    assert _INSTALL is not None and not _SKIP, "tests/comfy should have been left out"
    return _INSTALL


@pytest.fixture(scope="session")
def tiny_models(comfy_install: ComfyInstall) -> TinyModels:
    return ensure_tiny_models(comfy_install.path, comfy_install.python)


@pytest.fixture(scope="session")
def comfy_folders(comfy_install: ComfyInstall, tiny_models: TinyModels,
                  tmp_path_factory: pytest.TempPathFactory) -> Iterator[Path]:
    """Private ComfyUI folders (returned: the models folder) plus the tiny models on the search paths."""
    import folder_paths

    work = tmp_path_factory.mktemp("comfy")
    saved = (folder_paths.models_dir, folder_paths.get_output_directory(), folder_paths.get_input_directory(),
             folder_paths.get_temp_directory())
    models = work / "models"
    for sub in ("output", "input", "temp", "models/streamcache"):
        (work / sub).mkdir(parents=True)
    folder_paths.models_dir = str(models)
    folder_paths.set_output_directory(str(work / "output"))
    folder_paths.set_input_directory(str(work / "input"))
    folder_paths.set_temp_directory(str(work / "temp"))
    for name in ("checkpoints", "diffusion_models", "text_encoders", "vae"):
        folder_paths.add_model_folder_path(name, str(tiny_models.root / name), is_default=True)
    yield models
    folder_paths.models_dir = saved[0]
    folder_paths.set_output_directory(saved[1])
    folder_paths.set_input_directory(saved[2])
    folder_paths.set_temp_directory(saved[3])


@pytest.fixture(scope="session")
def comfy_nodes(comfy_folders: Path) -> ModuleType:
    """ComfyUI's own ``nodes`` module (UNETLoader, CLIPTextEncode, ...)."""
    import nodes

    return nodes


@pytest.fixture(scope="session")
def pack(comfy_folders: Path) -> ModuleType:
    """This pack, imported the way ComfyUI imports it (as the package ``comfyui_streamcache``)."""
    from support.pack import import_pack

    return import_pack()


@pytest.fixture(scope="session")
def cache_root(pack: ModuleType, comfy_folders: Path) -> Path:
    """The pack's default cache folder for this session (``<private models>/streamcache``)."""
    roots = pack.nodes.paths.cache_roots()
    assert roots == [comfy_folders / "streamcache"], roots
    return roots[0]


@pytest.fixture(scope="module")
def models(comfy_nodes: ModuleType, tiny_models: TinyModels) -> tuple[Any, Any, Any]:
    """The tiny SD1.5 UNet, CLIP-L and TAESD, loaded by ComfyUI's own loader nodes (a model patcher, a CLIP, a
    VAE), for the tests that encode and train with them."""
    (model,) = comfy_nodes.UNETLoader().load_unet(tiny_models.name("unet"), "default")
    (clip,) = comfy_nodes.CLIPLoader().load_clip(tiny_models.name("clip"), "stable_diffusion")
    (vae,) = comfy_nodes.VAELoader().load_vae(tiny_models.name("vae"))
    return model, clip, vae


@pytest.fixture(scope="module")
def handles(pack: ModuleType) -> ModuleType:
    """The pack's ``nodes.handles`` module (dataset handles), as ComfyUI loaded it."""
    return importlib.import_module(f"{pack.__name__}.nodes.handles")


@pytest.fixture(scope="session")
def wan_vae(comfy_nodes: ModuleType, tmp_path_factory: pytest.TempPathFactory) -> tuple[str, Any]:
    """A tiny WAN 2.1 VAE (random weights, the real architecture) in a folder registered for ComfyUI's ``vae``
    models, and the VAE ComfyUI's own VAELoader makes of it: ``(file name, VAE)``."""
    import folder_paths
    from support.tiny_families import save_wan21_vae

    folder = tmp_path_factory.mktemp("wan_vae")
    path = save_wan21_vae(folder)
    folder_paths.add_model_folder_path("vae", str(folder))
    (vae,) = comfy_nodes.VAELoader().load_vae(path.name)
    return path.name, vae


@pytest.fixture
def lora_folder(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    """ComfyUI's output folder for this test, its ``loras/`` (where Save LoRA Weights writes) listed as a LoRA
    folder, as README's extra_model_paths.yaml recipe does."""
    import folder_paths

    output = tmp_path / "output"
    (output / "loras").mkdir(parents=True)
    monkeypatch.setattr(folder_paths, "output_directory", str(output))
    monkeypatch.setitem(folder_paths.folder_names_and_paths, "loras",
                        ([str(output / "loras")], set(folder_paths.supported_pt_extensions)))
    return output


@pytest.fixture(scope="module")
def train_node(pack: ModuleType) -> type:
    """The pack's Train LoRA node class, as ComfyUI loaded it."""
    return importlib.import_module(f"{pack.__name__}.nodes.train_lora").TrainLoRA


@pytest.fixture(scope="module")
def six_images(pack: ModuleType, comfy_nodes: ModuleType, models: tuple, handles: ModuleType,
               tmp_path_factory: pytest.TempPathFactory) -> Any:
    """A cache of six 64×64 images encoded by ComfyUI's VAEEncode (TAESD) and CLIPTextEncode (CLIP-L), one bucket:
    its dataset's handle (the short runs of ``support.train_options``)."""
    from support.encoded import write_comfy_encoded

    _, clip, vae = models
    root = tmp_path_factory.mktemp("six_images") / "cache"
    write_comfy_encoded(pack, comfy_nodes, clip, vae, root, [(64, 64)] * 6, seed=0,
                        caption="a photo of test pattern number {}")
    return handles.StreamDatasetHandle(str(root), "train")

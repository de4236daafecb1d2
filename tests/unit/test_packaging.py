"""The pack as the Comfy Registry and comfy-cli see it: pyproject.toml fields, the icon, and the archive.

The first tests read the files directly. The last two run comfy-cli (``comfy node validate``, and the function
``comfy node pack`` zips with) when it is installed: ``$COMFY_CLI``, ``comfy`` on ``PATH`` or
``.venv-tools/bin/comfy``; otherwise they skip with one line.
"""

from __future__ import annotations

import os
import re
import shutil
import subprocess
import zipfile
from pathlib import Path
from typing import Any
from urllib.parse import urlparse

import pytest
from support.paths import PACK_ROOT

tomllib = pytest.importorskip("tomllib")

NODE_IDS = ("StreamCache_EncodeDataset", "StreamCache_SaveCache", "StreamCache_LoadLazyCache",
            "StreamCache_TrainLoRA", "StreamCache_CleanCache", "StreamCache_CacheInfo",
            "StreamCache_CombineDatasets")
# comfy-cli's registry/config_parser.py: the only accelerator values the registry takes
REGISTRY_ACCELERATORS = {"GPU :: NVIDIA CUDA", "GPU :: AMD ROCm", "GPU :: Intel Arc", "NPU :: Huawei Ascend",
                         "GPU :: Apple Metal"}
REGISTRY_OS_PREFIXES = ("Microsoft", "POSIX", "MacOS", "OS Independent")


@pytest.fixture(scope="module")
def pyproject() -> dict[str, Any]:
    return tomllib.loads((PACK_ROOT / "pyproject.toml").read_text(encoding="utf-8"))


def _tracked(path: str) -> bool:
    done = subprocess.run(["git", "ls-files", "--error-unmatch", path], cwd=PACK_ROOT, capture_output=True)
    return done.returncode == 0


def test_node_id_follows_the_registry_rules(pyproject: dict[str, Any]) -> None:
    name = pyproject["project"]["name"]
    # registry: < 100 chars, alphanumerics . - _, no consecutive specials, starts with a letter; no "ComfyUI"
    assert re.fullmatch(r"[A-Za-z](?:[A-Za-z0-9]|[._-](?=[A-Za-z0-9]))*", name) and len(name) < 100, name
    assert "comfy" not in name.lower(), name


def test_license_urls_and_version(pyproject: dict[str, Any]) -> None:
    project = pyproject["project"]
    assert project["license"] == {"file": "LICENSE"}
    assert "MIT License" in (PACK_ROOT / "LICENSE").read_text(encoding="utf-8")
    assert re.fullmatch(r"\d+\.\d+\.\d+", project["version"])
    urls = project["urls"]
    repo = urls["Repository"]
    assert re.fullmatch(r"https://github\.com/[\w.-]+/[\w.-]+", repo), repo
    assert urls["Issues"] == repo + "/issues"  # the key comfy-cli reads
    assert re.fullmatch(r">=\d+\.\d+\.\d+", pyproject["tool"]["comfy"]["requires-comfyui"])
    assert pyproject["tool"]["comfy"]["PublisherId"]


def test_dependencies_mirror_requirements_txt(pyproject: dict[str, Any]) -> None:
    lines = [ln.split("#")[0].strip() for ln in (PACK_ROOT / "requirements.txt").read_text().splitlines()]
    assert sorted(ln for ln in lines if ln) == sorted(pyproject["project"]["dependencies"])


def test_the_remote_extra_mirrors_requirements_remote_txt(pyproject: dict[str, Any]) -> None:
    """Training from a bucket needs obstore, and only that: the pyproject extra and the file ComfyUI users install
    by hand list the same, and the default dependencies do not include it (a local-disk user installs nothing)."""
    lines = [ln.split("#")[0].strip() for ln in (PACK_ROOT / "requirements-remote.txt").read_text().splitlines()]
    assert sorted(ln for ln in lines if ln) == sorted(pyproject["project"]["optional-dependencies"]["remote"])
    assert not any(d.startswith("obstore") for d in pyproject["project"]["dependencies"])


def test_classifiers_are_ones_the_registry_takes(pyproject: dict[str, Any]) -> None:
    classifiers = pyproject["project"]["classifiers"]
    systems = [c.removeprefix("Operating System :: ") for c in classifiers if c.startswith("Operating System :: ")]
    assert systems and all(s.startswith(REGISTRY_OS_PREFIXES) for s in systems), systems
    accelerators = {c.removeprefix("Environment :: ") for c in classifiers if c.startswith("Environment ::")}
    assert accelerators <= REGISTRY_ACCELERATORS, accelerators


def test_icon_is_a_committed_square_png_at_its_raw_url(pyproject: dict[str, Any]) -> None:
    from PIL import Image

    icon = pyproject["tool"]["comfy"]["Icon"]
    owner_repo = urlparse(pyproject["project"]["urls"]["Repository"]).path.strip("/")
    url = urlparse(icon)
    assert url.scheme == "https" and url.netloc == "raw.githubusercontent.com", icon
    prefix = f"/{owner_repo}/main/"
    assert url.path.startswith(prefix), f"{icon} is not a file of {owner_repo} on main"
    rel = url.path.removeprefix(prefix)
    assert (PACK_ROOT / rel).is_file() and _tracked(rel), f"{rel} is not committed"
    with Image.open(PACK_ROOT / rel) as image:
        assert image.format in ("PNG", "JPEG", "GIF")
        assert image.width == image.height <= 400, image.size


def test_web_folder_is_registered_once(pyproject: dict[str, Any]) -> None:
    """WEB_DIRECTORY in __init__.py registers web/; a `web` key here too would load every JS file twice."""
    assert "web" not in pyproject["tool"]["comfy"]
    assert 'WEB_DIRECTORY = "./web"' in (PACK_ROOT / "__init__.py").read_text(encoding="utf-8")


# ------------------------------------------------------------------------------------------------ comfy-cli
def _comfy_cli() -> Path | None:
    for candidate in (os.environ.get("COMFY_CLI"), shutil.which("comfy"), str(PACK_ROOT / ".venv-tools/bin/comfy")):
        if candidate and Path(candidate).is_file() and (Path(candidate).parent / "python").is_file():
            return Path(candidate)
    return None


@pytest.fixture(scope="module")
def comfy_cli() -> Path:
    found = _comfy_cli()
    if found is None:
        pytest.skip("comfy-cli not found (set COMFY_CLI, or pip install comfy-cli into a venv on PATH)")
    return found


def test_comfy_node_validate_is_clean(comfy_cli: Path) -> None:
    done = subprocess.run([str(comfy_cli), "--skip-prompt", "node", "validate"], cwd=PACK_ROOT,
                          stdin=subprocess.DEVNULL, capture_output=True, text=True, timeout=300)
    out = done.stdout + done.stderr
    assert done.returncode == 0, out
    assert "All validation checks passed" in out, out
    assert "Warning" not in out and "Security warnings" not in out, out


def test_registry_archive_holds_the_runtime_and_nothing_else(comfy_cli: Path, tmp_path: Path) -> None:
    """The zip ``comfy node pack`` / ``publish`` builds (comfy-cli's own ``zip_files``: git-tracked files minus
    .comfyignore), made from this working tree into a temporary file."""
    archive = tmp_path / "node.zip"
    subprocess.run([str(comfy_cli.parent / "python"), "-c",
                    "import sys; from comfy_cli.file_utils import zip_files; zip_files(sys.argv[1])", str(archive)],
                   cwd=PACK_ROOT, check=True, capture_output=True, timeout=300)
    names = set(zipfile.ZipFile(archive).namelist())
    tracked = subprocess.run(["git", "ls-files"], cwd=PACK_ROOT, capture_output=True, text=True,
                             check=True).stdout.splitlines()
    runtime = {p for p in tracked if p.split("/")[0] in ("nodes", "dataset_cache", "web", "example_workflows")
               and (PACK_ROOT / p).is_file()}
    assert runtime and runtime <= names, sorted(runtime - names)
    for required in ("__init__.py", "requirements.txt", "pyproject.toml", "LICENSE", "README.md"):
        assert required in names
    for node_id in NODE_IDS:
        assert f"web/docs/{node_id}.md" in names, node_id
    for template in (PACK_ROOT / "example_workflows").glob("*.json"):
        assert f"example_workflows/{template.stem}.jpg" in names, f"{template.name} has no thumbnail"
    assert "scripts/join-training" in names  # users run it on the other machines of a run
    left_out = ("tests/", "bench/", "scripts/", ".ci/", ".venv", "node_modules/")
    leaked = sorted(n for n in names if n.startswith(left_out) and n != "scripts/join-training")
    assert not leaked, leaked
    assert not [n for n in names if n.startswith("docs/") and n.endswith(".png")]

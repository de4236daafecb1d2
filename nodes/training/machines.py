"""What a rank on another machine needs from rank 0, and how it finds the same things there.

A local worker shares rank 0's disk: it loads the model from the same path and opens the caches by their folders.
Another machine has its own ComfyUI, with its own folders. So rank 0 names each model file by its ComfyUI folder
kind and name (``diffusion_models``, ``flux1-dev.safetensors``) with its size and the hash of its ends, and each
local cache by its name in the ``streamcache`` folders with a fingerprint of what it trains
(:mod:`dataset_cache.identity`); the other machine looks both up in its own folders and refuses, by name, a file or
cache it lacks or holds in another version (training on different weights or rows would not fail: it would average
gradients of different runs).
A cache in a bucket is opened there by its URL, at rank 0's version, with that machine's own fetch folder. An
``existing_lora`` and its training state travel with the job: that machine trains from rank 0's, placed in a
folder of the run's own, without a copy by hand.

(ComfyUI's options that change what the model computes are rank 0's on every rank: ``join_entry.py``.)
"""

from __future__ import annotations

import contextlib
import dataclasses
import os
import shutil
import tempfile
from collections.abc import Iterable, Iterator, Mapping
from dataclasses import dataclass
from pathlib import Path, PurePosixPath
from typing import Any

import safetensors.torch
import torch
import xxhash

import folder_paths

from ...dataset_cache import __version__
from ...dataset_cache.format.reader import CacheReader
from ...dataset_cache.identity import cache_fingerprint, file_edges
from ...dataset_cache.optimizer_state import lora_digest
from ...dataset_cache.reopen import CacheAddress, reopen
from ..paths import cache_roots, resolve_cache
from .lora_files import NONE, OUTPUT_SUFFIX, lora_path
from .resume import STATE_FOLDER, state_store

__all__ = ["Elsewhere", "ExistingLora", "ModelFile", "NamedCache", "check_same_code", "elsewhere", "existing_lora",
           "existing_placed", "local_model_paths", "open_named", "pack_code", "replace_paths", "software",
           "software_notes"]



@dataclass(frozen=True)
class ModelFile:
    """A model file of rank 0's, as another machine finds it: by ComfyUI folder kind and name, checked by size
    and the hash of its ends (:func:`~dataset_cache.identity.file_edges`: a whole hash would read the whole file at
    every start)."""

    path: str
    kind: str
    name: str
    size: int
    edges: str


@dataclass(frozen=True)
class NamedCache:
    """A cache of rank 0's, as another machine finds it: its name in the ``streamcache`` folders and the
    fingerprint of what it holds (``None`` name: a cache in a bucket, opened by its address)."""

    address: CacheAddress
    name: str | None
    fingerprint: str


@dataclass(frozen=True)
class ExistingLora:
    """Rank 0's ``existing_lora`` file and its training state file (``None``: it has none), by name and bytes."""

    name: str
    lora: bytes
    state_name: str | None = None
    state: bytes | None = None


@dataclass(frozen=True)
class Elsewhere:
    """The part of a job only a rank on another machine needs."""

    files: tuple[ModelFile, ...]
    caches: tuple[NamedCache, ...]
    folders: dict[str, list[str]]
    """Rank 0's folder list of each kind a loader argument equals (``embedding_directory``), mapped to this
    machine's."""
    existing: ExistingLora | None = None
    code: str = ""
    """Rank 0's :func:`pack_code` (another machine must run the same code: it trains the same steps)."""


def _kind_of(path: str) -> tuple[str, str] | None:
    """The folder kind and name rank 0's ComfyUI lists ``path`` under: of the folders holding it, the innermost
    (``models/diffusion_models`` rather than a ``models`` folder some configuration lists for another kind)."""
    real = os.path.realpath(path)
    found: list[tuple[int, int, str, str]] = []
    for order, (kind, (folders, _)) in enumerate(folder_paths.folder_names_and_paths.items()):
        for folder in folders:
            root = os.path.realpath(folder)
            if real.startswith(root.rstrip(os.sep) + os.sep):
                found.append((-len(root), order, kind, os.path.relpath(real, root).replace(os.sep, "/")))
    if not found:
        return None
    _, _, kind, name = min(found)  # the longest root; for one root in two kinds, the first in ComfyUI's table
    return kind, name


def elsewhere(recipe_args: Iterable[Any], caches: Iterable[tuple[CacheAddress, Any]]) -> Elsewhere:
    """Rank 0's side: the model files among a loader recipe's arguments and the caches (each address with rank 0's
    open reader of it, which is fingerprinted: nothing is opened again), named for another machine.

    Raises:
        ValueError: a model file or a cache folder outside ComfyUI's folders (another machine could not find it
            by name), naming it.
    """
    files, folders = [], {}
    for arg in recipe_args:
        if isinstance(arg, str) and os.path.isfile(arg):
            found = _kind_of(arg)
            if found is None:
                raise ValueError(f"the model file {arg} is in none of ComfyUI's model folders, so a rank on another "
                                 "machine cannot find it by name; move it into one (e.g. models/diffusion_models)")
            size = os.path.getsize(arg)
            files.append(ModelFile(arg, found[0], found[1], size, file_edges(Path(arg), size)))
        elif isinstance(arg, list) and arg and all(isinstance(a, str) for a in arg):
            for kind, (paths, _) in folder_paths.folder_names_and_paths.items():
                if list(paths) == arg:
                    folders[kind] = list(arg)
                    break
    return Elsewhere(tuple(files), tuple(_named(a, r) for a, r in caches), folders, code=pack_code())


def _named(address: CacheAddress, reader: Any) -> NamedCache:
    if address.version is not None:
        return NamedCache(address, None, "")
    root = Path(address.root).resolve()
    for base in cache_roots():
        if root.is_relative_to(base.resolve()):
            name = root.relative_to(base.resolve()).as_posix()
            return NamedCache(address, name, cache_fingerprint(reader))
    raise ValueError(f"the cache {address.root} is in none of the streamcache folders, so a rank on another machine "
                     "cannot find it by name; keep it in models/streamcache (or a folder extra_model_paths.yaml "
                     "lists as streamcache)")


def local_model_paths(files: Iterable[ModelFile]) -> dict[str, str]:
    """This machine's path of each of rank 0's model files (rank 0's path → here).

    Raises:
        FileNotFoundError: a file this machine's ComfyUI does not list, naming it and its folder kind.
        ValueError: a file of that name in another version (size or hash), naming both paths.
    """
    out = {}
    for file in files:
        here = folder_paths.get_full_path(file.kind, file.name)
        if here is None:
            raise FileNotFoundError(f"this machine has no {file.kind} model named {file.name!r} (rank 0 trains "
                                    f"{file.path}): copy it into this ComfyUI's models/{file.kind} folder")
        size = os.path.getsize(here)
        if size != file.size or file_edges(Path(here), size) != file.edges:
            raise ValueError(f"this machine's {file.kind} model {here} is not rank 0's {file.path} (another size or "
                             f"content: {size} bytes, rank 0's {file.size}): copy rank 0's file here")
        out[file.path] = here
    return out


def replace_paths(args: tuple[Any, ...], paths: Mapping[str, str], folders: Mapping[str, list[str]]) -> tuple[Any, ...]:
    """A loader recipe's arguments with rank 0's paths replaced by this machine's (files by ``paths``, folder
    lists by the kinds in ``folders``)."""
    lists = {tuple(v): list(folder_paths.get_folder_paths(k)) for k, v in folders.items()}
    return tuple(paths.get(a, a) if isinstance(a, str) else lists.get(tuple(a), a) if isinstance(a, list) else a
                 for a in args)


def open_named(cache: NamedCache, fetch_dir: Path | None) -> CacheReader:
    """Open one of rank 0's caches on this machine: a bucket's at rank 0's version into this machine's
    ``fetch_dir``; a folder by its name here, refused unless it holds what rank 0's holds.

    Raises:
        FileNotFoundError: no cache of that name here.
        ValueError: the cache here holds something else, naming it and what to do.
    """
    address = cache.address
    if cache.name is None:
        options = dataclasses.replace(address.remote, fetch_dir=fetch_dir) if address.remote is not None else None
        return reopen(dataclasses.replace(address, remote=options))
    root = resolve_cache(cache.name)
    if not root.is_dir():
        raise FileNotFoundError(f"this machine has no cache named {cache.name!r} in its streamcache folders "
                                f"({', '.join(str(r) for r in cache_roots())}): copy rank 0's {address.root} there")
    reader = reopen(CacheAddress(str(root)))
    if cache_fingerprint(reader) != cache.fingerprint:
        reader.close()
        raise ValueError(f"this machine's cache {root} is not what rank 0 trains from ({address.root}): it holds "
                         "other entries or datasets; copy rank 0's cache again")
    return reader


def existing_lora(name: str) -> ExistingLora | None:
    """Rank 0's side: the ``existing_lora`` of that name and its training state, read to send (``None``: none)."""
    if name == NONE:
        return None
    data = Path(lora_path(name)).read_bytes()
    state = state_store().find(lora_digest(safetensors.torch.load(data)))
    if state is None:
        return ExistingLora(name, data)
    return ExistingLora(name, data, state.name, state.read_bytes())


@contextlib.contextmanager
def existing_placed(existing: ExistingLora | None) -> Iterator[None]:
    """On another machine, while the run trains: rank 0's ``existing_lora`` under its name in a ``loras`` folder of
    the run's own (first in the list) or its output folder's ``loras/``, and its training state in that output
    folder, where the trainer looks for them. This machine's own folders are left as they are (the run's output
    folder is its own: a rank on another machine saves nothing); all of it is deleted afterwards.

    Raises:
        ValueError: a name that would leave the folder (never sent by rank 0's own lists).
    """
    if existing is None:
        yield
        return
    place = Path(tempfile.mkdtemp(prefix="streamcache-join-"))
    saved_output = folder_paths.get_output_directory()
    loras = folder_paths.folder_names_and_paths.get("loras")
    try:
        output, own_loras = place / "output", place / "loras"
        output.mkdir()
        own_loras.mkdir()
        relative = existing.name.removesuffix(OUTPUT_SUFFIX) if existing.name.endswith(OUTPUT_SUFFIX) else None
        target = output / _inside(relative) if relative is not None else own_loras / _inside(existing.name)
        target.parent.mkdir(parents=True, exist_ok=True)
        target.write_bytes(existing.lora)
        if existing.state is not None and existing.state_name is not None:
            (output / STATE_FOLDER).mkdir()
            (output / STATE_FOLDER / _inside(existing.state_name)).write_bytes(existing.state)
        folder_paths.set_output_directory(str(output))
        paths, extensions = loras if loras is not None else ([], set(folder_paths.supported_pt_extensions))
        folder_paths.folder_names_and_paths["loras"] = ([str(own_loras), *paths], extensions)
        yield
    finally:
        folder_paths.set_output_directory(saved_output)
        if loras is not None:
            folder_paths.folder_names_and_paths["loras"] = loras
        shutil.rmtree(place, ignore_errors=True)


def _inside(name: str) -> str:
    parts = PurePosixPath(name.replace("\\", "/")).parts
    if not parts or any(p in ("", ".", "..") for p in parts) or PurePosixPath(name).is_absolute():
        raise ValueError(f"existing_lora: rank 0 sent the name {name!r:.200}, which leaves its folder")
    return "/".join(parts)


_PACK_ROOT = Path(__file__).resolve().parents[2]
_CODE: list[str] = []


def pack_code() -> str:
    """This pack's version and a hash of its Python code (``0.1.0/1f2e...``): two machines training one run must run
    the same code, which a version number alone does not tell between releases or in a git checkout."""
    if not _CODE:
        h = xxhash.xxh3_64()
        for path in sorted(p for part in ("dataset_cache", "nodes") for p in (_PACK_ROOT / part).rglob("*.py")):
            text = path.read_bytes().replace(b"\r\n", b"\n")  # a Windows checkout's line ends are the same code
            h.update(path.relative_to(_PACK_ROOT).as_posix().encode() + b"\0" + text)
        _CODE.append(f"{__version__}/{h.hexdigest()}")
    return _CODE[0]


def check_same_code(theirs: str) -> None:
    """Refuse to train with code other than rank 0's (``theirs``).

    Raises:
        RuntimeError: naming both versions and what to do.
    """
    mine = pack_code()
    if theirs and theirs != mine:
        raise RuntimeError(f"this machine's ComfyUI-StreamCache ({mine}) is not rank 0's ({theirs}): install the same "
                           "version on every machine (the code is compared, not only the version number)")


def software() -> dict[str, str]:
    """The versions of what computes a step here (ComfyUI's and PyTorch's), which a rank reports with ``ready``."""
    try:
        from comfyui_version import __version__ as comfyui
    except ImportError:  # a ComfyUI checkout without the generated file
        comfyui = "unknown"
    return {"ComfyUI": str(comfyui), "torch": str(torch.__version__)}


def software_notes(mine: Mapping[str, str], theirs: Mapping[int, Mapping[str, str]],
                   machines: Mapping[int, str]) -> list[str]:
    """A note for each rank on another machine whose ComfyUI or PyTorch is not rank 0's (``mine``): it trains, but
    its steps may compute otherwise (other kernels, other model code), which averaged gradients would hide."""
    notes = []
    for rank, machine in machines.items():
        other = theirs.get(rank, {})
        differ = [f"{name} {other[name]} (rank 0: {mine[name]})" for name in sorted(mine)
                  if name in other and other[name] != mine[name]]
        if differ:
            notes.append(f"rank {rank} on {machine} runs {', '.join(differ)}: its steps may compute otherwise than "
                         "rank 0's; install the same versions on every machine")
    return notes

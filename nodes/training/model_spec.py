"""The model a worker process trains: rebuilt there from the same local file by the loader's own function, with
every patch applied upstream, or refused by name before any process starts.

ComfyUI's loaders record how to load a model again: ``ModelPatcher.cached_patcher_init = (function, args[,
index])`` (``comfy.sd.load_diffusion_model``, ``load_checkpoint_guess_config``, ...). Rank 0's own training copy
is made that way already (``clone(force_deepcopy=True)`` calls it), and ComfyUI's multi-GPU clones use it too. So a
worker gets that recipe — a module-level function and a file path, reloaded from the local disk (the page cache
when rank 0 read it a moment ago), never downloaded — plus the patcher's state that ``clone()`` copies: weight
patches (a LoRA loaded before training), object patches (a Model Sampling node's ``model_sampling``, the compute
dtype), weight wrappers, model options, wrappers, callbacks and attachments. That state travels pickled; ComfyUI's
Model Sampling nodes make their sampling object from a class defined inside the node function, which pickle cannot
name, so such a class — one that only combines module-level base classes, with no body of its own — is sent as its
bases and made again on arrival. Anything else that cannot be pickled (a closure in ``model_options``, a hook, an
additional model such as a ControlNet) is refused with its place in the patcher named.
"""

from __future__ import annotations

import io
import pickle
import uuid
from collections.abc import Callable
from typing import Any

import torch

from ...dataset_cache.units import format_bytes

__all__ = ["build_spec", "rebuild", "recipe_args"]

_SENT = ("patches", "patches_uuid", "object_patches", "weight_wrapper_patches", "model_options", "force_cast_weights",
         "wrappers", "callbacks", "attachments")
"""The patcher state ``ModelPatcher.clone()`` carries over that a worker needs."""
_MUST_BE_EMPTY = {
    "additional_models": "additional models (e.g. a ControlNet or reference model attached to it)",
    "injections": "patcher injections",
    "hook_patches": "hook patches (from the Create Hook nodes)",
    "current_hooks": "hooks (from the Create Hook nodes)",
    "forced_hooks": "forced hooks",
}
_RECIPE_BYTES = 16 << 20
"""A loader recipe names a file; one carrying more tensor data than this carries the weights themselves, which every
worker would receive a copy of through a pipe: refused (see :func:`build_spec`)."""
_LOADED: dict[str, Any] = {}
_ADVICE = ("train on one device (devices '0'), or build the model without that node (load it with Load Diffusion "
           "Model or Load Checkpoint; LoRAs loaded with Load LoRA are supported)")
_PLAIN_CLASS_KEYS = {"__module__", "__qualname__", "__doc__", "__dict__", "__weakref__", "__firstlineno__",
                     "__static_attributes__", "__orig_bases__", "__parameters__"}


def _make_class(name: str, qualname: str, module: str, bases: tuple[type, ...]) -> type:
    """A class combining ``bases``, as a function-local class with no body of its own was (see the module doc)."""
    made = type(name, bases, {"__module__": module, "__qualname__": qualname})
    return made


class _Pickler(pickle.Pickler):
    """Pickle, plus function-local classes that only combine module-level bases (ComfyUI's Model Sampling nodes)."""

    def reducer_override(self, obj: Any) -> Any:
        if isinstance(obj, type) and "<locals>" in obj.__qualname__ and all(
                key in _PLAIN_CLASS_KEYS for key in vars(obj)):
            return _make_class, (obj.__name__, obj.__qualname__, obj.__module__, obj.__bases__)
        return NotImplemented


def _dumps(value: Any) -> bytes:
    out = io.BytesIO()
    _Pickler(out, protocol=pickle.HIGHEST_PROTOCOL).dump(value)
    return out.getvalue()


def build_spec(model: Any) -> bytes:
    """What a worker needs to rebuild ``model`` (a ComfyUI ``ModelPatcher``), pickled.

    Raises:
        ValueError: the model cannot be rebuilt in another process (no loader recipe), or carries something that
            cannot be sent; the message names it and what to do.
    """
    recipe = getattr(model, "cached_patcher_init", None)
    if recipe is None:
        raise ValueError(
            f"training on several devices: the model ({type(getattr(model, 'model', None)).__name__}) came from a "
            "loader that does not record how to load it again (ModelPatcher.cached_patcher_init is not set), so the "
            "worker processes cannot rebuild it; load it with Load Diffusion Model or Load Checkpoint, or train on "
            "one device (devices '0')")
    carried = _tensor_bytes(recipe)
    if carried > _RECIPE_BYTES:
        raise ValueError(
            f"training on several devices: the model's loader recipe (ModelPatcher.cached_patcher_init) holds "
            f"{format_bytes(carried)} of weights in memory rather than a file to load, and each worker process "
            "would be sent a copy; save the model to a file and load it with Load Diffusion Model or Load "
            "Checkpoint, or train on one device (devices '0')")
    for name, what in _MUST_BE_EMPTY.items():
        if getattr(model, name, None):
            raise ValueError(f"training on several devices: the model carries {what} ({name}), which the worker "
                             f"processes cannot rebuild; {_ADVICE}")
    spec = {"recipe": recipe, "state": {name: getattr(model, name) for name in _SENT if hasattr(model, name)}}
    try:
        return _dumps(spec)
    except Exception as exc:
        path, culprit, error = _find_unpicklable(spec["state"], "", exc) if _picklable_recipe(recipe) else (
            "loader recipe (cached_patcher_init)", recipe, exc)
        raise ValueError(
            f"training on several devices: the model's {path.lstrip('.')} ({_kind(culprit)}) cannot be sent to the "
            f"worker processes ({type(error).__name__}: {error}); {_ADVICE}") from exc


def _tensor_bytes(value: Any, depth: int = 0) -> int:
    """Bytes of the tensors in ``value`` (nested dicts, lists, tuples), without pickling anything."""
    if isinstance(value, torch.Tensor):
        return value.nelement() * value.element_size()
    if depth > 8:
        return 0
    if isinstance(value, dict):
        return sum(_tensor_bytes(v, depth + 1) for v in value.values())
    if isinstance(value, (list, tuple, set, frozenset)):
        return sum(_tensor_bytes(v, depth + 1) for v in value)
    return 0


def _picklable_recipe(recipe: Any) -> bool:
    try:
        _dumps(recipe)
    except Exception:
        return False
    return True


def _find_unpicklable(value: Any, path: str, error: Exception, depth: int = 0) -> tuple[str, Any, Exception]:
    """The innermost part of ``value`` that does not pickle: its path (``model_options['x'][0]``), itself and
    the error."""
    try:
        _dumps(value)
        return path, value, error
    except Exception as exc:
        error = exc
    if depth < 8:
        if isinstance(value, dict):
            items: list[tuple[str, Any]] = [(f"{path}[{k!r}]" if path else str(k), v) for k, v in value.items()]
        elif isinstance(value, (list, tuple, set, frozenset)):
            items = [(f"{path}[{i}]", v) for i, v in enumerate(value)]
        elif hasattr(value, "__dict__") and not isinstance(value, type):
            items = [(f"{path}.{k}", v) for k, v in vars(value).items()]
        else:
            items = []
        for sub_path, sub in items:
            if not _pickles(sub):
                return _find_unpicklable(sub, sub_path, error, depth + 1)
    return path, value, error


def _pickles(value: Any) -> bool:
    try:
        _dumps(value)
    except Exception:
        return False
    return True


def _kind(value: Any) -> str:
    kind = value if isinstance(value, type) else type(value)
    name = getattr(value, "__qualname__", None) if callable(value) else None
    return f"{name or kind.__qualname__} from {getattr(value, '__module__', None) or kind.__module__}"


def recipe_args(model: Any) -> tuple[Any, ...]:
    """The arguments of ``model``'s loader recipe (file paths among them), ``()`` without one."""
    recipe = getattr(model, "cached_patcher_init", None)
    return tuple(recipe[1]) if recipe is not None else ()


def rebuild(spec: bytes, locate: Callable[[tuple[Any, ...]], tuple[Any, ...]] | None = None) -> Any:
    """The worker's model from :func:`build_spec`'s bytes: the loader's function run on the same file (a plain,
    non-dynamic ``ModelPatcher``, as ``clone(force_deepcopy=True)`` makes), with the sent state set on it;
    ``locate`` gives the loader's arguments on this machine (another machine's paths, see ``machines.py``).

    The trainer clones what it gets with ``force_deepcopy=True``, which would load the file a second time; the
    returned patcher's recipe therefore hands out this already loaded model (once).
    """
    loaded = pickle.loads(spec)
    function, args, *index = loaded["recipe"]
    if locate is not None:
        args = locate(tuple(args))
    made = function(*args, disable_dynamic=True)
    model = made[index[0]] if index else made
    for name, value in loaded["state"].items():
        setattr(model, name, value)
    token = uuid.uuid4().hex
    _LOADED[token] = model
    model.cached_patcher_init = (_already_loaded, (token,))
    return model


def _already_loaded(token: str, disable_dynamic: bool = True) -> Any:
    """The recipe of a rebuilt model: itself, the first time (a second deep clone would need the file again)."""
    try:
        return _LOADED.pop(token)
    except KeyError:
        raise RuntimeError("this worker's model was already cloned once for training; it is not loaded again") \
            from None

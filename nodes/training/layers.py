"""``train_layers`` applied to ComfyUI's adapter setup: only the chosen layers get adapters.

ComfyUI's ``_setup_lora_adapters`` (and its bypass form, and our CPU redraw of new adapters) give an adapter to
every layer ``model.named_modules()`` yields with a ``weight_function``. Handing them a view of the model patcher
whose ``named_modules`` yields the chosen layers only keeps ComfyUI's own adapter construction, in its own order,
for those layers; everything else (``add_weight_wrapper``, the model's other attributes) is the real patcher's.
"""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import Any

import torch

from ...dataset_cache.layer_filter import LayerFilter

__all__ = ["MODEL_PREFIX", "LayerChoice", "adapter_layers", "choose_layers"]

MODEL_PREFIX = "diffusion_model."
"""What every trained layer's name starts with (ComfyUI's model wraps the diffusion model under this name)."""


def adapter_layers(model: torch.nn.Module) -> list[str]:
    """The names of the layers ComfyUI's trainer gives adapters: a ``weight_function`` and a weight or a bias."""
    return [n for n, m in model.named_modules() if hasattr(m, "weight_function")
            and (getattr(m, "weight", None) is not None or getattr(m, "bias", None) is not None)]


@dataclass
class LayerChoice:
    """The layers a run trains (``chosen``, of ``total``) and the filter that chose them."""

    filter: LayerFilter
    chosen: frozenset[str]
    total: int
    unmatched: list[str] = field(default_factory=list)

    def view(self, mp: Any) -> Any:
        """``mp`` for ComfyUI's adapter setup: itself when every layer trains, else a view showing the chosen
        layers only."""
        return mp if self.filter.everything else _PatcherView(mp, self.chosen)

    def describe(self) -> str:
        return f"trains {len(self.chosen)} of the model's {self.total} layers (train_layers {self.filter.text()!r})"

    def notes(self) -> list[str]:
        return [f"train_layers: {p!r} is in no layer's name (a typo?); the other patterns chose the layers"
                for p in self.unmatched]


def choose_layers(model: torch.nn.Module, layer_filter: LayerFilter, existing: dict[str, torch.Tensor],
                  existing_name: str) -> LayerChoice:
    """The layers ``layer_filter`` chooses of ``model``'s, refusing a choice that would drop layers of the LoRA
    being continued (``existing``, from ``existing_name``): they would be missing from the LoRA this run outputs.

    The patterns are matched against each layer's name inside the diffusion model (:data:`MODEL_PREFIX` taken off,
    from the names and from patterns copied from a LoRA's keys): every name starts with it, so a piece such as
    ``ff`` (in ``diffusion_model``) would otherwise choose every layer.

    Raises:
        ValueError: the filter chooses no layer, or leaves out layers ``existing`` holds weights of.
    """
    names = adapter_layers(model)
    short = {n.removeprefix(MODEL_PREFIX): n for n in names}
    matching = layer_filter.without_prefix(MODEL_PREFIX)
    chosen = frozenset(short[n] for n in matching.select(list(short)))
    choice = LayerChoice(layer_filter, chosen, len(names), matching.unmatched(short))
    if existing and not layer_filter.everything:
        known = set(names)
        dropped = sorted({owner for owner in (_owner(k, known) for k in existing) if owner and owner not in chosen})
        if dropped:
            raise ValueError(
                f"existing_lora {existing_name!r} has weights for {len(dropped)} layer(s) train_layers "
                f"{layer_filter.text()!r:.200} leaves out (such as {dropped[0]!r}): the LoRA this run outputs would "
                "lose them. Widen train_layers to include them, or leave it empty")
    return choice


def _owner(key: str, names: set[str]) -> str | None:
    """The layer a LoRA key belongs to: the longest layer name that is a dotted prefix of ``key``."""
    parts = key.split(".")
    for end in range(len(parts) - 1, 0, -1):
        prefix = ".".join(parts[:end])
        if prefix in names:
            return prefix
    return None


class _ModulesView:
    """A model whose ``named_modules`` yields the chosen layers only (and every non-layer module); the rest is the
    model's own."""

    def __init__(self, model: torch.nn.Module, chosen: frozenset[str]) -> None:
        self._model = model
        self._chosen = chosen

    def named_modules(self, *args: Any, **kwargs: Any) -> Iterator[tuple[str, torch.nn.Module]]:
        for name, module in self._model.named_modules(*args, **kwargs):
            if name in self._chosen or not hasattr(module, "weight_function"):
                yield name, module

    def __getattr__(self, name: str) -> Any:
        return getattr(self._model, name)


class _PatcherView:
    """A model patcher whose ``model`` is a :class:`_ModulesView`; every other attribute is the patcher's own."""

    def __init__(self, mp: Any, chosen: frozenset[str]) -> None:
        self._mp = mp
        self.model = _ModulesView(mp.model, chosen)

    def __getattr__(self, name: str) -> Any:
        return getattr(self._mp, name)

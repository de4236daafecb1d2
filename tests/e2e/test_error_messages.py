"""Errors in the user's terms: every bad input of every node, queued over HTTP as a user would queue it, is answered
with a message that names the input, its value and what to do (never a bare Python message).

Validation errors come back from ``POST /prompt`` (ComfyUI shows them on the node before anything runs); execution
errors land in ``/history``. Each case names the input and words its message must hold; every message is also
checked by :func:`support.messages.why_bare`, as the session does for every error any e2e test provokes
(``tests/e2e/conftest.py``).
"""

from __future__ import annotations

from typing import Any

import pytest
from support.client import SEEN_NODE_ERRORS, ComfyClient, PromptError
from support.datasets import Subset, make_kohya_folder
from support.examples import encode_prompt
from support.messages import why_bare
from support.server import ComfyServer
from support.tiny_models import TinyModels

NO_CACHE_YET = "(no cache yet: encode one, then press R)"  # nodes/inputs.py: the empty list's one entry
NO_FOLDER_YET = "(no folder in input/ yet: add one, then press R)"
CACHE = "e2e_msg_cache"


def _load_then_save(cache: str, dataset_name: str = "default") -> dict[str, Any]:
    return {"1": {"class_type": "StreamCache_LoadLazyCache", "inputs": {"cache": cache, "dataset_name": dataset_name}},
            "2": {"class_type": "StreamCache_SaveCache", "inputs": {"dataset": ["1", 0], "cache": "e2e_msg_copy",
                                                                    "dataset_name": "copy"}}}


def _save_from(cache: str, dataset_name: str) -> dict[str, Any]:
    prompt = _load_then_save(cache)
    prompt["2"]["inputs"]["dataset_name"] = dataset_name
    return prompt


def _node(class_type: str, **inputs: Any) -> dict[str, Any]:
    return {"1": {"class_type": class_type, "inputs": inputs}}


@pytest.fixture(scope="module")
def models(tiny_models: TinyModels) -> tuple[str, str]:
    return tiny_models.name("vae"), tiny_models.name("clip")


@pytest.fixture(scope="module")
def cache(comfy_server: ComfyServer, models: tuple[str, str]) -> str:
    """A small encoded cache (dataset ``default``), for the cases that need one to exist."""
    make_kohya_folder(comfy_server.input_dir / "e2e_msg_images", (Subset(1, "x", ((64, 64),), "png"),))
    assert comfy_server.client().run(encode_prompt(*models, "e2e_msg_images", CACHE)).status == "success"
    return CACHE


def _errors_of(client: ComfyClient, prompt: dict[str, Any]) -> list[dict[str, str]]:
    """Queue ``prompt``; return the errors the pack's nodes reported (validation or execution)."""
    before = len(SEEN_NODE_ERRORS)
    try:
        client.run(prompt, check=False)
    except PromptError:
        pass  # refused at validation: recorded from the reply
    return SEEN_NODE_ERRORS[before:]


VALIDATION = [  # (what, prompt builder (vae, clip) -> prompt, input named, words the message holds)
    ("cache uses a cache's folder name", lambda v, c: encode_prompt(v, c, "e2e_msg_images", "mine/shards"), "cache",
     ["'mine/shards'", "'shards'", "choose a name"]),
    ("save: cache escapes", lambda v, c: _node("StreamCache_SaveCache", cache="../up", dataset_name="d"), "cache",
     ["'../up'", "must not contain '..'", "StreamCache folders"]),
    ("load: unknown cache", lambda v, c: _load_then_save("e2e_msg_nope"), "cache",
     ["'e2e_msg_nope'", "unknown cache", "available", "Encode Dataset"]),
    ("load: list still empty", lambda v, c: _load_then_save(NO_CACHE_YET), "cache",
     ["no cache exists yet", "Encode Dataset", "press R"]),
    ("clean: unknown cache", lambda v, c: _node("StreamCache_CleanCache", cache="e2e_msg_nope", dry_run=True),
     "cache", ["'e2e_msg_nope'", "unknown cache", "available"]),
    ("info: cache escapes", lambda v, c: _node("StreamCache_CacheInfo", cache="../../etc"), "cache",
     ["'../../etc'", "must not contain '..'"]),
    ("info: list still empty", lambda v, c: _node("StreamCache_CacheInfo", cache=NO_CACHE_YET), "cache",
     ["no cache exists yet", "press R"]),
]


@pytest.mark.parametrize("case", VALIDATION, ids=[c[0] for c in VALIDATION])
def test_bad_inputs_are_refused_at_validation_in_the_users_terms(case: tuple, client: ComfyClient,
                                                                 models: tuple[str, str]) -> None:
    what, build, name, words = case
    errors = _errors_of(client, build(*models))
    assert errors, f"{what}: no error"
    (error,) = [e for e in errors if e["kind"] == "validation" and e["type"] == "custom_validation_failed"]
    message = error["message"]
    assert message.startswith(f"{name} - "), message  # ComfyUI marks this input
    assert all(w in message for w in words), f"{what}: {message!r} lacks {[w for w in words if w not in message]}"
    assert why_bare("", message.split(" - ", 1)[1]) is None, message


def test_load_lazy_cache_marks_only_the_input_that_is_wrong(client: ComfyClient) -> None:
    """A cache error is shown on ``cache`` only, not also on ``dataset_name`` (ComfyUI attaches a node's validation
    message to every input its check takes)."""
    errors = _errors_of(client, _load_then_save("e2e_msg_nope"))
    marked = {e["message"].split(" - ", 1)[0] for e in errors if e["type"] == "custom_validation_failed"}
    assert marked == {"cache"}, errors


def test_a_folder_not_in_the_list_is_refused_on_the_folder_only(client: ComfyClient,
                                                                models: tuple[str, str]) -> None:
    """Encode Dataset's folder is a dropdown of input/'s folders: ComfyUI's own list check refuses another value
    (a shared workflow naming a folder this machine lacks, or a path out of input/), marking only that input."""
    for folder in ("e2e_msg_not_here", "../secrets"):
        with pytest.raises(PromptError) as refused:
            client.queue_prompt(encode_prompt(*models, folder, "e2e_msg_x"))
        (entry,) = refused.value.details["node_errors"].values()
        assert [(e["type"], e["extra_info"]["input_name"]) for e in entry["errors"]] == \
            [("value_not_in_list", "folder")], entry
        assert f"folder: '{folder}' not in" in entry["errors"][0]["details"]


EXECUTION = [  # (what, prompt builder (vae, clip, cache) -> prompt, words the message holds)
    ("dataset_name unprintable",
     lambda v, c, cache: encode_prompt(v, c, "e2e_msg_images", "e2e_msg_x", dataset_name="a\x07"),
     ["dataset_name", "'a\\x07'", "printable"]),
    ("save: dataset_name empty", lambda v, c, cache: _save_from(cache, " "),
     ["dataset_name is empty", "default"]),
    ("bucket_step not a multiple of 8",
     lambda v, c, cache: encode_prompt(v, c, "e2e_msg_images", "e2e_msg_x", bucket_step=12),
     ["bucket_step 12", "multiple of 8", "e.g. 64"]),
    ("bucket_step above resolution",
     lambda v, c, cache: encode_prompt(v, c, "e2e_msg_images", "e2e_msg_x", resolution=64, bucket_step=128),
     ["bucket_step 128", "resolution 64", "use a bucket_step"]),
    ("load: dataset not in the cache", lambda v, c, cache: _load_then_save(cache, "other"),
     ["dataset_name", "'other'", "'default'", "pick one"]),
    ("load: dataset_name empty", lambda v, c, cache: _load_then_save(cache, " "),
     ["dataset_name is empty", "Cache Info"]),
    ("save: nothing connected", lambda v, c, cache: _node("StreamCache_SaveCache", cache="e2e_msg_s",
                                                         dataset_name="d"),
     ["nothing to save", "connect"]),
]


@pytest.mark.parametrize("case", EXECUTION, ids=[c[0] for c in EXECUTION])
def test_bad_inputs_found_while_running_are_node_errors_in_the_users_terms(case: tuple, client: ComfyClient,
                                                                           models: tuple[str, str],
                                                                           cache: str) -> None:
    what, build, words = case
    errors = [e for e in _errors_of(client, build(*models, cache)) if e["kind"] == "execution"]
    assert len(errors) == 1, f"{what}: {errors}"
    message = errors[0]["message"]
    assert all(w in message for w in words), f"{what}: {message!r} lacks {[w for w in words if w not in message]}"
    assert why_bare(errors[0]["type"], message) is None, message

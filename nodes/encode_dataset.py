"""Node "Encode Dataset": an image + caption folder → entries in a cache, encoding only what is missing.

The work is the library's (:func:`dataset_cache.encode_plan.plan_encode`, :func:`dataset_cache.encode_run.
run_encode`); this node resolves the folder and cache names, hands ComfyUI's VAE and CLIP over as encoder callables
(:mod:`.encoders`), reports progress, honours Cancel and turns the result into a ``STREAM_DATASET`` handle plus a
report.

Warm re-runs load no model: ``vae`` and ``clip`` are lazy inputs, requested only when the plan lacks an entry
they make, with the encoders' fingerprints assumed from the identity of the upstream loader nodes recorded by an
earlier run (:mod:`.encoder_record`; a wrong assumption can never store an entry under a wrong key).
``fingerprint_inputs`` lets ComfyUI's node cache skip an unchanged folder and cache. How and why, with the
trade-offs: docs/ARCHITECTURE.md ("Encode Dataset: deciding before loading").

Folders are resolved inside ComfyUI's input directory; absolute folders elsewhere need
``STREAMCACHE_ALLOW_ABSOLUTE_FOLDERS=1`` in ComfyUI's environment (workflows are shared files: a node must not
read arbitrary paths by default).
"""

from __future__ import annotations

import logging
import math
import os
import re
from pathlib import Path
from typing import Any

import comfy.model_management
import comfy.utils
import folder_paths
from comfy_api.latest import io

from ..dataset_cache.buckets import CROP_MODES, FLIP_MODES, BucketConfig
from ..dataset_cache.captions import MAX_SHUFFLE_VARIANTS, MAX_TAG_DROPOUT
from ..dataset_cache.encode_jobs import EncodePlan
from ..dataset_cache.encode_settings import FAILURE_POLICIES, MAX_EXTRA_RESOLUTIONS, EncodeSettings
from ..dataset_cache.encode_plan import plan_encode
from ..dataset_cache.imaging import MASK_MODES
from ..dataset_cache.listing import CAPTION_EXTENSION, check_caption_extension
from ..dataset_cache.missing_captions import MISSING_CAPTIONS
from ..dataset_cache.reference_plan import NO_CAPTIONS
from ..dataset_cache import check_dataset_name
from ..dataset_cache.encode_report import EncodeReport
from ..dataset_cache.encode_run import run_encode
from ..dataset_cache.frames import (FRAMES_SUFFIX, MAX_CLIP_FRAMES, MAX_CLIPS_PER_VIDEO, MAX_FPS, MIN_FPS,
                                    SAMPLING_MODES, FrameSettings)
from . import encoders
from .encoder_record import Encoders, choose_encoders, store_record
from .fingerprints import OwnWrites, cache_identity, folder_digest
from .handles import StreamDataset, StreamDatasetHandle
from .inputs import NO_FOLDER_YET, existing_caches_hint, input_folders
from .paths import env_flag, explain_disk_full, resolve_cache, resolve_cache_to_write
from .ui_output import EventSender, TextWithData

__all__ = ["ALLOW_ABSOLUTE_ENV", "EVENT", "EncodeDataset", "report_fields", "resolve_folder"]

log = logging.getLogger("streamcache.encode_dataset")

NO_REFERENCES = "none"
"""``reference_folder``'s value for a dataset without reference images."""
ALLOW_ABSOLUTE_ENV = "STREAMCACHE_ALLOW_ABSOLUTE_FOLDERS"
"""Set to ``1`` to allow absolute dataset folders outside ComfyUI's input directory."""
EVENT = "streamcache.encode"
"""Websocket event of the live encode report (at most two a second, plus the first and the last): ``{"node",
"phase": "encoding", "done", "total", "samples", "new", "changed", "unchanged", "removed", "failed"}``."""

_OWN_WRITES = OwnWrites()
_MIN_RESOLUTION, _MAX_RESOLUTION = 64, 8192
"""The range of ``resolution`` and of each of ``extra_resolutions``."""


def resolve_folder(folder: str) -> Path:
    """Resolve a dataset folder typed into the node: relative to ComfyUI's input directory, never escaping it.

    Raises:
        ValueError: empty, contains ``..``, or absolute outside the input directory while
            ``STREAMCACHE_ALLOW_ABSOLUTE_FOLDERS`` is not set; the message says what is allowed.
    """
    folder = (folder or "").strip()
    base = os.path.normpath(os.path.abspath(folder_paths.get_input_directory()))
    how = (f"Give a folder inside ComfyUI's input directory ({base}), e.g. `my_dataset` or `people/alice`; "
           f"absolute folders elsewhere need {ALLOW_ABSOLUTE_ENV}=1 in ComfyUI's environment.")
    if not folder:
        raise ValueError(f"folder is empty. {how}")
    if "\x00" in folder:
        raise ValueError(f"folder {folder!r} contains a NUL character. {how}")
    if ".." in re.split(r"[\\/]+", folder):
        raise ValueError(f"folder {folder!r} must not contain '..'. {how}")
    if os.path.isabs(folder):
        path = os.path.normpath(folder)
        inside = os.path.commonpath([path, base]) == base
        if not inside and not env_flag(ALLOW_ABSOLUTE_ENV, False):
            raise ValueError(f"folder {folder!r} is outside ComfyUI's input directory. {how}")
        return Path(path)
    return Path(os.path.normpath(os.path.join(base, folder)))


def _settings(resolution: int, bucket_step: int, crop: str, caption_prefix: str, caption_suffix: str,
              batch_size: int, on_failure: str, upscale: bool = False, frame_count: int = 17,
              frame_sampling: str = "first", frame_step: int = 2, fps: float = 0.0,
              frame_stride: int | None = None, flip: str = "none", shuffle_variants: int = 0, keep_tokens: int = 0,
              empty_caption: bool = False, masks: str = "none", mask_factor: int | None = None,
              missing_caption: str = "empty", extra_resolutions: str = "", tag_dropout: float = 0.0,
              wildcards: bool = False, clips_per_video: int = 1, keep_tokens_separator: str = "",
              caption_extension: str = CAPTION_EXTENSION, secondary_separator: str = "",
              reference_folder: str = NO_REFERENCES) -> EncodeSettings:
    problem = _bucket_problem(resolution, bucket_step) or _frame_problem(frame_count, frame_step, fps)
    if problem:
        raise ValueError(problem)
    extra = _extra_resolutions(extra_resolutions, resolution, bucket_step)
    min_side = max(bucket_step, resolution // 2 // bucket_step * bucket_step)  # kohya: 256 for 512
    bucket = BucketConfig(resolution=resolution, step=bucket_step, min_side=min_side, crop=crop, upscale=upscale,
                          flip=flip)
    video = FrameSettings(frames=frame_count, sampling=frame_sampling, every=frame_step, fps=float(fps),
                          stride=frame_stride, clips=clips_per_video)
    return EncodeSettings(bucket=bucket, caption_prefix=caption_prefix, caption_suffix=caption_suffix,
                          batch_size=batch_size, failure_policy=on_failure, video=video,
                          shuffle_variants=shuffle_variants, keep_tokens=keep_tokens,
                          empty_caption=bool(empty_caption), masks=masks, mask_factor=mask_factor,
                          missing_caption=missing_caption, extra_resolutions=extra,
                          tag_dropout=round(float(tag_dropout), 4), wildcards=bool(wildcards),
                          keep_tokens_separator="" if keep_tokens_separator is None else keep_tokens_separator,
                          caption_extension=check_caption_extension(caption_extension),
                          secondary_separator="" if secondary_separator is None else secondary_separator,
                          reference_folder=str(_reference_folder(reference_folder) or ""))


def _reference_folder(value: Any) -> Path | None:
    """``reference_folder`` resolved as ``folder`` is (inside ComfyUI's input directory); ``None`` for none."""
    if value is None or (isinstance(value, str) and value.strip() in ("", NO_REFERENCES)):
        return None
    if not isinstance(value, str):
        raise ValueError(f"reference_folder must be a folder name, got {type(value).__name__}")
    try:
        return resolve_folder(value)
    except ValueError as exc:
        raise ValueError(f"reference_folder: {exc}") from None


def _extra_resolutions(text: Any, resolution: int, bucket_step: int) -> tuple[int, ...]:
    """``extra_resolutions`` ("768, 1024") as the resolutions besides ``resolution``, in the order written; a
    resolution written twice, or equal to ``resolution``, counts once.

    Raises:
        ValueError: naming ``extra_resolutions``, the piece that is not a resolution and what one is.
    """
    if text is None:
        return ()
    if not isinstance(text, str):
        raise ValueError(f"extra_resolutions must be text such as '768, 1024', got {type(text).__name__}")
    out: list[int] = []
    for piece in (p.strip() for p in text.replace(";", ",").split(",")):
        if not piece:
            continue
        if not piece.isdecimal() or not _MIN_RESOLUTION <= int(piece) <= _MAX_RESOLUTION or int(piece) % 8:
            raise ValueError(f"extra_resolutions: {piece!r:.40} is not a resolution; write resolutions from "
                             f"{_MIN_RESOLUTION} to {_MAX_RESOLUTION} (multiples of 8) separated by commas, such as "
                             "'768, 1024'")
        problem = _bucket_problem(int(piece), bucket_step)
        if problem:
            raise ValueError(f"extra_resolutions: {problem}")
        if int(piece) != resolution and int(piece) not in out:
            out.append(int(piece))
    if len(out) > MAX_EXTRA_RESOLUTIONS:
        raise ValueError(f"extra_resolutions: {len(out)} resolutions; at most {MAX_EXTRA_RESOLUTIONS} (each is a "
                         "latent of every image)")
    return tuple(out)


def _bucket_problem(resolution: Any, bucket_step: Any) -> str | None:
    """What is wrong with a resolution / bucket_step pair, in words a user can act on (None: nothing)."""
    if not isinstance(resolution, int) or not isinstance(bucket_step, int):
        return None  # linked inputs: checked when the values arrive
    if bucket_step < 8 or bucket_step % 8:
        return f"bucket_step {bucket_step}: use a multiple of 8 (the VAE's downscale factor), e.g. 64"
    if bucket_step > resolution:
        return (f"bucket_step {bucket_step} is larger than resolution {resolution}, so no bucket fits: use a "
                f"bucket_step from 8 to {resolution // 8 * 8} (a multiple of 8), or raise the resolution")
    return None


def _frame_problem(frame_count: Any, frame_step: Any, fps: Any) -> str | None:
    """What is wrong with the clip inputs, naming the input and what it takes (None: nothing). ComfyUI checks
    their minimum and maximum, but a NaN passes its comparisons and ``fps`` takes 0 or a rate, not what lies
    between (a rate near 0 is no rate: it once divided by zero deep in the plan)."""
    for name, value in (("frame_count", frame_count), ("frame_step", frame_step)):
        if type(value) is not int or not 1 <= value <= MAX_CLIP_FRAMES:
            return f"{name} {value!r}: use a whole number from 1 to {MAX_CLIP_FRAMES}"
    if isinstance(fps, bool) or not isinstance(fps, (int, float)) or not (
            math.isfinite(fps) and (fps == 0 or MIN_FPS <= fps <= MAX_FPS)):
        return (f"fps {fps!r}: use 0 (each video keeps its own frame rate) or a rate from {MIN_FPS:g} to "
                f"{MAX_FPS:g} frames a second")
    return None


def _hidden(cls: type, name: str) -> Any:
    hidden = getattr(cls, "hidden", None)
    return getattr(hidden, name, None) if hidden is not None else None


def _format(report: EncodeReport, enc: Encoders) -> str:
    def state(label: str, loaded: bool, fp: str) -> str:
        return f"{label} loaded (fingerprint {fp[:12]})" if loaded else f"{label} not loaded (nothing to encode)"

    loaded = f"{state('VAE', enc.vae_loaded, enc.vae_fp)}; {state('text encoder', enc.clip_loaded, enc.text_fp)}"
    return f"{report.summary()}\n{loaded}"


def _source_state(src: Path, caption_extension: str = CAPTION_EXTENSION) -> str:
    """The folder part of the node's fingerprint: its path and stat-only listing with the captions of
    ``caption_extension`` (``missing`` when gone)."""
    return f"{src}\0{folder_digest(src, caption_extension) if src.exists() else 'missing'}"


def _folders_state(src: Path, caption_extension: str, refs: Path | None) -> str:
    """:func:`_source_state` of the dataset folder, and of the reference folder ``refs`` when one is given (an
    edited reference makes the node run again)."""
    state = _source_state(src, caption_extension)
    return state if refs is None else f"{state}\0{_source_state(refs, NO_CAPTIONS)}"


def _run(plan: EncodePlan, vae: Any, clip: Any, node_id: str | None = None) -> EncodeReport:
    """Run the encode with ComfyUI's progress bar, the live ``streamcache.encode`` event and Cancel; release the
    encoders; record an interrupt. The source counts are the plan's (the library's report and log use the same)."""
    pbar: list[comfy.utils.ProgressBar] = []
    events = EventSender(EVENT, node_id)
    counts = {"samples": len(plan.samples), "new": plan.new, "changed": plan.changed, "unchanged": plan.unchanged,
              "removed": plan.removed, "failed": len(plan.failures)}

    def progress(done: int, total: int) -> None:  # called on this (the execution) thread only
        if not pbar:
            pbar.append(comfy.utils.ProgressBar(max(total, 1)))
        pbar[0].update_absolute(done, max(total, 1))
        events({"phase": "encoding", "done": done, "total": total, **counts}, force=done in (0, total))

    cut_texts: list[str] = []
    try:
        report = run_encode(plan, encode_images=encoders.image_encoder(vae) if vae is not None else None,
                            encode_texts=encoders.text_encoder(clip, cut_texts) if clip is not None else None,
                            encode_clips=encoders.clip_encoder(vae) if vae is not None else None,
                            progress=progress, should_stop=comfy.model_management.processing_interrupted)
    finally:
        encoders.release(*(e for e in (vae, clip) if e is not None))
    if cut_texts:
        report.notes.append(f"{len(cut_texts)} caption line(s) were longer than "
                            f"{encoders.MAX_TOKEN_WINDOWS * 75} tokens and were encoded cut to that length "
                            f"(first: {cut_texts[0][:60]!r}...)")
    if report.stopped:  # every finished batch is committed; let ComfyUI record the interrupt
        comfy.model_management.throw_exception_if_processing_interrupted()
        raise comfy.model_management.InterruptProcessingException()
    return report


def report_fields(report: EncodeReport, enc: Encoders | None = None) -> dict[str, Any]:
    """The report as JSON-able fields: the node's ``streamcache_report`` UI output (drawn by the web extension)."""
    fields: dict[str, Any] = {
        "dataset": report.dataset, "samples": report.samples, "new": report.new, "changed": report.changed,
        "unchanged": report.unchanged, "removed": report.removed, "encoded": report.encoded,
        "encoded_latents": report.encoded_latents, "encoded_conditionings": report.encoded_conditionings,
        "reused": report.reused, "failed": report.failed, "skipped": report.skipped,
        "bytes_written": report.bytes_written, "seconds": round(report.seconds, 3), "stopped": report.stopped,
        "sourceless": report.sourceless,
        "failures": [f"{f.relpath}: {f.reason}" for f in report.failures[:5]],
        "encoded_masks": report.encoded_masks, "encoded_mirrors": report.encoded_mirrors,
        "encoded_references": report.encoded_references,
        "encoded_empty_caption": report.encoded_empty_caption, "variants": dict(report.variants),
        "short_clips": list(report.short_clips),
    }
    if enc is not None:
        fields.update(vae_loaded=enc.vae_loaded, clip_loaded=enc.clip_loaded, vae_fingerprint=enc.vae_fp,
                      text_fingerprint=enc.text_fp)
    return fields


def _key(root: Path, dataset: str) -> tuple[str, str]:
    return str(root), dataset



def _reference_input() -> Any:
    """``reference_folder``: like ``folder``, a dropdown of the input directory's folders (a text field while
    absolute folders are allowed), led by ``none``."""
    about = ("Edit models (Flux Kontext, Qwen-Image-Edit): the folder of the images the dataset's images were made "
             "from, each named as its image (a.png's is a.png, a.jpg... there; for a kohya subfolder's image, in the "
             "same subfolder or at the top). Each is encoded with the same VAE at its image's bucket and crop, and "
             "Train LoRA gives it to the model as ComfyUI's ReferenceLatent node does; an image without one trains "
             "without. none: no reference images.")
    if env_flag(ALLOW_ABSOLUTE_ENV, False):
        return io.String.Input("reference_folder", default="", optional=True, placeholder=NO_REFERENCES,
                               tooltip=f"{about} A folder inside ComfyUI's input directory, or an absolute path.")
    return io.Combo.Input("reference_folder", options=[NO_REFERENCES, *input_folders()], default=NO_REFERENCES,
                          optional=True, tooltip=f"{about} The folders of ComfyUI's input directory (press R after "
                          "adding one).")


def _check_folder(folder: str) -> None:
    """Refuse the folder dropdown's "nothing yet" entry and what :func:`resolve_folder` refuses."""
    if folder == NO_FOLDER_YET:
        raise ValueError(f"folder: ComfyUI's input directory ({folder_paths.get_input_directory()}) has no folder "
                         "yet. Put your images (and .txt captions) into a folder there, then press R to refresh "
                         "the list and pick it")
    path = resolve_folder(folder)
    if path.name.lower().endswith(FRAMES_SUFFIX) and len(path.name) > len(FRAMES_SUFFIX):
        above = "/".join(re.split(r"[\\/]+", folder.strip().rstrip("/\\"))[:-1])
        raise ValueError(f"folder {folder!r} is a clip (a <name>.frames folder holds the frames of one video "
                         "clip), not a dataset folder: pick the folder that holds it"
                         + (f" ({above!r})" if above else ""))


def _check_dataset_name(dataset_name: str) -> None:
    """The dataset name's problem, naming the input (the library's message names only the value)."""
    if not str(dataset_name).strip():
        raise ValueError("dataset_name is empty; give the dataset a name, e.g. `default`")
    try:
        check_dataset_name(dataset_name)
    except ValueError as exc:
        raise ValueError(f"dataset_name: {exc}") from exc


def _folder_input() -> io.Input:
    """``folder``: a dropdown of the input directory's folders, like ComfyUI's own "Load Image (from Folder)"; a
    text field while absolute folders are allowed (:data:`ALLOW_ABSOLUTE_ENV`), since those are typed."""
    about = ("The image folder (kohya `<repeats>_<name>` subfolders allowed; captions in same-name .txt files, "
             "one variant per line).")
    if env_flag(ALLOW_ABSOLUTE_ENV, False):
        return io.String.Input("folder", default="my_dataset",
                               tooltip=f"{about} A folder inside ComfyUI's input directory, or an absolute path "
                               f"({ALLOW_ABSOLUTE_ENV} is set).")
    folders = input_folders() or [NO_FOLDER_YET]
    return io.Combo.Input("folder", options=folders, default=folders[0],
                          tooltip=f"{about} The folders of ComfyUI's input directory (press R after adding one); "
                          "a folder kept elsewhere can be offered by a symbolic link in input/, or typed as an "
                          f"absolute path once ComfyUI runs with {ALLOW_ABSOLUTE_ENV}=1.")


# ------------------------------------------------------------------------------------------------ the node


class EncodeDataset(io.ComfyNode):
    """Encodes an image + caption folder into a cache; unchanged images and captions cost nothing."""

    @classmethod
    def define_schema(cls) -> io.Schema:
        return io.Schema(
            node_id="StreamCache_EncodeDataset",
            display_name="Encode Dataset",
            category="StreamCache",
            description="Encodes an image folder (kohya layout, .txt captions) into a StreamCache cache: VAE "
                        "latents per aspect bucket and one text-encoder conditioning per distinct caption line. "
                        "Only new or changed files are encoded; when nothing changed, the VAE and CLIP loaders "
                        "do not even run.",
            inputs=[
                _folder_input(),
                io.String.Input("cache", default="my_dataset",
                                tooltip="The cache to encode into: a folder name inside models/streamcache, "
                                "created if missing; an existing cache only gets what it lacks. "
                                + existing_caches_hint()),
                io.String.Input("dataset_name", default="default",
                                tooltip="Name of the dataset inside the cache (a cache can hold several; "
                                "encoding again under the same name updates it)."),
                io.Vae.Input("vae", lazy=True, tooltip="VAE for the latents; only loaded when a latent is missing."),
                io.Clip.Input("clip", lazy=True,
                              tooltip="Text encoder for the captions; only loaded when a caption is missing."),
                io.Int.Input("resolution", default=512, min=_MIN_RESOLUTION, max=_MAX_RESOLUTION, step=8,
                             tooltip="Training resolution: bucket areas are at most resolution²."),
                io.Int.Input("bucket_step", default=64, min=8, max=512, step=8,
                             tooltip="Bucket sides are multiples of this (64 as in kohya; at least the VAE's "
                             "downscale factor)."),
                io.Combo.Input("crop", options=list(CROP_MODES), default="center",
                               tooltip="How a resized image is cut to its bucket: center, or a random crop "
                               "fixed per image (seeded by its content)."),
                io.String.Input("caption_prefix", default="",
                                tooltip="Put before every caption line, e.g. a trigger word `ohwx, `."),
                io.String.Input("caption_suffix", advanced=True, default="", tooltip="Put after every caption line."),
                io.Int.Input("batch_size", advanced=True, default=4, min=1, max=256,
                             tooltip="Images or captions per encoder call; each batch is saved when done, so "
                             "Cancel keeps everything finished."),
                io.Combo.Input("on_failure", advanced=True, options=list(FAILURE_POLICIES), default="skip",
                               tooltip="An unreadable image or caption: skip it (listed in the report) or "
                               "stop with an error naming the file."),
                io.Boolean.Input("upscale", default=False, optional=True, advanced=True,
                                 tooltip="Off (kohya's bucket_no_upscale): an image smaller than its bucket keeps "
                                 "its own size, rounded down to bucket_step, so a large resolution never blows a "
                                 "small image up. On: every image is resized to cover its bucket."),
                io.Int.Input("frame_count", default=17, min=1, max=MAX_CLIP_FRAMES, optional=True,
                             tooltip="Clips (videos, <name>.frames folders): frames per clip. Rounded down to what "
                             "the VAE takes (WAN: 1 + 4m, e.g. 17, 33, 81); a shorter clip gives what it has, "
                             "named in the report. Images ignore it."),
                io.Combo.Input("frame_sampling", options=list(SAMPLING_MODES), default="first", optional=True,
                               tooltip="Which frames of a clip: the first N, N spread uniformly over it, or every "
                               "k-th from the start (k = frame_step)."),
                io.Int.Input("frame_step", default=2, min=1, max=MAX_CLIP_FRAMES, optional=True, advanced=True,
                             tooltip="k of frame_sampling every_k: take every k-th frame."),
                io.Float.Input("fps", default=0.0, min=0.0, max=1000.0, step=0.5, optional=True, advanced=True,
                               tooltip="Resample videos to this frame rate before sampling; 0 keeps each video's "
                               "own rate; otherwise 0.01 to 1000. Frame folders are taken as they are."),
                io.Combo.Input("flip", options=list(FLIP_MODES), default="none", optional=True,
                               tooltip="Horizontal flips: none; always (every image is stored mirrored); random "
                               "(the image and its mirror are both cached and training picks one per epoch; "
                               "switching from none encodes only the mirrors)."),
                io.Int.Input("shuffle_variants", default=0, min=0, max=MAX_SHUFFLE_VARIANTS, optional=True,
                             advanced=True,
                             tooltip="Tag shuffling (kohya's shuffle_caption): 0 = off; N encodes N shuffled "
                             "versions of every caption line (comma-separated tags) and training picks one per "
                             "epoch. Only a changed line's versions are encoded again."),
                io.Int.Input("keep_tokens", default=0, min=0, max=64, optional=True, advanced=True,
                             tooltip="With tag shuffling: how many leading tags stay in place (kohya's "
                             "keep_tokens), e.g. 1 for a trigger word at the start of every caption."),
                io.Boolean.Input("empty_caption", default=False, optional=True, advanced=True,
                                 tooltip="Also encode the empty caption, which Train LoRA's caption_dropout "
                                 "trains with (one entry per text encoder)."),
                io.Combo.Input("masks", options=list(MASK_MODES), default="none", optional=True,
                               tooltip="Loss masks (images only): none; masklabel (<name>-masklabel.png beside "
                               "the image, white = full weight, as OneTrainer and kohya); alpha (the image's "
                               "alpha channel). Cached at latent resolution; a changed mask re-makes only "
                               "the mask, without loading the VAE."),
                io.Combo.Input("missing_caption", options=list(MISSING_CAPTIONS), default="empty", optional=True,
                               tooltip="What an image or clip without a caption file (.txt) trains with: empty "
                               "(the empty prompt); folder name (the name of its kohya <repeats>_<name> folder "
                               "after the repeats, e.g. 'ohwx woman' for 10_ohwx woman/, as kohya's class tokens); "
                               "file name (its file name without the extension). An empty caption file stays the "
                               "empty prompt. Changing it encodes only the new captions, without loading the VAE."),
                io.String.Input("extra_resolutions", default="", optional=True, placeholder="none",
                                tooltip="Train at several resolutions (multi-resolution, as ai-toolkit's "
                                "resolution list): more resolutions, separated by commas (e.g. '768, 1024' with "
                                "resolution 512), each image also encoded at each of them (its own bucket and "
                                "latent; a small image with upscale off once at its own size). Every resolution "
                                "is a sample of the dataset, so an epoch sees each image once per resolution. Adding "
                                "one encodes only its latents: captions are shared. Clips too: each clip (and "
                                "each window of clips_per_video) at every resolution."),
                io.Float.Input("tag_dropout", default=0.0, min=0.0, max=MAX_TAG_DROPOUT, step=0.05, round=0.01,
                               optional=True, advanced=True,
                               tooltip="With tag shuffling (kohya's caption_tag_dropout_rate): the share of each "
                               "caption line's shuffle_variants versions that leave out a tag after keep_tokens, "
                               "per tag, e.g. 0.1. Needs shuffle_variants (8 or more lets small rates show). "
                               "Changing it encodes only captions."),
                io.Boolean.Input("wildcards", default=False, optional=True, advanced=True,
                                 tooltip="Caption wildcards (kohya's enable_wildcard): '{red|blue} car' trains as "
                                 "'red car' and 'blue car', each combination of a line's options its own cached "
                                 "caption, picked per epoch; every caption line weighs alike. Write {{ and }} for "
                                 "literal braces. Off: braces are encoded as written."),
                io.Int.Input("clips_per_video", default=1, min=1, max=MAX_CLIPS_PER_VIDEO, optional=True,
                             tooltip="Clips: how many clips each video (or .frames folder) gives, each a sample "
                             "(musubi-tuner's uniform frame extraction): windows of frame_count frames (first or "
                             "every_k), spread evenly from the start to the end of the video, so a long video "
                             "trains all of it. Raising it encodes only the new windows. 1: one clip, as before."),
                io.String.Input("keep_tokens_separator", default="", optional=True, advanced=True,
                                tooltip="kohya's keep_tokens_separator, e.g. '|||': in a caption line holding it, "
                                "the tags before it stay in front and those after a second one stay at the end; "
                                "only the tags between are shuffled and dropped (keep_tokens is then not used). "
                                "The separator itself is never encoded. Empty: none."),
                io.String.Input("caption_extension", default=CAPTION_EXTENSION, optional=True, advanced=True,
                                tooltip="The caption files' extension (kohya's caption_extension): '.txt', or "
                                "'.caption' for a dataset captioned so; then .txt files beside the images are "
                                "not read."),
                io.String.Input("secondary_separator", default="", optional=True, advanced=True,
                                tooltip="kohya's secondary_separator, e.g. ';;;': tags joined by it ('hatsune "
                                "miku;;;vocaloid') stay together when tags are shuffled or dropped, and it is "
                                "encoded as a comma. Empty: none."),
                _reference_input(),
            ],
            outputs=[
                StreamDataset.Output(display_name="dataset", tooltip="The encoded dataset, for training nodes."),
                io.String.Output(display_name="report",
                                 tooltip="New/changed/unchanged/removed files, entries encoded, failures."),
            ],
            hidden=[io.Hidden.unique_id, io.Hidden.dynprompt],
            is_output_node=True,
        )

    @classmethod
    def validate_inputs(cls, cache: str | None = None) -> bool | str:
        # Only `cache`: ComfyUI shows a message returned here on every input this signature names, so a folder
        # problem would also be marked on the cache. `folder` gets ComfyUI's own list check (a dropdown) and, with
        # dataset_name, is checked when the node starts (check_lazy_status, before any model loads);
        # resolution / bucket_step are checked there too (named here, they would lose ComfyUI's min/max check).
        try:
            if cache is not None:
                resolve_cache_to_write(cache)
        except ValueError as exc:
            return str(exc)
        return True

    @classmethod
    def fingerprint_inputs(cls, folder: str, cache: str, dataset_name: str,
                           caption_extension: str = CAPTION_EXTENSION, reference_folder: str = NO_REFERENCES,
                           **_: Any) -> str:
        root, src = resolve_cache(cache), resolve_folder(folder)
        state = _folders_state(src, caption_extension, _reference_folder(reference_folder))
        return _OWN_WRITES.fingerprint(_key(root, dataset_name), state, cache_identity(root, dataset_name))

    @classmethod
    def _plan(cls, folder: str, cache: str, dataset_name: str, vae: Any, clip: Any,
              options: dict[str, Any]) -> tuple[EncodePlan, Encoders, Path]:
        _check_folder(folder)
        _check_dataset_name(dataset_name)
        root, src = resolve_cache_to_write(cache), resolve_folder(folder)
        enc = choose_encoders(root, dataset_name, vae, clip, _hidden(cls, "dynprompt"), _hidden(cls, "unique_id"))
        plan = plan_encode(src, root, dataset=dataset_name,
                           settings=_settings(**options, frame_stride=enc.frame_stride, mask_factor=enc.mask_factor),
                           vae_fingerprint=enc.vae_fp, text_fingerprint=enc.text_fp)
        return plan, enc, root

    @classmethod
    def check_lazy_status(cls, folder: str, cache: str, dataset_name: str, vae: Any = None, clip: Any = None,
                          **options: Any) -> list[str]:
        plan, _, _root = cls._plan(folder, cache, dataset_name, vae, clip, options)
        if plan.failures and plan.settings.failure_policy == "stop":
            return []  # execute raises the failure; no model needs loading for that
        needed = []
        if vae is None and plan.needs_vae:
            needed.append("vae")
        if clip is None and plan.needs_text_encoder:
            needed.append("clip")
        return needed

    @classmethod
    def execute(cls, folder: str, cache: str, dataset_name: str, vae: Any = None, clip: Any = None,
                **options: Any) -> io.NodeOutput:
        plan, enc, root = cls._plan(folder, cache, dataset_name, vae, clip, options)
        dataset = dataset_name
        if plan.failures and plan.settings.failure_policy == "stop":
            raise plan.failures[0].error()
        for name, missing in (("VAE", plan.needs_vae and vae is None),
                              ("CLIP", plan.needs_text_encoder and clip is None)):
            if missing:
                raise ValueError(f"{plan.folder}: files changed after ComfyUI decided the {name} was not needed; "
                                 "queue the prompt again")
        with explain_disk_full(root, "encoding"):
            report = _run(plan, vae, clip, _hidden(cls, "unique_id"))
        if not report.sourceless:
            store_record(root, dataset, enc)
        refs = Path(plan.settings.reference_folder) if plan.settings.reference_folder else None
        _OWN_WRITES.remember(_key(root, dataset), _folders_state(Path(plan.folder), plan.settings.caption_extension,
                                                                 refs), cache_identity(root, dataset))
        text = _format(report, enc)
        return io.NodeOutput(StreamDatasetHandle(str(root), dataset), text,
                             ui=TextWithData(text, streamcache_report=report_fields(report, enc)))

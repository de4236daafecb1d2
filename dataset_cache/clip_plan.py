"""The clips' planning: each clip (a video or a ``.frames`` folder) keyed by its source and the frames it takes,
its samples added (one per resolution and window: ``extra_resolutions``, ``clips_per_video``), and the report's
notes on clips.

Apart from the images' planning because a clip's key, limits and shortfalls are its own (frame indices, the VAE's
temporal stride, the keys of earlier builds kept), while its captions and mirror follow the images' rules.
"""

from __future__ import annotations

from collections.abc import Sequence
from itertools import product

from .buckets import CropPlan, crop_plans
from .captions import caption_keys, too_many_variants
from .dataset import Sample
from .errors import SourceFailure
from .encode_jobs import ClipJob, LatentJob, Planned
from .encode_settings import EncodeSettings
from .frames import MAX_CLIP_PIXEL_BYTES, FrameSettings, clip_key_fields, legacy_clip_key_fields
from .keys import hash_bytes, latent_key
from .scan import SourceClip
from .sources_record import SourcesRecord

__all__ = ["SHORT_CLIPS_NAMED", "plan_clips", "clip_notes"]


SHORT_CLIPS_NAMED = 20
"""Clips giving fewer frames than asked that the report's note names one by one (then a count; the plan's
``short_clips`` and the node's structured report hold them all)."""


def clip_notes(settings: EncodeSettings, short: Sequence[str], fewer: Sequence[str] = ()) -> tuple[str, ...]:
    """What the report says about clips: a frame count the VAE's stride rounds, the clips that give fewer frames
    than asked (``short``) and the videos whose clips overlap or are fewer than ``clips_per_video`` (``fewer``),
    each list's first :data:`SHORT_CLIPS_NAMED` by name."""
    video = settings.video
    notes = []
    if video.stride and video.stride > 1 and video.effective_frames != video.frames:
        notes.append(f"frame count {video.frames} is taken as {video.effective_frames}: the VAE compresses time by "
                     f"{video.stride}, so it encodes 1 + {video.stride}·m frames without dropping any")
    if short:
        more = f"; and {len(short) - SHORT_CLIPS_NAMED} more" if len(short) > SHORT_CLIPS_NAMED else ""
        notes.append(f"{len(short)} clip(s) give fewer frames than the {video.effective_frames} asked; each trains "
                     "with the frames it gives, in the bucket of that frame count: "
                     + "; ".join(short[:SHORT_CLIPS_NAMED]) + more)
    if fewer:
        more = f"; and {len(fewer) - SHORT_CLIPS_NAMED} more" if len(fewer) > SHORT_CLIPS_NAMED else ""
        notes.append(f"{len(fewer)} video(s) are too short for clips_per_video {video.clips} clips end to end, so "
                     "their clips overlap (windows taking the same frames are one clip): "
                     + "; ".join(fewer[:SHORT_CLIPS_NAMED]) + more)
    return tuple(notes)


def _clip_key(source_hash: str, plan: CropPlan, vae_fp: str, video: FrameSettings, kind: str,
              indices: tuple[int, ...], have: set[str]) -> str:
    """A clip's latent key: the frames it takes (:func:`.frames.clip_key_fields`), or the key an earlier build
    gave it for these settings when the cache holds that one (its clips are kept, not encoded again)."""
    key = latent_key(source_hash, plan.key_fields(), vae_fp, extra=clip_key_fields(kind, indices, video.stride))
    if key not in have and video.stride is not None:
        legacy = latent_key(source_hash, plan.key_fields(), vae_fp,
                            extra=legacy_clip_key_fields(video, kind, indices))
        if legacy in have:
            return legacy
    return key


def _clip_source(clip: SourceClip, record: SourcesRecord) -> tuple[str, tuple[str, ...], tuple[str, ...]] | None:
    """A clip's source hash, its frame files and their hashes (none for a video), or ``None`` when a file of it
    could not be hashed (already a validation failure)."""
    if clip.kind == "video":
        entry = record.get(clip.relpath)
        if entry is None:
            return None
        return entry.hash, (), ()
    entries = [record.get(f.relpath) for f in clip.frames]
    if any(e is None for e in entries):
        return None
    frame_hashes = tuple(e.hash for e in entries if e is not None)
    names = [f.relpath.rpartition("/")[2] for f in clip.frames]
    # the frames' names (within the folder) and contents in order: moving the folder keeps the key
    listed = "\n".join(f"{n}\t{h}" for n, h in zip(names, frame_hashes))
    return hash_bytes(listed.encode("utf-8", "surrogatepass")), tuple(f.path for f in clip.frames), frame_hashes


def _prepared(clip: SourceClip, record: SourcesRecord, settings: EncodeSettings, acc: Planned
              ) -> tuple[str, tuple[str, ...], tuple[str, ...], list[CropPlan]] | None:
    """A clip's source hash, frame files and hashes and its crop plan at each resolution (``extra_resolutions``;
    a plan two resolutions share once), or ``None`` when it cannot be planned (a failure added to
    ``acc.unplannable``, or a file that could not be hashed: already a validation failure)."""
    if settings.video.stride == 0:
        acc.unplannable.append(SourceFailure(clip.relpath, clip.path, (
            "is a video clip, but the VAE encodes still images only (it reads a batch as separate images); "
            "connect a video VAE (e.g. WAN's) or move the clip out of the folder")))
        return None
    too_many = too_many_variants(clip.captions, settings)
    if too_many:
        acc.unplannable.append(SourceFailure(clip.relpath, clip.path, too_many))
        return None
    source = _clip_source(clip, record)
    if source is None:
        return None
    try:
        plans = crop_plans(settings.bucket_configs(), clip.width, clip.height, source[0])
    except ValueError as exc:
        acc.unplannable.append(SourceFailure(clip.relpath, clip.path, str(exc)))
        return None
    return (*source, plans)


def _too_big(frames: int, plans: list[CropPlan]) -> str | None:
    """Why ``frames`` frames at one of ``plans``' sizes are too many pixels to decode (``None``: none is)."""
    for plan in plans:
        width, height = plan.bucket
        need = frames * width * height * 3 * 4
        if need > MAX_CLIP_PIXEL_BYTES:
            return (f"{frames} frames at {width}x{height} take {need / (1 << 30):.1f} GiB of pixels to encode, "
                    f"above the limit of {MAX_CLIP_PIXEL_BYTES >> 30} GiB; lower the frame count or the resolution")
    return None


def _fewer_clips(clip: SourceClip, video: FrameSettings, windows: Sequence[tuple[int, ...]]) -> str | None:
    """``"<relpath>: <n> clips ... "`` when a video's clips overlap or are fewer than ``clips_per_video``."""
    overlap = len(windows) > 1 and bool(set(windows[0]) & set(windows[1]))  # evenly spread: the first two say
    if video.clips == 1 or (len(windows) == video.clips and not overlap):
        return None
    return (f"{clip.relpath}: {len(windows)} clip(s) of {len(windows[0])} frames from its {clip.frame_count}"
            + (", overlapping" if overlap else ""))


def plan_clips(clips: Sequence[SourceClip], record: SourcesRecord, settings: EncodeSettings, acc: Planned,
               have: set[str], short: list[str]) -> dict[str, LatentJob]:
    """Key every clip (its bytes, or its frames' in order, plus the crop plan and the frames it takes), add its
    samples to ``acc`` (one per resolution and window: ``extra_resolutions``, ``clips_per_video``); return the
    latent jobs by key (apart from ``acc.latents``: clips are encoded on their own). Clips that cannot be planned
    are added to ``acc.unplannable``, clips that give fewer frames than asked to ``short`` (``"<relpath>: <taken>
    of <asked> frames (why)"``), videos whose windows overlap or are fewer than asked to ``acc.fewer_clips``.
    ``have``: the keys the cache holds."""
    jobs: dict[str, LatentJob] = {}
    video = settings.video
    for clip in clips:
        prepared = _prepared(clip, record, settings, acc)
        if prepared is None:
            continue
        source_hash, frame_paths, frame_hashes, plans = prepared
        windows = video.windows(clip.frame_count, clip.rate)
        too_big = _too_big(len(windows[0]), plans)
        if too_big:
            acc.unplannable.append(SourceFailure(clip.relpath, clip.path, too_big))
            continue
        lack = video.shortfall(clip.frame_count, clip.rate)
        if lack is not None:
            short.append(f"{clip.relpath}: {lack}")
        fewer = _fewer_clips(clip, video, windows)
        if fewer is not None:
            acc.fewer_clips.append(fewer)
        ckeys = caption_keys(clip.captions, clip.relpath, settings, acc.keys, acc.texts, acc.cut, acc.many)
        for plan, indices in product(plans, windows):
            job = ClipJob(indices, frame_paths, frame_hashes)
            lkey = _clip_key(source_hash, plan, acc.keys.vae, video, clip.kind, indices, have)
            jobs.setdefault(lkey, LatentJob(lkey, clip.path, clip.relpath, source_hash, plan, job))
            mirror = None
            if settings.bucket.flip == "random":
                mplan = settings.bucket.mirror_plan(plan)
                mirror = _clip_key(source_hash, mplan, acc.keys.vae, video, clip.kind, indices, have)
                jobs.setdefault(mirror, LatentJob(mirror, clip.path, clip.relpath, source_hash, mplan, job,
                                                  mirror=True))
            acc.samples.append(Sample(lkey, ckeys, clip.repeats, clip.relpath, mirror=mirror,
                                      empty_caption=acc.empty))
    return jobs

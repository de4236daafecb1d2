"""Benchmark: decoding one clip's sampled frames (the encode's path) against decoding the whole clip first.

Writes a video of ``--frames`` frames at ``--size`` (MPEG-4, PyAV), then, each in a fresh subprocess so peak RSS
is its own, ``--runs`` (>= 5) times:

* ``sampled``: :func:`dataset_cache.video.load_clip` with ``--take`` frames spread uniformly, into one
  ``[take, H, W, 3]`` buffer at a 256-side bucket (what Encode Dataset does);
* ``whole``: every frame decoded to one float32 ``[T, H, W, 3]`` tensor, then the same frames picked and resized
  (what a loader holding the whole clip, such as ComfyUI's ``VideoFromFile.get_components``, pays).

Reports median (min–max) seconds and peak RSS growth. Needs PyAV (ComfyUI's python has it).

    /opt/comfyui-dev/venv/bin/python -m bench.bench_clips          # from the pack root
    /opt/comfyui-dev/venv/bin/python -m bench.bench_clips --frames 600 --size 1280x720 --take 33
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def write_video(path: Path, frames: int, width: int, height: int) -> None:
    import av
    import numpy as np

    with av.open(str(path), "w") as container:
        stream = container.add_stream("mpeg4", rate=30)
        stream.width, stream.height, stream.pix_fmt = width, height, "yuv420p"
        gen = np.random.default_rng(0)
        base = gen.integers(0, 255, (height, width, 3), dtype=np.uint8)
        for i in range(frames):
            arr = np.roll(base, i * 4, axis=1)
            for packet in stream.encode(av.VideoFrame.from_ndarray(arr, format="rgb24")):
                container.mux(packet)
        for packet in stream.encode():
            container.mux(packet)


def _child(mode: str, path: str, take: int) -> dict[str, float]:
    import torch

    from dataset_cache.buckets import BucketConfig
    from dataset_cache.frames import FrameSettings
    from dataset_cache.video import load_clip, probe_video

    info = probe_video(path)
    plan = BucketConfig(resolution=256, step=16, min_side=128).plan(info.width, info.height)
    indices = FrameSettings(frames=take, sampling="uniform", stride=1).indices(info.frames)
    width, height = plan.bucket
    base = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    start = time.perf_counter()
    out = torch.empty((len(indices), height, width, 3))
    if mode == "sampled":
        load_clip(path, indices, plan, out, name=path)
    else:
        import av
        from PIL import Image

        from dataset_cache.imaging import apply_plan

        with av.open(path) as container:
            whole = torch.stack([torch.from_numpy(f.to_ndarray(format="rgb24")).float() / 255
                                 for f in container.decode(container.streams.video[0])])
        for row, index in enumerate(indices):
            img = Image.fromarray((whole[index] * 255).round().to(torch.uint8).numpy())
            out[row] = torch.from_numpy(__import__("numpy").asarray(apply_plan(img, plan))).float() / 255
    seconds = time.perf_counter() - start
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    return {"seconds": seconds, "rss_mib": (peak - base) / 1024}


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--frames", type=int, default=300)
    ap.add_argument("--size", default="640x360")
    ap.add_argument("--take", type=int, default=17)
    ap.add_argument("--runs", type=int, default=5)
    ap.add_argument("--child", nargs=3, help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.child:
        print(json.dumps(_child(args.child[0], args.child[1], int(args.child[2]))))
        return 0
    if args.runs < 5:
        ap.error("--runs must be >= 5")
    width, height = map(int, args.size.split("x"))
    with tempfile.TemporaryDirectory() as tmp:
        path = Path(tmp) / "clip.mp4"
        write_video(path, args.frames, width, height)
        results: dict[str, list[dict[str, float]]] = {"sampled": [], "whole": []}
        for _ in range(args.runs):
            for mode in results:  # interleaved: both see the same machine load
                out = subprocess.run([sys.executable, "-m", "bench.bench_clips", "--child", mode, str(path),
                                      str(args.take)], capture_output=True, text=True, check=True, cwd=ROOT)
                results[mode].append(json.loads(out.stdout))
        print(f"clip: {args.frames} frames {width}x{height} ({path.stat().st_size / 1e6:.1f} MB), {args.take} "
              f"frames taken uniformly at a 256-side bucket; load {os.getloadavg()[0]:.2f}")
        print("| path | seconds | peak RSS growth |")
        print("|---|---|---|")
        for mode, rows in results.items():
            sec = [r["seconds"] for r in rows]
            rss = [r["rss_mib"] for r in rows]
            print(f"| {mode} | {statistics.median(sec):.2f} ({min(sec):.2f}–{max(sec):.2f}) | "
                  f"{statistics.median(rss):.0f} MiB ({min(rss):.0f}–{max(rss):.0f}) |")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())

"""A rank joining a Train LoRA run "from another machine", for tests: ``scripts/join-training`` started as a user
starts it there, with that machine's own ComfyUI folders (copies of the model file and caches), its output in a
file, over the loopback."""

from __future__ import annotations

import os
import shutil
import socket
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path

from .paths import PACK_ROOT

__all__ = ["JOIN", "KEY", "Joiner", "free_port", "other_machine", "start_joiner"]

JOIN = PACK_ROOT / "scripts" / "join-training"
KEY = "a key of at least sixteen characters"


def free_port() -> int:
    """A port of the loopback nothing listens on (for rank 0's join address)."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def other_machine(base: Path, unet: Path, caches: dict[str, Path] | None = None) -> Path:
    """``base`` laid out as another machine's ComfyUI base folder: ``unet`` under ``models/diffusion_models`` and each
    cache copied under ``models/streamcache/<name>``."""
    (base / "models" / "diffusion_models").mkdir(parents=True)
    shutil.copy(unet, base / "models" / "diffusion_models" / unet.name)
    for name, cache in (caches or {}).items():
        shutil.copytree(cache, base / "models" / "streamcache" / name)
    return base


@dataclass
class Joiner:
    """A running join command and the file its output goes to."""

    proc: subprocess.Popen[bytes]
    log: Path

    def ended(self, timeout: float = 120.0) -> tuple[int, str]:
        """Its exit code once it has ended, and its output."""
        code = self.proc.wait(timeout=timeout)
        return code, self.log.read_text(errors="replace")

    def stop(self) -> None:
        """Kill it if it still runs, and wait for it."""
        if self.proc.poll() is None:
            self.proc.kill()
        self.proc.wait(timeout=30)


def start_joiner(comfyui: Path, base: Path, port: int, *, key: str = KEY, wait_s: int = 240,
                 repeat: bool = False) -> Joiner:
    """Start ``scripts/join-training --main 127.0.0.1:<port>`` with ComfyUI at ``comfyui`` and ``--base-directory
    base``; its temporary folder is ``<base>/../join-tmp`` (to see what it leaves there) and its output goes to
    ``<base>/../join-<n>.log``."""
    temp = base.parent / "join-tmp"
    temp.mkdir(exist_ok=True)
    log = base.parent / f"join-{len(list(base.parent.glob('join-*.log')))}.log"
    env = {**os.environ, "STREAMCACHE_JOIN_KEY": key, "TMPDIR": str(temp)}
    env.pop("STREAMCACHE_JOIN_ADDRESS", None)
    command = [sys.executable, str(JOIN), "--main", f"127.0.0.1:{port}", "--comfyui", str(comfyui),
               "--wait", str(wait_s), *(["--repeat"] if repeat else []), "--", "--base-directory", str(base)]
    with log.open("wb") as out:
        proc = subprocess.Popen(command, stdout=out, stderr=subprocess.STDOUT, env=env, cwd=base)
    return Joiner(proc, log)

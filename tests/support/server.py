"""Starting a real ComfyUI server (a subprocess) with this pack installed, in private folders.

Used by the e2e suite's session fixture and by ``scripts/run-example``. The server gets:

* ``--cpu --listen 127.0.0.1 --port <free port>``, ``--database-url sqlite:///:memory:``, ``--disable-api-nodes``;
* ``--base-directory`` plus input/output/temp/user folders under a private work folder, so nothing is written
  into the ComfyUI install (the pack's default cache folder becomes ``<work>/base/models/streamcache``);
* an ``--extra-model-paths-config`` file naming a model folder (tiny generated models, or real ones), the output
  folder's ``loras/`` as a LoRA folder (where Save LoRA Weights writes) and a ``custom_nodes`` folder that holds
  only a symlink to this pack.

:meth:`ComfyServer.start` waits until the HTTP API answers and fails if the log says the pack did not import.
"""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import time
import urllib.error
import urllib.request
from pathlib import Path
from typing import Any

from .client import ComfyClient
from .comfy_env import ComfyInstall
from .paths import PACK_ROOT

__all__ = ["ComfyServer", "PACK_LINK_NAME", "ServerStartError"]

PACK_LINK_NAME = "comfyui-streamcache"
MODEL_FOLDERS = ("checkpoints", "diffusion_models", "text_encoders", "vae", "loras")


class ServerStartError(RuntimeError):
    """ComfyUI did not come up, or came up without this pack."""


def _free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class ComfyServer:
    """One ComfyUI server process; use as a context manager or call :meth:`start` / :meth:`stop`."""

    def __init__(self, install: ComfyInstall, workdir: Path, *, models_dir: Path | None = None,
                 extra_args: tuple[str, ...] = (), address_space_limit_bytes: int | None = None,
                 env: dict[str, str] | None = None) -> None:
        """``address_space_limit_bytes`` caps the server's virtual memory (``RLIMIT_AS``, POSIX): a prompt that
        tries to allocate without bound then fails inside the server under test, not the machine running it.
        ``env``: variables added to the server's environment."""
        self.install = install
        self.env = dict(env or {})
        self.address_space_limit_bytes = address_space_limit_bytes
        self.workdir = Path(workdir).resolve()
        self.models_dir = Path(models_dir).resolve() if models_dir else None
        self.extra_args = extra_args
        self.port = _free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.base = self.workdir / "base"
        self.input_dir = self.workdir / "input"
        self.output_dir = self.workdir / "output"
        self.temp_dir = self.workdir / "temp"
        self.user_dir = self.workdir / "user"
        self.custom_nodes = self.workdir / "custom_nodes"
        self.streamcache_dir = self.base / "models" / "streamcache"
        self.log_path = self.workdir / "comfyui.log"
        self._proc: subprocess.Popen[bytes] | None = None
        self.startup_seconds: float | None = None

    # --- setup --------------------------------------------------------------------------------------------
    def _write_layout(self) -> Path:
        for d in (self.base, self.base / "custom_nodes", self.input_dir, self.output_dir, self.temp_dir,
                  self.user_dir, self.custom_nodes, self.streamcache_dir, self.output_dir / "loras"):
            d.mkdir(parents=True, exist_ok=True)
        link = self.custom_nodes / PACK_LINK_NAME
        if not link.is_symlink():
            link.symlink_to(PACK_ROOT, target_is_directory=True)
        lines = ["streamcache_custom_nodes:", f"  custom_nodes: {json.dumps(str(self.custom_nodes))}"]
        if self.models_dir is not None:
            lines += ["streamcache_models:", f"  base_path: {json.dumps(str(self.models_dir))}"]
            lines += [f"  {name}: {name}" for name in MODEL_FOLDERS]
        # Save LoRA Weights writes output/loras/; listing it lets Load LoRA sample with a LoRA trained just now
        lines += ["streamcache_outputs:", f"  base_path: {json.dumps(str(self.output_dir))}", "  loras: loras"]
        config = self.workdir / "extra_model_paths.yaml"
        config.write_text("\n".join(lines) + "\n")
        return config

    def command(self) -> list[str]:
        config = self._write_layout()
        return [
            str(self.install.python), "main.py", "--cpu", "--listen", "127.0.0.1", "--port", str(self.port),
            "--base-directory", str(self.base),
            "--input-directory", str(self.input_dir), "--output-directory", str(self.output_dir),
            "--temp-directory", str(self.temp_dir), "--user-directory", str(self.user_dir),
            "--extra-model-paths-config", str(config),
            "--database-url", "sqlite:///:memory:", "--disable-api-nodes",
            *self.extra_args,
        ]

    def _limit_memory(self) -> Any:
        limit = self.address_space_limit_bytes
        if limit is None:
            return None

        def apply() -> None:  # runs in the child between fork and exec
            import resource

            resource.setrlimit(resource.RLIMIT_AS, (limit, limit))
        return apply

    def peak_virtual_memory_bytes(self) -> int | None:
        """The server process's peak virtual memory (``VmPeak``, Linux), or None where unknown."""
        if self._proc is None:
            return None
        try:
            for line in Path(f"/proc/{self._proc.pid}/status").read_text().splitlines():
                if line.startswith("VmPeak:"):
                    return int(line.split()[1]) * 1024
        except OSError:
            return None
        return None

    # --- lifecycle ----------------------------------------------------------------------------------------
    def start(self, timeout: float = 300.0) -> ComfyServer:
        """Start the server and wait for ``/object_info``; raise :class:`ServerStartError` with the log tail."""
        t0 = time.monotonic()
        log = open(self.log_path, "wb")
        env = {**os.environ, "PYTHONUNBUFFERED": "1", **self.env}
        self._proc = subprocess.Popen(self.command(), cwd=self.install.path, stdout=log, stderr=subprocess.STDOUT,
                                      env=env, start_new_session=True, preexec_fn=self._limit_memory())
        log.close()
        while True:
            if self._proc.poll() is not None:
                raise ServerStartError(f"ComfyUI exited with {self._proc.returncode} during startup:\n"
                                       + self.log_tail())
            try:
                with urllib.request.urlopen(self.url + "/system_stats", timeout=5) as resp:
                    if resp.status == 200:
                        break
            except (urllib.error.URLError, ConnectionError, TimeoutError):
                pass
            if time.monotonic() - t0 > timeout:
                self.stop()
                raise ServerStartError(f"ComfyUI did not answer within {timeout:.0f} s:\n" + self.log_tail())
            time.sleep(0.25)
        self.startup_seconds = time.monotonic() - t0
        problems = self.pack_import_problems()
        if problems:
            self.stop()
            raise ServerStartError("ComfyUI could not import the pack:\n" + "\n".join(problems)
                                   + "\n--- log tail ---\n" + self.log_tail())
        return self

    def stop(self) -> None:
        """Terminate the server (its whole process group), killing it if it does not exit in 20 s."""
        proc, self._proc = self._proc, None
        if proc is None or proc.poll() is not None:
            return
        try:
            os.killpg(proc.pid, signal.SIGTERM)
            proc.wait(timeout=20)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait(timeout=20)
        except ProcessLookupError:
            pass

    def __enter__(self) -> ComfyServer:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()

    # --- inspection ---------------------------------------------------------------------------------------
    def log_text(self) -> str:
        return self.log_path.read_text(errors="replace") if self.log_path.exists() else ""

    def log_tail(self, lines: int = 60) -> str:
        return "\n".join(self.log_text().splitlines()[-lines:])

    def pack_import_problems(self) -> list[str]:
        """Log lines saying that this pack failed to import (empty when it imported)."""
        lines = self.log_text().splitlines()
        problems = [line for line in lines
                    if ("IMPORT FAILED" in line or "Cannot import" in line) and PACK_LINK_NAME in line]
        if not problems and not any(PACK_LINK_NAME in line for line in lines):
            problems.append(f"the log never mentions {PACK_LINK_NAME}: it was not found among the custom nodes")
        return problems

    def client(self) -> ComfyClient:
        return ComfyClient(self.url)

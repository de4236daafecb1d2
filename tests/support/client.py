"""A small client for ComfyUI's HTTP + websocket API (`POST /prompt`, `GET /history`, `/ws` events).

HTTP uses the standard library only. Progress and execution events come from the websocket (``/ws``), via the
``websocket-client`` package; without it, :meth:`ComfyClient.run` falls back to polling ``/history``.
"""

from __future__ import annotations

import json
import struct
import time
import urllib.error
import urllib.request
import uuid
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

__all__ = ["ComfyClient", "PromptError", "PromptResult", "SEEN_NODE_ERRORS", "record_node_errors"]

PACK_PREFIX = "StreamCache_"
SEEN_NODE_ERRORS: list[dict[str, str]] = []
"""Every error a node of the pack reported to a client of this process: ``{"kind": "validation" | "execution",
"node_type", "type", "message"}`` (the e2e suite checks that none is a bare Python message)."""


_TEXT = 3
"""ComfyUI's ``BinaryEventTypes.TEXT``: a 4-byte event type, a 4-byte node id length, the node id, the text."""


def _progress_text(message: bytes) -> tuple[str, str] | None:
    """``(node id, text)`` of a binary progress-text frame, ``None`` for any other binary frame."""
    if len(message) < 8 or struct.unpack(">I", message[:4])[0] != _TEXT:
        return None
    size = struct.unpack(">I", message[4:8])[0]
    return message[8:8 + size].decode("utf-8"), message[8 + size:].decode("utf-8", errors="replace")


def record_node_errors(reply: Any) -> None:
    """Keep the pack's validation errors of a ``/prompt`` reply (``node_errors``) in :data:`SEEN_NODE_ERRORS`."""
    node_errors = reply.get("node_errors") if isinstance(reply, dict) else None
    for entry in (node_errors or {}).values():
        if not isinstance(entry, dict) or not str(entry.get("class_type", "")).startswith(PACK_PREFIX):
            continue
        for error in entry.get("errors", []):
            SEEN_NODE_ERRORS.append({"kind": "validation", "node_type": entry["class_type"],
                                     "type": str(error.get("type", "")),
                                     "message": str(error.get("details") or error.get("message", ""))})


def _record_execution_errors(entry: dict[str, Any]) -> None:
    for kind, data in entry.get("status", {}).get("messages", []):
        if kind == "execution_error" and str(data.get("node_type", "")).startswith(PACK_PREFIX):
            SEEN_NODE_ERRORS.append({"kind": "execution", "node_type": data["node_type"],
                                     "type": str(data.get("exception_type", "")),
                                     "message": str(data.get("exception_message", ""))})


class PromptError(RuntimeError):
    """ComfyUI refused a prompt (validation) or the prompt failed while executing."""

    def __init__(self, message: str, details: Any = None) -> None:
        self.details = details
        super().__init__(message + (f"\n{json.dumps(details, indent=2, default=str)}" if details else ""))


@dataclass
class PromptResult:
    """What one finished prompt produced."""

    prompt_id: str
    history: dict[str, Any]
    """``/history/<prompt_id>[prompt_id]``: ``outputs`` (node id → ui dict), ``status``, ``meta``."""
    events: list[dict[str, Any]] = field(default_factory=list)
    """Websocket JSON messages received for this prompt, in order (empty when polling)."""

    @property
    def outputs(self) -> dict[str, Any]:
        return self.history.get("outputs", {})

    @property
    def status(self) -> str:
        return self.history.get("status", {}).get("status_str", "")

    def events_of(self, kind: str) -> list[dict[str, Any]]:
        return [e["data"] for e in self.events if e.get("type") == kind]


class ComfyClient:
    """Talks to one ComfyUI server at ``base_url`` (``http://127.0.0.1:8188``)."""

    def __init__(self, base_url: str, *, timeout: float = 30.0) -> None:
        self.base_url = base_url.rstrip("/")
        self.timeout = timeout
        self.client_id = uuid.uuid4().hex

    # --- plain HTTP -------------------------------------------------------------------------------------
    def get(self, route: str) -> Any:
        with urllib.request.urlopen(self.base_url + route, timeout=self.timeout) as resp:
            return json.loads(resp.read())

    def post(self, route: str, body: Any) -> Any:
        req = urllib.request.Request(
            self.base_url + route, data=json.dumps(body).encode(), headers={"Content-Type": "application/json"}
        )
        with urllib.request.urlopen(req, timeout=self.timeout) as resp:
            raw = resp.read()
        return json.loads(raw) if raw else None

    def object_info(self) -> dict[str, Any]:
        return self.get("/object_info")

    def submit(self, body: dict[str, Any]) -> dict[str, Any]:
        """POST a ``/prompt`` body; returns ComfyUI's reply or raises :class:`PromptError` with its details."""
        try:
            reply = self.post("/prompt", body)
        except urllib.error.HTTPError as exc:
            text = exc.read().decode(errors="replace")
            try:
                details: Any = json.loads(text)
            except ValueError:
                details = text
            record_node_errors(details)
            raise PromptError(f"ComfyUI refused the prompt (HTTP {exc.code})", details) from exc
        record_node_errors(reply)
        return reply

    def queue_prompt(self, prompt: dict[str, Any]) -> str:
        """POST ``/prompt``; returns the prompt id or raises :class:`PromptError` with ComfyUI's node errors."""
        reply = self.submit({"prompt": prompt, "client_id": self.client_id})
        if reply.get("node_errors"):
            raise PromptError("ComfyUI reported node errors", reply["node_errors"])
        return reply["prompt_id"]

    def history(self, prompt_id: str) -> dict[str, Any] | None:
        return self.get(f"/history/{prompt_id}").get(prompt_id)

    # --- running ----------------------------------------------------------------------------------------
    def run(self, prompt: dict[str, Any], *, timeout: float = 300.0, check: bool = True) -> PromptResult:
        """Queue ``prompt``, wait until it finished, return its history (and websocket events).

        Raises:
            PromptError: refused at validation, or (``check=True``) finished with an error status.
            TimeoutError: not finished within ``timeout`` seconds.
        """
        result, _ = self.run_body({"prompt": prompt, "client_id": self.client_id}, timeout=timeout, check=check,
                                  allow_node_errors=False)
        return result

    def run_body(self, body: dict[str, Any], *, timeout: float, check: bool, allow_node_errors: bool
                 ) -> tuple[PromptResult, dict[str, Any]]:
        """Queue a ``/prompt`` body, wait until it finished; returns ``(result, node_errors)``.

        With ``allow_node_errors``, outputs refused at validation are returned, not raised, while the others run.
        """
        try:
            import websocket  # websocket-client
        except ImportError:  # poll /history instead (no events)
            websocket = None
        events: list[dict[str, Any]] = []
        ws = None
        if websocket is not None:
            ws = websocket.WebSocket()
            ws.connect(self.base_url.replace("http", "ws", 1) + f"/ws?clientId={self.client_id}", timeout=timeout)
        try:
            reply = self.submit(body)
            if reply.get("node_errors") and not allow_node_errors:
                raise PromptError("ComfyUI reported node errors", reply["node_errors"])
            prompt_id = reply["prompt_id"]
            deadline = time.monotonic() + timeout
            if ws is not None:
                self._wait_ws(ws, prompt_id, deadline, events)
            entry = self._wait_history(prompt_id, deadline)
        finally:
            if ws is not None:
                ws.close()
        _record_execution_errors(entry)
        result = PromptResult(prompt_id, entry, events)
        if check and result.status != "success":
            errors = [m for m in entry.get("status", {}).get("messages", []) if m[0] == "execution_error"]
            raise PromptError(f"prompt {prompt_id} finished with status {result.status!r}", errors or entry)
        return result, reply.get("node_errors") or {}

    @staticmethod
    def _wait_ws(ws: Any, prompt_id: str, deadline: float, events: list[dict[str, Any]]) -> None:
        while True:
            remaining = deadline - time.monotonic()
            if remaining <= 0:
                raise TimeoutError(f"prompt {prompt_id} did not finish in time")
            ws.settimeout(remaining)
            message = ws.recv()
            if not isinstance(message, str):
                text = _progress_text(message)
                if text is not None:  # a node's progress text (ComfyUI's send_progress_text); previews skipped
                    events.append({"type": "progress_text", "data": {"node": text[0], "text": text[1]}})
                continue
            event = json.loads(message)
            data = event.get("data") or {}
            if data.get("prompt_id") not in (None, prompt_id):
                continue
            events.append(event)
            if event.get("type") == "executing" and data.get("node") is None and data.get("prompt_id") == prompt_id:
                return
            if event.get("type") in ("execution_error", "execution_interrupted"):
                return

    def run_and_act(self, prompt: dict[str, Any], when: Callable[[dict[str, Any]], bool], act: Callable[[], None],
                    *, timeout: float = 600.0) -> PromptResult:
        """Queue ``prompt``, call ``act`` once as soon as a websocket event of it satisfies ``when`` (e.g. POST
        ``/interrupt`` mid-run, or kill a worker), and wait until the prompt ended, whatever its status."""
        import websocket  # websocket-client: the events are the point here

        ws = websocket.WebSocket()
        ws.connect(self.base_url.replace("http", "ws", 1) + f"/ws?clientId={self.client_id}", timeout=timeout)
        events: list[dict[str, Any]] = []
        try:
            prompt_id = self.queue_prompt(prompt)
            deadline = time.monotonic() + timeout
            acted = False
            while True:
                ws.settimeout(max(0.1, deadline - time.monotonic()))
                message = ws.recv()
                if time.monotonic() > deadline:
                    raise TimeoutError(f"prompt {prompt_id} did not end in time")
                if not isinstance(message, str):
                    continue
                event = json.loads(message)
                if (event.get("data") or {}).get("prompt_id") not in (None, prompt_id):
                    continue
                events.append(event)
                if not acted and when(event):
                    act()
                    acted = True
                if event["type"] in ("execution_interrupted", "execution_error", "execution_success"):
                    break
            entry = self._wait_history(prompt_id, deadline)
        finally:
            ws.close()
        return PromptResult(prompt_id, entry, events)

    def _wait_history(self, prompt_id: str, deadline: float) -> dict[str, Any]:
        """``/history`` holds a prompt only once it finished (success, error or interrupt)."""
        while True:
            entry = self.history(prompt_id)
            if entry:
                return entry
            if time.monotonic() > deadline:
                raise TimeoutError(f"prompt {prompt_id} did not appear in /history in time")
            time.sleep(0.05)

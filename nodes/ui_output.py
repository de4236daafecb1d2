"""What the pack's nodes show on the canvas: node UI output with structured fields, and live websocket events.

Every figure reaches ``/history`` as plain node output: :class:`TextWithData` is ComfyUI's ``PreviewText``
(``{"text": [report]}``) plus structured keys (``{"streamcache_report": [{...}]}``) that the pack's front-end
extension (``web/js/streamcache.js``) draws. Without the extension the text is still there, and the structured
keys are plain JSON in the history.

:class:`EventSender` sends a throttled custom websocket event from the execution thread; it never imports the
server (no server, e.g. in tests that call ``execute`` directly: no event) and never raises.
"""

from __future__ import annotations

import logging
import sys
import time
from typing import Any

from comfy_api.latest import ui

__all__ = ["EventSender", "TextWithData", "show_text"]

log = logging.getLogger("streamcache.ui")


class TextWithData(ui.PreviewText):
    """``PreviewText(text)`` plus structured fields: ``as_dict()`` → ``{"text": (text,), key: [value], ...}``."""

    def __init__(self, value: str, **data: Any) -> None:
        super().__init__(value)
        self.data = data

    def as_dict(self) -> dict[str, Any]:
        return {**super().as_dict(), **{key: [value] for key, value in self.data.items()}}


def show_text(text: str, node_id: str | None) -> None:
    """Show ``text`` on node ``node_id`` (ComfyUI's ``send_progress_text``, drawn by its own front end) when a server
    exists; never raises: what a node shows must never fail its work."""
    instance = getattr(getattr(sys.modules.get("server"), "PromptServer", None), "instance", None)
    if instance is None or node_id is None:
        return
    try:
        instance.send_progress_text(text, node_id, getattr(instance, "client_id", None))
    except Exception:
        log.debug("could not show %r", text[:80], exc_info=True)


class EventSender:
    """Sends ``event`` with ``{"node": node_id, ...}`` at most every ``interval`` seconds (``force`` always sends)."""

    def __init__(self, event: str, node_id: str | None, interval: float = 0.5) -> None:
        self.event = event
        self.node_id = node_id
        self.interval = interval
        self._last = float("-inf")

    def __call__(self, data: dict[str, Any], *, force: bool = False) -> bool:
        now = time.monotonic()
        if not force and now - self._last < self.interval:
            return False
        server_module = sys.modules.get("server")  # never imported here: no server, no event
        instance = getattr(getattr(server_module, "PromptServer", None), "instance", None)
        if instance is None:
            return False
        self._last = now
        try:
            instance.send_sync(self.event, {"node": self.node_id, **data}, getattr(instance, "client_id", None))
        except Exception:  # a progress event must never fail the node
            log.debug("could not send %s", self.event, exc_info=True)
            return False
        return True

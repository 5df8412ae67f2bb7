"""HTTP helpers shared by the integration tests."""

from __future__ import annotations

import json
import urllib.error
import urllib.request


def post_chat(url: str, body: bytes) -> tuple[int, dict]:
    """POST raw bytes to ``url``'s chat completions; (status, decoded JSON body), for errors too."""
    req = urllib.request.Request(f"{url}/v1/chat/completions", data=body, headers={"Content-Type": "application/json"})
    try:
        with urllib.request.urlopen(req, timeout=60) as r:
            return r.status, json.loads(r.read())
    except urllib.error.HTTPError as e:
        return e.code, json.loads(e.read())

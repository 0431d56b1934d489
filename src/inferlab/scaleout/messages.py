"""The typed messages between the ingress and a replica: a forwarded HTTP request, and the head of its response
(the body follows as bytes). Plain dataclasses: they cross processes through Ray's pickling."""

from __future__ import annotations

import json
from dataclasses import dataclass, field


@dataclass(slots=True)
class ForwardedRequest:
    method: str
    path: str
    query: str
    headers: list[tuple[str, str]]
    body: bytes
    # What the prefix-affinity router matches on: the prompt text, or the chat messages' text joined; "" for a
    # request without one (GET /v1/models, a malformed body), which the router places by load alone.
    routing_text: str = ""


@dataclass(slots=True)
class ResponseHead:
    status: int
    headers: list[tuple[str, str]] = field(default_factory=list)


def routing_text(body: bytes, max_chars: int = 4096) -> str:
    """The prompt's leading text, as the router sees it. Only the start matters to a prefix cache (the first KV
    blocks), so the text is cut at `max_chars`, which also bounds the router's prefix tree."""
    try:
        data = json.loads(body)
    except (ValueError, UnicodeDecodeError):
        return ""
    if not isinstance(data, dict):
        return ""
    text = ""
    if isinstance(data.get("messages"), list):
        text = "".join(_content_text(m.get("content")) for m in data["messages"] if isinstance(m, dict))
    elif isinstance(data.get("prompt"), str):
        text = data["prompt"]
    elif isinstance(data.get("prompt"), list) and data["prompt"]:
        first = data["prompt"][0]
        # a batch of prompts routes by its first; token ids route by their decimal text (same ids, same prefix)
        text = first if isinstance(first, str) else " ".join(map(str, data["prompt"] if isinstance(first, int)
                                                                    else first))
    return text[:max_chars]


def _content_text(content: object) -> str:
    if isinstance(content, str):
        return content
    if isinstance(content, list):
        return "".join(p.get("text", "") for p in content if isinstance(p, dict) and isinstance(p.get("text"), str))
    return ""

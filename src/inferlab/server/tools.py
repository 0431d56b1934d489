"""Tool calling: what `tools` + `tool_choice` do to a chat request's prompt, its output constraint and its response.

- The tools reach the chat template (`tools=`, as transformers renders them) where the model's template uses them;
  a template that ignores them (the bundled SmolLM2's) gets them as a system message listing the functions' JSON
  schemas, so the model knows what it may call (engine/prompt.py, PromptTokenizer.render_chat).
- `tool_choice` named function: the output is constrained (xgrammar) to that function's parameter schema, and it is
  the call's `arguments`; streamed as `tool_calls` deltas whose `arguments` grow token by token. finish_reason is
  "stop", as OpenAI's for a forced function.
- `required`: the output is constrained to a JSON array of one or more `{"name": <one of the tools>, "parameters":
  <its schema>}` (vLLM's shape; at most one with `parallel_tool_calls: false`); parsed into `tool_calls` when it
  ends, sent as one delta when streaming (the array is only known to be whole then). finish_reason "tool_calls".
- `auto`: unconstrained; an output that is a Hermes-style `<tool_call>{"name": ..., "arguments": ...}</tool_call>`
  (or that JSON alone) naming a known tool becomes `tool_calls`, anything else stays content.
- `none` (or no tools): plain chat; the tools are still rendered, as OpenAI's and vLLM's do.
"""

from __future__ import annotations

import json
import re
import uuid
from dataclasses import dataclass
from typing import Any, Literal

from inferlab.engine.structured_output import Guide

ToolMode = Literal["none", "auto", "required", "named"]
_HERMES = re.compile(r"<tool_call>\s*(.*?)\s*</tool_call>", re.S)


@dataclass(slots=True)
class ToolPlan:
    mode: ToolMode
    functions: dict[str, dict[str, Any]]  # name -> parameters schema
    name: str | None = None  # the forced function, for "named"
    parallel: bool = True  # parallel_tool_calls: false allows one call only

    @property
    def guide(self) -> Guide | None:
        if self.mode == "named":
            return Guide("json_schema", json.dumps(self.functions[self.name]), "tool_choice")  # type: ignore[index]
        if self.mode == "required":
            defs: dict[str, Any] = {}
            calls = [{"type": "object", "properties": {"name": {"const": n}, "parameters": _hoist_defs(n, p, defs)},
                      "required": ["name", "parameters"]} for n, p in self.functions.items()]
            schema = {"type": "array", "minItems": 1, "items": {"anyOf": calls}}
            if not self.parallel:
                schema["maxItems"] = 1
            return Guide("json_schema", json.dumps({**schema, "$defs": defs} if defs else schema), "tool_choice")
        return None

    @property
    def streams_arguments(self) -> bool:
        return self.mode == "named"

    def calls(self, text: str) -> list[tuple[str, str]] | None:
        """(name, arguments JSON) of each call the finished output makes, or None when it is plain content."""
        if self.mode == "named":
            return [(self.name, text)]  # type: ignore[list-item]
        if self.mode == "required":
            try:
                return [(c["name"], json.dumps(c["parameters"])) for c in json.loads(text)]
            except (json.JSONDecodeError, KeyError, TypeError):
                return None  # cut off by max_tokens: the caller reports it as content with finish_reason length
        if self.mode == "auto":
            found = _HERMES.findall(text) or [text.strip()]
            calls = []
            for raw in found:
                try:
                    c = json.loads(raw)
                    name, args = c["name"], c.get("arguments", c.get("parameters", {}))
                except (json.JSONDecodeError, KeyError, TypeError, AttributeError):
                    return None
                if name not in self.functions:
                    return None
                calls.append((name, args if isinstance(args, str) else json.dumps(args)))
            return calls
        return None


def new_call_id() -> str:
    return f"call_{uuid.uuid4().hex[:24]}"


def _hoist_defs(name: str, schema: dict[str, Any], defs: dict[str, Any]) -> dict[str, Any]:
    """A function's schema nested in the `required` array: its local `$defs` (pydantic's enums, nested models) move
    to the root, renamed per function, and its `#/$defs/X` references follow them."""
    local = schema.get("$defs", {})

    def walk(x: Any) -> Any:
        if isinstance(x, dict):
            out = {k: walk(v) for k, v in x.items() if k != "$defs"}
            ref = out.get("$ref")
            if isinstance(ref, str) and ref.startswith("#/$defs/"):
                out["$ref"] = f"#/$defs/{name}.{ref[len('#/$defs/'):]}"
            return out
        return [walk(v) for v in x] if isinstance(x, list) else x

    for key, value in local.items():
        defs[f"{name}.{key}"] = walk(value)
    return walk(schema)

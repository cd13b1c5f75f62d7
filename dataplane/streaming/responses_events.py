"""A whole Responses API answer as the event stream OpenAI would have sent.

For a streaming Responses request that an origin answered whole, in JSON (it
ignored `stream`): the client's SDK reads events, and finds none in the JSON
(`client.responses.stream` raises for want of response.completed). The events
are OpenAI's, numbered from 0 (`sequence_number`):

- response.created, with the response `in_progress` and no output yet;
- per output item: response.output_item.added (the item, in progress and
  empty), then for a message each of its content parts (content_part.added,
  its text as one output_text.delta or its refusal as one refusal.delta, the
  matching .done events, content_part.done), for a function call its
  arguments as one function_call_arguments.delta and .done; and
  response.output_item.done with the whole item;
- response.completed (response.incomplete or response.failed, as its status
  says), with the whole response.

Pure: JSON in, bytes out.
"""

from __future__ import annotations

from typing import Any

from dataplane import jsonio

__all__ = ["response_events"]

# The terminal event of each final status (anything else: completed).
_ENDS = {"incomplete": "response.incomplete", "failed": "response.failed"}


def response_events(response: dict[str, Any]) -> bytes | None:
    """The SSE frames of a whole Responses answer; None when it is not one (no
    `"object": "response"` with a list of output items)."""
    output = response.get("output")
    if response.get("object") != "response" or not isinstance(output, list):
        return None
    if not all(isinstance(item, dict) for item in output):
        return None
    out = _Events()
    out.add("response.created", response={**response, "status": "in_progress", "output": []})
    for index, item in enumerate(output):
        _item(out, index, item)
    end = _ENDS.get(str(response.get("status")), "response.completed")
    out.add(end, response=response)
    return b"".join(out.frames)


class _Events:
    def __init__(self) -> None:
        self.frames: list[bytes] = []

    def add(self, kind: str, **fields: Any) -> None:
        data = jsonio.dumps({"type": kind, "sequence_number": len(self.frames), **fields})
        self.frames.append(b"event: " + kind.encode() + b"\ndata: " + data + b"\n\n")


def _item(out: _Events, index: int, item: dict[str, Any]) -> None:
    kind = item.get("type")
    where: dict[str, Any] = {"output_index": index}
    item_id = item.get("id")
    started: dict[str, Any] = {**item, "status": "in_progress"}
    if kind == "message":
        started["content"] = []
    elif kind == "function_call":
        started["arguments"] = ""
    out.add("response.output_item.added", item=started, **where)
    if kind == "message":
        parts = item.get("content")
        for part_index, part in enumerate(parts if isinstance(parts, list) else ()):
            if isinstance(part, dict):
                _part(out, {**where, "item_id": item_id, "content_index": part_index}, part)
    elif kind == "function_call":
        arguments = item.get("arguments")
        if isinstance(arguments, str):
            at = {**where, "item_id": item_id}
            out.add("response.function_call_arguments.delta", delta=arguments, **at)
            out.add("response.function_call_arguments.done", arguments=arguments, **at)
    out.add("response.output_item.done", item=item, **where)


def _part(out: _Events, where: dict[str, Any], part: dict[str, Any]) -> None:
    kind = part.get("type")
    empty: dict[str, Any] = dict(part)
    if kind == "output_text":
        empty["text"] = ""
        if "annotations" in part:
            empty["annotations"] = []
    elif kind == "refusal":
        empty["refusal"] = ""
    out.add("response.content_part.added", part=empty, **where)
    if kind == "output_text" and isinstance(part.get("text"), str):
        out.add("response.output_text.delta", delta=part["text"], **where)
        out.add("response.output_text.done", text=part["text"], **where)
    elif kind == "refusal" and isinstance(part.get("refusal"), str):
        out.add("response.refusal.delta", delta=part["refusal"], **where)
        out.add("response.refusal.done", refusal=part["refusal"], **where)
    out.add("response.content_part.done", part=part, **where)

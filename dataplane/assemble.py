"""Prompt assembly: a tenant's rules applied to a request before anything else sees it.

Pure: takes the parsed body, returns whether it changed (the body is edited in
place). The cache key and the origin both see the assembled request, so an
alias and its target share cache entries and an enforced system prompt cannot
be bypassed by a cached answer.

Rules, in order:
1. model aliases: a public name is replaced by the name origins serve;
2. the system prompt (chat only): prepended as the first message, or, when
   enforced, replacing every system and developer message the client sent;
3. defaults: parameters the client left out;
4. the max_tokens ceiling: max_tokens and max_completion_tokens are clamped to
   it, and set to it when the client sent neither.
"""

from __future__ import annotations

import copy
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

from dataplane.http.errors import bad_request

SYSTEM_ROLES = frozenset({"system", "developer"})
TOKEN_FIELDS = ("max_tokens", "max_completion_tokens")


@dataclass(frozen=True, slots=True)
class PromptRules:
    system_prompt: str = ""
    enforce_system_prompt: bool = False
    defaults: Mapping[str, Any] = field(default_factory=dict)
    max_tokens_ceiling: int = 0
    aliases: Mapping[str, str] = field(default_factory=dict)

    @property
    def empty(self) -> bool:
        return not (self.system_prompt or self.defaults or self.max_tokens_ceiling or self.aliases)


NO_RULES: PromptRules = PromptRules()


def assemble(endpoint: str, body: dict[str, Any], rules: PromptRules) -> bool:
    """Apply rules to body in place; return True if anything changed.

    Raises ApiError (400) when a field the rules act on has the wrong type.
    """
    if rules.empty:
        return False
    changed = False
    model = body.get("model")
    if isinstance(model, str):
        target = rules.aliases.get(model)
        if target is not None:
            body["model"] = target
            changed = True
    if rules.system_prompt and endpoint == "chat.completions":
        messages = body["messages"]
        if rules.enforce_system_prompt:
            messages = [
                m for m in messages if not (isinstance(m, dict) and m.get("role") in SYSTEM_ROLES)
            ]
        body["messages"] = [{"role": "system", "content": rules.system_prompt}, *messages]
        changed = True
    for name, value in rules.defaults.items():
        if name not in body:
            # A copy: a list or object default must not be shared by requests.
            body[name] = copy.deepcopy(value) if isinstance(value, list | dict) else value
            changed = True
    ceiling = rules.max_tokens_ceiling
    if ceiling and endpoint != "embeddings":
        present = False
        for name in TOKEN_FIELDS:
            if name not in body or body[name] is None:
                continue
            value = body[name]
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise bad_request(f"'{name}' must be a positive integer", param=name)
            present = True
            if value > ceiling:
                body[name] = ceiling
                changed = True
        if not present:
            body["max_tokens"] = ceiling
            changed = True
    return changed

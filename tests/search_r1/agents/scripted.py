"""Scripted chat models for the agent tests, with the exact contract of `search_r1.agents.chat.ChatModel`.

`ScriptedChat({"planner": [...], "summarizer": [...], ...})` plays canned replies per role (the role
is recognised from the system message the agent sent) and records every call (deep copies of the
messages, stop strings, max_tokens) in `.calls`. Replies end at the first stop string, included
(as both real implementations return them), finish "stop"; otherwise finish "end" (the model ended
its turn). A reply may be a callable `(messages) -> str` (to answer from what the agent sent),
`CRASH` (raise, as a bug would), `OVERFLOW` (ContextOverflow, as a full context window) or
`SERVER_DOWN` (GenerationError, as a server down after its retries). completion_tokens counts
whitespace words.
"""
from __future__ import annotations

import copy

from search_r1.agents.chat import ChatReply, ContextOverflow
from search_r1.agents.prompts import role_of
from search_r1.rollout.backends import GenerationError

CRASH, OVERFLOW, SERVER_DOWN = object(), object(), object()
class ScriptCrash(RuntimeError):
    """What a CRASH step raises."""


class ScriptedChat:
    name = "scripted"

    def __init__(self, scripts: dict[str, list], fallback: str | None = None):
        self.scripts = {role: list(replies) for role, replies in scripts.items()}
        self.fallback = fallback
        self.calls: list[dict] = []

    def of(self, role: str) -> list[dict]:
        return [c for c in self.calls if c["role"] == role]

    def chat(self, messages, *, stop=(), max_tokens=512, temperature=0.0, seed=None) -> ChatReply:
        role = role_of(messages)
        self.calls.append({"role": role, "messages": copy.deepcopy(messages), "stop": tuple(stop),
                           "max_tokens": max_tokens})
        queue = self.scripts.get(role, [])
        if queue:
            reply = queue.pop(0)
        elif self.fallback is not None:
            reply = self.fallback
        else:
            raise AssertionError(f"the script for role {role!r} ran out (call {len(self.calls)})")
        if reply is CRASH:
            raise ScriptCrash(f"scripted crash in the {role} role")
        if reply is OVERFLOW:
            raise ContextOverflow(f"scripted: the {role} conversation does not fit the context window")
        if reply is SERVER_DOWN:
            raise GenerationError(f"scripted: the server is down ({role})")
        text = reply(messages) if callable(reply) else reply
        cuts = [(text.find(s), s) for s in stop if s in text]
        if cuts:
            at, hit = min(cuts)
            text = text[: at + len(hit)]
        words = text.split()
        if len(words) > max_tokens:
            return ChatReply(" ".join(words[:max_tokens]), "length", "", 0, max_tokens)
        return ChatReply(text, "stop" if cuts else "end", min(cuts)[1] if cuts else "", 0, len(words))

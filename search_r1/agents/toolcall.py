"""Tool-call agentic RAG (QwQ / Qwen style): `python -m search_r1.agents.toolcall`.

    python -m search_r1.agents.toolcall --model smollm2-135m-instruct --retriever-index default \\
        --question "What is the capital of Rutuk?"
    python -m search_r1.agents.toolcall --model Qwen/Qwen2.5-7B-Instruct --base-url http://127.0.0.1:8001 \\
        --retriever-url http://127.0.0.1:8000 --data test.parquet --out runs/toolcall --concurrency 8

The loop: the prompt (`prompts.toolcall_messages`) carries today's date and the search budget. Each
turn the model writes until `</tool_call>` (a stop string on servers, the exact stopping criterion
of `HFGenerator` locally) or the end of its turn. A tool call (either JSON form, decoded by
`protocol.decode_tool_call`) runs and its result goes back inside `<tool_response>`: search results
as `Doc N(Title: ..) text` lines numbered across the whole conversation, or the corrective message
for malformed JSON, an unknown tool or a missing argument. A turn without a tool call is the final
answer. When the search budget is used up (or the step, token or time budget), the model is told
so and gets one last turn to answer; each such hit is recorded. The final answer cites the
documents named in it (`Doc 2`, `[2]`), else lists every document the model was shown.

Failures end one question, never a batch: when the conversation outgrows the model's context window
(a local model's limit, a server's 400) the model is told so and asked for the final answer, with the
newest tool responses replaced by a note until the request fits (`overflow` in the result); when
even the question alone does not fit, or the server fails (401/403, another 4xx, down after its
retries), the result carries the `error` and no answer.

Transcript: "messages" (default for servers) sends each tool response as a user message; "inline"
(default for local models) keeps one assistant message that the model continues, with the tool
responses inside it, exactly as the training rollout of the `tool_call` protocol lays them out.
"""
from __future__ import annotations

import re
import sys
from dataclasses import asdict, dataclass, field

from search_r1.agents.budget import Budgets, BudgetMeter, Trace
from search_r1.agents.chat import ChatModel, ContextOverflow
from search_r1.agents.prompts import (TOOLCALL_CORRECTION, TOOLCALL_CORRECTION_ACCESS, TOOLCALL_DROPPED,
                                      TOOLCALL_FORCE, TOOLCALL_FORCE_CONTEXT, toolcall_messages)
from search_r1.agents.tools import AccessTool, SearchTool, Sources, ToolError
from search_r1.protocol import SEARCH_TOOL_NAMES, TOOL_CALL_RE, decode_tool_call, search_observation
from search_r1.rewards import extract_answer
from search_r1.rollout.backends import GenerationError
from search_r1.search.format import render_passages, split_title

ACCESS_TOOL_NAMES = ("access", "web_access", "visit")
TRANSCRIPTS = ("inline", "messages")
PHASE = "toolcall"
_ANSWER_RE = re.compile(r"<answer>.*?</answer>", re.DOTALL)
_CITE_RE = re.compile(r"\bDoc\s*(\d+)|\[(\d+)\]", re.IGNORECASE)
_ENV_RE = re.compile(r"<tool_response>.*?</tool_response>", re.DOTALL)


@dataclass(frozen=True)
class ToolCallConfig:
    """Settings of the tool-call agent. budgets.max_tool_calls is the search budget the prompt states;
    max_tokens_per_turn caps one model turn; transcript: inline | messages (module docstring);
    date: the date the prompt states (None: today); seed: sampling seed (temperature > 0)."""

    budgets: Budgets = field(default_factory=lambda: Budgets(max_steps=8, max_tool_calls=5, max_tokens=4096,
                                                             max_seconds=300.0))
    max_tokens_per_turn: int = 512
    temperature: float = 0.0
    transcript: str = "messages"
    date: str | None = None
    seed: int | None = 0

    def __post_init__(self):
        if self.transcript not in TRANSCRIPTS:
            raise ValueError(f"--transcript {self.transcript!r}; allowed values: {list(TRANSCRIPTS)}")
        if self.max_tokens_per_turn < 1:
            raise ValueError(f"--max-tokens-per-turn must be >= 1, got {self.max_tokens_per_turn}")
        if self.temperature < 0:
            raise ValueError(f"--temperature must be >= 0, got {self.temperature}")


class _Conversation:
    """The context sent to the model and the response text (model turns + tool responses, in order)."""

    def __init__(self, head: list[dict], inline: bool):
        self.head, self.inline = head, inline
        self.pieces: list[tuple[str, str]] = []  # (role, text): "model" turns and "env" tool responses

    def context(self) -> list[dict]:
        if self.inline:
            parts = [text for _, text in self.pieces]
            tail = [{"role": "assistant", "content": "".join(parts), "parts": parts}] if parts else []
            return self.head + tail
        msgs = list(self.head)
        for role, text in self.pieces:
            msgs.append({"role": "assistant", "content": text} if role == "model"
                        else {"role": "user", "content": text.strip()})
        return msgs

    def add(self, role: str, text: str) -> None:
        self.pieces.append((role, text))

    def compacted(self, k: int) -> "_Conversation":
        """A copy whose `k` newest tool responses are replaced by TOOLCALL_DROPPED (to fit the context)."""
        copy = _Conversation(self.head, self.inline)
        env_at = [i for i, (role, _) in enumerate(self.pieces) if role == "env"]
        dropped = set(env_at[len(env_at) - k:]) if k > 0 else set()
        note = search_observation(TOOLCALL_DROPPED, "tool_call")
        copy.pieces = [(role, note if i in dropped else text) for i, (role, text) in enumerate(self.pieces)]
        return copy

    def tool_responses(self) -> int:
        return sum(1 for role, _ in self.pieces if role == "env")

    def response(self) -> str:
        return "".join(text for _, text in self.pieces)


def first_tool_call(text: str) -> re.Match | None:
    """The first complete `<tool_call>` of a turn, unless a complete `<answer>` comes before it."""
    call, answer = TOOL_CALL_RE.search(text), _ANSWER_RE.search(text)
    if call is None or (answer is not None and answer.start() < call.start()):
        return None
    return call


class ToolCallAgent:
    """Runs the loop of the module docstring for one question at a time (thread-safe: no run state
    is kept on the agent, so a batch runs several questions at once).

    model: a ChatModel; search: a SearchTool; access: an AccessTool, or None to offer search only.
    """

    def __init__(self, model: ChatModel, search: SearchTool, access: AccessTool | None = None,
                 config: ToolCallConfig = ToolCallConfig()):
        self.model, self.search, self.access, self.config = model, search, access, config

    def run(self, question: str, console=None) -> dict:
        """Answer `question`; returns the result record (answer, sources, tool calls, budget, events;
        `overflow` and `error` as the module docstring says)."""
        cfg = self.config
        trace = Trace(console=console)
        meter = BudgetMeter(cfg.budgets, trace)
        run = _Run(self, trace, meter, Sources())
        conv = _Conversation(toolcall_messages(question, cfg.budgets.max_tool_calls, cfg.date,
                                               access=self.access is not None), cfg.transcript == "inline")
        final, forced, error, overflow = None, False, None, None
        try:
            try:
                final, forced = self._loop(run, conv)
            except ContextOverflow as exc:
                overflow = str(exc)
                trace.add(PHASE, "overflow", f"the context window is full ({exc}): asking for the final answer")
                forced = True
            if final is None:
                notice = TOOLCALL_FORCE_CONTEXT if overflow else TOOLCALL_FORCE
                conv, final, error = run.force_answer(conv, notice)
        except GenerationError as exc:
            error = f"server error: {exc}"
            trace.add(PHASE, "error", error)
        return run.result(question, conv, final, forced, error) | {"overflow": overflow}

    def _loop(self, run: "_Run", conv: _Conversation) -> tuple[str | None, bool]:
        """Turns until an answer (final text, False) or a spent budget (None, True: force the answer)."""
        trace, meter = run.trace, run.meter
        while True:
            spent = meter.exhausted()
            if spent:
                meter.hit(spent, PHASE, "asking for the final answer")
                return None, True
            reply = run.call(conv, ("</tool_call>",))
            call = first_tool_call(reply.text)
            if call is None:  # no tool call: this turn is the answer (or the model ended its turn)
                if reply.finish_reason == "length" and meter.spent("tokens"):
                    meter.hit("tokens", PHASE, "the turn was cut short; it is the final answer")
                return reply.text, False
            if meter.spent("tool_calls"):  # a call beyond the budget is not run
                trace.add(PHASE, "refused", "tool call over the search budget, not run")
                meter.hit("tool_calls", PHASE, "asking for the final answer")
                return None, True
            conv.add("env", search_observation(run.execute(call.group(1)), "tool_call"))
            if meter.spent("tool_calls"):
                meter.hit("tool_calls", PHASE, "asking for the final answer")
                return None, True


class _Run:
    """The mutable state of one question's run (tool log, sources, counters) and its steps."""

    def __init__(self, agent: ToolCallAgent, trace: Trace, meter: BudgetMeter, sources: Sources):
        self.agent, self.trace, self.meter, self.sources = agent, trace, meter, sources
        self.tool_log: list[dict] = []
        self.turns = self.bad_calls = 0

    def call(self, conv: _Conversation, stop: tuple, last: bool = False):
        cfg = self.agent.config
        budget = cfg.max_tokens_per_turn if last else max(1, min(cfg.max_tokens_per_turn, self.meter.tokens_left()))
        reply = self.agent.model.chat(conv.context(), stop=stop, max_tokens=budget, temperature=cfg.temperature,
                                      seed=cfg.seed)
        conv.add("model", reply.text)
        self.turns += 1
        self.meter.add_call(reply.completion_tokens)
        shown = " ".join(reply.text.split())
        self.trace.add(PHASE, "model", f"turn {self.turns} ({reply.completion_tokens} tokens, {reply.finish_reason}): "
                       f"{shown[:160]}{'...' if len(shown) > 160 else ''}", tokens=reply.completion_tokens,
                       finish=reply.finish_reason)
        return reply

    def force_answer(self, conv: _Conversation, notice: str) -> tuple[_Conversation, str | None, str | None]:
        """(conversation, final text, error) of the last turn, told `notice`. While the request does not
        fit the context window, the newest tool responses are replaced by a note, one more each try;
        when nothing is left to drop, the error says so and there is no final text."""
        for k in range(conv.tool_responses() + 1):
            trial = conv.compacted(k)
            trial.add("env", search_observation(notice, "tool_call"))
            try:
                return trial, self.call(trial, (), last=True).text, None
            except ContextOverflow as exc:
                self.trace.add(PHASE, "overflow", f"the final turn does not fit with {k} tool responses removed: {exc}")
                error = f"context overflow: {exc}"
        return conv, None, error

    def execute(self, payload: str) -> str:
        """Run one tool call; the text of its tool response (results, or the corrective message)."""
        agent = self.agent
        tools = "web_search" + (", access" if agent.access is not None else "")
        try:
            call = decode_tool_call(payload)
        except ValueError as exc:
            return self._correct(str(exc), payload)
        if call.name in SEARCH_TOOL_NAMES:
            query = call.arguments.get("query")
            if not isinstance(query, str) or not query.strip():
                return self._correct('web_search needs a non-empty "query" argument', payload)
            return self._search(query.strip())
        if call.name in ACCESS_TOOL_NAMES and agent.access is not None:
            target = next((call.arguments[k] for k in ("target", "url", "id") if call.arguments.get(k)), None)
            if not isinstance(target, (str, int)):
                return self._correct('access needs a "target" argument (a document number, id or URL)', payload)
            return self._access(str(target))
        return self._correct(f"there is no tool named {call.name!r}; the tools are {tools}", payload)

    def _correct(self, problem: str, payload: str) -> str:
        self.bad_calls += 1
        self.trace.add(PHASE, "invalid", problem, payload=payload[:300])
        self.tool_log.append({"tool": "invalid", "problem": problem, "payload": payload[:300]})
        access = TOOLCALL_CORRECTION_ACCESS if self.agent.access is not None else ""
        return TOOLCALL_CORRECTION.format(problem=problem, access=access)

    def _search(self, query: str) -> str:
        self.meter.tool_calls += 1
        try:
            hits = self.agent.search(query)
        except ToolError as exc:
            self.trace.add(PHASE, "search", f'"{query}" failed: {exc}', query=query)
            self.tool_log.append({"tool": "search", "query": query, "error": str(exc)})
            return f"Error: {exc}"
        shown = [self.sources.add(h["id"], split_title(h["contents"])[0], self.agent.search.kind, query) for h in hits]
        self.tool_log.append({"tool": "search", "query": query, "docs": [s.number for s in shown],
                              "ids": [s.id for s in shown]})
        listed = ", ".join(f"Doc {s.number} {s.title} [{s.id}]" for s in shown) or "no results"
        self.trace.add(PHASE, "search", f'"{query}" -> {listed}', query=query, ids=[s.id for s in shown])
        if not hits:
            return f"No results for: {query}"
        return render_passages([h["contents"] for h in hits], start=shown[0].number)

    def _access(self, target: str) -> str:
        self.meter.tool_calls += 1
        resolved = self.sources.resolve(target)
        try:
            doc = self.agent.access(resolved)
        except ToolError as exc:
            self.trace.add(PHASE, "access", f"{target} failed: {exc}", target=target)
            self.tool_log.append({"tool": "access", "target": target, "error": str(exc)})
            return f"Error: {exc}"
        source = self.sources.add(doc.id, doc.title, doc.kind, "access")
        self.tool_log.append({"tool": "access", "target": target, "id": doc.id, "doc": source.number})
        self.trace.add(PHASE, "access", f"{target} -> Doc {source.number} {doc.title} ({len(doc.text)} chars"
                       f"{', truncated' if doc.truncated else ''})", target=target, id=doc.id)
        return render_passages([f'"{doc.title}"\n{doc.text}'], start=source.number)

    def result(self, question: str, conv: _Conversation, final: str | None, forced: bool, error: str | None) -> dict:
        response = conv.response()
        answer = extract_answer(response)
        final_text = final or ""
        numbers = []
        for m in _CITE_RE.finditer(_ENV_RE.sub(" ", TOOL_CALL_RE.sub(" ", final_text))):
            n = int(m.group(1) or m.group(2))
            if self.sources.get(n) is not None and n not in numbers:
                numbers.append(n)
        cited = bool(numbers)
        sources = [self.sources.get(n) for n in numbers] if cited else list(self.sources.items)
        if answer is not None or final_text:
            self.trace.add(PHASE, "answer", f"{answer if answer is not None else '(no <answer> tags)'}"
                           + (" [forced]" if forced else "") + (f"; cites Doc {', '.join(map(str, numbers))}"
                                                                if cited else ""), answer=answer)
        return {
            "question": question, "answer": answer, "final_text": final_text, "response": response,
            "sources": [asdict(s) | {"label": s.label()} for s in sources], "cited": cited,
            "tool_calls": self.tool_log, "turns": self.turns,
            "searches": sum(1 for t in self.tool_log if t["tool"] == "search"),
            "search_queries": [t["query"] for t in self.tool_log if t["tool"] == "search"],
            "invalid_calls": self.bad_calls, "forced_answer": forced,
            "format_valid": self.bad_calls == 0 and answer is not None and error is None,
            "budget": self.meter.state(), "events": self.trace.events, "error": error,
        }


def agent_from_flags(args, model: ChatModel, search: SearchTool, access: AccessTool,
                     budgets: Budgets) -> ToolCallAgent:
    """The agent `python -m search_r1.agents.toolcall`'s flags describe (search_r1/agents/cli.py)."""
    transcript = args.transcript if args.transcript != "auto" else ("messages" if args.base_url else "inline")
    config = ToolCallConfig(budgets=budgets, max_tokens_per_turn=args.max_tokens_per_turn,
                            temperature=args.temperature, transcript=transcript, date=args.date, seed=args.seed)
    return ToolCallAgent(model, search, access if args.tools == "search,access" else None, config)


def main(argv=None) -> int:
    from search_r1.agents.cli import run_cli

    return run_cli("toolcall", agent_from_flags, argv, epilog=__doc__)


if __name__ == "__main__":
    sys.exit(main())

"""Planner / writer report agent with a memory bank (ASearcher / WebWeaver style):
`python -m search_r1.agents.weaver`.

    python -m search_r1.agents.weaver --model smollm2-135m-instruct --retriever-index default \\
        --question "Which river flows through Soforek?" --out runs/soforek     # report.md + trace.json
    python -m search_r1.agents.weaver --model my-model --base-url http://127.0.0.1:8001 \\
        --retriever-url http://127.0.0.1:8000 --data test.parquet --out runs/weaver --concurrency 4

start -> planner -> writer -> answer:

- Planner: `((search -> access -> summary) * n -> write_outline) * m -> terminate`, one action per
  turn (`<search> q </search>`, `<access> id-or-url <goal> g </goal> </access>`,
  `<write_outline></write_outline>`, `<terminate></terminate>`). An access reads the document
  (retriever `/access` by id, or a guarded web fetch) and a separate summarizer call, which sees ONLY
  the page and the goal, answers Rational / Evidence / Summary; the summary enters the memory bank
  under the next id. `write_outline` gives the planner the summaries since the last outline
  (`memory.MemoryBank.since_flag`) and the current outline; its new outline cites summaries as
  `<cite><id>1</id>, <id>3</id></cite>` and the flag advances. The step budget forces `terminate`;
  summaries no outline has taken in yet get one last outline on the way out.
- Writer: per outline section, a fresh conversation: `<retrieve><id>1</id></retrieve>` returns
  exactly the summaries asked for (unknown ids are named), `<write> text </write>` writes the section,
  `<write_terminate></write_terminate>` ends the writer. The report keeps citations resolvable: its
  reference list maps every cited id to its source (title, doc id or URL) and goal.
- Answer: the short final answer from the report, the outline and the planner's history.

State (memory bank, counters, outline, sections, report, the planner's messages, budgets, events)
is saved to `trace.json` beside `report.md` after every step (atomically); running again with the
same --out resumes from it. An unparseable action gets a corrective message, an unknown id is
reported back to the model; neither crashes the run.

When a call outgrows the model's context window (a local model's limit, a server's 400), the phase
ends with what the memory bank holds (`overflows` in the trace): the planner terminates (the last
outline is written from the summaries once more, or the current outline is kept), the writer skips
the section, the answer is asked again from the report alone; a page too long for the summarizer is
an error the planner reads. Only when the answer cannot fit even so does the run end with an `error`.
A server failure (401/403, another 4xx, down after its retries) stops the run with an `error` in the
failed phase; the saved state keeps that phase, so running again retries the failed step.
"""
from __future__ import annotations

import json
import re
import sys
from dataclasses import dataclass, field
from pathlib import Path

from search_r1.agents import prompts as P
from search_r1.agents.budget import Budgets, BudgetMeter, Trace
from search_r1.agents.chat import ChatModel, ContextOverflow
from search_r1.agents.memory import MemoryBank, cited_ids, ids_in, outline_sections, parse_summary, render_citations
from search_r1.agents.tools import AccessTool, SearchTool, Sources, ToolError
from search_r1.evaluation.runner import write_atomic
from search_r1.rewards import extract_answer
from search_r1.rollout.backends import GenerationError
from search_r1.search.format import split_title

TRACE_FILE, REPORT_FILE = "trace.json", "report.md"
STATE_VERSION = 1
PLANNER_STOPS = ("</search>", "</access>", "</write_outline>", "</terminate>")
WRITER_STOPS = ("</retrieve>", "</write>", "</write_terminate>")
_PLANNER_RE = re.compile(r"<(search|access|write_outline|terminate)>(.*?)</\1>|<(write_outline|terminate)\s*/>",
                         re.DOTALL)
_WRITER_RE = re.compile(r"<(retrieve|write|write_terminate)>(.*?)</\1>|<(write_terminate)\s*/>", re.DOTALL)
_GOAL_RE = re.compile(r"<goal>(.*?)</goal>", re.DOTALL)
_OUTLINE_RE = re.compile(r"<outline>(.*?)</outline>", re.DOTALL)


@dataclass(frozen=True)
class WeaverConfig:
    """Settings of the report agent. budgets: steps = planner actions, tool_calls = searches + reads,
    tokens / seconds over the whole run. planner_tokens caps a planner turn; long_tokens a summary,
    outline, section or answer; writer_steps: model turns per section; page_chars: characters of a
    page the summarizer reads; notes_chars: characters of planner history the answer step reads."""

    budgets: Budgets = field(default_factory=lambda: Budgets(max_steps=12, max_tool_calls=10, max_tokens=16384,
                                                             max_seconds=900.0))
    planner_tokens: int = 256
    long_tokens: int = 768
    writer_steps: int = 4
    page_chars: int = 6000
    notes_chars: int = 4000
    temperature: float = 0.0
    date: str | None = None
    seed: int | None = 0

    def __post_init__(self):
        for name in ("planner_tokens", "long_tokens", "writer_steps", "page_chars", "notes_chars"):
            if getattr(self, name) < 1:
                raise ValueError(f"--{name.replace('_', '-')} must be >= 1, got {getattr(self, name)}")


def parse_planner_action(text: str) -> tuple[str, str, str]:
    """(kind, target-or-query, goal) of the first complete planner action; kind "invalid" with the
    problem in place of the target when there is none or the access lacks a target or a goal."""
    m = _PLANNER_RE.search(text)
    if m is None:
        return "invalid", "no <search>, <access>, <write_outline> or <terminate> action", ""
    kind, body = m.group(1) or m.group(3), (m.group(2) or "")
    if kind == "search":
        return ("search", body.strip(), "") if body.strip() else ("invalid", "the search query is empty", "")
    if kind == "access":
        goal = _GOAL_RE.search(body)
        target = _GOAL_RE.sub(" ", body).strip()
        if goal is None or not goal.group(1).strip():
            return "invalid", "an access needs a goal: <access> id <goal> what to learn </goal> </access>", ""
        if not target:
            return "invalid", "an access needs a document id or URL before the <goal>", ""
        return "access", target, goal.group(1).strip()
    return kind, body.strip(), ""


class WeaverAgent:
    """The report agent of the module docstring. `run(question, out_dir)` resumes a saved run."""

    def __init__(self, model: ChatModel, search: SearchTool, access: AccessTool, config: WeaverConfig = WeaverConfig()):
        self.model, self.search, self.access, self.config = model, search, access, config

    def run(self, question: str, out_dir, console=None) -> dict:
        out = Path(out_dir)
        out.mkdir(parents=True, exist_ok=True)
        state = self._load(out, question)
        run = _WeaverRun(self, state, out, console)
        if state["phase"] != "done":
            state["error"] = None  # a run stopped by a server error retries the failed step
        try:
            while state["phase"] != "done":
                phase = state["phase"]
                try:
                    {"planner": run.planner, "writer": run.writer, "answer": run.answer}[phase]()
                except ContextOverflow as exc:
                    run.overflow(phase, exc)
        except GenerationError as exc:
            state["error"] = f"server error in the {state['phase']}: {exc}"
            run.trace.add(state["phase"], "error", state["error"])
        run.save()
        return run.result()

    def _load(self, out: Path, question: str) -> dict:
        path = out / TRACE_FILE
        if path.is_file():
            state = json.loads(path.read_text(encoding="utf-8"))
            if state.get("version") != STATE_VERSION or state.get("question") != question:
                raise ValueError(f"{path} holds a run of another question or format ({state.get('question')!r}); "
                                 "use another --out, or delete it to start over")
            return state
        return {"version": STATE_VERSION, "question": question, "phase": "planner", "error": None,
                "planner": {"messages": [], "terminated": False}, **MemoryBank().state(), "sources": [],
                "outline": "", "outlines": [], "writer": {"sections": None, "index": 0, "messages": [],
                                                          "terminated": False},
                "report": "", "answer": None, "final_text": "", "invalid_actions": 0, "budget": {}, "events": [],
                "overflows": [], "answer_compact": False}


class _WeaverRun:
    """One question's run over its saved state (every method leaves the state consistent and saved)."""

    def __init__(self, agent: WeaverAgent, state: dict, out: Path, console):
        self.agent, self.state, self.out, self.cfg = agent, state, out, agent.config
        state.setdefault("overflows", [])  # traces saved before overflows were recorded
        state.setdefault("answer_compact", False)
        self.trace = Trace(state["events"], console, t_offset=state["budget"].get("seconds", 0.0))
        self.meter = BudgetMeter(self.cfg.budgets, self.trace, state["budget"])
        self.bank = MemoryBank(state["memory_bank"], state["summary_id_counter"], state["summary_id_flag"])
        self.sources = Sources(state["sources"])
        if state["events"]:
            self.trace.add(state["phase"], "resume", f"resuming from {out / TRACE_FILE} in the {state['phase']} phase")

    # -- plumbing ---------------------------------------------------------------------------------
    def save(self) -> None:
        s = self.state
        s.update(self.bank.state(), sources=self.sources.to_json(), budget=self.meter.state(), events=self.trace.events)
        write_atomic(self.out / TRACE_FILE, json.dumps(s, indent=1, ensure_ascii=False) + "\n")

    def call(self, role: str, messages: list[dict], stop: tuple, max_tokens: int, step: bool = False):
        budget = max(1, min(max_tokens, self.meter.tokens_left()))
        reply = self.agent.model.chat(messages, stop=stop, max_tokens=budget, temperature=self.cfg.temperature,
                                      seed=self.cfg.seed)
        self.meter.add_call(reply.completion_tokens, step=step)
        return reply

    def overflow(self, phase: str, exc: ContextOverflow) -> None:
        """End `phase` (or its current step) with what the memory holds; see the module docstring."""
        s = self.state
        s["overflows"].append({"phase": phase, "message": str(exc)})
        if phase == "planner" and not s["planner"]["terminated"]:
            s["planner"]["terminated"] = True
            then = "the planner ends with what the memory bank holds"
        elif phase == "planner":  # the last outline did not fit either
            s["phase"] = "writer"
            then = "the writer writes from the current outline"
        elif phase == "writer":
            w = s["writer"]
            w["sections"][w["index"]]["status"] = "not written (context overflow)"
            w["index"] += 1
            w["messages"] = []
            then = "skipping the section"
        elif not s["answer_compact"]:
            s["answer_compact"] = True
            then = "answering from the report alone"
        else:
            s["error"] = f"context overflow in the answer: {exc}"
            s["phase"] = "done"
            then = "no answer"
        self.trace.add(phase, "overflow", f"the context window is full ({exc}): {then}")
        self.save()

    def _invalid(self, phase: str, problem: str) -> None:
        self.state["invalid_actions"] += 1
        self.trace.add(phase, "invalid", problem)

    # -- planner ----------------------------------------------------------------------------------
    def planner(self) -> None:
        s, cfg = self.state, self.cfg
        msgs = s["planner"]["messages"]
        if not msgs:
            b = cfg.budgets
            msgs += [{"role": "system", "content": P.PLANNER_SYSTEM.format(
                        date=cfg.date or P.today(), steps=b.max_steps, tool_calls=b.max_tool_calls)},
                     {"role": "user", "content": P.PLANNER_USER.format(question=s["question"])}]
        while not s["planner"]["terminated"]:
            spent = self.meter.exhausted()
            if spent:
                self.meter.hit(spent, "planner", "terminating the planner")
                break
            reply = self.call("planner", msgs, PLANNER_STOPS, cfg.planner_tokens, step=True)
            msgs.append({"role": "assistant", "content": reply.text})
            kind, arg, goal = parse_planner_action(reply.text)
            if kind == "invalid":
                self._invalid("planner", arg)
                observation = P.PLANNER_CORRECTION.format(problem=arg)
            elif kind == "terminate":
                self.trace.add("planner", "terminate", "the planner ends")
                s["planner"]["terminated"] = True
                observation = "Planning finished."
            elif kind == "write_outline":
                observation = self.write_outline()
            elif self.meter.spent("tool_calls"):
                self.meter.hit("tool_calls", "planner", "refusing further searches and reads")
                observation = (f"The budget of {cfg.budgets.max_tool_calls} searches and reads is used up. Write the "
                               "outline with <write_outline></write_outline>, or <terminate></terminate>.")
            else:
                observation = self.do_search(arg) if kind == "search" else self.do_access(arg, goal)
            msgs.append({"role": "user", "content": f"<information>{observation}</information>"})
            self.save()
        if self.bank.since_flag() and not self.meter.exhausted(("tokens", "seconds")):
            self.trace.add("planner", "outline", "summaries not in the outline yet: writing it once more")
            self.write_outline()
        s["phase"] = "writer"
        self.save()

    def do_search(self, query: str) -> str:
        self.meter.tool_calls += 1
        try:
            hits = self.agent.search(query)
        except ToolError as exc:
            self.trace.add("planner", "search", f'"{query}" failed: {exc}', query=query)
            return f"Error: {exc}"
        lines = []
        for h in hits:
            title, text = split_title(h["contents"])
            src = self.sources.add(h["id"], title, self.agent.search.kind, query)
            lines.append(f"Doc {src.number} (id: {h['id']}) {title}: {text}")
        listed = ", ".join(f"[{h['id']}]" for h in hits) or "no results"
        self.trace.add("planner", "search", f'"{query}" -> {listed}', query=query, ids=[h["id"] for h in hits])
        return "\n".join(lines) if lines else f"No results for: {query}"

    def do_access(self, target: str, goal: str) -> str:
        self.meter.tool_calls += 1
        try:
            doc = self.agent.access(self.sources.resolve(target))
        except ToolError as exc:
            self.trace.add("planner", "access", f"{target} failed: {exc}", target=target)
            return f"Error: {exc}"
        # The summarizer sees ONLY the page and the goal: no question, no history, no other summary.
        page = f"{doc.title}\n{doc.text[: self.cfg.page_chars]}".strip()
        messages = [{"role": "system", "content": P.SUMMARIZER_SYSTEM},
                    {"role": "user", "content": P.SUMMARIZER_USER.format(goal=goal, page=page)}]
        try:
            parts = parse_summary(self.call("summarizer", messages, ("</summary>",), self.cfg.long_tokens).text)
        except ContextOverflow as exc:
            self.trace.add("planner", "access", f"{target}: the page does not fit the summarizer's context ({exc})",
                           target=target)
            return (f"Error: {doc.title} is too long for the model's context window; read another document "
                    "or write the outline.")
        entry = self.bank.add({"kind": doc.kind, "id": doc.id, "title": doc.title}, goal, parts["rational"],
                              parts["evidence"], parts["summary"])
        self.trace.add("planner", "summary", f"#{entry.id} {entry.label()} for goal {goal!r}: "
                       f"{entry.summary[:120]}", id=entry.id, source=entry.source, parsed=parts["parsed"])
        return f"Summary <id>{entry.id}</id> of {entry.label()} (goal: {goal}):\n{entry.summary}"

    def write_outline(self) -> str:
        s = self.state
        new = self.bank.since_flag()
        if not new and s["outline"]:
            self._invalid("planner", "write_outline with no new summaries")
            return "No new summaries since the last outline: search and read more first, or terminate."
        summaries = "\n".join(f"[{e.id}] {e.label()} (goal: {e.goal}): {e.summary}" for e in new) or "(none)"
        messages = [{"role": "system", "content": P.OUTLINE_SYSTEM},
                    {"role": "user", "content": P.OUTLINE_USER.format(
                        question=s["question"], outline=s["outline"] or "(none yet)", summaries=summaries)}]
        reply = self.call("outline", messages, ("</outline>",), self.cfg.long_tokens)
        m = _OUTLINE_RE.search(reply.text if "<outline>" in reply.text else "<outline>" + reply.text)
        outline = (m.group(1) if m else reply.text).strip()
        cites = cited_ids(outline)
        _, unknown = self.bank.lookup(cites)
        s["outline"] = outline
        s["outlines"].append({"version": len(s["outlines"]) + 1, "outline": outline, "cites": cites,
                              "unknown": unknown, "took_in": [e.id for e in new]})
        self.bank.advance_flag()
        self.trace.add("planner", "outline", f"v{len(s['outlines'])}: {len(outline_sections(outline))} sections, "
                       f"cites {cites}" + (f", unknown ids {unknown}" if unknown else ""), cites=cites, unknown=unknown)
        note = (f" It cites ids the memory bank does not hold: {unknown} (it holds 1-{self.bank.summary_id_counter});"
                " cite only summary ids you were given." if unknown else "")
        return f"Outline version {len(s['outlines'])} written, citing {cites}.{note}\n{outline}"

    # -- writer -----------------------------------------------------------------------------------
    def writer(self) -> None:
        s, w = self.state, self.state["writer"]
        if w["sections"] is None:
            w["sections"] = [{"heading": x["heading_text"], "cites": x["cites"], "retrieved": [], "text": "",
                              "status": "pending"} for x in outline_sections(s["outline"])]
        while w["index"] < len(w["sections"]) and not w["terminated"]:
            section = w["sections"][w["index"]]
            spent = self.meter.exhausted(("tokens", "seconds"))
            if spent:
                self.meter.hit(spent, "writer", "leaving the remaining sections unwritten")
                break
            self.write_section(section, w["index"])
            w["index"] += 1
            w["messages"] = []
            self.save()
        for section in w["sections"][w["index"]:]:
            section["status"] = "not written (writer stopped)"
        s["report"] = self.report()
        s["phase"] = "answer"
        write_atomic(self.out / REPORT_FILE, s["report"])
        self.save()

    def write_section(self, section: dict, k: int) -> None:
        s, w = self.state, self.state["writer"]
        msgs = w["messages"]
        if not msgs:
            cites = ", ".join(f"<id>{i}</id>" for i in section["cites"])
            msgs += [{"role": "system", "content": P.WRITER_SYSTEM},
                     {"role": "user", "content": P.WRITER_USER.format(
                         question=s["question"], outline=s["outline"], k=k + 1, n=len(w["sections"]),
                         heading=section["heading"], cites=f"<cite>{cites}</cite>" if cites else "none")}]
        turns = sum(1 for m in msgs if m["role"] == "assistant")
        while turns < self.cfg.writer_steps:
            reply = self.call("writer", msgs, WRITER_STOPS, self.cfg.long_tokens)
            turns += 1
            msgs.append({"role": "assistant", "content": reply.text})
            m = _WRITER_RE.search(reply.text)
            kind = (m.group(1) or m.group(3)) if m else "invalid"
            if kind == "write":
                section.update(text=m.group(2).strip(), status="written")
                self.trace.add("writer", "write", f"section {k + 1} {section['heading']!r}: {len(section['text'])} "
                               f"chars, cites {cited_ids(section['text'])}")
                return
            if kind == "write_terminate":
                w["terminated"] = True
                section["status"] = "not written (writer stopped)"
                self.trace.add("writer", "terminate", f"the writer stops at section {k + 1}")
                return
            if kind == "retrieve":
                ids = ids_in(m.group(2))
                found, unknown = self.bank.lookup(ids)
                section["retrieved"] = list(dict.fromkeys(section["retrieved"] + [e.id for e in found]))
                self.trace.add("writer", "retrieve", f"section {k + 1}: ids {ids}"
                               + (f", unknown {unknown}" if unknown else ""), ids=ids, unknown=unknown)
                body = "\n".join(f"[{e.id}] {e.label()} (goal: {e.goal}): {e.summary}" for e in found)
                if unknown:
                    body += (f"\nUnknown ids: {unknown}; the memory bank holds ids 1-{self.bank.summary_id_counter}.")
                observation = body.strip() or "Nothing retrieved: give ids as <retrieve><id>1</id></retrieve>."
            else:
                problem = "no <retrieve>, <write> or <write_terminate> action"
                self._invalid("writer", problem)
                observation = P.WRITER_CORRECTION.format(problem=problem)
            msgs.append({"role": "user", "content": f"<information>{observation}</information>"})
            self.save()
        section["status"] = f"not written ({self.cfg.writer_steps} turns without <write>)"
        self.trace.add("writer", "skip", f"section {k + 1}: {section['status']}")

    def report(self) -> str:
        """report.md: the written sections (citations as [n]) and the reference list of cited ids."""
        s = self.state
        lines, used = [f"# {s['question']}", ""], []
        for section in s["writer"]["sections"] or []:
            if not section["text"]:
                continue
            cites = cited_ids(section["text"])
            lines += [f"## {section['heading']}", "", render_citations(section["text"]).strip()]
            if not cites and section["retrieved"]:  # keep the evidence the section was written from visible
                lines.append("Sources: " + "".join(f"[{i}]" for i in section["retrieved"]))
                cites = section["retrieved"]
            lines.append("")
            used += cites
        found, unknown = self.bank.lookup(list(dict.fromkeys(used)))
        if found or unknown:
            lines += ["## References", ""]
            lines += [f"[{e.id}] {e.label()}; goal: {e.goal}" for e in sorted(found, key=lambda e: e.id)]
            lines += [f"[{i}] (cited, but the memory bank has no summary {i})" for i in unknown]
        if len(lines) == 2:
            lines.append("(no section was written)")
        return "\n".join(lines).rstrip() + "\n"

    # -- answer -----------------------------------------------------------------------------------
    def answer(self) -> None:
        s = self.state
        history = "\n".join(f"{m['role']}: {m['content']}" for m in s["planner"]["messages"][2:])
        notes = history[-self.cfg.notes_chars:] if history else "(none)"
        report, outline = s["report"], s["outline"] or "(none)"
        if s["answer_compact"]:  # the full prompt overflowed the context: the report's head alone
            notes, outline, report = "(omitted)", "(omitted)", report[: self.cfg.notes_chars]
        messages = [{"role": "system", "content": P.ANSWER_SYSTEM},
                    {"role": "user", "content": P.ANSWER_USER.format(question=s["question"], report=report,
                                                                       outline=outline, notes=notes)}]
        reply = self.call("answer", messages, ("</answer>",), self.cfg.long_tokens)
        s["final_text"] = reply.text
        s["answer"] = extract_answer(reply.text)
        self.trace.add("answer", "answer", s["answer"] if s["answer"] is not None else "(no <answer> tags)")
        s["phase"] = "done"

    def result(self) -> dict:
        s = self.state
        searches = [e for e in self.trace.events if e["kind"] == "search"]
        sections = s["writer"]["sections"] or []
        return {
            "question": s["question"], "answer": s["answer"], "final_text": s["final_text"],
            "response": s["final_text"], "report": s["report"], "outline": s["outline"],
            "memory_bank": s["memory_bank"], "sections": sections,
            "searches": len(searches), "search_queries": [e.get("query", "") for e in searches],
            "turns": self.meter.steps, "invalid_actions": s["invalid_actions"],
            "format_valid": s["answer"] is not None and s["invalid_actions"] == 0 and not s["error"],
            "budget": self.meter.state(), "error": s["error"], "report_path": str(self.out / REPORT_FILE),
            "overflow": "; ".join(f"{o['phase']}: {o['message']}" for o in s["overflows"]) or None,
        }


def agent_from_flags(args, model: ChatModel, search: SearchTool, access: AccessTool, budgets: Budgets) -> WeaverAgent:
    """The agent `python -m search_r1.agents.weaver`'s flags describe (search_r1/agents/cli.py)."""
    config = WeaverConfig(budgets=budgets, planner_tokens=args.planner_tokens, long_tokens=args.long_tokens,
                          writer_steps=args.writer_steps, page_chars=args.page_chars, temperature=args.temperature,
                          date=args.date, seed=args.seed)
    return WeaverAgent(model, search, access, config)


def main(argv=None) -> int:
    from search_r1.agents.cli import run_cli

    return run_cli("weaver", agent_from_flags, argv, epilog=__doc__)


if __name__ == "__main__":
    sys.exit(main())

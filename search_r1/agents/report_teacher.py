"""Demonstrations of the report agent's formats, for teaching a small model to play its roles.

SmolLM2-135M never writes a valid planner action (docs/agents/report.md), so the report agent never
writes a report with it. The project taught the same model the Search-R1 format with a supervised
warm-start on demonstrations built from the synthetic world (search_r1.trainer.warmstart); this
module builds the report agent's equivalent. `ReportTeacher` is a `ChatModel` that plays every role of
the agent (search_r1.agents.weaver) correctly on the synthetic world's questions, from their records
(subject, bridge entity, follow-up question, gold answer), and `Recorder` keeps each call's messages
and reply. Run the real agent with `Recorder(ReportTeacher(rows))` on a training question and every
recorded call is a demonstration in exactly the format the agent sends and parses, since the agent
itself wrote the prompts and read the replies:

    planner     <search> question </search> -> <access> Doc n <goal> question </goal> </access>
                -> (two-hop) <search> follow-up </search> -> <access> ... </access>
                -> <write_outline></write_outline> -> <terminate></terminate>
    summarizer  <rational> ... </rational> <evidence> the page's sentences that share a content word
                with the goal </evidence> <summary> the page's title: those sentences (the title names
                the "he" or "it" of a sentence) </summary>
    outline     <outline> one section per summary (headed by the entity its hop looked up: the subject,
                then the bridge; the summary, cited) and an Answer section citing them all </outline>
    writer      <retrieve> the section's cited ids </retrieve> -> <write> the section's points </write>
    answer      <answer> gold </answer>

The teacher reads only what the agent shows it, except that it recognises the question and so knows
which entities a useful page must name (the subject and bridge, the bridge and answer): where the
retriever did not return such a page, it stops early and `demonstration_run` rejects the run (as the
search warm-start keeps only demonstrations whose evidence was retrieved).
"""
from __future__ import annotations

import copy
import re
from dataclasses import dataclass, field

from search_r1.agents.prompts import role_of
from search_r1.agents.chat import ChatReply
from search_r1.agents.memory import outline_sections

_QUESTION_RE = re.compile(r"^Question: (.*)$", re.MULTILINE)
_DOC_RE = re.compile(r"^Doc (\d+) \(id: ([^)]*)\) (.*)$", re.MULTILINE)
_SUMMARY_OBS_RE = re.compile(r"Summary <id>(\d+)</id> of .*? \(goal: (.*?)\):\n", re.DOTALL)
_NEW_SUMMARY_RE = re.compile(r"^\[(\d+)\] (.*?) \((?:doc [^)]*|<[^>]*>)\) \(goal: (.*?)\): (.*)$", re.MULTILINE)
_SENTENCE_RE = re.compile(r"(?<=[.!?])\s+")
_WORD_RE = re.compile(r"[a-z0-9]+")
_STOPWORDS = frozenset("a an the of in on at to is was are were which what who whom where when how did does do "
                       "for from by with and or it its this that as be".split())


def content_stems(text: str) -> set[str]:
    """Content words cut to 5 letters, a crude stem: "founder" and "founded" meet at "found"."""
    return {w[:5] for w in _WORD_RE.findall(text.lower()) if w not in _STOPWORDS}


def relevant_sentences(page: str, goal: str, limit: int = 3) -> str:
    """The page's sentences sharing a content stem with the goal, in page order (at most `limit`); the
    first sentence when none does."""
    sentences = [s.strip() for line in page.splitlines() for s in _SENTENCE_RE.split(line) if s.strip()]
    want = content_stems(goal)
    chosen = [s for s in sentences if content_stems(s) & want][:limit]
    return " ".join(chosen or sentences[:1])


@dataclass(frozen=True)
class Hop:
    """One search-and-read round: the query, the entities a useful page names, the goal of the read."""

    query: str
    needs: tuple[str, ...]

    @property
    def goal(self) -> str:
        return self.query


def hops_of(row: dict) -> list[Hop]:
    """The rounds a question needs: single-hop, the question itself (the page names the subject and the
    answer); two-hop, the question (subject and bridge) and then the follow-up (bridge and answer)."""
    gold = row["golden_answers"][0]
    if int(row.get("hops", 1)) == 2:
        return [Hop(row["question"], (row["subject"], row["bridge"])), Hop(row["follow_up"], (row["bridge"], gold))]
    return [Hop(row["question"], (row["subject"], gold))]


class ReportTeacher:
    """A ChatModel playing the report agent's roles on known questions (see the module docstring)."""

    name = "report-teacher"

    def __init__(self, rows: list[dict]):
        self.rows = {r["question"].strip(): r for r in rows}

    def chat(self, messages, *, stop=(), max_tokens=512, temperature=0.0, seed=None) -> ChatReply:
        role = role_of(messages)
        text = getattr(self, role)(messages)
        cuts = [(text.find(s) + len(s), s) for s in stop if s in text]
        hit = ""
        if cuts:
            end, hit = min(cuts)
            text = text[:end]
        return ChatReply(text, "stop" if hit else "end", hit, 0, len(text.split()))

    # -- roles ------------------------------------------------------------------------------------
    def _row(self, text: str) -> dict | None:
        m = _QUESTION_RE.search(text)
        return self.rows.get(m.group(1).strip()) if m else None

    def planner(self, messages: list[dict]) -> str:
        row = self._row(messages[1]["content"])
        if row is None:
            return "<terminate></terminate>"
        history = messages[2:]
        summarized_goals = {m.group(2) for msg in history if msg["role"] == "user"
                            for m in _SUMMARY_OBS_RE.finditer(msg["content"])}
        if any(msg["role"] == "user" and "Outline version" in msg["content"] for msg in history):
            return "<terminate></terminate>"
        for hop in hops_of(row):
            if hop.goal in summarized_goals:
                continue
            results = self._results_of(history, hop.query)
            if results is None:
                return f"<search> {hop.query} </search>"
            doc = next((number for number, text in results if all(e.lower() in text.lower() for e in hop.needs)),
                       None)
            if doc is None:  # the retriever did not show a page with the evidence: stop here
                break
            return f"<access> Doc {doc} <goal> {hop.goal} </goal> </access>"
        if summarized_goals:
            return "<write_outline></write_outline>"
        return "<terminate></terminate>"

    @staticmethod
    def _results_of(history: list[dict], query: str) -> list[tuple[str, str]] | None:
        """(doc number, title and text) of the latest search for `query`; None if it was not searched."""
        for i in range(len(history) - 1, 0, -1):
            if history[i - 1]["role"] == "assistant" and history[i - 1]["content"].strip() == f"<search> {query} </search>":
                return [(m.group(1), m.group(3)) for m in _DOC_RE.finditer(history[i]["content"])]
        return None

    def summarizer(self, messages: list[dict]) -> str:
        user = messages[1]["content"]
        goal, _, page = user.partition("\n\nDocument:\n")
        goal = goal.removeprefix("Goal: ").strip()
        title = page.splitlines()[0].strip().strip('"') if page.strip() else "the document"
        sentence = relevant_sentences("\n".join(page.splitlines()[1:]) or page, goal)
        return (f"<rational> The sentences of {title} that bear on the goal. </rational>\n"
                f"<evidence> {sentence} </evidence>\n<summary> {title}: {sentence} </summary>")

    def outline(self, messages: list[dict]) -> str:
        user = messages[1]["content"]
        row = self._row(user)
        current = user.split("Current outline:\n", 1)[1].split("\n\nNew summaries:\n", 1)[0].strip()
        new = _NEW_SUMMARY_RE.findall(user.split("\n\nNew summaries:\n", 1)[1])
        lines = [] if current.startswith("(none") else [ln for ln in current.splitlines() if ln.strip()]
        lines = lines[: next((i for i, ln in enumerate(lines) if ln == "## Answer"), len(lines))]  # re-added last
        about = {hop.goal: hop.needs[0] for hop in hops_of(row)} if row is not None else {}
        for sid, title, goal, summary in new:  # a section per summary, headed by what its hop looked up
            lines += [f"## {about.get(goal.strip(), title)}", f"- {summary.strip()} <cite><id>{sid}</id></cite>"]
        ids = sorted({int(i) for ln in lines for i in re.findall(r"<id>(\d+)</id>", ln)})
        if row is not None and ids:
            cites = ", ".join(f"<id>{i}</id>" for i in ids)
            lines += ["## Answer", f"- The answer is {row['golden_answers'][0]}. <cite>{cites}</cite>"]
        return "<outline>\n" + "\n".join(lines) + "\n</outline>"

    def writer(self, messages: list[dict]) -> str:
        user = messages[1]["content"]
        outline = user.split("Outline:\n", 1)[1].split("\n\nWrite section ", 1)[0]
        k = int(re.search(r"Write section (\d+) of", user).group(1))
        sections = outline_sections(outline)
        section = sections[k - 1] if k <= len(sections) else {"body": "", "cites": []}
        retrieved = any(m["role"] == "assistant" and m["content"].startswith("<retrieve>") for m in messages[2:])
        if section["cites"] and not retrieved:
            return "<retrieve>" + ", ".join(f"<id>{i}</id>" for i in section["cites"]) + "</retrieve>"
        points = " ".join(ln.strip().removeprefix("- ").strip() for ln in section["body"].splitlines() if ln.strip())
        return f"<write> {points} </write>" if points else "<write_terminate></write_terminate>"

    def answer(self, messages: list[dict]) -> str:
        row = self._row(messages[1]["content"])
        return f"<answer> {row['golden_answers'][0]} </answer>" if row else "<answer> unknown </answer>"

    def toolcall(self, messages: list[dict]) -> str:
        raise ValueError("ReportTeacher plays the report agent's roles, not the tool-call agent's")


@dataclass
class Recorder:
    """A ChatModel wrapper keeping every call: {"role", "messages" (a copy), "reply"}."""

    model: object
    calls: list[dict] = field(default_factory=list)

    @property
    def name(self) -> str:
        return self.model.name

    def chat(self, messages, **kw) -> ChatReply:
        reply = self.model.chat(messages, **kw)
        self.calls.append({"role": role_of(messages), "messages": copy.deepcopy(messages), "reply": reply.text})
        return reply


def demonstration_run(result: dict, row: dict) -> str | None:
    """Why a teacher's run is not a demonstration to keep (None when it is): it must answer with the
    gold answer, read a page for every hop, write every outline section, and make no invalid action."""
    hops = len(hops_of(row))
    sections = result.get("sections") or []
    if result.get("error"):
        return f"error: {result['error']}"
    if result.get("answer") not in row["golden_answers"]:
        return "evidence_not_retrieved"  # the teacher stops early without it, so it cannot answer
    if len(result.get("memory_bank") or []) < hops:
        return "evidence_not_retrieved"
    if not any(g.lower() in e["summary"].lower() for e in result["memory_bank"] for g in row["golden_answers"]):
        return "answer_not_in_summaries"  # the report could not show where the answer came from
    if len(sections) < hops + 1 or any(s.get("status") != "written" for s in sections):
        return "sections_missing"
    if result.get("invalid_actions"):
        return "invalid_action"
    return None

"""The report agent's memory bank, citations and outline sections.

Every page summary gets the next integer id (`summary_id_counter`, from 1). `summary_id_flag` is the
last id an outline has taken in: the planner's next `write_outline` sees the summaries with ids in
`(summary_id_flag, summary_id_counter]`, then the flag advances to the counter. Outlines and report
sections cite summaries as `<cite><id>1</id>, <id>3</id></cite>`; the writer fetches them with
`<retrieve><id>1</id>, <id>3</id></retrieve>`. Ids the bank does not hold are returned as unknown,
for the agent to tell the model.
"""
from __future__ import annotations

import re
from dataclasses import asdict, dataclass

CITE_RE = re.compile(r"<cite>(.*?)</cite>", re.DOTALL)
ID_RE = re.compile(r"<id>\s*(\d+)\s*</id>")
_PART_RE = {name: re.compile(rf"<{name}>(.*?)</{name}>", re.DOTALL | re.IGNORECASE)
            for name in ("rational", "evidence", "summary")}
# The same three parts written as headings ("Rational: ...", "**Evidence**: ..."), as models often do.
_HEADED_RE = re.compile(r"^\W*(rational|rationale|evidence|summary)\W*:\s*", re.IGNORECASE | re.MULTILINE)
_HEADING_RE = re.compile(r"^\s*#{1,6}\s+(.*\S)\s*$")


def _unique(ids) -> list[int]:
    return list(dict.fromkeys(ids))


def ids_in(text: str) -> list[int]:
    """Integers in `<id>N</id>` tags, in order, each once; bare numbers if there is no tag."""
    tagged = [int(m) for m in ID_RE.findall(text)]
    return _unique(tagged if tagged else (int(m) for m in re.findall(r"\d+", text)))


def cited_ids(text: str) -> list[int]:
    """The ids cited in `text` (`<cite><id>1</id>, <id>3</id></cite>` blocks), in order, each once."""
    return _unique(int(m) for block in CITE_RE.findall(text) for m in ID_RE.findall(block))


def render_citations(text: str) -> str:
    """`<cite><id>1</id>, <id>3</id></cite>` -> `[1][3]`, for the report's readers."""
    return CITE_RE.sub(lambda m: "".join(f"[{i}]" for i in _unique(int(x) for x in ID_RE.findall(m.group(1)))), text)


def parse_summary(text: str) -> dict:
    """The summarizer's reply -> {"rational", "evidence", "summary", "parsed"}: tagged parts, else
    "Rational: / Evidence: / Summary:" headings; without either, the whole reply is the summary
    (parsed False)."""
    parts = {name: (m.group(1).strip() if (m := regex.search(text)) else "") for name, regex in _PART_RE.items()}
    if not parts["summary"]:
        pieces = _HEADED_RE.split(text)
        headed = {pieces[i].lower().replace("rationale", "rational"): pieces[i + 1].strip()
                  for i in range(1, len(pieces) - 1, 2)}
        parts = {name: headed.get(name, parts[name]) for name in parts}
    if parts["summary"]:
        return {**parts, "parsed": True}
    return {**parts, "summary": " ".join(text.split()), "parsed": False}


@dataclass(frozen=True)
class MemoryEntry:
    """One summary: id, the source it summarises ({"kind", "id", "title"}), the goal, its three parts."""

    id: int
    source: dict
    goal: str
    rational: str
    evidence: str
    summary: str

    def label(self) -> str:
        s = self.source
        where = f"<{s['id']}>" if s.get("kind") == "web" else f"doc {s['id']}"
        return f"{s.get('title') or 'untitled'} ({where})"


class MemoryBank:
    """Summaries by integer id, with the counter and the outline flag (see the module docstring)."""

    def __init__(self, entries: list[dict] | None = None, counter: int = 0, flag: int = 0):
        self.entries = {e["id"]: MemoryEntry(**e) for e in entries or []}
        self.summary_id_counter, self.summary_id_flag = counter, flag
        if self.entries and max(self.entries) > counter or not 0 <= flag <= counter:
            raise ValueError(f"inconsistent memory bank: ids {sorted(self.entries)}, counter {counter}, flag {flag}")

    def add(self, source: dict, goal: str, rational: str, evidence: str, summary: str) -> MemoryEntry:
        self.summary_id_counter += 1
        entry = MemoryEntry(self.summary_id_counter, dict(source), goal, rational, evidence, summary)
        self.entries[entry.id] = entry
        return entry

    def since_flag(self) -> list[MemoryEntry]:
        """Summaries no outline has taken in yet: ids in (summary_id_flag, summary_id_counter]."""
        return [self.entries[i] for i in range(self.summary_id_flag + 1, self.summary_id_counter + 1)
                if i in self.entries]

    def advance_flag(self) -> None:
        self.summary_id_flag = self.summary_id_counter

    def lookup(self, ids) -> tuple[list[MemoryEntry], list[int]]:
        """(entries found, in the order asked; ids the bank does not hold)."""
        found = [self.entries[i] for i in ids if i in self.entries]
        return found, [i for i in ids if i not in self.entries]

    def state(self) -> dict:
        return {"memory_bank": [asdict(e) for e in self.entries.values()],
                "summary_id_counter": self.summary_id_counter, "summary_id_flag": self.summary_id_flag}


def outline_sections(outline: str) -> list[dict]:
    """Sections of an outline: `{"heading", "body", "cites"}` per markdown heading line (`## ...`),
    the body being the lines up to the next heading; an outline without headings has one section per
    non-empty line. `cites`: the ids cited in the heading and body."""
    sections: list[dict] = []
    lines = [ln for ln in outline.splitlines() if ln.strip()]
    if not any(_HEADING_RE.match(ln) for ln in lines):
        sections = [{"heading": ln.strip().lstrip("-*0123456789. ").strip() or ln.strip(), "body": ""} for ln in lines]
    else:
        for ln in lines:
            m = _HEADING_RE.match(ln)
            if m:
                sections.append({"heading": m.group(1), "body": ""})
            elif sections:
                sections[-1]["body"] += ln.rstrip() + "\n"
    for s in sections:
        s["cites"] = cited_ids(s["heading"] + "\n" + s["body"])
        s["heading_text"] = " ".join(CITE_RE.sub(" ", s["heading"]).split()) or s["heading"]
    return sections

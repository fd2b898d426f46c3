"""Figures of one report agent run, from its trace.json (search_r1.agents.weaver saves it): did it
finish a report, and do its citations point at evidence the run really retrieved."""
from __future__ import annotations

from search_r1.agents.memory import cited_ids


def run_metrics(trace: dict) -> dict:
    """finished: an outline and at least three written sections; sections: written sections; cites:
    `<cite>` ids in the written sections (each occurrence per section once); valid_cites: those naming a
    memory-bank summary whose document a search of the same run returned; invalid_actions: the
    planner's and writer's unparseable turns."""
    written = [s for s in (trace.get("writer", {}).get("sections") or []) if s.get("status") == "written"]
    retrieved = {str(i) for e in trace.get("events", []) if e.get("kind") == "search" for i in e.get("ids", [])}
    bank = {e["id"]: e for e in trace.get("memory_bank", [])}
    cites = [i for s in written for i in cited_ids(s.get("text", ""))]
    valid = [i for i in cites if i in bank and str(bank[i]["source"].get("id")) in retrieved]
    return {"finished": bool(trace.get("outline")) and len(written) >= 3, "sections": len(written),
            "cites": len(cites), "valid_cites": len(valid), "invalid_actions": trace.get("invalid_actions", 0)}

"""Rendering retrieved documents the way Search-R1 shows them to the policy.

A corpus document's `contents` is `"Title"\ntext` (the wiki-18 jsonl convention). The policy sees
each hit as one line `Doc {i}(Title: {title}) {text}` with i counted from 1.
"""
from __future__ import annotations


def split_title(contents: str) -> tuple[str, str]:
    """`'"Title"\\ntext'` -> `("Title", "text")`; a document without a newline has an empty text."""
    title, _, text = contents.partition("\n")
    return title.strip().strip('"'), text.strip()


def render_passages(contents: list[str], start: int = 1) -> str:
    """Render hits as `Doc 1(Title: T) text\\nDoc 2(...)...\\n` (trailing newline per hit, as upstream).

    `start` is the first document's number (agents number documents across several searches, so
    that a citation `Doc 5` names one document of the whole conversation).
    """
    lines = []
    for i, c in enumerate(contents, start=start):
        title, text = split_title(c)
        lines.append(f"Doc {i}(Title: {title}) {text}\n")
    return "".join(lines)

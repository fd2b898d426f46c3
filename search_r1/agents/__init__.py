"""Inference agents over the project's models, search engines and scoring.

    python -m search_r1.agents.toolcall ...   tool-call agentic RAG (QwQ style), search_r1/agents/toolcall.py
    python -m search_r1.agents.weaver ...     planner/writer report agent with a memory bank, weaver.py

Shared pieces: `chat` (the chat-model seam: OpenAI-compatible servers, local transformers models),
`tools` (search through RetrieverClient / WebSearchEngine; access by document id or URL),
`urlguard` + `webpage` (guarded page fetching), `budget` (budgets and the event trace),
`memory` (the report agent's memory bank), `prompts`, and `cli` (flags, single and batch runs,
scored with search_r1.evaluation).
"""

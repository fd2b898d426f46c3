"""Prompt templates for the Search-R1 protocol.

The instruction tells the policy the protocol: reason in `<think>`, search with `<search>`, read
results in `<information>`, answer in `<answer>`. Data files carry the instruction already inside
`prompt[0].content` (the Search-R1 parquet format), so a model trained here sees the same text at
evaluation time; `apply_chat_template` turns the messages into token ids for the rollout.
"""
from __future__ import annotations

SEARCH_R1_INSTRUCTION = (
    "Answer the given question. Every time you receive new information, first reason about it "
    "inside <think> and </think>. If you are missing knowledge, call the search engine with "
    "<search> query </search>; its top results come back between <information> and "
    "</information>. You may search as many times as you need. When no more knowledge is needed, "
    "give only the final answer inside <answer> and </answer>, with no explanation, for example "
    "<answer> Beijing </answer>. Question: {question}\n"
)

TOOL_CALL_INSTRUCTION = (
    "Answer the given question. Reason step by step inside <think> and </think>. To look something "
    "up, call the search tool by writing "
    '<tool_call>{{"name": "search", "arguments": {{"query": "..."}}}}</tool_call>; results come back '
    "between <tool_response> and </tool_response>. When you know the answer, give only the final "
    "answer inside <answer> and </answer>. Question: {question}\n"
)

TEMPLATES = {"tags": SEARCH_R1_INSTRUCTION, "tool_call": TOOL_CALL_INSTRUCTION}

# Data templates (`python -m search_r1.data.prepare --template ...`) and the protocol each one speaks:
#   base       one user message holding the instruction and the question (upstream Search-R1's prompt)
#   chat       a system message holding the instruction, then a user message "Question: ..." (instruct
#              models that follow system prompts)
#   tool_call  one user message with the tool-call instruction (<tool_call> JSON, <tool_response>)
DATA_TEMPLATES = {"base": "tags", "chat": "tags", "tool_call": "tool_call"}
CHAT_SYSTEM_INSTRUCTION = SEARCH_R1_INSTRUCTION.split(" Question: {question}")[0]
CHAT_USER_MESSAGE = "Question: {question}\n"

# Baselines of the Search-R1 paper, used by `python -m search_r1.evaluation --no-search / --rag`: the same
# answer format (so the same metric functions apply), no search tags offered.
NO_SEARCH_INSTRUCTION = (
    "Answer the given question directly, without searching. You may reason inside <think> and "
    "</think> first. Give only the final answer inside <answer> and </answer>, with no explanation, "
    "for example <answer> Beijing </answer>. Question: {question}\n"
)
RAG_INSTRUCTION = (
    "Answer the given question using the documents below. You may reason inside <think> and "
    "</think> first. Give only the final answer inside <answer> and </answer>, with no explanation, "
    "for example <answer> Beijing </answer>.\nDocuments:\n{documents}Question: {question}\n"
)


def normalize_question(question: str) -> str:
    """Upstream Search-R1's question normalization: strip whitespace, end with a question mark."""
    q = question.strip()
    if q and q[-1] != "?":
        q += "?"
    return q


def make_prompt(question: str, protocol: str = "tags") -> str:
    """The user message for `question` under `protocol` ("tags" or "tool_call")."""
    if protocol not in TEMPLATES:
        raise ValueError(f"unknown protocol {protocol!r}; choose one of {sorted(TEMPLATES)}")
    return TEMPLATES[protocol].format(question=normalize_question(question))


def make_messages(question: str, protocol: str = "tags") -> list[dict]:
    """Chat messages for the parquet `prompt` column: one user turn holding the instruction."""
    return [{"role": "user", "content": make_prompt(question, protocol)}]


def template_messages(question: str, template: str = "base") -> list[dict]:
    """Chat messages for `question` under a data template (see DATA_TEMPLATES)."""
    if template not in DATA_TEMPLATES:
        raise ValueError(f"unknown template {template!r}; choose one of {sorted(DATA_TEMPLATES)}")
    if template == "chat":
        return [{"role": "system", "content": CHAT_SYSTEM_INSTRUCTION},
                {"role": "user", "content": CHAT_USER_MESSAGE.format(question=normalize_question(question))}]
    return make_messages(question, DATA_TEMPLATES[template])


def baseline_messages(question: str, documents: str | None = None) -> list[dict]:
    """The paper's baselines: direct answer (documents None) or RAG (rendered passages given)."""
    q = normalize_question(question)
    if documents is None:
        return [{"role": "user", "content": NO_SEARCH_INSTRUCTION.format(question=q)}]
    return [{"role": "user", "content": RAG_INSTRUCTION.format(question=q, documents=documents)}]


def rag_documents(tokenizer, documents: list[str], max_tokens: int) -> list[str]:
    """Rendered passages for the RAG prompt, each cut to `max_tokens` tokens (the budget a search
    observation gets in the search mode), so both modes read the same amount of evidence."""
    out = []
    for d, ids in zip(documents, tokenizer(list(documents), add_special_tokens=False)["input_ids"]):
        out.append(d if len(ids) <= max_tokens else tokenizer.decode(ids[:max_tokens]) + "\n")
    return out


def apply_chat_template(tokenizer, messages: list[dict]) -> list[int]:
    """Token ids of `messages` with the generation prompt appended (ChatML for SmolLM2 / Qwen)."""
    if getattr(tokenizer, "chat_template", None):
        ids = tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=True)
        if isinstance(ids, dict) or hasattr(ids, "input_ids"):  # transformers 5 may return BatchEncoding
            ids = ids["input_ids"]
        return list(ids)
    # A tokenizer without a chat template (base models): plain concatenation of the contents.
    text = "".join(m["content"] for m in messages)
    return tokenizer(text, add_special_tokens=False)["input_ids"]


# The single-process API's prompt (`search_r1.grpo`): ChatML (Qwen / SmolLM2 style), a system message
# holding the instruction plus two worked examples (one that searches, one that answers from memory),
# so a small model sees the whole tag protocol once before its first turn.
GRPO_EXAMPLES = (
    "\n\nExample 1 (a search is needed)\nQuestion: Who founded Veltra Systems?\n"
    "<think> I do not know who founded Veltra Systems, so I search. </think>\n"
    "<search> Veltra Systems founder </search>\n"
    "<information>Doc 1(Title: Veltra Systems) Veltra Systems was founded by Ana Osk in 1987.\n"
    "</information>\n"
    "<think> The document says Ana Osk founded it. </think>\n<answer> Ana Osk </answer>\n\n"
    "Example 2 (no search is needed)\nQuestion: What is the capital of France?\n"
    "<think> I already know this. </think>\n<answer> Paris </answer>"
)
GRPO_SYSTEM_PROMPT = CHAT_SYSTEM_INSTRUCTION + GRPO_EXAMPLES
CHATML_TEMPLATE = "<|im_start|>system\n{system}<|im_end|>\n<|im_start|>user\n{user}<|im_end|>\n<|im_start|>assistant\n"


def grpo_messages(question: str) -> list[dict]:
    """System (instruction + examples) and user ("Question: ...") messages of the GRPO API prompt."""
    return [{"role": "system", "content": GRPO_SYSTEM_PROMPT},
            {"role": "user", "content": CHAT_USER_MESSAGE.format(question=normalize_question(question)).rstrip()}]


def chatml_prompt(question: str) -> str:
    """`grpo_messages(question)` rendered as ChatML text, ending with the assistant header."""
    system, user = (m["content"] for m in grpo_messages(question))
    return CHATML_TEMPLATE.format(system=system, user=user)

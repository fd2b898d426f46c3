"""search_r1.protocol: action parsing, stop strings, observation texts and budgeted encoding."""
import pytest

from search_r1.protocol import (
    ObservationEncoder,
    failed_search_observation,
    invalid_action_observation,
    mentions_any,
    parse_action,
    search_observation,
    search_rounds,
    stop_strings,
)

from tests.search_r1.rollout.scripted import smollm2_tokenizer


@pytest.fixture(scope="module")
def tok():
    return smollm2_tokenizer()


# -- tags ---------------------------------------------------------------------------------------
@pytest.mark.parametrize("text, kind, content", [
    ("<think>a</think><search> who founded Veltra </search>", "search", "who founded Veltra"),
    ("<answer> Ana Osk </answer>", "answer", "Ana Osk"),
    ("<search>\nmulti\nline\n</search>", "search", "multi\nline"),
    # first complete action wins, whatever comes later
    ("<answer>A</answer><search>q</search>", "answer", "A"),
    ("<search>q</search><answer>A</answer>", "search", "q"),
    # an opened but unclosed tag is no action; mismatched tags are no action
    ("<search> q", "invalid", ""),
    ("<search> q </answer>", "invalid", ""),
    ("plain text", "invalid", ""),
    # empty / whitespace query is invalid; an empty answer is still an answer (it just scores 0)
    ("<search>   </search>", "invalid", ""),
    ("<answer></answer>", "answer", ""),
    # the tool-call syntax means nothing under the tags protocol
    ('<tool_call>{"name": "search", "arguments": {"query": "q"}}</tool_call>', "invalid", ""),
])
def test_parse_tags(text, kind, content):
    action = parse_action(text, "tags")
    assert (action.kind, action.content) == (kind, content)


def test_parse_reports_end_of_action():
    text = "<think>x</think><search> q </search> trailing"
    action = parse_action(text)
    assert text[: action.end].endswith("</search>") and text[action.end:] == " trailing"
    assert parse_action("nothing").end == -1


# -- tool_call ----------------------------------------------------------------------------------
@pytest.mark.parametrize("text, kind, content", [
    ('<tool_call>{"name": "search", "arguments": {"query": " Veltra founder "}}</tool_call>', "search", "Veltra founder"),
    # OpenAI style: arguments as a JSON string
    ('<tool_call>{"name": "search", "arguments": "{\\"query\\": \\"q1\\"}"}</tool_call>', "search", "q1"),
    ("<answer> 42 </answer>", "answer", "42"),
    ('<tool_call>{"name": "search", "arguments": {"query": ""}}</tool_call>', "invalid", ""),
    ('<tool_call>{"name": "browse", "arguments": {"query": "q"}}</tool_call>', "invalid", ""),
    ('<tool_call>{"name": "search", "arguments": {"q": "x"}}</tool_call>', "invalid", ""),
    ('<tool_call>{"name": "search", "arguments": {"query": 3}}</tool_call>', "invalid", ""),
    ("<tool_call>not json</tool_call>", "invalid", ""),
    ('<tool_call>["search"]</tool_call>', "invalid", ""),
    # the QwQ / ReAct form, with the web_search name, reads the same
    ('<tool_call>{"action": "web_search", "action_input": {"query": " Veltra "}}</tool_call>', "search", "Veltra"),
    ('<tool_call>{"action": "search", "action_input": "{\\"query\\": \\"q2\\"}"}</tool_call>', "search", "q2"),
    ('<tool_call>{"name": "web_search", "arguments": {"query": "q3"}}</tool_call>', "search", "q3"),
    ('<tool_call>{"action": "access", "action_input": {"query": "q"}}</tool_call>', "invalid", ""),
    ('<tool_call>{"action": "web_search", "action_input": ["q"]}</tool_call>', "invalid", ""),
    ("<search> q </search>", "invalid", ""),
])
def test_parse_tool_call(text, kind, content):
    action = parse_action(text, "tool_call")
    assert (action.kind, action.content) == (kind, content)


def test_unknown_protocol_is_a_clear_error():
    with pytest.raises(ValueError, match=r"unknown protocol 'xml'.*\['tags', 'tool_call'\]"):
        parse_action("x", "xml")
    with pytest.raises(ValueError, match="allowed values"):
        stop_strings("xml")


@pytest.mark.parametrize("protocol, search", [
    ("tags", lambda q: f"<search> {q} </search>"),
    ("tool_call", lambda q: f'<tool_call>{{"name": "search", "arguments": {{"query": "{q}"}}}}</tool_call>'),
])
def test_search_rounds_pair_each_query_with_its_observation(protocol, search):
    # a trajectory as the rollout writes it: turn, observation, an invalid turn (the corrective message
    # quotes the tags themselves), a second search, its observation, the answer
    text = ("<think> first </think>\n" + search("who is A") + search_observation("Doc 1 A lives in B", protocol)
            + "<think> hm </think> <search> </search>" + invalid_action_observation(protocol)
            + "<think> now B </think>\n" + search("where is B") + search_observation("Doc 1 B is in C", protocol)
            + "<answer> C </answer>")
    assert search_rounds(text, protocol) == [("who is A", "Doc 1 A lives in B"), ("where is B", "Doc 1 B is in C")]
    assert search_rounds("<answer> C </answer>", protocol) == []
    # a failed search is still a round: the policy read the failure text
    failed = search("q") + failed_search_observation(protocol)
    assert [q for q, _ in search_rounds(failed, protocol)] == ["q"]


def test_stop_strings_and_texts():
    assert stop_strings("tags") == ("</search>", "</answer>")
    assert stop_strings("tool_call") == ("</tool_call>", "</answer>")
    assert search_observation("Doc 1(Title: T) x\n") == "\n\n<information>Doc 1(Title: T) x</information>\n\n"
    assert search_observation("R", "tool_call") == "\n\n<tool_response>R</tool_response>\n\n"
    failed = failed_search_observation()
    assert failed.startswith("\n\n<information>") and failed.endswith("</information>\n\n")
    assert "search engine did not respond" in failed
    for protocol, tags in [("tags", ("<search>", "<answer>")), ("tool_call", ("<tool_call>", "<answer>"))]:
        text = invalid_action_observation(protocol)
        assert text.startswith("\n") and text.endswith("\n") and all(t in text for t in tags)


# -- observation encoding -----------------------------------------------------------------------
def test_encoder_keeps_text_exact_and_fits_budgets(tok):
    enc = ObservationEncoder(tok, "tags")
    passages = "Doc 1(Title: Veltra) Veltra was founded by Ana Osk in 1901.\nDoc 2(Title: Osk) Ana Osk.\n"
    full = search_observation(passages)
    n_full = len(tok(full, add_special_tokens=False)["input_ids"])
    obs = enc.encode(["search", "invalid", "failed", "search"], [passages, None, None, passages],
                     [1000, 1000, 1000, 1000])
    assert tok.decode(obs[0]) == full and obs[0] == obs[3]
    assert abs(len(obs[0]) - n_full) <= 2  # piecewise tokenization costs at most the two seams
    assert tok.decode(obs[1]) == invalid_action_observation("tags")
    assert tok.decode(obs[2]) == failed_search_observation("tags")
    assert enc.last_shortened == 0


def test_encoder_shortens_passages_but_keeps_closing_tag(tok):
    enc = ObservationEncoder(tok, "tags")
    passages = " ".join(f"Doc {i}(Title: T{i}) some long passage text number {i}." for i in range(1, 40))
    budget = 30
    [ids] = enc.encode(["search"], [passages], [budget])
    assert len(ids) == budget
    text = tok.decode(ids)
    assert text.startswith("\n\n<information>Doc 1(Title: T1)")
    assert text.endswith("</information>\n\n")
    assert enc.last_shortened == 1
    # Below the wrapper + one token nothing fits; constant messages longer than the budget neither.
    assert enc.encode(["search", "invalid", "failed"], [passages, None, None], [enc.min_search_tokens - 1, 5, 5]) \
        == [None, None, None]
    with pytest.raises(ValueError, match="observation kind 'web'"):
        enc.encode(["web"], [None], [10])


def test_encoder_tool_call_wrapper(tok):
    enc = ObservationEncoder(tok, "tool_call")
    [ids] = enc.encode(["search"], ["Doc 1(Title: A) b\n"], [100])
    assert tok.decode(ids) == "\n\n<tool_response>Doc 1(Title: A) b</tool_response>\n\n"


@pytest.mark.parametrize("payload, problem", [
    ("{not json", "not valid JSON"),
    ("[1, 2]", "must be a JSON object, got a list"),
    ('{"arguments": {"query": "q"}}', "names no tool"),
    ('{"name": "search", "arguments": "oops"}', "string that is not a JSON object"),
    ('{"action": "web_search", "action_input": 3}', "action_input of the tool call must be a JSON object"),
])
def test_decode_tool_call_names_the_problem(payload, problem):
    from search_r1.protocol import decode_tool_call

    with pytest.raises(ValueError, match=problem):
        decode_tool_call(payload)


def test_decode_tool_call_both_forms():
    from search_r1.protocol import ToolCall, decode_tool_call

    assert decode_tool_call('{"name": "access", "arguments": {"target": "34"}}') == ToolCall("access", {"target": "34"})
    assert decode_tool_call('{"action": "web_search", "action_input": {"query": "x"}}') == \
        ToolCall("web_search", {"query": "x"})
    assert decode_tool_call('{"name": "search"}') == ToolCall("search", {})


def test_mentions_any_ignores_case_and_never_counts_an_empty_name():
    # An empty gold answer or bridge must not make every observation count as showing it: the
    # warm-start's evidence filter and the two-hop failure analysis both ask this question.
    assert mentions_any("Doc 1(Title: Veltra) founded by ANA OSK", ["ana osk"])
    assert not mentions_any("Doc 1(Title: Veltra) founded by Ana", ["Ana Osk"])
    assert not mentions_any("any text at all", ["", ""])
    assert mentions_any("Tamanine", ["", "tamanine"])
    assert not mentions_any("anything", [])

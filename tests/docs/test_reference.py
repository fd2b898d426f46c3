"""The reference pages (docs/reference/{config,metrics,cli}.md) list every config key, logged metric
and CLI flag the code has, and are what `python scripts/gen_reference.py` writes today.

Each check reads the code independently of the generator's page layout where it can (yaml.safe_load
for the config keys, ast scans for the logged metric keys, the argparse parsers themselves), and each
has a negative case: a made-up key, metric or flag the same helper reports as missing. Fix a failure
by documenting the new item at its source (a `# comment` above the YAML key, a row in the generator's
METRICS_CPU / METRICS_VERL / TRAIN_GRPO_FLAGS / MAKE_TARGETS, a `help=` for the flag) and running
`.venv/bin/python scripts/gen_reference.py`.
"""
from __future__ import annotations

import argparse
import importlib.util
import re
import sys
from functools import lru_cache
from pathlib import Path

import pytest
import yaml

REPO = Path(__file__).resolve().parents[2]
PAGES = REPO / "docs" / "reference"
REGENERATE = "run: .venv/bin/python scripts/gen_reference.py"


@lru_cache(maxsize=None)
def gen():
    """scripts/gen_reference.py as a module (scripts/ is not a package)."""
    spec = importlib.util.spec_from_file_location("gen_reference", REPO / "scripts" / "gen_reference.py")
    module = importlib.util.module_from_spec(spec)
    sys.modules["gen_reference"] = module  # dataclasses look their module up while it executes
    spec.loader.exec_module(module)
    return module


@lru_cache(maxsize=None)
def page(name: str) -> str:
    return (PAGES / name).read_text()


def sections(text: str, level: int = 2) -> dict[str, str]:
    """{heading: body} of a page's headings of one level."""
    marker = "#" * level + " "
    out, current = {}, None
    for line in text.splitlines():
        if line.startswith(marker):
            current = line[len(marker):]
            out[current] = ""
        elif current is not None:
            out[current] += line + "\n"
    return out


def code_spans(text: str) -> set[str]:
    return set(re.findall(r"`([^`]+)`", text))


# ---------------------------------------------------------------------------------------------------
# config.md
# ---------------------------------------------------------------------------------------------------
CONFIGS = [rel for rel, *_ in gen().CONFIG_FILES]


def leaf_keys(tree, prefix="") -> set[str]:
    """Dotted paths of every non-mapping value (lists are leaves) of a parsed YAML document."""
    if isinstance(tree, dict) and tree:
        return set().union(*(leaf_keys(v, f"{prefix}{k}.") for k, v in tree.items()))
    return {prefix.rstrip(".")}


def config_section(rel: str) -> str:
    """The config.md section of one file: the one whose heading names it (`configs/x.yaml` or the path)."""
    name = Path(rel).name if "verl_cpu/" not in rel else "verl_cpu/base.yaml"
    found = [body for heading, body in sections(page("config.md")).items() if f"{name}`" in heading]
    assert len(found) == 1, f"config.md: expected one section whose heading names {name}, found {len(found)}"
    return found[0]


def missing_config_keys(rel: str, keys: set[str]) -> list[str]:
    spans = code_spans(config_section(rel))
    return sorted(k for k in keys if k not in spans)


@pytest.mark.parametrize("rel", CONFIGS)
def test_every_config_key_is_on_the_page(rel):
    keys = leaf_keys(yaml.safe_load((REPO / rel).read_text()))
    assert keys, rel
    missing = missing_config_keys(rel, keys)
    assert not missing, f"{rel} keys missing from docs/reference/config.md: {missing}; {REGENERATE}"
    # negative: a key the file does not have is reported
    assert missing_config_keys(rel, {"trainer.no_such_key"}) == ["trainer.no_such_key"]


def test_every_key_has_its_comment_on_the_page():
    """Each key's meaning is its YAML comment (or its group's): a key without one has no meaning on the page."""
    for rel in CONFIGS:
        keys = gen().yaml_keys(REPO / rel)
        commented = {k.key for k in keys if k.comment}
        bare = [k.key for k in keys if not k.is_mapping and gen()._see_parent(k.key, commented).startswith("(no")
                and k.key not in commented]
        assert not bare, f"{rel}: keys without a comment above them (their meaning on config.md): {bare}"


def test_schema_fields_are_on_the_page():
    """Every field of the CPU trainer's dataclasses and of the verl `search_r1:` group's settings."""
    g = gen()
    cpu = set(g.cpu_config_types())
    verl = set(g.verl_group_types())
    assert cpu and verl
    missing = missing_config_keys(CONFIGS[0], cpu) + missing_config_keys("verl_ext/configs/grpo_verl.yaml", verl)
    assert not missing, f"config fields missing from config.md: {missing}; {REGENERATE}"


def test_yaml_reader_reads_comments_and_lists(tmp_path):
    f = tmp_path / "x.yaml"
    f.write_text("# header\n# more\n\ntop:\n  # the a key\n  a: 1  # trailing\n  b:\n    # the items\n    - x\n"
                 "    - y\n\nc: \"#not a comment\"\n")
    keys = {k.key: k for k in gen().yaml_keys(f)}
    assert set(keys) == {"top", "top.a", "top.b", "c"}
    assert (keys["top.a"].value, keys["top.a"].comment) == ("1", "the a key")
    assert (keys["top.b"].value, keys["top.b"].comment, keys["top.b"].is_mapping) == ("[x, y]", "the items", False)
    assert keys["top"].comment == "" and keys["c"].value == '"#not a comment"'


# ---------------------------------------------------------------------------------------------------
# metrics.md
# ---------------------------------------------------------------------------------------------------
def metrics_section(title_start: str) -> set[str]:
    found = [body for heading, body in sections(page("metrics.md")).items() if heading.startswith(title_start)]
    assert len(found) == 1, f"metrics.md: no single section '{title_start}...'"
    return code_spans(found[0])


def test_every_logged_metric_is_on_the_page():
    g = gen()
    logged = g.logged_metrics()
    # the scan finds what the trainers are known to log (it must not silently find nothing)
    assert {"reward/mean", "actor/kl_loss", "timing/gen", "val/em", "alarm/drift"} <= logged["cpu"]
    assert {"env/searches_mean", "sync/unsynced_log_ppl_abs_diff", "val/em"} <= logged["verl"]
    cpu_page = metrics_section("Embedded CPU trainer")
    missing = g.undocumented(logged["cpu"] - set(g.METRICS_CPU_NOT_LOGGED), cpu_page)
    assert not missing, f"metrics the embedded trainer logs, missing from metrics.md: {missing}; {REGENERATE}"
    verl_page = metrics_section("verl trainer: our additions")
    missing = g.undocumented(logged["verl"], verl_page)
    assert not missing, f"metrics verl_ext/trainer.py logs, missing from metrics.md: {missing}; {REGENERATE}"
    missing = [t for t in logged["agent_loop"] if t not in verl_page]
    assert not missing, f"agent-loop timers missing from metrics.md: {missing}; {REGENERATE}"
    # negative: a new key, a new per-source key and a new timer are reported
    assert g.undocumented({"reward/new_thing", "env/<*>/new_share", "timing/new_phase"}, cpu_page) == [
        "env/<*>/new_share", "reward/new_thing", "timing/new_phase"]
    assert g.undocumented({"reward/<*>/em"}, cpu_page) == []


def test_the_page_lists_no_metric_the_code_does_not_log():
    g = gen()
    logged = g.logged_metrics()
    documented = {k for k in metrics_section("Embedded CPU trainer") if re.fullmatch(r"[a-z_]+/\S+", k)}
    documented -= {k for k in documented if not any(k == row[0] for row in g.METRICS_CPU)}  # keys quoted in text
    stale = g.undocumented(documented, logged["cpu"])
    assert not stale, f"metrics.md lists keys the embedded trainer no longer logs: {stale}; {REGENERATE}"


def test_metric_scan_sees_dict_keys_fstrings_and_phases():
    import ast

    g = gen()
    tree = ast.parse('m = {"a/b": 1, f"c/{s}/d": 2}\nm["e/f"] = 3\nn = {f"g/{k}": v for k, v in x}\n'
                     'with timed(timing, "gen"):\n    pass\ntiming["search"] = 1.0\nprint("not/a/key")\n')
    assert {k for k in g._dict_keys(tree) if g._METRIC_KEY.match(k)} == {"a/b", "c/<*>/d", "e/f", "g/<*>"}
    assert g._timing_names(tree) == {"gen", "search"}


# ---------------------------------------------------------------------------------------------------
# cli.md
# ---------------------------------------------------------------------------------------------------
def cli_section(command: str) -> str:
    found = [body for heading, body in sections(page("cli.md")).items() if heading == f"`{command}`"]
    assert len(found) == 1, f"cli.md: no section `{command}`; {REGENERATE}"
    text = found[0]
    # subcommand sections (### `command sub`) belong to their command
    text += "".join(body for heading, body in sections(page("cli.md"), 3).items()
                    if heading.startswith(f"`{command} "))
    return text


def missing_options(command: str, names: list[str]) -> list[str]:
    spans = " ".join(code_spans(cli_section(command)))
    return [n for n in names if not re.search(rf"(?<![\w-]){re.escape(n)}(?![\w-])", spans)]


@pytest.mark.parametrize("cli", gen().CLIS, ids=lambda c: c.command)
def test_every_cli_flag_is_on_the_page(cli):
    options = gen().parser_options(cli.parser())
    names = [n for names in options.values() for n in names]
    assert names, cli.command
    missing = missing_options(cli.command, names)
    assert not missing, f"{cli.command}: flags missing from docs/reference/cli.md: {missing}; {REGENERATE}"
    subcommands = [sub for sub in options if sub]
    missing = [s for s in subcommands if f"### `{cli.command} {s}`" not in page("cli.md")]
    assert not missing, f"{cli.command}: subcommands without a section on cli.md: {missing}"
    # negative: a flag the parser does not have is reported
    assert missing_options(cli.command, ["--no-such-flag"]) == ["--no-such-flag"]


def test_every_argparse_cli_is_covered():
    """A new module with an argparse parser (in the roots the page covers) needs a CLIS entry."""
    g = gen()
    covered = {f for cli in g.CLIS for f in cli.files} | {"scripts/gen_reference.py"}
    found = sorted(str(p.relative_to(REPO)) for root in g.CLI_ROOTS for p in (REPO / root).rglob("*.py")
                   if "argparse.ArgumentParser(" in p.read_text())
    assert found
    uncovered = [f for f in found if f not in covered]
    assert not uncovered, (f"CLIs not on docs/reference/cli.md: {uncovered}; add them to CLIS in "
                           f"scripts/gen_reference.py and {REGENERATE}")


def test_parser_is_caught_inside_main(tmp_path):
    """A parser built inside main() is taken at parse_args, before main does anything else."""
    script = tmp_path / "tool.py"
    script.write_text("import argparse\n\ndef main():\n    p = argparse.ArgumentParser()\n"
                      "    p.add_argument('--alpha')\n    p.parse_args()\n    raise SystemExit('ran past parse_args')\n")
    spec = importlib.util.spec_from_file_location("tool", script)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    with gen()._catch_parse_args():
        with pytest.raises(gen()._Caught) as caught:
            module.main()
    assert "--alpha" in caught.value.parser._option_string_actions
    assert argparse.ArgumentParser.parse_args is not None and "catch" not in argparse.ArgumentParser.parse_args.__name__


def test_train_grpo_flags_and_make_targets_are_on_the_page():
    g = gen()
    flags = g.train_grpo_flags()
    assert {"--dry-run", "--config-name"} <= flags
    section = cli_section("bash scripts/train_grpo.sh")
    missing = [f for f in sorted(flags) if not any(s.split()[0] == f for s in code_spans(section))]
    assert not missing, f"scripts/train_grpo.sh flags missing from cli.md: {missing}; {REGENERATE}"
    verl_main = sections(page("cli.md"))["`python -m search_r1.trainer.main` and `python -m verl_ext.main`"]
    missing = [f for f in sorted(g.verl_main_flags()) if f not in code_spans(verl_main)]
    assert not missing, f"python -m verl_ext.main flags missing from cli.md: {missing}; {REGENERATE}"
    make = code_spans(sections(page("cli.md"))["`make` targets"])
    missing = [t for t in g.make_targets() if t not in make]
    assert not missing, f"Makefile targets missing from cli.md: {missing}; {REGENERATE}"
    # negative: the scan sees a new case pattern, and a new target would be missing
    assert "no-such-target" not in make and not any(s.split()[0] == "--new-flag" for s in code_spans(section))
    assert "--new-flag" in re.findall(r"(?:^|[\s\"(|])(--?[a-z][a-z0-9-]*)(?=(?:=\*)?\)|\"|\|)",
                                      '    --new-flag) x=1 ;;')


# ---------------------------------------------------------------------------------------------------
def test_pages_are_what_the_generator_writes():
    """Defaults, meanings and help texts too: a page differing from the generator's output is stale."""
    rendered = gen().render()
    stale = [name for name, text in rendered.items() if page(name) != text]
    assert not stale, f"stale reference pages: {stale}; {REGENERATE}"


def test_pages_hold_no_path_of_this_checkout():
    """A default such as REPO / "outputs" renders as this checkout's absolute path: the page then differs
    in every other clone (the fresh-clone run of 2026-12-07 failed on exactly that)."""
    leaked = [name for name, text in gen().render().items() if str(REPO) in text]
    assert not leaked, f"{leaked} contain {REPO}: give the flag a relative default (resolved against the repository)"

"""The documentation site builds with `mkdocs build --strict`: a broken link, a page in the nav that
does not exist or a missing anchor fails the test suite (issue 67).

mkdocs-material comes with the `test` extra (setup.py); without it the test is skipped, saying so.
"""
from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]


def test_mkdocs_build_strict(tmp_path):
    pytest.importorskip("mkdocs", reason="mkdocs is not installed (pip install -e '.[test]' brings mkdocs-material)")
    pytest.importorskip("material", reason="mkdocs-material is not installed (pip install -e '.[test]')")
    proc = subprocess.run(
        [sys.executable, "-m", "mkdocs", "build", "--strict", "--config-file", str(ROOT / "mkdocs.yml"),
         "--site-dir", str(tmp_path / "site")],
        cwd=ROOT, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, f"mkdocs build --strict failed:\n{proc.stdout}\n{proc.stderr}"
    assert (tmp_path / "site" / "index.html").is_file()


def test_every_docs_page_is_in_the_nav():
    """A page left out of mkdocs.yml's nav is only an INFO line for mkdocs; here it is a failure."""
    yaml = pytest.importorskip("yaml", reason="PyYAML is not installed")
    text = (ROOT / "mkdocs.yml").read_text()
    # mkdocs.yml may carry !!python tags (material's emoji extension); the nav needs none of them.
    config = yaml.load(text, Loader=_IgnoreTagsLoader)

    def pages(node):
        if isinstance(node, str):
            yield node
        elif isinstance(node, list):
            for item in node:
                yield from pages(item)
        elif isinstance(node, dict):
            for value in node.values():
                yield from pages(value)

    in_nav = {p for p in pages(config["nav"]) if p.endswith(".md")}
    on_disk = {str(p.relative_to(ROOT / "docs")) for p in (ROOT / "docs").rglob("*.md")}
    assert not in_nav - on_disk, f"in the nav but not under docs/: {sorted(in_nav - on_disk)}"
    assert not on_disk - in_nav, f"under docs/ but not in mkdocs.yml's nav: {sorted(on_disk - in_nav)}"


try:
    import yaml as _yaml

    class _IgnoreTagsLoader(_yaml.SafeLoader):
        pass

    _IgnoreTagsLoader.add_multi_constructor("", lambda loader, suffix, node: None)
except ImportError:  # the test that needs it skips
    _IgnoreTagsLoader = None

"""Publishing a rebuilt index (`build --force`, `import --force`) never leaves the user without one."""
import os

import pytest

from retriever_server import manifest
from retriever_server.manifest import publish_index


def make(path, text):
    path.mkdir()
    (path / "manifest.json").write_text(text)


def test_the_new_index_replaces_the_old_and_nothing_is_left_beside_it(tmp_path):
    out, tmp = tmp_path / "index", tmp_path / ".index.tmp-1"
    make(out, "old")
    make(tmp, "new")
    publish_index(tmp, out)
    assert (out / "manifest.json").read_text() == "new"
    assert sorted(p.name for p in tmp_path.iterdir()) == ["index"]


def test_a_failed_move_puts_the_old_index_back(tmp_path, monkeypatch):
    out, tmp = tmp_path / "index", tmp_path / ".index.tmp-1"
    make(out, "old")
    make(tmp, "new")
    real = os.replace

    def failing(src, dst):
        if os.fspath(src) == os.fspath(tmp):
            raise OSError("disk full")
        return real(src, dst)

    monkeypatch.setattr(manifest.os, "replace", failing)
    with pytest.raises(OSError, match="disk full"):
        publish_index(tmp, out)
    assert (out / "manifest.json").read_text() == "old"


def test_a_first_build_creates_the_parent(tmp_path):
    tmp = tmp_path / ".index.tmp-1"
    make(tmp, "new")
    publish_index(tmp, tmp_path / "a" / "index")
    assert (tmp_path / "a" / "index" / "manifest.json").read_text() == "new"

"""The shared server launcher: start-up failure is reported with the server's own words."""
import pytest

from retriever_server.launcher import ServerProcess, ServerStartError, free_port
from tests._fixtures.retriever import REPO, _env


def test_start_failure_carries_the_log_tail(tmp_path):
    server = ServerProcess([tmp_path], tmp_path / "server.log", env=_env(), cwd=REPO)
    with pytest.raises(ServerStartError, match=r"exited with code 2(.|\n)*no manifest.json"):
        server.start(timeout=60)
    assert server.proc is None or server.proc.poll() is not None
    with pytest.raises(OSError):
        server.health(timeout=1)  # nothing listens on its port


def test_command_binds_loopback_on_its_port(tmp_path):
    port = free_port()
    server = ServerProcess(["a", "b"], tmp_path / "log", flags=["--max-batch", "8"], port=port)
    cmd = server.command
    assert cmd[cmd.index("--host") + 1] == "127.0.0.1" and cmd[cmd.index("--port") + 1] == str(port)
    assert cmd.count("--index") == 2 and cmd[-2:] == ["--max-batch", "8"]
    assert server.url == f"http://127.0.0.1:{port}/retrieve"

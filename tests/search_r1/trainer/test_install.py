"""`pip install .` without -e: the installed trainer composes its Hydra config from the package.

The project is copied to a scratch directory (the build writes egg-info and build/ next to setup.py)
and installed with `pip install --no-deps --no-build-isolation` into a scratch venv whose only other
packages are the project venv's (a .pth line; its editable finder is not loaded). Then
`python -m search_r1.trainer.main --cfg job` runs from an unrelated directory: Hydra prints the
composed config, which needs the YAML from the installed package.
"""
import shutil
import subprocess
import sys
import sysconfig
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[3]
PACKAGES = ("search_r1", "verl_ext", "retriever_server")


def test_installed_without_editable_composes_the_trainer_config(tmp_path):
    src = tmp_path / "src"
    src.mkdir()
    shutil.copy(REPO / "setup.py", src / "setup.py")
    for pkg in PACKAGES:
        shutil.copytree(REPO / pkg, src / pkg, ignore=shutil.ignore_patterns("__pycache__", "*.pyc"))
    venv = tmp_path / "venv"
    subprocess.run([sys.executable, "-m", "venv", "--without-pip", str(venv)], check=True)
    py = venv / "bin" / "python"
    site = Path(subprocess.run([str(py), "-c", "import sysconfig; print(sysconfig.get_paths()['purelib'])"],
                               check=True, capture_output=True, text=True).stdout.strip())
    (site / "project_venv.pth").write_text(sysconfig.get_paths()["purelib"] + "\n")  # deps + pip, not our code
    env = {"PATH": "/usr/bin:/bin", "HOME": str(tmp_path), "HF_HUB_OFFLINE": "1", "PIP_NO_INDEX": "1",
           "PIP_DISABLE_PIP_VERSION_CHECK": "1"}
    subprocess.run([str(py), "-m", "pip", "install", "-q", "--no-deps", "--no-build-isolation", "--no-compile",
                    str(src)], check=True, env=env, cwd=tmp_path)
    shutil.rmtree(src)  # nothing may come from the source tree any more
    run = tmp_path / "elsewhere"
    run.mkdir()
    where = subprocess.run([str(py), "-c", "import search_r1; print(search_r1.__file__)"], check=True,
                           capture_output=True, text=True, env=env, cwd=run).stdout.strip()
    assert where.startswith(str(site)), where
    out = subprocess.run([str(py), "-m", "search_r1.trainer.main", "--cfg", "job", "rollout.n=3"],
                         capture_output=True, text=True, env=env, cwd=run, timeout=300)
    assert out.returncode == 0, out.stderr[-2000:]
    assert "name: smollm2-135m-instruct" in out.stdout and "'n': 3" in out.stdout  # the override reached the composed config
    if not (site / "search_r1" / "trainer" / "configs" / "grpo_cpu.yaml").is_file():
        pytest.fail("the YAML is not in the installed package")

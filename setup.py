"""Distribution `search-r1-verl`: Search-R1 (RL with a search engine) on verl.

Install for development with `make test` / `make demo` (they create ./.venv): the CPU install pins
torch==2.13.0 (the CPU build found on this machine's disk) with constraints-cpu.txt. A GPU node runs
`pip install -e '.[gpu]'`: verl's own `vllm` extra, which pins vllm 0.24.0 with the torch (2.11.0) and
transformers it needs; tests/verl_ext/test_install_resolution.py checks with pip's resolver that this resolves.
"""
from setuptools import find_packages, setup

CORE = [
    # No exact pin here: the CPU install pins torch==2.13.0 (constraints-cpu.txt, used by the Makefile)
    # and the `gpu` extra takes the torch verl's vllm extra pins (2.11.0).
    "torch>=2.11",
    "verl==0.9.1",
    "transformers>=5.5.3,<5.11",
    "tensordict<=0.10.0",
    "gguf>=0.10",
    "safetensors>=0.4",
    # serve: `python -m retriever_server serve --ray` shards and replicates the retriever on Ray Serve.
    "ray[default,serve]>=2.40",
    "hydra-core>=1.3,<1.4",
    "omegaconf>=2.3,<2.4",
    "fastapi>=0.110",
    "uvicorn>=0.29",
    # uvicorn picks these up by itself: C HTTP parsing and event loop leave more of the GIL to the
    # search threads (BM25 at 100k: 3,979 -> 4,268 q/s on 2 cores).
    "httptools>=0.6",
    "uvloop>=0.19; sys_platform != 'win32'",
    "orjson>=3.9",
    "httpx>=0.27",
    "requests>=2.31",
    "bm25s>=0.2.10,<0.4",
    "PyStemmer>=2.2",
    "faiss-cpu>=1.8,<2",
    "sentence-transformers>=3.0",
    "numpy>=1.26",
    "pandas>=2.0",
    "pyarrow>=15",
    "tqdm>=4.66",
    "matplotlib>=3.8",
    "tensorboard>=2.15",
    "psutil>=5.9",
    # verl's `verl-core` extra, not its base dependencies: the agent loop imports cachetools, the v1
    # trainer TransferQueue (with pyzmq, msgspec). verl_ext runs both, on CPU in tests too.
    "cachetools>=5",
    "TransferQueue>=0.1.10",
    "pyzmq>=25",
    "msgspec>=0.18",
]

setup(
    name="search-r1-verl",
    version="0.1.0",
    description="Search-R1: train LLMs to reason with a search engine, on verl",
    packages=find_packages(include=["search_r1", "search_r1.*", "verl_ext", "verl_ext.*",
                                    "retriever_server", "retriever_server.*"]),
    # The trainer's Hydra configs live in the package so `pip install .` (not -e) can compose them.
    package_data={"search_r1.trainer": ["configs/*.yaml"], "verl_ext": ["configs/*.yaml", "configs/*/*.yaml"]},
    python_requires=">=3.10,<3.13",
    install_requires=CORE,
    extras_require={
        "test": ["pytest>=8", "pytest-timeout>=2.3", "pytest-asyncio>=0.23", "pytest-xdist>=3.6", "mkdocs-material>=9.5,<10"],
        # verl's GPU stack as verl itself declares it: vllm==0.24.0, torch==2.11.0, transformers==5.9.0.
        "gpu": ["verl[vllm]==0.9.1"],
        "wandb": ["wandb>=0.17"],
    },
    entry_points={
        "verl.plugins": ["search_r1 = verl_ext"],
        "console_scripts": ["search-r1-retriever = retriever_server.__main__:main"],
    },
)

"""Session fixture `synth_world`: a small generated QA world (seed 0, a few hundred passages).

Yields the world's directory (`pathlib.Path`) holding corpus.jsonl, train/test parquet and jsonl and
meta.json, as written by `search_r1.data.synth.generate_world`.
"""
import pytest

SYNTH_WORLD_SEED = 0
SYNTH_WORLD_ENTITIES = 120  # about 300 passages and 500 questions, generated in well under a second


@pytest.fixture(scope="session")
def synth_world(tmp_path_factory):
    from search_r1.data.synth import generate_world

    out = tmp_path_factory.mktemp("synth_world")
    generate_world(out, seed=SYNTH_WORLD_SEED, n_entities=SYNTH_WORLD_ENTITIES, progress=False)
    yield out

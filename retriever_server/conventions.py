"""Encoder conventions: how a dense retriever turns text into the vectors its index holds.

An index answers correctly only when queries are encoded the way its passages were. The families the
Search-R1 ecosystem uses (upstream's retrieval server and index builder pick them from the model
name the same way):

    name  query text                                 passage text       pooling  normalized
    e5    "query: " + q                              "passage: " + p    mean     yes
    bge   "Represent this sentence for searching     p                  cls      yes
           relevant passages: " + q  (English models; the Chinese models have their own
           instruction, bge-m3 none)
    st    q                                          p                  as the sentence-transformers
                                                                        directory declares (MiniLM: mean,
                                                                        normalized)
    dpr   q                                          p                  cls      no (raw inner product)

    emb = pool(last_hidden_state [n, L, H], attention_mask [n, L])        [n, H]
    emb = emb / ||emb||   when normalized (inner product = cosine)

`read_st_layout` reads what a sentence-transformers directory declares (its pooling, whether it
normalizes). `auto` picks the family from the model's name (its `_name_or_path` in config.json, else
the directory name): a name containing the word e5, bge or dpr; anything else is `st`. Flags
(--pooling, --query-prefix, --passage-prefix, --normalize/--no-normalize) override single fields. The
resolved convention is written into the index manifest and the server encodes queries by it, so an
index is never queried with another convention than the one its passages were encoded with.
"""
from __future__ import annotations

import json
import re
from dataclasses import asdict, dataclass, replace
from pathlib import Path

POOLINGS = ("mean", "cls", "max")
NAMES = ("auto", "e5", "bge", "st", "dpr")
BGE_EN_INSTRUCTION = "Represent this sentence for searching relevant passages: "
BGE_ZH_INSTRUCTION = "为这个句子生成表示以用于检索相关文章："
_SUPPORTED_MODULES = ("Transformer", "Pooling", "Normalize")  # sentence-transformers modules the encoder implements


@dataclass(frozen=True)
class EncoderConvention:
    """How texts become vectors; recorded in the manifest (`params["encoder"]`)."""

    name: str                  # family: e5 | bge | st | dpr (custom when a flag overrode a field)
    query_prefix: str = ""     # prepended to every query before tokenization
    passage_prefix: str = ""   # prepended to every passage before tokenization
    pooling: str = "mean"      # mean | cls | max over the last hidden states
    normalize: bool = True     # L2-normalize the pooled vector (inner product = cosine)

    def __post_init__(self):
        if self.pooling not in POOLINGS:
            raise ValueError(f"pooling={self.pooling!r}; allowed values are {list(POOLINGS)}")

    def as_dict(self) -> dict:
        return asdict(self)

    @classmethod
    def from_dict(cls, data: dict) -> "EncoderConvention":
        known = set(cls.__dataclass_fields__)
        return cls(**{k: v for k, v in data.items() if k in known})


def model_name(model_dir: Path) -> str:
    """The name a model goes by: config.json's `_name_or_path` when it names a hub model, else the
    directory's own name (lowercased)."""
    names = []
    for cfg in (model_dir / "config.json", model_dir / "0_Transformer" / "config.json"):
        if cfg.exists():
            try:
                names.append(str(json.loads(cfg.read_text()).get("_name_or_path") or ""))
            except ValueError:
                pass
    names.append(model_dir.resolve().name)
    return " ".join(n for n in names if n).lower()


def family_of(name: str) -> str:
    """e5 / bge / dpr when one of these words is in the model name (as upstream decides), else st."""
    for family in ("e5", "bge", "dpr"):
        if re.search(rf"(^|[^a-z0-9]){family}([^a-z0-9]|$)", name):
            return family
    return "st"


def family_convention(family: str, name: str, st_pooling: str, st_normalize: bool) -> EncoderConvention:
    """The convention of a family; `st_pooling` / `st_normalize` are what the model directory declares
    (sentence-transformers modules), used by `st` only."""
    if family == "e5":
        return EncoderConvention("e5", "query: ", "passage: ", "mean", True)
    if family == "bge":
        instruction = ("" if "bge-m3" in name else
                       BGE_ZH_INSTRUCTION if re.search(r"(^|[^a-z0-9])zh([^a-z0-9]|$)", name) else
                       BGE_EN_INSTRUCTION)
        return EncoderConvention("bge", instruction, "", "cls", True)
    if family == "dpr":
        return EncoderConvention("dpr", "", "", "cls", False)
    if family == "st":
        return EncoderConvention("st", "", "", st_pooling, st_normalize)
    raise ValueError(f"--convention {family!r}; allowed values are {list(NAMES)}")


def read_st_layout(model_dir: Path) -> tuple[Path, str, int | None, bool]:
    """(transformer dir, pooling mode, max_seq_length, normalized) of a sentence-transformers or HF
    directory; a plain HF directory gives mean pooling, normalized.

    Raises:
        ValueError: for sentence-transformers modules this encoder does not implement (e.g. Dense).
    """
    modules_file = model_dir / "modules.json"
    if not modules_file.exists():
        return model_dir, "mean", None, True
    transformer_dir, pooling, normalize = model_dir, "mean", False
    for module in json.loads(modules_file.read_text()):
        kind = module["type"].rsplit(".", 1)[-1]
        if kind not in _SUPPORTED_MODULES:
            raise ValueError(f"{modules_file}: module type {module['type']!r} is not supported; "
                             f"supported: {list(_SUPPORTED_MODULES)}")
        path = model_dir / module.get("path", "")
        if kind == "Transformer":
            transformer_dir = path
        elif kind == "Normalize":
            normalize = True
        elif kind == "Pooling" and (path / "config.json").exists():
            cfg = json.loads((path / "config.json").read_text())
            pooling = ("cls" if cfg.get("pooling_mode_cls_token") else
                       "max" if cfg.get("pooling_mode_max_tokens") else "mean")
    max_len = None
    for cfg_dir in (transformer_dir, model_dir):
        cfg_file = cfg_dir / "sentence_bert_config.json"
        if cfg_file.exists():
            max_len = json.loads(cfg_file.read_text()).get("max_seq_length")
            break
    return transformer_dir, pooling, max_len, normalize


def resolve_convention(model_dir: Path, convention: str = "auto", pooling: str | None = None,
                       query_prefix: str | None = None, passage_prefix: str | None = None,
                       normalize: bool | None = None) -> EncoderConvention:
    """The convention for `model_dir`: the named family (`auto`: from the model's name), then any
    field given explicitly (not None) overrides it.

    Raises:
        ValueError: for an unknown convention name or pooling mode.
    """
    if convention not in NAMES:
        raise ValueError(f"--convention {convention!r}; allowed values are {list(NAMES)}")
    _, st_pooling, _, st_normalize = read_st_layout(model_dir)
    name = model_name(model_dir)
    family = family_of(name) if convention == "auto" else convention
    conv = family_convention(family, name, st_pooling, st_normalize)
    overrides = {k: v for k, v in dict(pooling=pooling, query_prefix=query_prefix,
                                       passage_prefix=passage_prefix, normalize=normalize).items()
                 if v is not None and v != getattr(conv, k)}
    if overrides:
        conv = replace(conv, **overrides, name=f"{conv.name}+custom")
    return conv


# Indexes built before conventions were recorded: MiniLM-style, as the encoder did then.
LEGACY = EncoderConvention("st", "", "", "mean", True)

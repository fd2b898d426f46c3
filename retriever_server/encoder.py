"""Text encoder for dense retrieval: HF transformers + the pooling a sentence-transformers dir declares.

Reads a sentence-transformers directory (modules.json: Transformer -> Pooling -> optional Normalize)
or a plain HF encoder directory (mean pooling), with transformers' AutoModel/AutoTokenizer only.
Importing sentence-transformers costs 2-3x more start-up time than transformers (it pulls in
scikit-learn and its training stack), which a query server pays on every start.

    emb = pool(last_hidden_state [n, L, H], attention_mask [n, L])   -> [n, H] float32
    emb = emb / ||emb||                                               (when the convention normalizes)

Pooling `mean` averages the non-padding token states, `cls` takes the first token, `max` the
element-wise max over non-padding tokens. The encoder convention (conventions.py: e5, bge, st, dpr)
says which pooling, which query / passage prefix and whether vectors are L2-normalized; without one,
the pooling the directory declares and normalization (inner product = cosine).
"""
from __future__ import annotations

import hashlib
import threading
from pathlib import Path

import numpy as np

from .conventions import EncoderConvention, read_st_layout
from .cpu import has_amx_int8

QUANTIZE = ("none", "int8")


def model_fingerprint(model_dir: Path) -> str:
    """sha256 over the transformer's config.json and, per weight file, its size and first 4 MiB:
    cheap for a 400 MB encoder, and different for two models of the same architecture (e5-base and
    bge-base share their config)."""
    transformer_dir = read_st_layout(Path(model_dir))[0]
    h = hashlib.sha256()
    cfg = transformer_dir / "config.json"
    if cfg.exists():
        h.update(cfg.read_bytes())
    for name in sorted(p.name for p in transformer_dir.iterdir() if p.name.endswith((".safetensors", ".bin"))):
        path = transformer_dir / name
        h.update(f"{name}:{path.stat().st_size}".encode())
        with open(path, "rb") as f:
            h.update(f.read(4 << 20))
    return h.hexdigest()[:16]


def int8_engine() -> str:
    """torch's quantized engine for the int8 encoder: oneDNN on CPUs with AMX int8 tiles (measured
    1.25x the default x86/fbgemm engine there, 1.95x fp32 instead of 1.55x), else torch's default."""
    import torch
    if has_amx_int8() and "onednn" in torch.backends.quantized.supported_engines:
        return "onednn"
    return torch.backends.quantized.engine


class TextEncoder:
    """Batched text -> [n, dim] float32 vectors (unit norm unless the convention says otherwise);
    safe to call from several threads. `encode_queries` / `encode_passages` add the convention's
    prefixes."""

    def __init__(self, model_dir: str | Path, quantize: str = "none", max_seq_length: int | None = None,
                 convention=None):
        if quantize not in QUANTIZE:
            raise ValueError(f"quantize={quantize!r}; allowed values are {list(QUANTIZE)}")
        import torch
        from transformers import AutoModel, AutoTokenizer

        transformer_dir, st_pooling, st_max_len, _ = read_st_layout(Path(model_dir))
        if convention is None:
            convention = EncoderConvention("st", pooling=st_pooling, normalize=True)
        self.convention = convention
        self.pooling, self.normalize = convention.pooling, convention.normalize
        self.tokenizer = AutoTokenizer.from_pretrained(str(transformer_dir), local_files_only=True)
        self.model = AutoModel.from_pretrained(str(transformer_dir), local_files_only=True).eval()
        limit = getattr(self.model.config, "max_position_embeddings", 512)
        self.max_seq_length = min(max_seq_length or st_max_len or 512, limit)
        if quantize == "int8":
            # Dynamic quantization: Linear weights int8, activations quantized per batch. The Linear
            # layers hold nearly all of a small BERT's FLOPs, so queries encode ~2x faster on CPU.
            # Per-channel weight scales keep cosine to fp32 at ~0.98 (per-tensor: ~0.945) at the same speed.
            import warnings
            from torch.ao.quantization import per_channel_dynamic_qconfig, quantize_dynamic
            # The engine packs the int8 weights; the packed kernels it picks run every later call.
            torch.backends.quantized.engine = int8_engine()
            with warnings.catch_warnings():
                warnings.simplefilter("ignore", UserWarning)  # torch's deprecation notice for quantized tensors
                self.model = quantize_dynamic(self.model, {torch.nn.Linear: per_channel_dynamic_qconfig},
                                              dtype=torch.qint8)
        self.quantize = quantize
        self.int8_engine = torch.backends.quantized.engine if quantize == "int8" else None
        self.dim = int(self.model.config.hidden_size)
        # HF fast tokenizers raise "Already borrowed" when two threads tokenize with padding at once.
        self._tokenizer_lock = threading.Lock()

    def _pool(self, hidden, mask):
        if self.pooling == "cls":
            return hidden[:, 0]
        m = mask.unsqueeze(-1).to(hidden.dtype)                          # [n, L, 1]
        if self.pooling == "max":
            return hidden.masked_fill(m == 0, float("-inf")).max(dim=1).values
        return (hidden * m).sum(dim=1) / m.sum(dim=1).clamp(min=1e-9)   # [n, H]

    def encode_queries(self, texts: list[str], batch_size: int = 64) -> np.ndarray:
        """Queries as the convention encodes them (e5: "query: " + q, bge: its instruction + q)."""
        prefix = self.convention.query_prefix
        return self.encode([prefix + t for t in texts] if prefix else texts, batch_size)

    def encode_passages(self, texts: list[str], batch_size: int = 64) -> np.ndarray:
        """Passages as the convention encodes them (e5: "passage: " + p)."""
        prefix = self.convention.passage_prefix
        return self.encode([prefix + t for t in texts] if prefix else texts, batch_size)

    def encode(self, texts: list[str], batch_size: int = 64) -> np.ndarray:
        """[n] texts, as given -> [n, dim] float32, L2-normalized when the convention says so (rows in
        input order)."""
        import torch
        out = np.zeros((len(texts), self.dim), dtype=np.float32)
        # Length-sorted batches pad less; results are scattered back to input order.
        order = sorted(range(len(texts)), key=lambda i: len(texts[i]))
        with torch.inference_mode():
            for start in range(0, len(order), batch_size):
                idx = order[start:start + batch_size]
                with self._tokenizer_lock:
                    batch = self.tokenizer([texts[i] for i in idx], padding=True, truncation=True,
                                           max_length=self.max_seq_length, return_tensors="pt")
                hidden = self.model(input_ids=batch["input_ids"],
                                    attention_mask=batch["attention_mask"]).last_hidden_state
                emb = self._pool(hidden, batch["attention_mask"])                 # [b, H]
                if self.normalize:
                    emb = torch.nn.functional.normalize(emb, dim=-1)
                out[idx] = emb.float().numpy()
        return out

"""The critic's model loads with the attention kernel its config names, not always FlashAttention-2.

verl 0.9.1 builds the critic (a value model) through `verl.utils.model.load_valuehead_model`, which
passes `attn_implementation="flash_attention_2"` to transformers whatever
`critic.model.override_config.attn_implementation` says (the actor's loader honours that key). Without
the `flash_attn` package the load fails, verl swallows the error and falls back to trl's value-head
model, and without trl (neither is in `.[gpu]`) the worker dies at start with "is not a value head
model, please install trl", which names neither the kernel nor the key. The `ppo_verl` CPU rehearsal
hit exactly that; a GPU node without flash-attn would too.

verl's `HFModelConfig` has already put the configured kernel on the HF config it hands the loader
(`AutoConfig.from_pretrained(..., attn_implementation=override_config.get("attn_implementation",
"flash_attention_2"))`), so the loader below reads it from there: unset, it is still verl's
flash_attention_2. verl's engine imports the loader from `verl.utils.model` at the moment it builds the
critic (transformer_impl `_build_module`), so replacing that module attribute is enough, and it is done
right after `verl.utils.model` is imported (verl_ext/__init__.py). When the token-classification load
fails and trl is installed, verl's own loader runs (its value-head path is unchanged); without trl the
error says what failed.
"""
from __future__ import annotations

import verl.utils.model as verl_model

VERL_LOADER = verl_model.load_valuehead_model
DEFAULT_ATTENTION = "flash_attention_2"  # verl's HFModelConfig default when override_config is silent


def configured_attention(model_config) -> str:
    """The attention kernel verl's HFModelConfig put on the critic's HF config (verl's default if none)."""
    return getattr(model_config, "_attn_implementation", None) or DEFAULT_ATTENTION


def load_valuehead_model(local_path, torch_dtype, model_config, trust_remote_code):
    """verl's `load_valuehead_model` (same signature and result) with the configured attention kernel."""
    from transformers import AutoModelForTokenClassification

    attention = configured_attention(model_config)
    try:
        return AutoModelForTokenClassification.from_pretrained(
            pretrained_model_name_or_path=local_path, torch_dtype=torch_dtype, config=model_config,
            attn_implementation=attention, trust_remote_code=trust_remote_code)
    except Exception as error:  # noqa: BLE001 - verl falls back on any failure; so do we, when it can
        if verl_model.is_trl_available():
            return VERL_LOADER(local_path, torch_dtype, model_config, trust_remote_code)
        raise RuntimeError(
            f"the critic's value model could not be built from {local_path} with "
            f"attn_implementation={attention} ({type(error).__name__}: {error}); set "
            f"critic.model.override_config.attn_implementation to a kernel this machine has (sdpa needs "
            f"nothing extra; flash_attention_2 needs `pip install flash-attn`)") from error


verl_model.load_valuehead_model = load_valuehead_model

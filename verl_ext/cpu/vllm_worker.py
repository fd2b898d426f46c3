"""The vLLM worker extension of the CPU rollout: verl's extension plus re-creating packed weights.

Why: on CPU, vLLM's `UnquantizedLinearMethod.process_weights_after_loading` hands each linear
layer's weight to a packed GEMM (oneDNN, or the sgl/zentorch kernels) and replaces `layer.weight`
with an empty `Parameter` (`dispatch_cpu_unquantized_gemm(layer, remove_weight=True)`, vllm
0.27.1 `model_executor/layers/utils.py`). That is fine for serving, but a weight sync calls
`model.load_weights`, which looks up `param.weight_loader` on that empty Parameter and fails
(`AttributeError: 'Parameter' object has no attribute 'weight_loader'`). Whether it happens depends
on the CPU and dtype: where oneDNN cannot build the packed matmul (bf16 on an AVX2-only CPU) vLLM
keeps the plain weight and the sync works; on AVX512 CPUs, and for fp32 everywhere, it fails.

Fix: before each sync, every linear layer whose weight was packed away gets a fresh weight
`Parameter` from its own quant method (`create_weights`, with the loader the layer was built with),
so `load_weights` fills it as at start-up; verl's extension already runs vLLM's
`process_weights_after_loading` after the last bucket, which packs the new weights again. Nothing
in vLLM or verl is patched: vLLM mixes this class into its worker (`worker_extension_cls`, chosen by
`verl_ext.cpu.vllm_server`).

verl's `vLLMColocateWorkerExtension` is subclassed rather than wrapped because vLLM adds the
extension to the worker's bases: its methods must be methods of this class.
"""
from __future__ import annotations

import logging

import torch
from verl.workers.rollout.vllm_rollout.utils import vLLMColocateWorkerExtension

logger = logging.getLogger(__name__)


def _weight_loader(layer):
    """The loader vLLM passed to `create_weights` when it built `layer` (vllm.model_executor.layers.linear)."""
    from vllm.model_executor.layers.linear import WEIGHT_LOADER_V2_SUPPORTED, ReplicatedLinear

    if isinstance(layer, ReplicatedLinear) or type(layer.quant_method).__name__ not in WEIGHT_LOADER_V2_SUPPORTED:
        return layer.weight_loader
    return layer.weight_loader_v2


def packed_away(layer) -> bool:
    """True for a vLLM linear layer whose weight the CPU GEMM dispatch replaced by an empty Parameter."""
    from vllm.model_executor.layers.linear import LinearBase, UnquantizedLinearMethod

    weight = getattr(layer, "weight", None)
    return (isinstance(layer, LinearBase) and isinstance(getattr(layer, "quant_method", None), UnquantizedLinearMethod)
            and isinstance(weight, torch.nn.Parameter) and weight.numel() == 0
            and not hasattr(weight, "weight_loader"))


def restore_packed_weights(model: torch.nn.Module) -> int:
    """Give every packed-away linear layer of `model` a loadable weight Parameter again; returns how many.

    The new Parameter has the layer's full (per-partition) shape and dtype and is left uninitialised:
    a weight sync overwrites all of it before vLLM packs it again.
    """
    restored = 0
    for layer in model.modules():
        if not packed_away(layer):
            continue
        layer.quant_method.create_weights(
            layer=layer,
            input_size_per_partition=getattr(layer, "input_size_per_partition", layer.input_size),
            output_partition_sizes=layer.output_partition_sizes,
            input_size=layer.input_size,
            output_size=layer.output_size,
            params_dtype=layer.params_dtype,
            weight_loader=_weight_loader(layer),
        )
        restored += 1
    return restored


class CPUWeightSyncExtension(vLLMColocateWorkerExtension):
    """verl's colocated-worker extension whose weight syncs work on vLLM's CPU backend."""

    def update_weights_from_ipc(self, *args, **kwargs):
        restored = sum(restore_packed_weights(model) for model in self._iter_all_models())
        if restored:
            logger.info("CPU weight sync: %d packed linear weights re-created for loading", restored)
        return super().update_weights_from_ipc(*args, **kwargs)

    def load_weights_from_safetensors(self, path: str) -> int:
        """Load every tensor of a safetensors file (HF parameter names) into the served model; returns
        how many. The embedded trainer's vLLM rollout calls this through `vllm serve`'s /collective_rpc
        (search_r1.rollout.vllm_server.VLLMServer.load_weights) after every update."""
        from safetensors.torch import load_file
        from vllm.model_executor.model_loader.utils import process_weights_after_loading

        weights = load_file(path)
        model = self.model_runner.model
        restore_packed_weights(model)
        model.load_weights(weights.items())
        # re-pack the new weights for the CPU GEMMs, as after the start-up load
        process_weights_after_loading(model, self.model_runner.vllm_config.model_config, self.device)
        return len(weights)

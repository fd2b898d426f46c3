"""Counting the bf16 casts autocast makes of a model's weights (the matrices), per weight."""
from collections import Counter

import torch
from torch.utils._python_dispatch import TorchDispatchMode


class WeightCasts(TorchDispatchMode):
    """`with WeightCasts(model) as casts:` ... then `casts.count[data_ptr]` is how many times that
    2-D parameter was cast to bf16 inside the block (autocast's cached casts are not counted: a
    cache hit dispatches nothing)."""

    def __init__(self, model):
        super().__init__()
        self.weights = {p.data_ptr() for p in model.parameters() if p.dim() == 2}
        self.count = Counter()

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if (func is torch.ops.aten._to_copy.default and kwargs.get("dtype") == torch.bfloat16
                and args[0].data_ptr() in self.weights):
            self.count[args[0].data_ptr()] += 1
        return func(*args, **kwargs)

"""A reproducible random stream per layer, so where a layer runs never changes its randomness.

Stages draw from their own process's global RNG, so dropout on stage 2 and dropout on stage 3
would see correlated masks (every process seeded alike), and a dropout layer that migrates would
continue from another stream. Here every layer that may draw random numbers runs under a seed
made of the run's base seed, the step, the micro-batch and the layer's index in the traced graph:
the same numbers on whichever stage the layer sits, and the same as a one-stage run of the same
pipeline. The process's global RNG is restored afterwards, so the rest of the program sees no
difference (the default generators are saved and restored directly: ``torch.random.fork_rng``
costs ~100 us a call, which on small layers distorted the stage times rebalancing measures).
``torch.utils.checkpoint`` keeps the seeded state for recomputation, so recomputed layers draw
the same masks.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import Any

import torch
import torch.nn.functional as F
from torch import fx, nn

_RANDOM_MODULES: tuple[type[nn.Module], ...] = (nn.modules.dropout._DropoutNd, nn.RReLU)
_RANDOM_FUNCTIONS: frozenset[Callable[..., Any]] = frozenset(
    {
        F.dropout, F.dropout1d, F.dropout2d, F.dropout3d, F.alpha_dropout, F.feature_alpha_dropout, F.rrelu,
        F.gumbel_softmax, torch.dropout, torch.bernoulli, torch.rand, torch.randn, torch.randint,
        torch.rand_like, torch.randn_like, torch.randint_like, torch.randperm, torch.normal,
        torch.multinomial,
    }
)  # fmt: skip
_MIX = 0x9E3779B97F4A7C15
_MASK = (1 << 63) - 1


def _draws_itself(module: nn.Module) -> bool:
    """Whether ``module``'s own code (not its children's) may consume random numbers in its current mode."""
    if not type(module).__module__.startswith("torch."):
        return True  # a user's module, in either mode (Monte Carlo dropout): assume it may
    if not module.training:
        return False
    if isinstance(module, nn.modules.dropout._DropoutNd):
        return module.p > 0
    if isinstance(module, (nn.MultiheadAttention, nn.RNNBase)):
        return module.dropout > 0
    return isinstance(module, _RANDOM_MODULES)


def module_draws_random(module: nn.Module) -> bool:
    """Whether calling ``module`` (a leaf of the trace) may consume random numbers in its current mode.

    torch's own leaves are containers too: ``nn.TransformerEncoderLayer`` holds ``nn.Dropout`` modules,
    ``nn.MultiheadAttention`` and the recurrent layers apply dropout from a float attribute, so the
    whole subtree is asked, not only the leaf's own type."""
    if not module._modules:  # most leaves (Linear, Conv, norms): asked at every call, so keep it cheap
        return _draws_itself(module)
    return any(_draws_itself(sub) for sub in module.modules())


def may_draw_random_ever(module: nn.Module) -> bool:
    """Whether ``module`` may consume random numbers in some mode and setting (``module_draws_random``
    answers for the present ones): a user's module anywhere in it, or a torch module that can."""
    random_types = (*_RANDOM_MODULES, nn.MultiheadAttention, nn.RNNBase)
    subs = module.modules()
    return any(not type(sub).__module__.startswith("torch.") or isinstance(sub, random_types) for sub in subs)


def may_draw_random(node: fx.Node, module: nn.Module | None) -> bool:
    """Whether running ``node`` may consume random numbers (known random ops, torch modules that hold
    one, or user modules)."""
    if node.op == "call_module" and module is not None:
        return module_draws_random(module)
    if node.op == "call_function":  # an exported layer (export_capture.ExportedLayer) says so itself
        return node.target in _RANDOM_FUNCTIONS or getattr(node.target, "draws_random", False) is True
    return False


def layer_seed(base: int, step: int, micro_batch: int, layer: int) -> int:
    """A 63-bit seed that depends on all four numbers (a simple multiplicative mix)."""
    value = base & _MASK
    for part in (step, micro_batch, layer):
        value = ((value ^ (part + 1)) * _MIX) & _MASK
    return value


@contextmanager
def seeded(seed: int, device: torch.device | None) -> Iterator[None]:
    """Run the block with the CPU generator (and ``device``'s, on CUDA) seeded, then restore both."""
    generators = [torch.default_generator]
    if device is not None and device.type == "cuda":
        index = device.index if device.index is not None else torch.cuda.current_device()
        generators.append(torch.cuda.default_generators[index])
    states = [generator.get_state() for generator in generators]
    for generator in generators:
        generator.manual_seed(seed)
    try:
        yield
    finally:
        for generator, state in zip(generators, states):
            generator.set_state(state)

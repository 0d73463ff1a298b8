"""The user's optimizer, rewired in place to own only this rank's parameter slices.

Each param group of the optimizer is given, instead of the model's parameters, one flat tensor
per bucket: the slice of that bucket's parameters this rank owns (a view into the model's
storage). The optimizer object itself stays the same, so Lightning's LR schedulers, the
``param_groups`` hyperparameters and ``zero_grad`` keep working, and state exists only for the
slice, about ``1/L`` of the model with equal weights.

This is exact for optimizers whose update is elementwise (``SGD``, ``Adam``, ``AdamW``,
``Adagrad``, ``RMSprop``, ...). Optimizers that look at a parameter's shape, its norm or at all
parameters at once (``LBFGS``, ``Adafactor``, ``Muon``, ``SparseAdam``, LAMB, LARS, Shampoo) would
silently train differently and are refused, and so is any optimizer this module does not know,
unless the user declares it elementwise (``HierSlicedStrategy(elementwise_optimizers=[...])``).

Checkpoints hold the optimizer state *consolidated*: exactly the layout ``state_dict()`` of the
unsharded optimizer would have (per original parameter, original numbering), so a checkpoint
resumes under any topology, or under plain ``ddp``.
"""

from __future__ import annotations

import functools
import math
from collections.abc import Sequence
from typing import Any

import torch
import torch.distributed as dist
from lightning.fabric.utilities.rank_zero import rank_zero_warn
from torch import nn
from torch.distributed.optim import ZeroRedundancyOptimizer

from lightning_hier.sliced.flat_buckets import FlatBucket
from lightning_hier.sliced.reducer import all_gather_slices

NOT_ELEMENTWISE = ("LBFGS", "SparseAdam", "Adafactor", "Muon", "Lamb", "LAMB", "Lars", "LARS", "Shampoo")
ELEMENTWISE = (
    "SGD", "Adam", "AdamW", "Adamax", "Adagrad", "Adadelta", "RMSprop", "Rprop", "NAdam", "RAdam", "ASGD",
)  # fmt: skip
SCALAR_STATE_KEYS = ("step",)


def _unwrapped(function: Any) -> Any:
    """A function without its decorators (torch's profiling hook and ``no_grad`` wrappers)."""
    while hasattr(function, "__wrapped__"):
        function = function.__wrapped__
    return function


def update_rule_of(optimizer: torch.optim.Optimizer) -> str:
    """The name of the optimizer whose update ``optimizer.step`` runs: a subclass of a known torch optimizer
    that keeps its ``step`` (one that only changes defaults or adds attributes) runs the parent's update;
    any other class is its own."""
    cls = type(optimizer)
    step = _unwrapped(cls.step)
    for base in cls.__mro__[1:]:
        if (
            base.__module__.startswith("torch.optim")
            and base.__name__ in ELEMENTWISE
            and _unwrapped(base.step) is step
        ):
            return base.__name__
    return cls.__name__


def check_optimizer(
    optimizer: torch.optim.Optimizer,
    declared_elementwise: Sequence[str] = (),
    strategy: str = "HierSlicedStrategy",
) -> None:
    """Refuse optimizers whose update is not elementwise, and unknown ones not declared elementwise.

    ``declared_elementwise`` lists optimizer class names the user vouches for (an update that looks
    only at each element's own gradient and state: no per-tensor norms, shapes or trust ratios).
    ``strategy`` is the class the errors name (hier_bsp's server shards the optimizer the same way).
    """
    name = type(optimizer).__name__
    if name in NOT_ELEMENTWISE:
        raise ValueError(
            f"{name} cannot run on flat parameter slices: its update is not elementwise. "
            f"{strategy} supports elementwise optimizers such as {', '.join(ELEMENTWISE)}; "
            f"{_whole_optimizer_alternative(strategy, name)}"
        )
    if update_rule_of(optimizer) not in ELEMENTWISE and name not in declared_elementwise:
        raise ValueError(
            f"{strategy} shards the optimizer by flat parameter slices, which gives DDP's result "
            "only if its update is elementwise (no per-tensor norms, shapes or trust ratios). "
            f"{name} is not one it knows ({', '.join(ELEMENTWISE)}). "
            f"If {name}'s update is elementwise, declare it: "
            f"{strategy}(elementwise_optimizers=[{name!r}]); otherwise "
            f"{_whole_optimizer_alternative(strategy, name)}"
        )


# need more than whole parameters on every rank: a closure re-running backward (LBFGS), sparse gradients
NEVER_REPLICATED = ("LBFGS", "SparseAdam")


def refuse_zero_redundancy(optimizer: torch.optim.Optimizer, strategy: str = "HierSlicedStrategy") -> None:
    """Refuse torch's ``ZeroRedundancyOptimizer``: it shards the optimizer state over the ranks itself, what
    ``strategy`` already does inside each node, and its ``state_dict()`` needs a ``consolidate_state_dict()``
    on every rank first, so the run would fail at its first checkpoint."""
    if not isinstance(optimizer, ZeroRedundancyOptimizer):
        return
    inner = getattr(getattr(optimizer, "_optim_constructor", None), "__name__", None) or "Adam"
    raise ValueError(
        f"ZeroRedundancyOptimizer shards the optimizer state over the ranks, which {strategy} already does "
        "inside each node (each rank keeps the state of its slices), and its state_dict() would fail at the "
        f"first checkpoint. Return the optimizer it wraps from configure_optimizers instead: "
        f"torch.optim.{inner}(params, ...) in place of ZeroRedundancyOptimizer(params, "
        f"optimizer_class=torch.optim.{inner}, ...)."
    )


def decide_sharding(
    optimizer: torch.optim.Optimizer, declared_elementwise: Sequence[str], shard_optimizer: bool | None
) -> bool:
    """Whether ``hier_sliced`` shards ``optimizer`` by flat slices (else it stays whole on every rank).

    ``shard_optimizer=None`` (the default): shard an elementwise optimizer, keep any other whole, with a
    warning that says why and what it costs; ``True``: shard or refuse (:func:`check_optimizer`);
    ``False``: keep it whole."""
    refuse_zero_redundancy(optimizer)
    name = type(optimizer).__name__
    if shard_optimizer or name in NEVER_REPLICATED:
        check_optimizer(optimizer, declared_elementwise)
        return True
    if shard_optimizer is False:
        return False
    try:
        check_optimizer(optimizer, declared_elementwise)
    except ValueError:
        known = name in NOT_ELEMENTWISE
        why = "its update is not elementwise" if known else "its update is not known to be elementwise"
        declare = "" if known else f", or elementwise_optimizers=[{name!r}] if it is elementwise"
        rank_zero_warn(
            f"HierSlicedStrategy keeps {name} whole on every rank, as ddp does ({why}, so flat slices "
            "would change its math): the gradients are still reduced hierarchically, but its state is not "
            f"sharded. Pass shard_optimizer=False to say so{declare}."
        )
        return False
    return True


def check_server_optimizer(
    optimizer: torch.optim.Optimizer, elementwise_optimizers: Sequence[str], devices_per_node: int | None
) -> None:
    """Whether ``hier_bsp``'s parameter server can step ``optimizer`` (else raise). With
    ``devices_per_node=1`` every rank's server slice is whole buckets, so each optimizer parameter is a whole
    model parameter with its shape (:class:`~lightning_hier.sliced.piece_sharding.PieceSharding`) and any
    optimizer that steps parameter by parameter runs as under ``ddp`` (Adafactor, LARS-like); otherwise the
    slices cut parameters, and only elementwise updates are exact (:func:`check_optimizer`)."""
    refuse_zero_redundancy(optimizer, "HierBSPStrategy")
    name = type(optimizer).__name__
    if devices_per_node == 1 and name not in NEVER_REPLICATED:
        return
    check_optimizer(optimizer, elementwise_optimizers, strategy="HierBSPStrategy")


def _whole_optimizer_alternative(strategy: str, name: str) -> str:
    if strategy == "HierSlicedStrategy" and name not in NEVER_REPLICATED:
        return (
            "pass HierSlicedStrategy(shard_optimizer=False): it then runs whole on every rank, as under ddp."
        )
    if strategy == "HierBSPStrategy" and name not in NEVER_REPLICATED:
        return (
            "pass HierBSPStrategy(devices_per_node=1): every rank then holds the whole server and the "
            "optimizer steps whole parameters, as under ddp."
        )
    return "use strategy='ddp' for this optimizer."


def refuse_shared_parameters(
    optimizers: Sequence[torch.optim.Optimizer],
    module: nn.Module,
    groups: Sequence[Sequence[Sequence[nn.Parameter]]] | None = None,
) -> None:
    """Refuse two optimizers that hold the same parameter (at setup, before any collective: every rank
    raises alike). Each optimizer's parameters live in flat buckets of its own, sliced over the node's ranks,
    and a parameter can live in one bucket only. ``groups``: each optimizer's param groups as module
    parameters, where its ``param_groups`` hold slices."""
    names = {id(p): n for n, p in module.named_parameters(remove_duplicate=False)}
    if groups is None:
        groups = [[group["params"] for group in optimizer.param_groups] for optimizer in optimizers]
    owner: dict[int, int] = {}
    for index, param_groups in enumerate(groups):
        for params in param_groups:
            for param in params:
                first = owner.setdefault(id(param), index)
                if first != index:
                    name = names.get(id(param), f"of shape {tuple(param.shape)}")
                    raise ValueError(
                        f"optimizers {first} and {index} both hold parameter {name!r}: "
                        "HierSlicedStrategy lays each optimizer's parameters into flat buckets of its own "
                        "(sliced over the node's ranks), and a parameter can live in one only. Give it to "
                        "one optimizer (a param group of its own there keeps its own lr and other settings), "
                        "or train this model with strategy='ddp'."
                    )


def frozen_parameters(module: nn.Module) -> list[tuple[str, nn.Parameter]]:
    """``module``'s parameters that do not require a gradient now (at setup), with their names."""
    return [(name, param) for name, param in module.named_parameters() if not param.requires_grad]


TAKEN_IN_BETWEEN_STEPS = (
    "between steps (in a callback's or the module's on_train_epoch_start or on_train_batch_start, as "
    "Lightning's BaseFinetuning does)"
)


def check_no_new_parameters(
    optimizer: torch.optim.Optimizer,
    groups_at_setup: int,
    frozen_at_setup: Sequence[tuple[str, nn.Parameter]],
    strategy: str,
) -> None:
    """Refuse parameters the optimizer gained that the strategy has not taken in: a param group added
    (``add_param_group``), or a parameter frozen when the shards were laid out (:func:`frozen_parameters`)
    that now has a gradient. The strategies take such parameters in between steps (the engines'
    ``take_in_new_parameters``); one added during a step, or trainable but in no param group, would
    silently never be updated. Looks at the frozen parameters only: it runs every step."""
    for name, param in frozen_at_setup:
        if param.requires_grad and param.grad is not None:
            raise RuntimeError(
                f"parameter {name!r} was frozen at setup (when {strategy} laid out the optimizer's shards) "
                f"and has a gradient now, but {strategy} has not taken it in, so it would never be updated: "
                f"it takes in parameters unfrozen {TAKEN_IN_BETWEEN_STEPS}, not during a step; a parameter "
                "in none of the optimizer's param groups must be added with optimizer.add_param_group "
                "(BaseFinetuning.unfreeze_and_add_param_group does both)."
            )
    groups_now = len(optimizer.param_groups)
    if groups_now != groups_at_setup:
        raise RuntimeError(
            f"the optimizer has {groups_now} param groups, {groups_at_setup} when {strategy} laid out its "
            f"shards: {strategy} takes in a group from add_param_group {TAKEN_IN_BETWEEN_STEPS}, not during "
            "a step (the groups hold flat slices then)."
        )


def with_added_groups(state: dict[str, Any], param_groups: Sequence[dict[str, Any]]) -> dict[str, Any]:
    """A consolidated optimizer ``state`` (numbered as torch's ``state_dict()``) with an entry for each param
    group of ``param_groups`` beyond its own (added with ``add_param_group`` since it was taken): their
    settings, and their parameters numbered after the others, as torch numbers them, with no state yet."""
    saved = list(state["param_groups"])
    numbered = sum(len(group["params"]) for group in saved)
    for group in param_groups[len(saved) :]:
        count = len(group["params"])
        saved.append(
            {
                **{k: v for k, v in group.items() if k != "params"},
                "params": list(range(numbered, numbered + count)),
            }
        )
        numbered += count
    return {"state": state["state"], "param_groups": saved}


def is_elementwise_state(key: str, value: Any, shape: torch.Size) -> bool:
    """Whether optimizer state ``key`` holds one value per element of a slice of ``shape``."""
    return key not in SCALAR_STATE_KEYS and torch.is_tensor(value) and value.shape == shape


class OptimizerSharding:
    """Owns the rewiring of one optimizer onto the slices of ``buckets``."""

    def __init__(
        self,
        optimizer: torch.optim.Optimizer,
        buckets: Sequence[FlatBucket],
        bucket_group: Sequence[int],
        original_groups: Sequence[Sequence[nn.Parameter]],
        param_of_index: Sequence[nn.Parameter],
        intra_group: dist.ProcessGroup,
    ) -> None:
        self.optimizer = optimizer
        self.buckets = list(buckets)
        self.intra_group = intra_group
        self.bucket_group = list(bucket_group)
        self.shards = [nn.Parameter(bucket.owned_params(), requires_grad=False) for bucket in self.buckets]
        self._original_groups = [list(group) for group in original_groups]
        # state_dict numbering of the unsharded optimizer: groups in order, each parameter once
        self._state_index: dict[int, int] = {}
        for group in self._original_groups:
            for param in group:
                self._state_index.setdefault(id(param), len(self._state_index))
        self._index_of_param = {id(p): i for i, p in enumerate(param_of_index)}
        self._param_of_index = list(param_of_index)
        # state the optimizer already holds for its own parameters: made at construction (Adagrad's "sum"
        # in torch 2.11 and before), loaded by the user in configure_optimizers, or left by an earlier fit
        # of the same optimizer object; each rank keeps its slices of it rather than dropping it
        original_ids = set(self._state_index)
        held = None
        if optimizer.state and all(id(key) in original_ids for key in optimizer.state):
            held = optimizer.state_dict()
        for group_index, group in enumerate(optimizer.param_groups):
            group["params"] = self._optimizer_params(group_index)
        optimizer.state.clear()
        if held is not None:
            self.load_consolidated_state_dict(held)
        self.holds_slices = True  # the optimizer steps this object's slices (until unshard or unshard_into)

    def _optimizer_params(self, group_index: int) -> list[nn.Parameter]:
        """What the optimizer steps for param group ``group_index``: one slice per bucket."""
        return [self.shards[b] for b, g in enumerate(self.bucket_group) if g == group_index]

    def original_groups(self) -> list[list[nn.Parameter]]:
        """The optimizer's param groups as the user built them, each parameter numbered once."""
        seen: set[int] = set()
        groups = []
        for group in self._original_groups:
            groups.append([p for p in group if id(p) not in seen and not seen.add(id(p))])
        return groups

    def _saved_index(self, param_index: int) -> int:
        return self._state_index[id(self._param_of_index[param_index])]

    # ------------------------------------------------------------------ checkpoints
    def _agreed_elementwise_keys(self) -> list[dict[str, torch.dtype]]:
        """Per bucket, the elementwise state keys (and dtypes) of *any* rank of the node.

        Each rank gathers per key, so every rank must walk the same keys even if its own slice has
        no state yet for some (a collective under a rank-local condition would hang the others).
        """
        local = []
        for shard in self.shards:
            shard_state = self.optimizer.state.get(shard, {})
            local.append(
                {k: v.dtype for k, v in shard_state.items() if is_elementwise_state(k, v, shard.shape)}
            )
        if dist.get_world_size(self.intra_group) == 1:
            return local
        gathered: list[list[dict[str, torch.dtype]] | None] = [None] * dist.get_world_size(self.intra_group)
        dist.all_gather_object(gathered, local, group=self.intra_group)  # host objects: CPU backend
        merged: list[dict[str, torch.dtype]] = [{} for _ in self.shards]
        for rank_keys in gathered:
            assert rank_keys is not None
            for bucket_keys, theirs in zip(merged, rank_keys):
                bucket_keys.update(theirs)
        return merged

    def consolidated_state_dict(self) -> dict[str, Any]:
        """The unsharded optimizer's ``state_dict()`` (a collective over the node's ranks)."""
        state: dict[int, dict[str, Any]] = {}
        agreed = self._agreed_elementwise_keys()
        for bucket, shard, keys in zip(self.buckets, self.shards, agreed):
            shard_state = self.optimizer.state.get(shard, {})
            for key in sorted(set(shard_state) | set(keys)):
                value = shard_state.get(key)
                if key in keys:
                    full = torch.zeros(bucket.padded_numel, dtype=keys[key], device=bucket.device)
                    start, end = bucket.owned_range
                    if value is not None:
                        full[start:end].copy_(value)
                    for work in all_gather_slices(full, bucket.bounds, self.intra_group):
                        work.wait()
                    for slot in bucket.slots:
                        entry = state.setdefault(self._saved_index(slot.index), {})
                        entry[key] = full[slot.offset : slot.offset + slot.numel].view(slot.shape).clone()
                else:
                    for slot in bucket.slots:
                        entry = state.setdefault(self._saved_index(slot.index), {})
                        entry[key] = value.clone() if torch.is_tensor(value) else value
        # in parameter order, as the unsharded optimizer's own state_dict() lists them after its steps
        return {"state": dict(sorted(state.items())), "param_groups": self.saved_param_groups()}

    def unshard(self) -> None:
        """Give the optimizer its own parameters back, with the full state (a collective over the node):
        after a fit it is the optimizer ``ddp`` would leave, and a later fit can take it up again."""
        state = self.consolidated_state_dict()
        for group, original in zip(self.optimizer.param_groups, self._original_groups):
            group["params"] = list(original)
        self.optimizer.state.clear()
        self.holds_slices = False
        self.optimizer.load_state_dict(state)

    def unshard_into(self, groups: Sequence[Sequence[nn.Parameter]]) -> None:
        """:meth:`unshard` onto ``groups``, the module parameters of every param group now: also of groups
        added since the sharding (they hold their parameters already) or changed by the user. Each
        parameter gets its full state back, by identity (a collective over the node)."""
        state = self.consolidated_state_dict()["state"]
        param_at = {self._state_index[id(p)]: p for group in self._original_groups for p in group}
        for group, params in zip(self.optimizer.param_groups, groups):
            group["params"] = list(params)
        self.optimizer.state.clear()
        self.holds_slices = False
        for index, entry in state.items():
            self.optimizer.state[param_at[index]] = entry

    def saved_param_groups(self) -> list[dict[str, Any]]:
        """The param groups of the unsharded optimizer's ``state_dict``: settings, parameter numbers."""
        groups = []
        for original, current in zip(self._original_groups, self.optimizer.param_groups):
            saved = {k: v for k, v in current.items() if k != "params"}
            saved["params"] = [self._state_index[id(p)] for p in original]
            groups.append(saved)
        return groups

    def _check_and_load_groups(self, state_dict: dict[str, Any]) -> None:
        """Refuse a ``state_dict`` of another model or optimizer setup; take its group settings."""
        saved_groups = state_dict["param_groups"]
        if len(saved_groups) != len(self.optimizer.param_groups):
            raise ValueError(
                f"the checkpoint's optimizer has {len(saved_groups)} param groups but the current one has "
                f"{len(self.optimizer.param_groups)}."
            )
        for original, saved in zip(self._original_groups, saved_groups):
            if len(saved["params"]) != len(original):
                raise ValueError(
                    f"a checkpoint param group has {len(saved['params'])} parameters, the optimizer's has "
                    f"{len(original)}: the checkpoint belongs to a different model or optimizer setup."
                )
        for group, saved in zip(self.optimizer.param_groups, saved_groups):
            group.update({k: v for k, v in saved.items() if k != "params"})

    def load_consolidated_state_dict(self, state_dict: dict[str, Any]) -> None:
        """Take this rank's slices out of an unsharded ``state_dict`` (no communication)."""
        self._check_and_load_groups(state_dict)
        saved_state = {int(k): v for k, v in state_dict["state"].items()}
        self.optimizer.state.clear()
        for bucket, shard in zip(self.buckets, self.shards):
            start, end = bucket.owned_range
            new_state: dict[str, Any] = {}
            for slot in bucket.slots:
                for key, value in saved_state.get(self._saved_index(slot.index), {}).items():
                    if key in new_state:
                        continue
                    if is_elementwise_state(key, value, slot.shape):
                        new_state[key] = torch.zeros(end - start, dtype=value.dtype, device=bucket.device)
                    else:
                        new_state[key] = value.clone() if torch.is_tensor(value) else value
            for slot, lo, hi in bucket.slots_in(start, end):
                for key, value in saved_state.get(self._saved_index(slot.index), {}).items():
                    if is_elementwise_state(key, value, slot.shape):
                        target = slot.offset + lo - start
                        new_state[key][target : target + hi - lo].copy_(value.reshape(-1)[lo:hi])
            if new_state:
                self.optimizer.state[shard] = new_state

    def local_state_numel(self) -> int:
        """Elements of per-element optimizer state held by this rank (for memory checks)."""
        total = 0
        for shard in self.shards:
            for key, value in self.optimizer.state.get(shard, {}).items():
                if is_elementwise_state(key, value, shard.shape):
                    total += value.numel()
        return total

    # ------------------------------------------------------------------ clipping
    def clip_grad_norm_(self, max_norm: float, norm_type: float = 2.0) -> torch.Tensor:
        """Clip by the global gradient norm: slice norms combined across the node.

        After reduction every node holds the same gradients, one slice per rank, so summing the
        slices' contributions over the intra-node group gives the norm over the whole model.
        """
        grads = [shard.grad for shard in self.shards if shard.grad is not None]
        device = self.buckets[0].device if self.buckets else torch.device("cpu")
        # float32 at least (half gradients' powers overflow), float64 where a bucket is (ddp's norm is in the
        # gradients' dtype); decided from the buckets, alike on every rank, so the all-reduces pair up
        dtype = functools.reduce(torch.promote_types, (b.dtype for b in self.buckets), torch.float32)
        zero = torch.zeros((), dtype=dtype, device=device)
        norm_type = float(norm_type)
        if norm_type == math.inf:
            local = max((g.abs().max() for g in grads if g.numel()), default=zero)
            total = local.detach().to(dtype).clone()
            dist.all_reduce(total, op=dist.ReduceOp.MAX, group=self.intra_group)
        else:
            local = sum((g.to(dtype).abs().pow(norm_type).sum() for g in grads), zero)
            total = local.detach().clone()
            dist.all_reduce(total, group=self.intra_group)
            total = total.pow(1.0 / norm_type)
        clip_coef = torch.clamp(max_norm / (total + 1e-6), max=1.0)
        for grad in grads:
            grad.mul_(clip_coef.to(grad.dtype))
        return total

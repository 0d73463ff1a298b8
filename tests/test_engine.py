"""The plain-torch engine on gloo processes, without Lightning."""

from __future__ import annotations

import copy
import os
import time
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
from helpers import init_gloo, run_spawned
from torch import nn

from lightning_hier import HierSlicedEngine, SlicePlan, Topology
from lightning_hier.sliced.reducer import all_gather_slices, reduce_scatter_into
from lightning_hier.sliced.sharded_optim import check_optimizer


class _SometimesUnused(nn.Sequential):
    """The last layer's output goes through ``extra`` only on every other forward (on every rank)."""

    def __init__(self, *layers: nn.Module) -> None:
        super().__init__(*layers)
        self.extra = nn.Linear(3, 3)
        self.calls = 0

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for layer in list(self)[:-1]:
            x = layer(x)
        self.calls += 1
        return self.extra(x) if self.calls % 2 else x


def _model(skip_every_other: bool = False) -> nn.Module:
    torch.manual_seed(0)
    layers = [nn.Linear(12, 24), nn.Tanh(), nn.Linear(24, 24), nn.Tanh(), nn.Linear(24, 3)]
    if skip_every_other:
        return _SometimesUnused(*layers, nn.Identity())
    return nn.Sequential(*layers)


def _batches(steps: int, world: int, per_rank: int = 4) -> list[tuple[torch.Tensor, torch.Tensor]]:
    generator = torch.Generator().manual_seed(1)
    return [
        (
            torch.randn(world * per_rank, 12, generator=generator),
            torch.randn(world * per_rank, 3, generator=generator),
        )
        for _ in range(steps)
    ]


def _train_engine(
    rank: int,
    world: int,
    store: str,
    per_node: int,
    weights: tuple,
    steps: int,
    bucket_mb: float,
    chunk_mb: float,
    clip: tuple[float, float] | None = None,
    skip_every_other: bool = False,
) -> dict:
    init_gloo(rank, world, store)
    model = _model(skip_every_other)
    optimizer = torch.optim.Adam(model.parameters(), lr=1e-2)
    topology = Topology(world, rank, per_node).build_groups()
    engine = HierSlicedEngine(
        model, optimizer, topology, SlicePlan(weights), bucket_cap_mb=bucket_mb, comm_chunk_mb=chunk_mb
    )
    launched_before_backward_end = []
    for x, y in _batches(steps, world):
        lo, hi = rank * 4, (rank + 1) * 4
        loss = nn.functional.mse_loss(model(x[lo:hi]), y[lo:hi])
        loss.backward()
        launched_before_backward_end.append(engine._next_to_launch)
        engine.finish_backward()
        if clip is not None:
            engine.clip_grad_norm_(*clip)
        optimizer.step()
        engine.after_step()
    engine.close()
    params = [p.detach().clone() for p in model.parameters()]
    return {
        "params": params,
        "state_numel": engine.sharding.local_state_numel(),
        "num_buckets": len(engine.buckets),
        "launched": launched_before_backward_end,
    }


def _reference(
    world: int, steps: int, clip: tuple[float, float] | None = None, skip_every_other: bool = False
) -> tuple[list[torch.Tensor], int]:
    model = _model(skip_every_other)
    optimizer = torch.optim.Adam(model.parameters(), lr=1e-2)
    for x, y in _batches(steps, world):
        optimizer.zero_grad()
        nn.functional.mse_loss(model(x), y).backward()  # mean over the global batch == DDP's average
        if clip is not None:
            torch.nn.utils.clip_grad_norm_(model.parameters(), *clip)
        optimizer.step()
    numel = sum(v.numel() for s in optimizer.state.values() for k, v in s.items() if k != "step")
    return [p.detach().clone() for p in model.parameters()], numel


@pytest.mark.parametrize(
    ("per_node", "weights", "chunk_mb"),
    [
        (2, (1.0, 1.0), 4.0),
        (2, (3.0, 1.0), 4.0),
        (4, (1.0, 2.0, 3.0, 4.0), 4.0),
        (2, (1.0, 1.0), 0.0004),  # buckets reduced in ~100-element chunks
        (2, (3.0, 1.0), 0.0003),
    ],
)
def test_engine_matches_single_process_reference_and_shards_state(
    tmp_path: Path, per_node: int, weights: tuple, chunk_mb: float
) -> None:
    world, steps = 4, 4
    results = run_spawned(_train_engine, world, tmp_path, per_node, weights, steps, 0.001, chunk_mb)
    for result in results:
        assert result is not None and "error" not in result, result
    reference, reference_state = _reference(world, steps)
    for result in results:
        for got, want in zip(result["params"], reference, strict=True):
            torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-6)
    # each rank holds state only for its slice: its weight's share of the full (unsharded) state
    total = sum(weights)
    for rank, result in enumerate(results):
        share = weights[rank % per_node] / total
        assert result["state_numel"] == pytest.approx(reference_state * share, rel=0.05, abs=16)
    assert sum(r["state_numel"] for r in results[:per_node]) >= reference_state
    # several buckets, and some were handed to the comm thread while backward was still running
    assert results[0]["num_buckets"] > 2
    assert all(n > 0 for n in results[0]["launched"])


@pytest.mark.parametrize(
    ("clip", "skip_every_other"),
    [((0.05, 2.0), False), ((0.02, float("inf")), False), (None, True)],
    ids=["clip-l2", "clip-inf", "adam-param-unused-every-other-step"],
)
def test_engine_matches_reference_with_clipping_and_a_sometimes_unused_parameter(
    tmp_path: Path, clip: tuple[float, float] | None, skip_every_other: bool
) -> None:
    world, steps = 4, 5
    settings = (2, (3.0, 1.0), steps, 0.001, 4.0, clip, skip_every_other)
    results = run_spawned(_train_engine, world, tmp_path, *settings)
    reference, _ = _reference(world, steps, clip, skip_every_other)
    unclipped, _ = _reference(world, steps, None, skip_every_other)
    for result in results:
        assert result is not None and "error" not in result, result
        for got, want in zip(result["params"], reference, strict=True):
            torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-6)
    if clip is not None:  # the clip was active: without it the parameters end elsewhere
        assert any((a - b).abs().max() > 1e-4 for a, b in zip(reference, unclipped))


def _frozen_differs_per_rank(rank: int, world: int, store: str) -> dict:
    init_gloo(rank, world, store)
    torch.manual_seed(rank)  # every rank draws its own initialisation, as an unseeded script would
    model = nn.Sequential(nn.Linear(4, 4), nn.Linear(4, 2))
    model[0].requires_grad_(False)  # frozen: not in the optimizer's buckets
    optimizer = torch.optim.SGD([p for p in model.parameters() if p.requires_grad], lr=0.1)
    engine = HierSlicedEngine(model, optimizer, Topology(world, rank, 2).build_groups())
    engine.sync_module_states()
    return {k: v.clone() for k, v in model.state_dict().items()}


def test_frozen_parameters_are_broadcast_at_start_like_ddp(tmp_path: Path) -> None:
    results = run_spawned(_frozen_differs_per_rank, 2, tmp_path)
    assert not any(r is None or "error" in r for r in results), results
    for key in results[0]:
        torch.testing.assert_close(results[1][key], results[0][key], rtol=0, atol=0, msg=key)


def _state_missing_on_one_rank(rank: int, world: int, store: str) -> dict:
    init_gloo(rank, world, store, timeout_s=20)
    model = _model()
    optimizer = torch.optim.Adam(model.parameters(), lr=1e-2)
    engine = HierSlicedEngine(model, optimizer, Topology(world, rank, 2).build_groups(), bucket_cap_mb=0.001)
    x, y = _batches(1, world)[0]
    nn.functional.mse_loss(model(x[rank * 4 : rank * 4 + 4]), y[rank * 4 : rank * 4 + 4]).backward()
    engine.finish_backward()
    optimizer.step()
    engine.after_step()
    if rank == 1:
        optimizer.state.pop(engine.sharding.shards[0])  # this rank has no state for bucket 0's slice
    state = engine.optimizer_state_dict()["state"]
    engine.close()
    return {"entries": len(state), "keys": sorted(state[0])}


def test_consolidation_does_not_hang_when_one_rank_lacks_some_state(tmp_path: Path) -> None:
    results = run_spawned(_state_missing_on_one_rank, 2, tmp_path)
    assert not any(r is None or "error" in r for r in results), results
    assert results[0] == results[1]
    assert "exp_avg" in results[0]["keys"] and results[0]["entries"] == len(list(_model().parameters()))


def _collectives(rank: int, world: int, store: str) -> dict:
    init_gloo(rank, world, store)
    group = dist.group.WORLD
    bounds = ((0, 5), (5, 7))  # uneven: 5 and 2 elements
    flat = torch.arange(7, dtype=torch.float32) * (rank + 1)
    out = torch.zeros(bounds[rank][1] - bounds[rank][0])
    reduce_scatter_into(out, flat, bounds, group)
    gathered = torch.zeros(7)
    gathered[bounds[rank][0] : bounds[rank][1]] = rank + 10
    for work in all_gather_slices(gathered, bounds, group):
        work.wait()
    return {"scattered": out, "gathered": gathered}


def test_a_one_rank_node_copies_the_slice_or_leaves_it_where_it_already_is(tmp_path: Path) -> None:
    """A node of one device: its slice is the bucket. A separate output gets a copy; an output that is the
    bucket itself (hier_sliced with devices_per_node=1 reduces in place) is left as it is."""
    init_gloo(0, 1, str(tmp_path / "store"))
    try:
        flat = torch.arange(6, dtype=torch.float32)
        out = torch.zeros(6)
        reduce_scatter_into(out, flat, ((0, 6),), dist.group.WORLD)
        in_place = flat[0:6]
        reduce_scatter_into(in_place, flat, ((0, 6),), dist.group.WORLD)
    finally:
        dist.destroy_process_group()
    assert torch.equal(out, torch.arange(6, dtype=torch.float32)) and out.data_ptr() != flat.data_ptr()
    assert torch.equal(in_place, torch.arange(6, dtype=torch.float32))


def test_uneven_reduce_scatter_and_all_gather(tmp_path: Path) -> None:
    results = run_spawned(_collectives, 2, tmp_path)
    summed = torch.arange(7, dtype=torch.float32) * 3  # ranks contribute x1 and x2
    torch.testing.assert_close(results[0]["scattered"], summed[:5])
    torch.testing.assert_close(results[1]["scattered"], summed[5:])
    expected = torch.tensor([10.0] * 5 + [11.0] * 2)
    for result in results:
        torch.testing.assert_close(result["gathered"], expected)


def _dies_mid_step(rank: int, world: int, store: str) -> dict:
    init_gloo(rank, world, store, timeout_s=20)
    model = _model()
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    engine = HierSlicedEngine(model, optimizer, Topology(world, rank, 2).build_groups(), bucket_cap_mb=0.001)
    x, y = _batches(1, 1)[0]
    nn.functional.mse_loss(model(x), y).backward()
    if rank == 1:
        os._exit(3)  # a peer crashes in the middle of the step
    start = time.monotonic()
    try:
        engine.finish_backward()
        optimizer.step()
        engine.after_step()
    except Exception as err:
        return {"raised": type(err).__name__, "seconds": time.monotonic() - start}
    return {"raised": None, "seconds": time.monotonic() - start}


def test_dead_peer_ends_the_step_with_an_error_not_a_hang(tmp_path: Path) -> None:
    results = run_spawned(_dies_mid_step, 2, tmp_path)
    assert results[1] is None  # it died without reporting
    assert results[0]["raised"] is not None, results[0]
    assert results[0]["seconds"] < 30


@pytest.mark.parametrize("optimizer_cls", [torch.optim.LBFGS, torch.optim.SparseAdam])
def test_non_elementwise_optimizers_are_refused(optimizer_cls: type) -> None:
    params = [nn.Parameter(torch.zeros(3))]
    with pytest.raises(ValueError, match="not elementwise"):
        check_optimizer(optimizer_cls(params))


class Lars(torch.optim.SGD):
    """A layer-wise trust ratio: ``lr * ||w|| / ||g||`` per tensor, so slices would change the math."""


class MySGD(torch.optim.SGD):
    """Its own update (a step that changes the gradient first): unknown unless declared."""

    def step(self, closure=None):  # noqa: ANN001, ANN201
        for group in self.param_groups:
            for param in group["params"]:
                if param.grad is not None:
                    param.grad.div_(param.grad.norm() + 1e-12)  # per tensor: not elementwise
        return super().step(closure)


class DefaultsAdamW(torch.optim.AdamW):
    """Only other defaults (as a library's preset): AdamW's own update runs."""

    def __init__(self, params, lr: float = 3e-4) -> None:  # noqa: ANN001
        super().__init__(params, lr=lr, weight_decay=0.1)


def test_unknown_optimizers_are_refused_unless_declared_elementwise() -> None:
    params = [nn.Parameter(torch.zeros(3))]
    with pytest.raises(ValueError, match="not elementwise"):
        check_optimizer(Lars(params, lr=0.1), declared_elementwise=["Lars"])  # known not to be
    with pytest.raises(ValueError, match=r"elementwise_optimizers=\['MySGD'\]"):
        check_optimizer(MySGD(params, lr=0.1))
    check_optimizer(MySGD(params, lr=0.1), declared_elementwise=["MySGD"])  # the user vouches for it


def test_hier_bsp_refuses_an_unknown_optimizer_naming_its_own_setting() -> None:
    """The parameter server shards the optimizer as hier_sliced does; the error names HierBSPStrategy's
    setting (not HierSlicedStrategy's, which a hier_bsp user cannot pass)."""
    from lightning_hier.bsp.engine import BSPEngine
    from lightning_hier.bsp.settings import BSPSettings

    model = nn.Linear(3, 1)
    settings = BSPSettings(superstep=1, max_staleness=0)
    with pytest.raises(ValueError, match=r"HierBSPStrategy\(elementwise_optimizers=\['MySGD'\]\)"):
        BSPEngine(model, MySGD(model.parameters(), lr=0.1), None, settings)  # refused before any group


def test_hier_bsp_steps_any_per_parameter_optimizer_whole_where_each_rank_holds_the_whole_server() -> None:
    """devices_per_node=1: every piece is a whole parameter, so Adafactor and unknown optimizers run (as
    under ddp: tests/scripts/bsp_equivalence.py); with node-sliced servers they are refused, the error
    naming devices_per_node=1; LBFGS never (its closure re-runs backward)."""
    from lightning_hier.sliced.sharded_optim import check_server_optimizer

    params = [nn.Parameter(torch.zeros(3, 2))]
    check_server_optimizer(torch.optim.Adafactor(params), (), devices_per_node=1)
    check_server_optimizer(MySGD(params, lr=0.1), (), devices_per_node=1)
    with pytest.raises(ValueError, match=r"not elementwise.*HierBSPStrategy\(devices_per_node=1\)"):
        check_server_optimizer(torch.optim.Adafactor(params), (), devices_per_node=2)
    with pytest.raises(ValueError, match="LBFGS cannot run on flat parameter slices.*strategy='ddp'"):
        check_server_optimizer(torch.optim.LBFGS(params), (), devices_per_node=1)


def test_a_subclass_that_keeps_the_parents_step_runs_the_parents_update() -> None:
    from lightning_hier.sliced.sharded_optim import update_rule_of

    params = [nn.Parameter(torch.zeros(3))]
    assert update_rule_of(DefaultsAdamW(params)) == "AdamW"
    assert update_rule_of(torch.optim.Adam(params)) == "Adam"
    assert update_rule_of(MySGD(params, lr=0.1)) == "MySGD"
    check_optimizer(DefaultsAdamW(params))  # accepted without declaring it


class _Eager(torch.optim.Optimizer):
    """Makes its state in the constructor, as torch 2.11's Adagrad (and fails in step without it)."""

    def __init__(self, params, lr: float = 0.1, start: float = 0.5) -> None:  # noqa: ANN001
        super().__init__(params, {"lr": lr, "start": start})
        for group in self.param_groups:
            for p in group["params"]:
                self.state[p]["acc"] = torch.full_like(p, group["start"])

    def step(self, closure=None) -> None:  # noqa: ANN001
        for group in self.param_groups:
            for p in group["params"]:
                self.state[p]["acc"].add_(p.grad)
                p.data.add_(self.state[p]["acc"], alpha=-group["lr"])


def _eager_state_through_slices(rank: int, world: int, store: str) -> dict:
    init_gloo(rank, world, store)
    model = nn.Linear(3, 2)
    optimizer = _Eager([{"params": [model.weight]}, {"params": [model.bias], "start": 2.0}])
    topology = Topology(world, rank, world).build_groups()
    engine = HierSlicedEngine(
        model, optimizer, topology, SlicePlan((1.0, 1.0)), elementwise_optimizers=["_Eager"]
    )
    sliced = {key: value["acc"].clone() for key, value in optimizer.state.items()}
    engine.close()
    engine.sharding.unshard()
    return {"sliced_numel": sum(v.numel() for v in sliced.values()), "state": optimizer.state_dict()["state"]}


def test_state_the_optimizer_already_holds_is_sliced_and_given_back(tmp_path: Path) -> None:
    """State made in the constructor (or loaded by the user, or left by an earlier fit) is kept: each rank
    holds its slices of it (8 elements over 2 ranks), and given back it is the constructor's state again."""
    for result in run_spawned(_eager_state_through_slices, 2, tmp_path):
        assert result is not None and "error" not in result, result
        assert result["sliced_numel"] == 4
        assert torch.equal(result["state"][0]["acc"], torch.full((2, 3), 0.5))
        assert torch.equal(result["state"][1]["acc"], torch.full((2,), 2.0))


def _two_engines_one_optimizer(rank: int, world: int, store: str, steps: int) -> dict:
    """``steps`` steps under one engine, the optimizer given back (unshard), then ``steps`` more under a new
    engine over the same optimizer object: what a second fit with the same optimizer does."""
    init_gloo(rank, world, store)
    model = _model()
    optimizer = torch.optim.Adam(model.parameters(), lr=1e-2)
    topology = Topology(world, rank, world).build_groups()
    batches = _batches(2 * steps, world)
    lo, hi = rank * 4, (rank + 1) * 4
    unsharded_state = None
    for half in range(2):
        engine = HierSlicedEngine(model, optimizer, topology, SlicePlan((1.0, 3.0)), bucket_cap_mb=0.001)
        for x, y in batches[half * steps : (half + 1) * steps]:
            nn.functional.mse_loss(model(x[lo:hi]), y[lo:hi]).backward()
            engine.finish_backward()
            optimizer.step()
            engine.after_step()
        engine.close()
        engine.sharding.unshard()
        if half == 0:
            unsharded_state = optimizer.state_dict()
            given_back = zip(optimizer.param_groups[0]["params"], model.parameters())
            params_given_back = [p is q for p, q in given_back]
    return {
        "params": [p.detach().clone() for p in model.parameters()],
        "params_given_back": params_given_back,
        "state_after_first": unsharded_state,
        "state_after_second": optimizer.state_dict(),
    }


def test_an_optimizer_given_back_equals_the_unsharded_one_and_a_new_engine_goes_on_from_its_state(
    tmp_path: Path,
) -> None:
    world, steps = 2, 3
    results = run_spawned(_two_engines_one_optimizer, world, tmp_path, steps)
    model = _model()
    reference = torch.optim.Adam(model.parameters(), lr=1e-2)
    reference_states = []
    for index, (x, y) in enumerate(_batches(2 * steps, world)):
        reference.zero_grad()
        nn.functional.mse_loss(model(x), y).backward()
        reference.step()
        if index + 1 == steps:  # state_dict() holds the live tensors, which later steps change in place
            reference_states.append(copy.deepcopy(reference.state_dict()))
    reference_states.append(reference.state_dict())
    for result in results:
        assert result is not None and "error" not in result, result
        assert all(result["params_given_back"])  # the optimizer steps the module's parameters again
        for got, want in zip(result["params"], model.parameters(), strict=True):
            torch.testing.assert_close(got, want.detach(), rtol=1e-5, atol=1e-6)
        for got, want in zip(
            (result["state_after_first"], result["state_after_second"]), reference_states, strict=True
        ):
            assert got["param_groups"] == want["param_groups"]
            assert got["state"].keys() == want["state"].keys()
            for index, entry in want["state"].items():
                for key, value in entry.items():
                    torch.testing.assert_close(got["state"][index][key], value, rtol=1e-5, atol=1e-7)


def test_optimizers_not_elementwise_stay_whole_by_default_and_are_refused_when_sharding_is_asked() -> None:
    """``shard_optimizer=None`` shards an elementwise optimizer and keeps any other whole on every rank, with
    a warning naming why instead of refusing it; ``True`` refuses them, pointing to
    ``shard_optimizer=False``; LBFGS and SparseAdam are refused either way."""
    from lightning_hier.sliced.sharded_optim import decide_sharding

    params = [nn.Parameter(torch.zeros(3, 2))]
    assert decide_sharding(torch.optim.Adam(params), (), None) is True
    assert decide_sharding(torch.optim.Adam(params), (), False) is False
    with pytest.warns(UserWarning, match=r"keeps Adafactor whole on every rank.*not elementwise"):
        assert decide_sharding(torch.optim.Adafactor(params), (), None) is False
    with pytest.warns(UserWarning, match=r"keeps MySGD whole.*elementwise_optimizers=\['MySGD'\]"):
        assert decide_sharding(MySGD(params, lr=0.1), (), None) is False
    assert decide_sharding(MySGD(params, lr=0.1), ("MySGD",), None) is True  # the user vouches for it
    with pytest.raises(ValueError, match=r"not elementwise.*shard_optimizer=False"):
        decide_sharding(torch.optim.Adafactor(params), (), True)
    for refused in (torch.optim.LBFGS(params), torch.optim.SparseAdam(params)):
        with pytest.raises(ValueError, match="not elementwise.*strategy='ddp'"):
            decide_sharding(refused, (), False)


def _reduce_scatters_of_one_backward(rank: int, world: int, store: str, chunk_mb: float | None) -> int:
    init_gloo(rank, world, store)
    torch.manual_seed(0)
    model = nn.Linear(1024, 1024)  # one bucket of 1,049,600 floats: 2.1 MB per slice of a 2-device node
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    topology = Topology(world, rank, world).build_groups()
    engine = HierSlicedEngine(model, optimizer, topology, SlicePlan((1.0, 1.0)), comm_chunk_mb=chunk_mb)
    calls = [0]
    names = ("reduce_scatter", "reduce_scatter_tensor", "reduce_scatter_single")  # the last: torch 2.13
    originals = {name: getattr(dist, name) for name in names if hasattr(dist, name)}
    for name, collective in originals.items():

        def counted(*args, _collective=collective, **kwargs):  # noqa: ANN002, ANN003, ANN202
            calls[0] += 1
            return _collective(*args, **kwargs)

        setattr(dist, name, counted)
    try:
        model(torch.randn(4, 1024)).sum().backward()
        engine.finish_backward()
    finally:
        for name, collective in originals.items():
            setattr(dist, name, collective)
    return calls[0]


@pytest.mark.parametrize(("chunk_mb", "pieces"), [(None, 3), (4.0, 1), (0.5, 5)])
def test_a_bucket_is_pipelined_in_1_mb_chunks_on_cpu_unless_told(
    tmp_path: Path, chunk_mb: float | None, pieces: int
) -> None:
    # a slice of 2,099,200 bytes: 3 chunks of at most 1 MiB (the CPU default), 1 of 4 MiB, 5 of 0.5 MiB
    assert run_spawned(_reduce_scatters_of_one_backward, 2, tmp_path, chunk_mb) == [pieces, pieces]

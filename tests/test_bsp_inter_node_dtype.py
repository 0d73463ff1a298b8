"""``HierBSPStrategy(inter_node_dtype=...)``: the parameter server's push across nodes in bf16 or int8 blocks.

On 2 nodes x 2 gloo processes the server's reduced slices, summed over supersteps, equal the exact fp64 sums
less what the nodes still owe in their error-feedback residuals; without compression they are the exact sums;
int8 puts about a quarter of fp32's bytes, bf16 half, on the inter-node link; and the digits example trained
with a compressed push ends within a stated tolerance of the full-precision push's loss, with the same
supersteps.
"""

from __future__ import annotations

import json
import math

import pytest
import torch
import torch.distributed as dist
from helpers import init_gloo, run_spawned, run_torchrun
from torch import nn

from lightning_hier import HierBSPStrategy, Topology
from lightning_hier.bsp.server import ShardedParameterServer
from lightning_hier.bucketing.size_plan import ParamInfo, plan_size_buckets
from lightning_hier.sliced.compressed_hop import INTER_NODE_DTYPES
from lightning_hier.sliced.int8_codec import BLOCK
from lightning_hier.sliced.slicing import SlicePlan

SUPERSTEPS = 4
DTYPES = ["int8", "fp8", "bf16", None]


def _model() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(64, 96), nn.ReLU(), nn.Linear(96, 40))  # 10,120 parameters


def _sums(rank: int, step: int, like: list[torch.Tensor]) -> list[torch.Tensor]:
    """Rank ``rank``'s gradient sums at superstep ``step``, of magnitudes over four decades in a bucket."""
    generator = torch.Generator().manual_seed(1000 * step + rank)
    out = []
    for flat in like:
        magnitude = 10.0 ** ((torch.arange(flat.numel()) // 900) % 4 - 2).float()
        out.append(torch.randn(flat.numel(), generator=generator) * magnitude)
    return out


def _pushes(rank: int, world: int, store: str) -> dict:
    """Every hop in one job (one set of groups): ``{dtype name or None: what this rank saw}``."""
    init_gloo(rank, world, store)
    try:
        topology = Topology(world, rank, 2).build_groups()
        return {name: _push(rank, topology, name) for name in DTYPES}
    finally:
        dist.destroy_process_group()


def _push(rank: int, topology: Topology, name: str | None) -> dict:
    model = _model()
    params = list(model.parameters())
    optimizer = torch.optim.SGD(params, lr=0.1)
    infos = [
        ParamInfo(i, p.numel(), p.element_size(), (0, p.dtype, p.device)) for i, p in enumerate(params)
    ]
    plan = plan_size_buckets(infos, 16 * 1024)  # a few buckets
    server = ShardedParameterServer(
        params, [0] * len(params), optimizer, [params], topology, plan, SlicePlan((1.0, 1.0)),
        INTER_NODE_DTYPES[name],
    )  # fmt: skip
    like = [bucket.grads for bucket in server.buckets]
    got = [torch.zeros(g.numel(), dtype=torch.float64) for g in server._slice_grads]
    exact = [torch.zeros_like(g) for g in got]
    magnitude = [torch.zeros_like(g) for g in got]  # sum over supersteps of |exact sum|
    sent = 0
    for step in range(SUPERSTEPS):
        sums = _sums(rank, step, like)
        for b, (total, bucket) in enumerate(zip(sums, server.buckets)):
            reference = total.double().clone()
            dist.all_reduce(reference)  # every rank's sums, exactly
            exact[b] += reference[slice(*bucket.owned_range)]
            magnitude[b] += reference[slice(*bucket.owned_range)].abs()
        sent = server.push(sums)
        for b, grad in enumerate(server._slice_grads):
            got[b] += grad.double()
    owed = []
    for residual in server._residuals:
        if residual is None:
            owed.append(None)
            continue
        total = residual.double().clone()
        dist.all_reduce(total, group=topology.inter_group)  # what every node of this slice still owes
        owed.append(total)
    slices = [g.numel() for g in server._slice_grads]
    return {
        "got": got,
        "exact": exact,
        "magnitude": magnitude,
        "owed": owed,
        "sent": sent,
        "slices": slices,
    }


@pytest.fixture(scope="module")
def pushes(tmp_path_factory: pytest.TempPathFactory) -> dict:
    results = run_spawned(_pushes, 4, tmp_path_factory.mktemp("pushes"))
    assert all(r is not None and "error" not in r for r in results), results
    return {name: [r[name] for r in results] for name in DTYPES}


# int8 and fp8 sum the dequantised parts in fp32; bf16's all-reduce adds in bf16, rounding each sum once more
# (not fed back): within 2^-8 of its size per superstep
SUM_ROUNDING = {"int8": 0.0, "fp8": 0.0, "bf16": 2.0**-8}


@pytest.mark.parametrize("name", ["int8", "fp8", "bf16"])
def test_a_compressed_push_delivers_the_exact_sums_less_what_the_nodes_owe(pushes: dict, name: str) -> None:
    for rank, result in enumerate(pushes[name]):
        for got, exact, magnitude, owed in zip(
            result["got"], result["exact"], result["magnitude"], result["owed"]
        ):
            assert owed is not None
            bound = 1e-4 + SUM_ROUNDING[name] * magnitude
            assert ((got + owed - exact).abs() <= bound).all(), (
                rank,
                ((got + owed - exact).abs() / bound).max(),
            )
            # the hop really rounded: what is owed is not nothing, and larger than fp32's own rounding
            assert owed.abs().max() > 1e-4 * exact.abs().max(), (rank, owed.abs().max())


def test_a_full_precision_push_delivers_the_exact_sums(pushes: dict) -> None:
    for result in pushes[None]:
        assert result["owed"] == [None] * len(result["got"])
        for got, exact in zip(result["got"], result["exact"]):
            torch.testing.assert_close(got, exact, rtol=1e-6, atol=1e-5)


@pytest.mark.parametrize(
    ("name", "low", "high"), [("int8", 0.25, 0.26), ("fp8", 0.25, 0.26), ("bf16", 0.49, 0.51)]
)
def test_the_push_counts_a_compressed_hops_bytes(pushes: dict, name: str, low: float, high: float) -> None:
    for full, narrow in zip(pushes[None], pushes[name]):
        # the bytes inside the node are the same, so the difference is the inter-node hop's; fp32's puts half
        # of each slice's 4-byte elements on the link (a ring of 2)
        inter_fp32 = sum(math.ceil(n * 4 / 2) for n in full["slices"])
        inter = narrow["sent"] - full["sent"] + inter_fp32
        if name in ("int8", "fp8"):  # a part of each slice per node: its values and block scales
            parts = [-(-n // 2) for n in narrow["slices"]]
            assert inter == sum(p + 4 * -(-p // BLOCK) for p in parts)
        else:
            assert inter == sum(math.ceil(n * 2 / 2) for n in narrow["slices"])
        assert low <= inter / inter_fp32 <= high, inter / inter_fp32


# ---------------------------------------------------------------------- the strategy
def test_the_strategy_refuses_an_unknown_inter_node_dtype_by_name() -> None:
    with pytest.raises(ValueError, match=r"inter_node_dtype='int4' is not one of"):
        HierBSPStrategy(inter_node_dtype="int4")  # type: ignore[arg-type]
    assert HierBSPStrategy(inter_node_dtype="int8").inter_node_dtype == "int8"


@pytest.fixture(scope="module")
def digits(tmp_path_factory: pytest.TempPathFactory) -> dict:
    out = tmp_path_factory.mktemp("bsp_digits") / "results.json"
    run_torchrun("bsp_inter_node_dtype_digits.py", 4, str(out), timeout=600)
    return json.loads(out.read_text())


@pytest.mark.parametrize(("name", "tolerance"), [("int8", 0.01), ("bf16", 0.01)])
def test_a_compressed_push_trains_the_digits_example_to_full_precisions_loss(
    digits: dict, name: str, tolerance: float
) -> None:
    full, narrow = digits["fp32"], digits[name]
    assert full["loss"] < 1.5  # it trained (from ~2.3)
    assert narrow["supersteps"] == full["supersteps"] > 0
    assert abs(narrow["loss"] - full["loss"]) / full["loss"] < tolerance, (full["loss"], narrow["loss"])
    # the parameters moved apart by rounding (the hop did compress), not by another training run
    assert 0 < narrow["distance"] < 0.05 * full["travel"], (narrow["distance"], full["travel"])

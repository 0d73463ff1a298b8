"""Per-layer activation memory policy: the keep/swap/recompute decision and its runtime."""

from __future__ import annotations

import gc
import json
import sys
from pathlib import Path

import pytest
import torch
from helpers import SCRIPTS, run_torchrun
from torch import nn

from lightning_hier.pipeline.activation_store import (
    ActivationMeter,
    LayerRunner,
    is_parameter_like,
    measure_layer_stats,
    storage_bytes,
)
from lightning_hier.pipeline.memory_policy import (
    KEEP,
    RECOMPUTE,
    SWAP,
    LayerMemoryStats,
    MemoryLimitError,
    MemoryPlan,
    decide_memory_plan,
    estimate_host_bytes,
    estimate_peak_bytes,
    estimate_resident_bytes,
    minimum_peak_bytes,
    needs_new_plan,
)

sys.path.insert(0, str(SCRIPTS))
import pipeline_batchnorm  # noqa: E402

# ---------------------------------------------------------------------------------------------
# decision
# ---------------------------------------------------------------------------------------------
BANDWIDTH = 1000.0  # bytes per second: swap seconds = saved_bytes / 1000


def _stats() -> list[LayerMemoryStats]:
    """Hand-built stage. With bandwidth 1000 B/s:

    layer  saved  input  fwd   bwd   swap s  swap/fwd
    a      1000   100    1.0   0.5   1.0     1.0
    b      4000   200    1.0   0.5   4.0     4.0
    c      2000   100    0.5   0.5   2.0     4.0   (ties with b: b first, stats order)
    d       500    50    0.1   0.1   0.5     5.0
    e      1500   300    1.0   0.2   1.5     1.5
    f      1000   100    0.4   0.2   1.0     2.5

    Order: d, b, c, f, e, a. Budget (forward+backward) = 4.0 + 2.0 = 6.0 s.
    Swapping: d (0.5 s), b (4.5 s), c (6.5 s >= 6.0: c stays swap, stop). Left: f, e, a.
    """
    rows = [
        ("a", 1000, 100, 1.0, 0.5),
        ("b", 4000, 200, 1.0, 0.5),
        ("c", 2000, 100, 0.5, 0.5),
        ("d", 500, 50, 0.1, 0.1),
        ("e", 1500, 300, 1.0, 0.2),
        ("f", 1000, 100, 0.4, 0.2),
    ]
    return [LayerMemoryStats(*row) for row in rows]


def _policies(plan: MemoryPlan) -> str:
    return "".join(policy[0] for _, policy in plan.policies)  # e.g. "kssser"


def test_swap_then_recompute_until_it_fits():
    # in_flight=2: peak = resident of one micro-batch + the most the other has during its backward.
    # After swapping d, b, c the resident stash is a 1000 + e 1500 + f 1000 = 3500. Backward of the
    # second: c comes back with the previous swapped layer b prefetched, beside a's stash still
    # alive: 1000 + 2000 + 4000 = 7000 (f: 3500, d with c: 3500, b: 5000) -> 10500 > 9000.
    # Recompute f: resident 2600, backward peak still 7000 -> 9600. Recompute e: resident
    # 1000 + 300 + 100 = 1400 -> 8400 <= 9000: a stays keep.
    plan = decide_memory_plan(_stats(), in_flight=2, memory_limit=9000, swap_bandwidth=BANDWIDTH)
    assert plan.as_mapping() == {"a": KEEP, "b": SWAP, "c": SWAP, "d": SWAP, "e": RECOMPUTE, "f": RECOMPUTE}
    assert [name for name, _ in plan.policies] == list("abcdef")
    assert plan.estimated_peak_bytes == 8400
    assert plan.estimated_host_bytes == (4000 + 2000 + 500) * 2
    assert plan.swap_seconds == pytest.approx(6.5)
    assert plan.budget_seconds == pytest.approx(6.0)
    assert (plan.count(KEEP), plan.count(SWAP), plan.count(RECOMPUTE)) == (1, 3, 2)
    assert plan.names(RECOMPUTE) == ["e", "f"]
    assert str(plan) == (
        "keep 1, swap 3 (6.500 s of 6.000 s), recompute 2, peak 8.2 KiB (+12.7 KiB on the host)"
    )
    assert plan.policy("zzz") == KEEP


def test_swap_alone_fits_leaves_the_rest_kept():
    # After the swaps the estimate is 10500 (see above): a limit of 10500 needs no recompute.
    plan = decide_memory_plan(_stats(), in_flight=2, memory_limit=10500, swap_bandwidth=BANDWIDTH)
    assert _policies(plan) == "kssskk"
    assert plan.estimated_peak_bytes == 10500


def test_swap_stops_at_budget_crossing_layer():
    # Faster link: swap seconds are a tenth, budget still 6.0 s: d 0.05, b 0.45, c 0.65, f 0.75,
    # e 0.9, a 1.0 -> everything swapped, never crossing. Nothing resident; peak: the largest pair
    # of a swapped layer and its prefetched predecessor, c 2000 + b 4000.
    plan = decide_memory_plan(_stats(), in_flight=2, memory_limit=10000, swap_bandwidth=10 * BANDWIDTH)
    assert _policies(plan) == "ssssss"
    assert plan.swap_seconds == pytest.approx(1.0)
    assert plan.estimated_peak_bytes == 6000
    # Slower link (swap seconds x4, budget 6.0): d alone is 2.0 s, b brings 18.0 >= 6 -> stop after b.
    # Resident: a 1000 + c 2000 + e 1500 + f 1000 = 5500; backward of the second micro-batch: d
    # comes back with b prefetched beside a and c, 1000 + 2000 + 500 + 4000 = 7500 -> 13000 > 12000.
    # Next in order: c -> recompute: resident 1000 + 100 + 1500 + 1000 = 3600; c re-materialised
    # beside its input, a and the prefetched b: 1000 + 100 + 2000 + 4000 = 7100 -> 10700.
    plan = decide_memory_plan(_stats(), in_flight=2, memory_limit=12000, swap_bandwidth=BANDWIDTH / 4)
    assert plan.as_mapping() == {"a": KEEP, "b": SWAP, "c": RECOMPUTE, "d": SWAP, "e": KEEP, "f": KEEP}
    assert plan.swap_seconds == pytest.approx(18.0)
    assert plan.estimated_peak_bytes == 10700


def test_zero_forward_time_ranks_first():
    stats = [
        LayerMemoryStats("x", 100, 10, 1.0, 1.0),  # ratio (100 / bw) / 1.0
        LayerMemoryStats("y", 10, 10, 0.0, 1.0),  # ratio inf
        LayerMemoryStats("z", 100, 10, 0.0, 1.0),  # ratio inf, after y (stats order)
    ]
    # Budget 3.0 s. Bandwidth 100 B/s: swap y 0.1 s, z 1.0 s (1.1 s), x 1.0 s (2.1 s): all swapped.
    # Transient: z comes back with y (110), y with x (110).
    plan = decide_memory_plan(stats, in_flight=1, memory_limit=150, swap_bandwidth=100.0)
    assert _policies(plan) == "sss"
    assert plan.estimated_peak_bytes == 110
    # Bandwidth 10 B/s: y 1.0 s, z 11.0 s >= 3.0: stop. x kept: z comes back with y beside x's
    # stash, 100 + 110 = 210 > 150, so x is recomputed: 10 + 110 = 120.
    plan = decide_memory_plan(stats, in_flight=1, memory_limit=150, swap_bandwidth=10.0)
    assert _policies(plan) == "rss"
    assert plan.estimated_peak_bytes == 120


def test_all_keep_when_no_limit_or_when_it_fits():
    all_keep = 2 * 10000
    for limit in (None, all_keep, 10 * all_keep):
        plan = decide_memory_plan(_stats(), in_flight=2, memory_limit=limit, swap_bandwidth=BANDWIDTH)
        assert _policies(plan) == "kkkkkk"
        assert plan.estimated_peak_bytes == all_keep
        assert plan.estimated_host_bytes == 0
        assert plan.swap_seconds == 0.0
    # One byte less and the optimisation runs.
    plan = decide_memory_plan(_stats(), in_flight=2, memory_limit=all_keep - 1, swap_bandwidth=BANDWIDTH)
    assert plan.count(SWAP) == 3


def test_previous_plan_with_recompute_and_free_memory_reruns_the_greedy_rule():
    tight = decide_memory_plan(_stats(), in_flight=2, memory_limit=9000, swap_bandwidth=BANDWIDTH)
    assert tight.count(RECOMPUTE) == 2
    assert needs_new_plan(tight, current_peak=8400, memory_limit=None)
    # memory fits but layers recompute -> optimise again, from scratch: the
    # swaps within the time budget (d, b, c) stay, and with room to spare nothing recomputes
    relaxed = decide_memory_plan(
        _stats(), in_flight=2, memory_limit=50000, swap_bandwidth=BANDWIDTH, previous=tight
    )
    assert _policies(relaxed) == "kssskk"
    assert relaxed.count(RECOMPUTE) == 0
    # Still tight: the same plan comes back.
    again = decide_memory_plan(
        _stats(), in_flight=2, memory_limit=9000, swap_bandwidth=BANDWIDTH, previous=tight
    )
    assert again == tight


def test_a_plan_in_force_that_fits_without_recompute_is_kept():
    swaps_only = decide_memory_plan(_stats(), in_flight=2, memory_limit=19999, swap_bandwidth=BANDWIDTH)
    assert swaps_only.count(SWAP) == 3 and swaps_only.count(RECOMPUTE) == 0
    # more room now: the plan in force fits without recompute, so it stays, swaps included
    later = decide_memory_plan(
        _stats(), in_flight=2, memory_limit=10**6, swap_bandwidth=BANDWIDTH, previous=swaps_only
    )
    assert later.policies == swaps_only.policies
    assert later.swap_seconds == swaps_only.swap_seconds
    # with no plan in force the same limit keeps everything
    fresh = decide_memory_plan(_stats(), in_flight=2, memory_limit=10**6, swap_bandwidth=BANDWIDTH)
    assert _policies(fresh) == "kkkkkk"


def test_memory_limit_below_minimum_names_the_minimum():
    # Minimum: the largest saved_bytes (b, 4000) on the device once + base 100 (+ held per micro-batch).
    assert minimum_peak_bytes(_stats(), in_flight=2, base_bytes=100) == 4100
    assert minimum_peak_bytes(_stats(), in_flight=2) == 4000
    assert minimum_peak_bytes(_stats(), in_flight=2, base_bytes=100, held_bytes=30) == 4160
    assert minimum_peak_bytes([], in_flight=3, base_bytes=7) == 7
    with pytest.raises(MemoryLimitError, match="4100") as info:
        decide_memory_plan(_stats(), in_flight=2, memory_limit=4099, swap_bandwidth=BANDWIDTH, base_bytes=100)
    assert isinstance(info.value, ValueError)
    assert info.value.required_bytes == 4100
    message = str(info.value)
    assert "memory_limit=4099 bytes is below the 4100 bytes" in message
    assert "raise memory_limit to at least 4100" in message
    with pytest.raises(MemoryLimitError, match="at least 4160"):
        decide_memory_plan(
            _stats(), in_flight=2, memory_limit=4159, swap_bandwidth=BANDWIDTH, base_bytes=100, held_bytes=30
        )


def test_greedy_that_cannot_reach_the_limit_raises():
    # 6599 >= minimum 4000, but only d, b, c may be swapped within the time budget; with f, e, a
    # recomputed the resident stash is 100 + 300 + 100 = 500, and the second micro-batch's backward
    # peaks when c comes back with b beside a's input: 100 + 2000 + 4000 -> 500 + 6100 = 6600.
    with pytest.raises(MemoryLimitError, match="at least 6600") as info:
        decide_memory_plan(_stats(), in_flight=2, memory_limit=6599, swap_bandwidth=BANDWIDTH)
    assert info.value.required_bytes == 6600
    plan = decide_memory_plan(_stats(), in_flight=2, memory_limit=6600, swap_bandwidth=BANDWIDTH)
    assert _policies(plan) == "rsssrr"


def test_validation():
    kwargs = {"in_flight": 1, "memory_limit": 1000, "swap_bandwidth": 1.0}
    with pytest.raises(ValueError, match="in_flight"):
        decide_memory_plan(_stats(), **{**kwargs, "in_flight": 0})
    with pytest.raises(ValueError, match="swap_bandwidth"):
        decide_memory_plan(_stats(), **{**kwargs, "swap_bandwidth": 0.0})
    with pytest.raises(ValueError, match="memory_limit"):
        decide_memory_plan(_stats(), **{**kwargs, "memory_limit": 0})
    with pytest.raises(ValueError, match="unique"):
        decide_memory_plan(_stats() + _stats()[:1], **kwargs)
    with pytest.raises(ValueError, match="held_bytes"):
        estimate_peak_bytes(_stats(), {}, in_flight=1, held_bytes=-1)
    with pytest.raises(ValueError, match="saved_bytes"):
        LayerMemoryStats("x", -1, 0, 0.0, 0.0)
    with pytest.raises(ValueError, match="policy"):
        MemoryPlan((("a", "spill"),), 0, 0.0, 0.0)


def test_estimate_and_plan_round_trip():
    stats = _stats()
    # resident: a keep 1000, b swap 0, c recompute 100, rest keep 500 + 1500 + 1000 = 4100, twice
    # for the micro-batches waiting; the third's backward peaks when b comes back beside a: 5000
    # (f 4100, c 1000 + 100 + 2000). Base 5. Held 10 per micro-batch: 3 * 10 more.
    mapping = {"b": SWAP, "c": RECOMPUTE}
    assert estimate_peak_bytes(stats, mapping, in_flight=3, base_bytes=5) == 2 * 4100 + 5000 + 5
    assert (
        estimate_peak_bytes(stats, mapping, in_flight=3, base_bytes=5, held_bytes=10) == 2 * 4110 + 5010 + 5
    )
    assert estimate_resident_bytes(stats, mapping, in_flight=3, held_bytes=10) == 3 * 4110
    assert estimate_host_bytes(stats, mapping, in_flight=3) == 3 * 4000
    assert estimate_peak_bytes(stats, {}, in_flight=1) == 10000
    with pytest.raises(ValueError, match="policy"):
        estimate_peak_bytes(stats, {"a": "spill"}, in_flight=1)
    plan = decide_memory_plan(stats, in_flight=2, memory_limit=8000, swap_bandwidth=BANDWIDTH)
    assert MemoryPlan.from_dict(json.loads(json.dumps(plan.to_dict()))) == plan
    assert LayerMemoryStats.from_dict(stats[0].to_dict()) == stats[0]


def test_estimate_counts_the_prefetched_previous_swapped_layer():
    stats = _stats()
    # b and c swapped, one micro-batch. When c's backward unpacks it, the runner brings c (2000)
    # and prefetches b (4000) while a's stash is alive: 7000 (without the prefetch the peak would be
    # b's 4000 beside a: 5000).
    assert estimate_peak_bytes(stats, {"b": SWAP, "c": SWAP}, in_flight=1) == 1000 + 2000 + 4000
    # a kept layer between them does not break the chain: b and d swapped -> d 500 comes back with
    # b 4000 beside a 1000 and c 2000, then b waits prefetched while c runs its backward.
    assert estimate_peak_bytes(stats, {"b": SWAP, "d": SWAP}, in_flight=1) == 1000 + 2000 + 500 + 4000
    # c recomputed (input 100, re-materialised 2000) while b waits prefetched, beside a.
    assert estimate_peak_bytes(stats, {"b": SWAP, "c": RECOMPUTE, "d": SWAP}, in_flight=1) == 7100
    # a swapped layer that saved nothing is not in the chain: a and c swapped, b saves nothing
    zero = [
        LayerMemoryStats("a", 1000, 0, 1, 1),
        LayerMemoryStats("b", 0, 0, 1, 1),
        LayerMemoryStats("c", 10, 0, 1, 1),
    ]
    assert estimate_peak_bytes(zero, dict.fromkeys("abc", SWAP), in_flight=1) == 1010


def test_needs_new_plan():
    keep_swap = MemoryPlan((("a", KEEP), ("b", SWAP)), 100, 0.1, 1.0)
    with_recompute = MemoryPlan((("a", RECOMPUTE), ("b", SWAP)), 100, 0.1, 1.0)
    assert needs_new_plan(None, 0, None)
    assert needs_new_plan(keep_swap, current_peak=1001, memory_limit=1000)
    assert not needs_new_plan(keep_swap, current_peak=10, memory_limit=1000)
    assert not needs_new_plan(keep_swap, current_peak=10, memory_limit=None)
    assert needs_new_plan(with_recompute, current_peak=1001, memory_limit=1000)
    assert not needs_new_plan(with_recompute, current_peak=950, memory_limit=1000)  # not well under
    assert needs_new_plan(with_recompute, current_peak=900, memory_limit=1000)
    assert needs_new_plan(with_recompute, current_peak=10**9, memory_limit=None)


# ---------------------------------------------------------------------------------------------
# runtime
# ---------------------------------------------------------------------------------------------
class Square(nn.Module):
    """Saves the same tensor twice (``x * x``)."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x * x


def _blocks(widths: list[int], dtype: torch.dtype = torch.float64, dropout: bool = False) -> list:
    torch.manual_seed(0)
    blocks = []
    for i, (n_in, n_out) in enumerate(zip(widths, widths[1:])):
        layers: list[nn.Module] = [nn.Linear(n_in, n_out), nn.Tanh()]
        if dropout and i == 1:
            layers.append(nn.Dropout(0.3))
        if i == 2:
            layers.append(Square())
        blocks.append((f"block{i}", nn.Sequential(*layers).to(dtype)))
    return blocks


def _loss_and_grads(blocks, x_leaf, policies, meter=None):
    runner = LayerRunner(meter)
    torch.manual_seed(123)  # same dropout masks in every run
    for _, module in blocks:
        module.zero_grad(set_to_none=True)
    x_leaf.grad = None
    out = runner.run_sequential(blocks, x_leaf * 1.0, policies)
    loss = (out**2).sum()
    loss.backward()
    grads = [p.grad.clone() for _, module in blocks for p in module.parameters()]
    return loss.detach(), grads, x_leaf.grad.clone()


@pytest.mark.parametrize("with_meter", [False, True])
def test_policies_give_the_same_loss_and_gradients(with_meter):
    blocks = _blocks([6, 8, 8, 5, 4], dropout=True)
    names = [name for name, _ in blocks]
    torch.manual_seed(1)
    x_leaf = torch.randn(7, 6, dtype=torch.float64, requires_grad=True)
    reference = _loss_and_grads(blocks, x_leaf, {})
    mixes = [
        dict.fromkeys(names, SWAP),
        dict.fromkeys(names, RECOMPUTE),
        dict(zip(names, [SWAP, RECOMPUTE, KEEP, SWAP])),
        dict(zip(names, [RECOMPUTE, SWAP, SWAP, KEEP])),
    ]
    for policies in mixes:
        meter = ActivationMeter() if with_meter else None
        loss, grads, x_grad = _loss_and_grads(blocks, x_leaf, policies, meter)
        torch.testing.assert_close(loss, reference[0], rtol=0, atol=0)
        torch.testing.assert_close(x_grad, reference[2], rtol=0, atol=0)
        assert len(grads) == len(reference[1])
        for got, want in zip(grads, reference[1]):
            torch.testing.assert_close(got, want, rtol=0, atol=0)
        if meter is not None:
            assert meter.current_bytes == 0 and meter.host_bytes == 0


def test_meter_counts_known_saved_tensors_once_per_storage():
    # tanh saves its output y1; sin saves its input, the same y1 (one storage, counted once);
    # exp saves its output y3. Peak = 2 tensors of 10 x 16 float32 = 1280 bytes.
    n = 10 * 16 * 4
    layers = [("tanh", torch.tanh), ("sin", torch.sin), ("exp", torch.exp)]
    meter = ActivationMeter()
    runner = LayerRunner(meter)
    x = torch.randn(10, 16, requires_grad=True).clone()
    out = runner.run_sequential(layers, x)
    assert meter.current_bytes == meter.peak_bytes == 2 * n
    assert meter.layer_bytes == {"tanh": n, "sin": n, "exp": n}
    out.sum().backward()
    assert meter.current_bytes == 0 and meter.peak_bytes == 2 * n
    meter.reset_peak()
    assert meter.peak_bytes == 0


def test_meter_skips_parameters_and_counts_linear_tanh_chain():
    # Linear (2-D input) saves its input and weight.t() (a parameter view: not counted); tanh saves
    # its output, which the next Linear saves again (same storage). k blocks of width d: the chain
    # input plus k block outputs, (k + 1) * batch * d * 4 bytes.
    k, batch, d = 4, 3, 8
    blocks = [(f"b{i}", nn.Sequential(nn.Linear(d, d), nn.Tanh())) for i in range(k)]
    peaks = {}
    for policy in (KEEP, SWAP, RECOMPUTE):
        meter = ActivationMeter()
        x = torch.randn(batch, d, requires_grad=True).clone()
        out = LayerRunner(meter).run_sequential(blocks, x, {name: policy for name, _ in blocks})
        peaks[policy] = meter.peak_bytes
        if policy == SWAP:
            assert meter.host_bytes == k * 2 * batch * d * 4  # input and output of every block
        out.sum().backward()
        assert meter.current_bytes == 0 and meter.host_bytes == 0
    assert peaks[KEEP] == (k + 1) * batch * d * 4
    assert peaks[SWAP] == 0 < peaks[KEEP]
    assert peaks[RECOMPUTE] == k * batch * d * 4 < peaks[KEEP]  # each block's input, not the last output
    weight = blocks[0][1][0].weight
    assert is_parameter_like(weight) and is_parameter_like(weight.t())
    assert not is_parameter_like(torch.randn(2, requires_grad=True).clone())


def test_swap_lets_the_device_tensor_go_and_graph_frees_without_backward():
    storages = []

    def layer(x):
        h = x * 3.0  # only sin saves h
        storages.append(h.untyped_storage().data_ptr())
        return torch.sin(h)

    for policy in (KEEP, SWAP):
        storages.clear()
        meter = ActivationMeter()
        x = torch.randn(5, 4, requires_grad=True).clone()
        out = LayerRunner(meter).run("layer", policy, layer, x)
        saved = out.grad_fn._saved_self  # what backward will get (goes through the unpack hook)
        torch.testing.assert_close(saved, x.detach() * 3.0, rtol=0, atol=0)
        assert (saved.untyped_storage().data_ptr() == storages[0]) is (policy == KEEP)
        assert (meter.current_bytes, meter.host_bytes) == ((80, 0) if policy == KEEP else (0, 80))
        del saved
        out.sum().backward()
        assert meter.current_bytes == meter.host_bytes == 0

    was_enabled = gc.isenabled()
    gc.disable()
    try:
        for policy in (KEEP, SWAP, RECOMPUTE):
            meter = ActivationMeter()
            x = torch.randn(5, 4, requires_grad=True).clone()
            out = LayerRunner(meter).run("layer", policy, lambda t: torch.exp(torch.tanh(t)), x)
            assert meter.current_bytes + meter.host_bytes > 0
            del out, x
            assert meter.current_bytes == 0 and meter.host_bytes == 0, policy  # no reference cycle
    finally:
        if was_enabled:
            gc.enable()


def test_swap_backward_prefetches_the_previous_swapped_layer():
    runner = LayerRunner(ActivationMeter())
    log = []
    copy_back, restore = runner._copy_back, runner._restore

    def logged_copy_back(entry):
        issued = entry.pending is None
        copy_back(entry)
        if issued and entry.pending is not None:
            log.append(("copy", entry.group.name))

    def logged_restore(entry):
        log.append(("unpack", entry.group.name))
        return restore(entry)

    runner._copy_back, runner._restore = logged_copy_back, logged_restore
    layers = [(f"L{i}", torch.sin) for i in range(3)]  # sin saves its input: one tensor per layer
    x = torch.randn(4, 3, requires_grad=True)
    out = runner.run_sequential(layers, x.clone(), dict.fromkeys(["L0", "L1", "L2"], SWAP))
    out.sum().backward()
    # Backward reaches L2 first: L2 and the previous swapped layer L1 start coming back; when L1 is
    # unpacked, L0 starts; every layer is on its way back before its own unpack.
    assert log == [
        ("copy", "L2"),
        ("copy", "L1"),
        ("unpack", "L2"),
        ("copy", "L0"),
        ("unpack", "L1"),
        ("unpack", "L0"),
    ]
    torch.testing.assert_close(
        x.grad, torch.cos(torch.sin(torch.sin(x))) * torch.cos(torch.sin(x)) * torch.cos(x)
    )
    assert runner.meter.host_bytes == 0


def test_keep_with_meter_still_detects_inplace_modification():
    meter = ActivationMeter()
    x = torch.randn(4, requires_grad=True).clone()
    out = LayerRunner(meter).run("sin", KEEP, torch.sin, x)
    x.mul_(2)
    with pytest.raises(RuntimeError, match="modified by an inplace operation"):
        out.sum().backward()


def test_runner_as_layer_run_hook_and_under_no_grad():
    torch.manual_seed(0)
    lin = nn.Linear(4, 2)
    x = torch.randn(3, 4, requires_grad=True)
    expected = torch.autograd.grad(lin(x * 1.0).square().sum(), (x, lin.weight))
    stash = 3 * 4 * 4  # linear saves its (non-leaf) input; the weight is a parameter
    for policy, device_bytes, host_bytes in ((KEEP, stash, 0), (SWAP, 0, stash), (RECOMPUTE, stash, 0)):
        meter = ActivationMeter()
        out = LayerRunner(meter)("lin", policy, lin, (x * 1.0,))  # the stage executor's calling convention
        assert (meter.current_bytes, meter.host_bytes) == (device_bytes, host_bytes), policy
        got = torch.autograd.grad(out.square().sum(), (x, lin.weight))
        for g, want in zip(got, expected):
            torch.testing.assert_close(g, want, rtol=0, atol=0)
        with torch.no_grad():  # nothing is stashed, so nothing is kept, swapped or counted
            out = LayerRunner(meter).run("lin", policy, lin, x * 1.0)
        assert out.grad_fn is None and meter.current_bytes == meter.host_bytes == 0
    with pytest.raises(ValueError, match="unknown policy"):
        LayerRunner().run("lin", "spill", lin, x)


def _allocator_profile(work) -> tuple[int, int]:
    """CPU allocator bytes while ``work(mark)`` runs: (live at the ``mark()`` call, peak), both
    relative to the start. The torch profiler's memory events see every allocation of torch's CPU
    allocator (``tracemalloc`` does not: torch does not allocate through Python)."""
    from torch.profiler import ProfilerActivity, profile, record_function

    gc.collect()
    with profile(activities=[ProfilerActivity.CPU], profile_memory=True) as prof:
        work(lambda: record_function("MARK").__enter__().__exit__(None, None, None))
    events = sorted(
        (e.start_ns(), e.name(), e.nbytes())
        for e in prof.profiler.kineto_results.events()
        if e.name() in ("[memory]", "MARK")
    )
    live = peak = 0
    at_mark = None
    for _, name, nbytes in events:
        if name == "MARK":
            at_mark = live
            continue
        live += nbytes
        peak = max(peak, live)
    assert at_mark is not None
    return at_mark, peak


class _InFlightMicroBatch:
    """What a pipeline schedule stashes per micro-batch (the meter holds its tensors through it)."""

    def __init__(self, received: torch.Tensor, output: torch.Tensor) -> None:
        self.received, self.output = received, output


def _cuda_allocator(work) -> tuple[int, int]:
    """Like :func:`_allocator_profile` for the current CUDA device, from the caching allocator."""
    gc.collect()
    torch.cuda.synchronize()
    base = torch.cuda.memory_allocated()
    torch.cuda.reset_peak_memory_stats()
    marks = []

    def mark() -> None:
        torch.cuda.synchronize()
        marks.append(torch.cuda.memory_allocated() - base)

    work(mark)
    torch.cuda.synchronize()
    return marks[0], torch.cuda.max_memory_allocated() - base


MIXES = ["kkkkkk", "ssssss", "rrrrrr", "srkssr", "rsskrs"]


def _check_stage_memory_against_the_allocator(mix: str, device: torch.device) -> None:
    # A middle stage: received input (a leaf that requires grad, as the schedule makes it), three
    # micro-batches in flight before the first backward, outputs held for the backward. Parameters
    # are frozen so that the allocator sees activations and the gradients flowing back only (with
    # trainable ones it also sees one layer's weight-gradient temporary at a time).
    torch.manual_seed(0)
    widths = [256, 512, 1024, 512, 768, 256, 128]
    blocks = [
        (f"block{i}", nn.Sequential(nn.Linear(a, b), nn.Tanh(), nn.Linear(b, b), nn.GELU()).to(device))
        for i, (a, b) in enumerate(zip(widths, widths[1:]))
    ]
    for _, module in blocks:
        module.requires_grad_(False)
    batch, in_flight = 64, 3
    names = [name for name, _ in blocks]
    letters = {"k": KEEP, "s": SWAP, "r": RECOMPUTE}
    policies = {name: letters[c] for name, c in zip(names, mix)}

    # the stats as a stage measures them (one all-keep micro-batch; it also warms up the kernels)
    meter = ActivationMeter()
    runner = LayerRunner(meter, device)
    x = received = torch.randn(batch, widths[0], device=device).requires_grad_()
    input_bytes = []
    for name, fn in blocks:
        input_bytes.append(storage_bytes([x], skip_parameters=True))
        x = runner.run(name, KEEP, fn, x)
    held = storage_bytes([received, x])
    x.sum().backward()
    stats = [LayerMemoryStats(n, meter.layer_bytes[n], b, 1.0, 1.0) for n, b in zip(names, input_bytes)]
    del x, received
    widest = max(batch * w * 4 for w in widths)

    # one micro-batch under the plan first, so that one-time allocations are not taken for the plan's
    # activations: on CUDA a recomputed layer's forward in backward is the autograd thread's first
    # matrix product, and cuBLASLt allocates its 1 MiB workspace for that thread then
    warm = LayerRunner(ActivationMeter(), device).run_sequential(
        blocks, torch.randn(batch, widths[0], device=device).requires_grad_(), policies
    )
    warm.backward(torch.ones_like(warm))
    del warm

    meter = ActivationMeter()
    runner = LayerRunner(meter, device)
    after_forward = {}

    def step(mark):
        stash = []
        for _ in range(in_flight):
            received = torch.randn(batch, widths[0], device=device).requires_grad_()
            item = _InFlightMicroBatch(received, runner.run_sequential(blocks, received, policies))
            meter.hold(item, (item.received, item.output))
            stash.append(item)
            del received
        after_forward.update(meter.snapshot())
        mark()
        while stash:
            item = stash.pop(0)
            item.output.backward(torch.ones_like(item.output))
            del item

    on_cuda = device.type == "cuda"
    at_mark, peak = (_cuda_allocator if on_cuda else _allocator_profile)(step)
    # swapped activations sit in host memory: on the CPU that is the same allocator, on a GPU not
    host = 0 if on_cuda else estimate_host_bytes(stats, policies, in_flight)
    resident = estimate_resident_bytes(stats, policies, in_flight, held)
    estimate = estimate_peak_bytes(stats, policies, in_flight, held_bytes=held)
    # after the forwards: meter, estimate and allocator agree (a recompute checkpoint also keeps the
    # RNG states, on the CPU: 5 KiB per recomputed layer and micro-batch, which neither counts)
    rng_state = 0 if on_cuda else torch.get_rng_state().numel() * mix.count("r") * in_flight
    assert after_forward["current_bytes"] == resident
    assert after_forward["host_bytes"] == estimate_host_bytes(stats, policies, in_flight)
    assert at_mark == resident + host + rng_state
    # the peak in backward: the estimate leaves out only the gradients flowing back, at most two
    # activations of the widest layer, and the gradient this test hands to backward
    seed = batch * widths[-1] * 4
    assert estimate + host <= peak <= estimate + host + rng_state + 2 * widest + seed, (peak, estimate + host)
    assert meter.current_bytes == meter.host_bytes == 0


@pytest.mark.parametrize("mix", MIXES)
def test_estimate_and_meter_agree_with_the_cpu_allocator(mix):
    _check_stage_memory_against_the_allocator(mix, torch.device("cpu"))


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
@pytest.mark.parametrize("mix", MIXES)
def test_estimate_and_meter_agree_with_cuda_max_memory_allocated(mix):
    _check_stage_memory_against_the_allocator(mix, torch.device("cuda"))


def _model_blocks() -> list:
    torch.manual_seed(0)
    widths = [32, 64, 128, 64, 96, 32, 16]
    return [
        (f"block{i}", nn.Sequential(nn.Linear(a, b), nn.Tanh(), nn.Linear(b, b), nn.GELU()))
        for i, (a, b) in enumerate(zip(widths, widths[1:]))
    ]


def test_measure_layer_stats():
    blocks = _model_blocks()
    batch = 16
    stats = measure_layer_stats(blocks, torch.randn(batch, 32), repeats=2)
    assert [s.name for s in stats] == [name for name, _ in blocks]
    widths = [32, 64, 128, 64, 96, 32, 16]
    for s, a, b in zip(stats, widths, widths[1:]):
        assert s.input_bytes == batch * a * 4
        # Linear saves its input, tanh its output, the second Linear the same output, GELU its input.
        assert s.saved_bytes == batch * (a + b + b) * 4
        assert s.forward_seconds > 0 and s.backward_seconds > 0
    assert all(p.grad is None for _, m in blocks for p in m.parameters())


@pytest.mark.parametrize("swap_share", [2.0, 1e6])
def test_end_to_end_plan_fits_the_measured_peak(swap_share):
    blocks = _model_blocks()
    batch, in_flight = 16, 2
    stats = measure_layer_stats(blocks, torch.randn(batch, 32), repeats=2)
    all_keep = estimate_peak_bytes(stats, {}, in_flight)
    minimum = minimum_peak_bytes(stats, in_flight)
    limit = (minimum + all_keep) // 2
    budget = sum(s.forward_seconds + s.backward_seconds for s in stats)
    # Swapping every layer would take swap_share times the forward+backward budget: 2.0 swaps about
    # half the layers, 1e6 only the first one in ratio order, so recompute has to make up the rest.
    bandwidth = sum(s.saved_bytes for s in stats) / (swap_share * budget)
    plan = decide_memory_plan(stats, in_flight=in_flight, memory_limit=limit, swap_bandwidth=bandwidth)
    assert plan.count(KEEP) < len(stats)
    if swap_share > len(stats):
        assert plan.count(SWAP) == 1 and plan.count(RECOMPUTE) >= 1
    assert plan.estimated_peak_bytes <= limit

    meter = ActivationMeter()
    runner = LayerRunner(meter)
    kept = ActivationMeter()
    outs, kept_outs = [], []
    torch.manual_seed(5)
    for _ in range(in_flight):  # all micro-batches in flight before the first backward
        x = torch.randn(batch, 32, requires_grad=True).clone()
        outs.append(runner.run_sequential(blocks, x, plan))
        kept_outs.append(LayerRunner(kept).run_sequential(blocks, x.detach().requires_grad_().clone()))
    assert meter.peak_bytes <= limit < all_keep
    assert kept.peak_bytes > limit  # without the plan it would not fit
    for out in outs:
        out.sum().backward()
    assert meter.current_bytes == 0 and meter.host_bytes == 0


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_cuda_swap_and_recompute_match_keep():
    device = torch.device("cuda")
    blocks = [(name, module.to(device)) for name, module in _blocks([64, 128, 128, 64, 32], torch.float32)]
    names = [name for name, _ in blocks]
    x_leaf = torch.randn(256, 64, device=device, requires_grad=True)
    reference = _loss_and_grads(blocks, x_leaf, {})
    for policies in (dict.fromkeys(names, SWAP), dict(zip(names, [SWAP, RECOMPUTE, SWAP, KEEP]))):
        meter = ActivationMeter()
        loss, grads, x_grad = _loss_and_grads(blocks, x_leaf, policies, meter)
        torch.cuda.synchronize()
        torch.testing.assert_close(loss, reference[0])
        torch.testing.assert_close(x_grad, reference[2])
        for got, want in zip(grads, reference[1]):
            torch.testing.assert_close(got, want)
        assert meter.current_bytes == 0 and meter.host_bytes == 0


# ---------------------------------------------------------------------------------------------
# layers that update buffers in forward (BatchNorm's running statistics)
# ---------------------------------------------------------------------------------------------
def _batch_norm_step(policy: str, wrap: str, micro_batches: int = 3) -> tuple[nn.Module, list[torch.Tensor]]:
    """``micro_batches`` forwards of a BatchNorm layer through a runner, then their backwards in reverse
    (as a pipeline stage runs them); the layer and the input gradients."""
    torch.manual_seed(0)
    norm = nn.BatchNorm1d(5, momentum=0.3).double()
    fn = {"module": norm, "closure": lambda x: norm(x), "method": norm.forward}[wrap]
    runner = LayerRunner(ActivationMeter())
    inputs = [
        (torch.randn(8, 5, dtype=torch.float64) * (i + 2) + i).requires_grad_() for i in range(micro_batches)
    ]
    outputs = []
    for x in inputs:
        runner.begin_forward()
        outputs.append(runner.run("norm", policy, fn, x * 1.0))
    for y in reversed(outputs):
        (y * torch.arange(5, dtype=torch.float64)).pow(2).sum().backward()
    return norm, [x.grad for x in inputs]


@pytest.mark.parametrize("wrap", ["module", "closure", "method"])
@pytest.mark.parametrize("policy", [RECOMPUTE, SWAP])
def test_recomputed_layer_updates_its_buffers_once_per_forward(policy: str, wrap: str) -> None:
    """A recomputed BatchNorm's running statistics advance once per micro-batch, as when kept (the
    recompute in backward leaves them as it found them), and its gradients are the kept layer's."""
    expected, expected_grads = _batch_norm_step(KEEP, wrap)
    norm, grads = _batch_norm_step(policy, wrap)
    assert int(expected.num_batches_tracked) == 3
    for name, buffer in expected.named_buffers():
        assert torch.equal(dict(norm.named_buffers())[name], buffer), name
    for got, want in zip(grads, expected_grads):
        assert torch.equal(got, want)


@pytest.mark.parametrize("policy", [KEEP, RECOMPUTE])
def test_pipeline_with_batchnorm_matches_one_process_accumulating_micro_batches(
    policy: str, tmp_path: Path
) -> None:
    """hier_pipeline over 2 stages with every layer under ``policy``: parameters and BatchNorm's
    running_mean / running_var / num_batches_tracked equal one process that accumulates the same
    micro-batches (each micro-batch's forward once)."""
    out = tmp_path / "state.pt"
    run_torchrun("pipeline_batchnorm.py", 2, policy, str(out), timeout=300)
    got = torch.load(out)
    model = pipeline_batchnorm.BatchNormChain()
    micro = pipeline_batchnorm.BATCH // pipeline_batchnorm.MICRO_BATCHES
    pipeline_batchnorm.trainer(devices=1, accumulate_grad_batches=pipeline_batchnorm.MICRO_BATCHES).fit(
        model, train_dataloaders=pipeline_batchnorm.batch_norm_loader(micro)
    )
    expected = model.state_dict()
    assert (
        int(expected["norm1.num_batches_tracked"])
        == pipeline_batchnorm.STEPS * pipeline_batchnorm.MICRO_BATCHES
    )
    assert set(got) == set(expected)
    for key, value in expected.items():
        torch.testing.assert_close(got[key], value, rtol=1e-9, atol=1e-12, msg=key)


def test_measure_layer_stats_leaves_batchnorm_running_statistics_as_they_were() -> None:
    """Profiling runs each layer several times; the model's running statistics are not advanced by it."""
    torch.manual_seed(0)
    lin, norm = nn.Linear(4, 6), nn.BatchNorm1d(6)
    with torch.no_grad():
        norm.running_mean.fill_(0.5)
    before = {name: b.clone() for name, b in norm.named_buffers()}
    stats = measure_layer_stats([("lin", lin), ("norm", norm)], torch.randn(10, 4) + 3, repeats=2)
    assert [s.name for s in stats] == ["lin", "norm"]
    assert stats[1].saved_bytes > 0
    for name, buffer in norm.named_buffers():
        assert torch.equal(buffer, before[name]), name


def _exported_classifier_step(policy: str) -> tuple[dict[str, torch.Tensor], dict[str, torch.Tensor]]:
    """Two micro-batches through a one-stage executor of the exported ``ImageClassifier`` (BatchNorm
    layers captured by ``torch.export``), every layer under ``policy``; its state and gradients."""
    from pipeline_export_capture import ImageClassifier

    from lightning_hier.pipeline.graph import LayerGraph
    from lightning_hier.pipeline.partition import StagePartition
    from lightning_hier.pipeline.stage import StageExecutor

    torch.manual_seed(0)
    model = ImageClassifier().double()
    graph = LayerGraph(model, example_input=((torch.zeros(2, 3, 16, 16, dtype=torch.float64),), {}))
    assert graph.capture == "export"
    executor = StageExecutor(graph, StagePartition((0,), graph.num_clusters), 0)
    executor.layer_run, executor.layer_run_always = LayerRunner(ActivationMeter()), True
    executor.policies = {graph.layers[i].name: policy for i in executor.layer_range}
    torch.manual_seed(1)
    outputs = [executor.forward(torch.randn(4, 3, 20, 20, dtype=torch.float64)) for _ in range(2)]
    for out in reversed(outputs):
        out.pow(2).sum().backward()
    grads = {name: p.grad for name, p in model.named_parameters() if p.grad is not None}
    return model.state_dict(), grads


def test_recomputed_exported_layers_update_batchnorm_statistics_once() -> None:
    """Exported layers read the model's buffers by name; recomputing them leaves BatchNorm's running
    statistics and the gradients as keeping them does."""
    state, grads = _exported_classifier_step(RECOMPUTE)
    expected_state, expected_grads = _exported_classifier_step(KEEP)
    assert any(name.endswith("num_batches_tracked") for name in expected_state)
    for name, value in expected_state.items():
        assert torch.equal(state[name], value), name
    assert grads.keys() == expected_grads.keys() and grads
    for name, value in expected_grads.items():
        assert torch.equal(grads[name], value), name

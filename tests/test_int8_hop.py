"""``HierSlicedStrategy(inter_node_dtype="int8")``: the inter-node hop in int8 blocks, one fp32 scale each.

The codec's round trip stays within half a scale per block; the reducers' all-reduce across nodes stays within
the quantisation bound of the fp32 sum (2 nodes x 1 and 2 nodes x 2 gloo processes); error feedback keeps the
sum delivered over many steps within one step's bound of what was given; no device value is read on the
host; the digits example trains to full precision's loss while the inter-node link carries about a quarter
of its bytes; every collective is legal under NCCL and issued in one order.
"""

from __future__ import annotations

import json
import math
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
from helpers import init_gloo, run_spawned, run_torchrun

from lightning_hier import HierSlicedStrategy, Topology
from lightning_hier.audit import analyze
from lightning_hier.audit.emulation import EMULATED_NCCL
from lightning_hier.sliced.int8_codec import (
    BLOCK,
    blocks_of,
    dequantize,
    int8_all_reduce,
    pack,
    quantize,
    unpack,
)
from lightning_hier.sliced.reducer import ReduceJob, make_reducer
from lightning_hier.topology import DEVICE_BACKEND_ENV

SLICE = 5003  # elements per device: parts of 2502 and 2501 on 2 nodes, each of two blocks, the last partial


def _gradient(rank: int, numel: int) -> torch.Tensor:
    """Rank ``rank``'s gradient: magnitudes from 1e-2 to 1e2 changing every 700 elements (inside blocks)."""
    generator = torch.Generator().manual_seed(100 + rank)
    magnitude = 10.0 ** ((torch.arange(numel) // 700) % 5 - 2).float()
    return torch.randn(numel, generator=generator) * magnitude


def _block_max(x: torch.Tensor, nodes: int) -> torch.Tensor:
    """Per element: ``max |x|`` over the block that carries it across ``nodes`` nodes (the slice cut into one
    part per node, each part into blocks of ``BLOCK``)."""
    n = x.numel()
    part = -(-n // nodes)
    blocks = -(-part // BLOCK)
    rows = torch.nn.functional.pad(x.abs(), (0, nodes * part - n)).view(nodes, part)
    cells = torch.nn.functional.pad(rows, (0, blocks * BLOCK - part)).view(nodes, blocks, BLOCK)
    return cells.amax(dim=2, keepdim=True).expand(-1, -1, BLOCK).reshape(nodes, -1)[:, :part].reshape(-1)[:n]


# ---------------------------------------------------------------------- the codec
def test_the_round_trip_of_a_block_is_within_half_its_scale() -> None:
    x = _gradient(0, 3 * (2 * BLOCK + 77)).view(3, -1)  # three rows of three blocks, the last of 77
    x[1, BLOCK : 2 * BLOCK] = 0.0  # a block of zeros
    q, scales = quantize(x)
    assert q.dtype == torch.int8 and q.shape == x.shape and scales.dtype == torch.float32
    assert scales.shape == (3, math.ceil(x.shape[1] / BLOCK))
    for row in range(3):
        for b in range(scales.shape[1]):
            block = x[row, b * BLOCK : (b + 1) * BLOCK]
            expected_scale = block.abs().max() / 127
            torch.testing.assert_close(scales[row, b], expected_scale, rtol=1e-6, atol=0)
            back = dequantize(q[row : row + 1, b * BLOCK : (b + 1) * BLOCK], scales[row : row + 1, b : b + 1])
            error = (back[0] - block).abs().max()
            assert error <= expected_scale / 2 * (1 + 1e-5), (row, b, error / expected_scale)
    assert int(q.abs().max()) == 127
    assert torch.equal(dequantize(q, scales)[1, BLOCK : 2 * BLOCK], torch.zeros(BLOCK))
    q_back, scales_back = unpack(pack(q, scales), x.shape[1])  # the message one collective carries
    assert torch.equal(q_back, q) and torch.equal(scales_back, scales)
    assert pack(q, scales).shape == (3, x.shape[1] + 4 * scales.shape[1])


# ---------------------------------------------------------------------- the reducers across nodes
def _reduce(rank: int, world: int, store: str, per_node: int, kind: str, chunk_bytes: int) -> dict:
    init_gloo(rank, world, store)
    try:
        topology = Topology(world, rank, per_node).build_groups()
        reducer = make_reducer(
            topology.intra_group, topology.inter_group, chunk_bytes, torch.device("cpu"), kind, torch.int8
        )
        bounds = [(k * SLICE, (k + 1) * SLICE) for k in range(per_node)]
        out = torch.zeros(SLICE)
        job = ReduceJob(_gradient(rank, per_node * SLICE), bounds, out)
        reducer.wait(reducer.submit(job))
        reducer.close()
        return {"sum": out, "local_rank": topology.local_rank}
    finally:
        dist.destroy_process_group()


@pytest.mark.parametrize(
    ("world", "per_node", "kind", "chunk_bytes"),
    [
        (2, 1, "thread", 1 << 30),
        (2, 1, "inline", 1 << 30),
        (4, 2, "thread", 1 << 30),
        (4, 2, "inline", 1 << 30),
        (4, 2, "thread", 8000),  # three pieces per slice, each its own all-to-all and all-gather
    ],
)
def test_the_int8_all_reduce_is_within_the_quantisation_bound_of_the_fp32_sum(
    world: int, per_node: int, kind: str, chunk_bytes: int, tmp_path: Path
) -> None:
    results = run_spawned(_reduce, world, tmp_path, per_node, kind, chunk_bytes)
    assert all(r is not None and "error" not in r for r in results), results
    nodes = world // per_node
    gradients = [_gradient(rank, per_node * SLICE) for rank in range(world)]
    for rank, result in enumerate(results):
        k = result["local_rank"]
        # what each node's reduce-scatter leaves on the rank that owns slice k, then their exact sum
        node_sums = [
            sum(gradients[node * per_node + j][k * SLICE : (k + 1) * SLICE] for j in range(per_node))
            for node in range(nodes)
        ]
        exact = sum(s.double() for s in node_sums)
        # each node's part is sent within max|x| / 254 of its block and the owner's sum again within
        # max|sum| / 254, where max|sum| <= sum of the nodes' maxima: in all, sum of the maxima / 127
        if chunk_bytes >= SLICE * 4:
            bound = sum(_block_max(s, nodes) for s in node_sums).double() / 127
        else:  # pieces move the blocks: the largest magnitude within a block's reach of the element
            window = torch.nn.functional.max_pool1d(
                torch.stack([s.abs() for s in node_sums]).unsqueeze(0), 2 * BLOCK + 1, 1, BLOCK
            )[0]
            bound = window.sum(0).double() / 127
        error = (result["sum"].double() - exact).abs()
        assert (error <= bound * (1 + 1e-4) + 1e-6).all(), (rank, (error / bound).max())
        assert error.max() > 0  # it really was quantised
        # every node decodes the same gathered bytes: the same-index ranks hold identical sums
        assert torch.equal(result["sum"], results[k]["sum"])


# ---------------------------------------------------------------------- error feedback
def _steps(rank: int, world: int, store: str, steps: int) -> dict:
    init_gloo(rank, world, store)
    try:
        group = dist.group.WORLD  # 2 nodes x 1: the world is the inter-node group
        gradient = _gradient(rank, SLICE)
        delivered = {}
        first = None
        for feedback in (True, False):
            residual = torch.zeros(SLICE) if feedback else None
            total = torch.zeros(SLICE, dtype=torch.float64)
            for step in range(steps):
                out = gradient.clone()
                work, decode = int8_all_reduce(out, residual, group)
                work.wait()
                decode()
                total += out.double()
                if step == 0 and not feedback:
                    first = out.clone()
            delivered[feedback] = total
            if feedback:
                owed = [torch.zeros(SLICE) for _ in range(world)]
                dist.all_gather(owed, residual)
        return {"with": delivered[True], "without": delivered[False], "owed": owed, "first": first}
    finally:
        dist.destroy_process_group()


def test_error_feedback_keeps_the_sum_over_steps_within_one_steps_bound(tmp_path: Path) -> None:
    steps = 30
    results = run_spawned(_steps, 2, tmp_path, steps)
    assert all(r is not None and "error" not in r for r in results), results
    gradients = [_gradient(rank, SLICE) for rank in range(2)]
    given = steps * sum(g.double() for g in gradients)
    one_step = sum(_block_max(g, 2) for g in gradients).double() / 127
    for result in results:
        # what arrived over the steps is what was given less what the nodes still owe (their residuals)
        owed = sum(r.double() for r in result["owed"])
        torch.testing.assert_close(result["with"], given - owed, rtol=0, atol=1e-3)
        drift = (result["with"] - given).abs()
        # the residuals hold one step's rounding (of an input grown by at most that rounding)
        assert (drift <= one_step * 1.05).all(), (drift / one_step).max()
        # without feedback the same rounding is lost at every step: the drift grows with the steps
        torch.testing.assert_close(result["without"], steps * result["first"].double(), rtol=1e-6, atol=1e-6)
        lost = (result["without"] - given).abs()
        assert lost.max() > 10 * drift.max(), (lost.max(), drift.max())


# ---------------------------------------------------------------------- no host reads
def _guarded(rank: int, world: int, store: str) -> dict:
    from test_no_host_sync import HostSyncGuard, OnDevice

    init_gloo(rank, world, store)
    try:
        out = _gradient(rank, SLICE).as_subclass(OnDevice)
        residual = torch.zeros(SLICE).as_subclass(OnDevice)
        with HostSyncGuard() as guard:
            work, decode = int8_all_reduce(out, residual, dist.group.WORLD)
            work.wait()
            decode()
        return {"syncs": [(s.op, s.caller) for s in guard.syncs], "marked": isinstance(out, OnDevice)}
    finally:
        dist.destroy_process_group()


def test_the_int8_hop_reads_no_device_value_on_the_host(tmp_path: Path) -> None:
    # on CPU the tensors of a GPU run are stood in for by marked tensors (tests/test_no_host_sync.py); a
    # real device's stream order is what tests/test_gpu.py's checks run
    for result in run_spawned(_guarded, 2, tmp_path):
        assert result is not None and "error" not in result, result
        assert result["marked"] and result["syncs"] == [], result["syncs"]


# ---------------------------------------------------------------------- the strategy
def test_the_strategy_takes_int8() -> None:
    assert HierSlicedStrategy(inter_node_dtype="int8").inter_node_dtype == "int8"


@pytest.fixture(scope="module")
def digits(tmp_path_factory: pytest.TempPathFactory) -> dict:
    out = tmp_path_factory.mktemp("int8_digits") / "results.json"
    run_torchrun("int8_hop_digits.py", 4, str(out), timeout=600)
    return json.loads(out.read_text())


def test_int8_hop_keeps_the_digits_loss_within_half_a_percent_of_full_precision(digits: dict) -> None:
    fp32, int8 = digits["fp32"]["loss"], digits["int8"]["loss"]
    assert fp32 < 1.5  # the steps really trained the model (from ~2.3)
    assert abs(int8 - fp32) / fp32 < 0.005, (fp32, int8)


def test_int8_hop_sends_about_a_quarter_of_the_fp32_bytes_across_nodes(digits: dict) -> None:
    for fp32_rank, int8_rank in zip(digits["fp32"]["inter_bytes"], digits["int8"]["inter_bytes"]):
        assert len(int8_rank) == len(fp32_rank) > 0
        for (fp32_bytes, fp32_wire), (_, int8_wire) in zip(fp32_rank, int8_rank):
            # fp32: one all-reduce of the rank's slice (n floats); on 2 nodes a ring puts n floats on the link
            n = fp32_bytes // 4
            part = math.ceil(n / 2)
            message = part + 4 * math.ceil(part / BLOCK)  # int8 values and fp32 scales of one part
            # int8: the all-to-all puts one part's message on the link, the all-gather one more
            assert int8_wire == 2 * message, (int8_wire, message)
            assert 0.25 <= int8_wire / fp32_wire <= 0.27, int8_wire / fp32_wire


def test_the_digits_scripts_block_option_reaches_the_hop(one_process_group) -> None:  # noqa: ANN001
    """``--block`` (docs/hier_sliced.md's table) must change the block of the hop the reducers call, whose
    default was bound when the codec was defined, not only the module's constant."""
    import inspect

    import int8_hop_digits

    from lightning_hier.sliced import int8_codec

    readers = [inspect.unwrap(f) for f in (blocks_of, quantize, dequantize, int8_all_reduce)]
    saved = [f.__defaults__ for f in readers]
    try:
        int8_hop_digits.use_block(128)
        # a block of 128 small elements before larger ones: with blocks of 128 the small ones get a scale of
        # their own and arrive exactly; in one block of 2048 they would round to 0 (1e-3 < 1 / 254)
        gradient = torch.cat([torch.full((128,), 1e-3), torch.ones(172)])
        out = gradient.clone()
        work, decode = int8_all_reduce(out, None, one_process_group)
        work.wait()
        decode()
        torch.testing.assert_close(out, gradient, rtol=1e-6, atol=0)
        assert int8_codec.BLOCK == 128 and blocks_of(300) == 3 and quantize(gradient[None])[1].shape == (1, 3)
    finally:
        int8_codec.BLOCK = BLOCK
        for f, defaults in zip(readers, saved):
            f.__defaults__ = defaults


def test_every_collective_of_the_int8_hop_is_legal_under_nccl_and_in_one_order(tmp_path: Path) -> None:
    audit_dir = tmp_path / "audit"
    env = {DEVICE_BACKEND_ENV: EMULATED_NCCL, "LIGHTNING_HIER_AUDIT_DIR": str(audit_dir)}
    run_torchrun("int8_hop_digits.py", 4, str(tmp_path / "audit.json"), "--audit", env=env, timeout=300)
    report = analyze(audit_dir)
    assert sorted(report.records) == [0, 1, 2, 3]
    report.raise_if_problems()
    ours = [r for r in report.select(package=True) if "sliced/int8_codec.py" in r["caller"]]
    assert {r["op"] for r in ours} >= {"all_to_all_single", "all_gather_single"}, {r["op"] for r in ours}
    assert all(r["main_thread"] for r in ours)  # the inline reducer of a CUDA run: from the training thread
    for r in ours:  # int8 messages only, on a device group among the same-index ranks of the two nodes
        assert {t[1] for t in r["tensors"]} == {"int8"}, r["tensors"]
        assert sorted(r["group_devices"]) == ["cpu", "cuda"] and r["group_ranks"] in ([0, 2], [1, 3]), r


# ---------------------------------------------------------------------- a non-finite step
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.int8])
def test_a_non_finite_step_leaves_the_next_steps_finite(dtype: torch.dtype, one_process_group) -> None:  # noqa: ANN001
    """An fp16 loss scale that overflows gives one step of inf gradients, which the grad scaler skips; the
    residual must not carry inf - inf into every later step (the scaler would skip them all)."""
    from lightning_hier.sliced.reducer import InlineReducer

    reducer = InlineReducer(one_process_group, one_process_group, inter_dtype=dtype)
    reducer._inter_size = 2  # the one-process group stands in for the inter-node hop (a sum of one)
    residual = torch.zeros(4)
    overflowed = torch.tensor([1.0, float("inf"), 2.0, 3.0])
    out = reducer.wait(reducer.submit(ReduceJob(overflowed, [(0, 4)], torch.zeros(4), residual=residual)))
    assert not torch.isfinite(out).all()  # the overflow reaches the scaler, which skips the step
    gradient = torch.tensor([1.0, 1.0, 2.0, 3.0])
    job = ReduceJob(gradient.clone(), [(0, 4)], torch.zeros(4), residual=residual)
    out = reducer.wait(reducer.submit(job))
    assert torch.isfinite(residual).all() and torch.isfinite(out).all(), (out, residual)
    # bf16 holds these exactly; int8 within half a scale of the block (max 3 / 127)
    torch.testing.assert_close(out, gradient, rtol=0, atol=3 / 254 * 1.0001)


# ---------------------------------------------------------------------- the same bits as the plain codec
def _reference_quantize(rows: torch.Tensor, block: int = BLOCK) -> tuple[torch.Tensor, torch.Tensor]:
    """The codec written plainly, one padded copy per step: what the in-place passes must reproduce."""
    count, length = rows.shape
    nb = -(-length // block)
    work = rows.float() if rows.dtype != torch.float64 else rows
    padded = torch.nn.functional.pad(work, (0, nb * block - length)).view(count, nb, block)
    scales = (padded.abs().amax(dim=2) / 127).float()
    divisor = torch.where(scales > 0, scales, torch.ones_like(scales)).to(work.dtype)
    values = torch.round(padded / divisor.unsqueeze(2)).clamp_(-127, 127)
    return values.view(count, nb * block)[:, :length].to(torch.int8), scales


def _reference_dequantize(
    q: torch.Tensor, scales: torch.Tensor, block: int = BLOCK, dtype: torch.dtype = torch.float32
) -> torch.Tensor:
    count, length = q.shape
    nb = scales.shape[1]
    padded = torch.nn.functional.pad(q.to(dtype), (0, nb * block - length)).view(count, nb, block)
    return (padded * scales.to(dtype).unsqueeze(2)).view(count, nb * block)[:, :length]


def _reference_all_reduce(out: torch.Tensor, residual: torch.Tensor | None, group: dist.ProcessGroup) -> None:
    size, rank, n = dist.get_world_size(group), dist.get_rank(group), out.numel()
    part = -(-n // size)
    compute = torch.float64 if out.dtype == torch.float64 else torch.float32
    if residual is not None:
        out.add_(residual)
    rows = torch.nn.functional.pad(out.to(compute), (0, size * part - n)).view(size, part)
    q, scales = _reference_quantize(rows)
    if residual is not None:
        torch.sub(out, _reference_dequantize(q, scales, BLOCK, compute).reshape(-1)[:n], out=residual)
    message = pack(q, scales)
    received = torch.empty_like(message)
    dist.all_to_all_single(received, message, group=group)
    total = _reference_dequantize(*unpack(received, part), BLOCK, compute).sum(dim=0, keepdim=True)
    q_sum, scales_sum = _reference_quantize(total)
    if residual is not None:
        lo, hi = min(rank * part, n), min((rank + 1) * part, n)
        dropped = total - _reference_dequantize(q_sum, scales_sum, BLOCK, compute)
        residual[lo:hi].add_(dropped[0, : hi - lo])
        residual.nan_to_num_(nan=0.0, posinf=0.0, neginf=0.0)
    gathered = torch.empty((size, message.shape[1]), dtype=torch.int8)
    dist.all_gather_into_tensor(gathered, pack(q_sum, scales_sum), group=group)
    out.copy_(_reference_dequantize(*unpack(gathered, part), BLOCK, compute).reshape(-1)[:n])


def _bits(x: torch.Tensor) -> torch.Tensor:
    """``x``'s bytes, so that -0.0 and 0.0 (or two NaNs) compare by their encoding."""
    return x.contiguous().view(torch.uint8)


def _awkward(rows: int, length: int, dtype: torch.dtype, seed: int) -> torch.Tensor:
    """Random rows of mixed magnitudes with a block of zeros, one of -0.0 and one of subnormals (whose scale
    rounds coarsely, so that clamping matters) where the rows are long enough."""
    x = _gradient(seed, rows * length).view(rows, length).to(dtype)
    if length > 3 * BLOCK:
        x[0, :BLOCK] = 0.0
        x[-1, BLOCK : 2 * BLOCK] = -0.0
        x[0, 2 * BLOCK : 3 * BLOCK] = torch.randn(BLOCK).to(dtype) * 1e-43
    return x


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64, torch.bfloat16])
@pytest.mark.parametrize("shape", [(3, 3 * BLOCK + 77), (2, 4 * BLOCK), (4, BLOCK - 1), (1, 5)])
def test_quantize_and_dequantize_give_the_bits_of_the_plain_codec(shape: tuple, dtype: torch.dtype) -> None:
    x = _awkward(*shape, dtype, seed=len(shape) + shape[1])
    q, scales = quantize(x)
    q_ref, scales_ref = _reference_quantize(x)
    assert torch.equal(q, q_ref) and torch.equal(_bits(scales), _bits(scales_ref))
    for out_dtype in (torch.float32, torch.float64):
        back = dequantize(q, scales, BLOCK, out_dtype)
        assert torch.equal(_bits(back), _bits(_reference_dequantize(q_ref, scales_ref, BLOCK, out_dtype)))
    strided = torch.cat([x, x], dim=1)[:, : shape[1]]  # rows that are views with a longer stride
    assert torch.equal(quantize(strided)[0], q_ref)


_SIZES = [(SLICE, torch.float32), (4 * BLOCK, torch.float32), (3, torch.float32), (6244, torch.float64),
          (SLICE, torch.bfloat16)]  # fmt: skip


def _against_reference(rank: int, world: int, store: str) -> dict:
    init_gloo(rank, world, store)
    mismatches = []
    try:
        for n, dtype in _SIZES:
            for feedback in (True, False):
                gradient = _awkward(1, n, dtype, seed=rank)[0]
                ours, theirs = gradient.clone(), gradient.clone()
                residuals = [torch.zeros(n, dtype=dtype) for _ in range(2)] if feedback else [None, None]
                for step in range(3):  # from the second step on, the residuals are not zero
                    work, decode = int8_all_reduce(ours, residuals[0], dist.group.WORLD)
                    work.wait()
                    decode()
                    _reference_all_reduce(theirs, residuals[1], dist.group.WORLD)
                    if not torch.equal(_bits(ours), _bits(theirs)):
                        mismatches.append((n, str(dtype), feedback, step, "sum"))
                    if feedback and not torch.equal(_bits(residuals[0]), _bits(residuals[1])):
                        mismatches.append((n, str(dtype), feedback, step, "residual"))
                    ours.add_(gradient)
                    theirs.add_(gradient)
        return {"mismatches": mismatches}
    finally:
        dist.destroy_process_group()


@pytest.mark.parametrize("world", [2, 4])
def test_the_int8_all_reduce_gives_the_bits_of_the_plain_codec(world: int, tmp_path: Path) -> None:
    # 4 nodes of 3 elements: parts of one element and a last node with none (all padding)
    for result in run_spawned(_against_reference, world, tmp_path):
        assert result is not None and "error" not in result, result
        assert result["mismatches"] == [], result["mismatches"]


# ---------------------------------------------------------------------- passes over the data
class _Traffic:
    """Counts, per aten operation that is not a view, the elements of its largest tensor (the data it
    reads or writes), and the bytes of the tensors it returns in fresh memory."""

    def __init__(self) -> None:
        from torch.utils._python_dispatch import TorchDispatchMode
        from torch.utils._pytree import tree_flatten

        traffic = self

        class Mode(TorchDispatchMode):
            def __torch_dispatch__(self, func, types, args=(), kwargs=None):  # noqa: ANN001, ANN202
                inputs = [t for t in tree_flatten((args, kwargs))[0] if isinstance(t, torch.Tensor)]
                result = func(*args, **(kwargs or {}))
                if not func.is_view:
                    outputs = [t for t in tree_flatten(result)[0] if isinstance(t, torch.Tensor)]
                    traffic.elements += max((t.numel() for t in inputs + outputs), default=0)
                    known = {t.untyped_storage().data_ptr() for t in inputs}
                    fresh = [t for t in outputs if t.untyped_storage().data_ptr() not in known]
                    traffic.fresh_bytes += sum(t.numel() * t.element_size() for t in fresh)
                return result

        self.mode = Mode()
        self.elements = 0
        self.fresh_bytes = 0


def test_the_int8_hop_makes_few_passes_and_allocates_only_its_all_gathers_messages(one_process_group) -> None:  # noqa: ANN001
    """The hop is bound by passes over the slice on a CPU: adding the residual, quantising (max, min,
    divide, round, clamp, store as int8), the residual (dequantise, subtract), the owner's sum (dequantise,
    sum), quantising the sum and its residual, and decoding what arrives; and by memory it takes anew."""
    n = 3 * BLOCK + 100  # a short last block
    out, residual = _gradient(0, n), torch.zeros(n)
    for _step in range(2):  # the second call: scratch buffers already there
        traffic = _Traffic()
        with traffic.mode:
            work, decode = int8_all_reduce(out, residual, one_process_group)
            work.wait()
            decode()
    passes = traffic.elements / n
    assert passes <= 32, passes  # the codec written plainly: 46, most of them on zero-padded copies
    # the all-gather's two int8 messages (its own: it runs asynchronously) and per-block scales, no float
    # copy of the slice (on a CPU a fresh page costs a fault)
    assert traffic.fresh_bytes <= 2 * (n + 4 * blocks_of(n)) + 64 * 4 * blocks_of(n), traffic.fresh_bytes

"""hier_pipeline as pipeline x data parallel: 2 replicas of a 2-stage pipeline on 4 gloo processes against
Lightning's ``ddp`` on 2 processes, each ddp rank reading its replica's shard in the same batches (the
pipeline's micro-batch losses are weighted by their share of the batch, so a replica's gradient is its whole
batch's, as a ddp rank's). float64, so any real difference shows at full size. The layout, the bucketing of
the averaged gradients and the stage-count checks are checked without processes."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
from helpers import init_gloo, run_spawned, run_torchrun

from lightning_hier.audit import analyze
from lightning_hier.audit.emulation import EMULATED_NCCL
from lightning_hier.pipeline.replicas import ReplicaGradients, ReplicaLayout, averaged_over_replicas
from lightning_hier.pipeline.settings import PipelineSettings
from lightning_hier.topology import DEVICE_BACKEND_ENV

SCENARIOS = (
    "adam_clip_accumulate",
    "rebalance_tied",
    "batchnorm",
    "batchnorm_after_backward",
    "memory_limit",
)
RTOL = 1e-9  # float64: micro-batches against whole batches differ by rounding only


# ---------------------------------------------------------------------------------------------- no processes
def test_layout_keeps_each_replica_contiguous_with_replica_0s_last_stage_on_rank_0() -> None:
    layout = ReplicaLayout(stages=3, replicas=2)
    assert [[layout.rank(r, s) for s in range(3)] for r in range(2)] == [[2, 1, 0], [5, 4, 3]]
    assert [layout.stage_of(rank) for rank in range(6)] == [2, 1, 0, 2, 1, 0]
    assert [layout.replica_of(rank) for rank in range(6)] == [0, 0, 0, 1, 1, 1]
    assert layout.pipeline_ranks(1) == [3, 4, 5]
    assert layout.replica_ranks(0) == [2, 5]  # stage 0 of every replica
    # a gather over a pipeline group lists its stages from the last to the first
    assert [layout.pipeline_ranks(1)[layout.position(s)] for s in range(3)] == [5, 4, 3]
    # one replica is the plain pipeline: stage s on rank S - 1 - s
    assert [ReplicaLayout(4).rank(0, s) for s in range(4)] == [3, 2, 1, 0]
    # 2 nodes x 2 devices, 2 stages: each replica inside a node, each stage's replicas on different nodes
    two_by_two = ReplicaLayout(stages=2, replicas=2)
    assert {rank // 2 for rank in two_by_two.replica_ranks(0)} == {0, 1}
    assert {rank // 2 for rank in two_by_two.pipeline_ranks(1)} == {1}


def test_stages_must_divide_the_processes_before_any_collective() -> None:
    assert ReplicaLayout.of_world(8, 2) == ReplicaLayout(stages=2, replicas=4)
    assert ReplicaLayout.of_world(8, None) == ReplicaLayout(stages=8, replicas=1)
    with pytest.raises(ValueError, match=r"stages=3 but the Trainer launches 4 .*Valid values: \[1, 2, 4\]"):
        PipelineSettings(stages=3).check_world_size(4)
    PipelineSettings(stages=2, partition=[3, 5]).check_world_size(4)
    with pytest.raises(ValueError, match=r"describes 4 stages but stages=2"):
        PipelineSettings(stages=2, partition=[1, 1, 1, 1]).check_world_size(4)


def test_gradients_go_in_buckets_of_one_dtype_in_the_order_given() -> None:
    averager = ReplicaGradients(group=None, replicas=2, device=torch.device("cpu"), bucket_bytes=64)
    grads = [
        torch.zeros(8, dtype=torch.float64),  # 64 bytes: fills a bucket
        torch.zeros(4, dtype=torch.float32),
        torch.zeros(2, dtype=torch.float64),
        torch.zeros(20, dtype=torch.float32),  # 80 bytes: a bucket of its own
        torch.zeros(1, dtype=torch.float32),
    ]
    buckets = averager._buckets(grads)
    shapes = [[(g.dtype, g.numel()) for g in bucket] for bucket in buckets]
    assert shapes == [
        [(torch.float64, 8)],
        [(torch.float32, 4)],
        [(torch.float32, 20)],
        [(torch.float64, 2)],
        [(torch.float32, 1)],
    ]


def _average_on_two_replicas(rank: int, world: int, store: str) -> dict:
    """Four parameters of one stage in each of two replicas: gradients on both, on the second only, on
    neither, and a float64 one; buckets of at most 16 bytes, so several all-reduces."""
    init_gloo(rank, world, store)
    torch.manual_seed(0)
    params = [torch.nn.Parameter(torch.zeros(3)) for _ in range(3)]
    params.append(torch.nn.Parameter(torch.zeros(2, dtype=torch.float64)))
    params[0].grad = torch.tensor([1.0, 2.0, 3.0]) * (rank + 1)
    if rank == 1:
        params[1].grad = torch.tensor([4.0, 6.0, 8.0])
    params[3].grad = torch.tensor([0.25, -1.0], dtype=torch.float64) * (1 + 2 * rank)
    ReplicaGradients(dist.group.WORLD, 2, torch.device("cpu"), bucket_bytes=16).average(params)
    # times: the mean over the replicas, the last column the largest
    rows = torch.tensor([[1.0, 2.0, 10.0], [3.0, 4.0, 20.0]], dtype=torch.float64) * (rank + 1)
    table = averaged_over_replicas(rows, dist.group.WORLD, 2, max_columns=1)
    return {"grads": [None if p.grad is None else p.grad.tolist() for p in params], "table": table.tolist()}


def test_gradients_and_time_tables_average_over_the_replicas(tmp_path: Path) -> None:
    results = run_spawned(_average_on_two_replicas, 2, tmp_path)
    assert all(result is not None and "error" not in result for result in results), results
    expected = [[1.5, 3.0, 4.5], [2.0, 3.0, 4.0], None, [0.5, -2.0]]
    for result in results:
        assert result["grads"] == expected  # a gradient no replica has stays None (the optimizer skips it)
        assert result["table"] == [[1.5, 3.0, 20.0], [4.5, 6.0, 40.0]]


def _overlap_on_two_replicas(rank: int, world: int, store: str) -> dict:
    """Two micro-batches' backward through a float64 model in each of two replicas, averaged once after the
    backward and once from the hooks of the last micro-batch's backward (buckets of at most 40 bytes: the
    head's bias, its weight, the first layer's bias and weight each alone, then a parameter only the second
    replica uses beside one none uses, whose bucket waits for the end)."""
    init_gloo(rank, world, store)
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(3, 4), torch.nn.Tanh(), torch.nn.Linear(4, 2)).double()
    only_second = torch.nn.Parameter(torch.zeros(3, dtype=torch.float64))
    unused = torch.nn.Parameter(torch.zeros(2, dtype=torch.float64))
    params = [unused, only_second, *model.parameters()]

    def backward(micro: int) -> None:
        x = torch.randn(5, 3, dtype=torch.float64, generator=torch.Generator().manual_seed(10 * rank + micro))
        loss = model(x).pow(2).sum()
        if rank == 1:
            loss = loss + (only_second * x[0]).sum()
        loss.backward()

    after = ReplicaGradients(dist.group.WORLD, 2, torch.device("cpu"), bucket_bytes=40)
    for micro in range(2):
        backward(micro)
    after.average(params)
    expected = [None if p.grad is None else p.grad.clone() for p in params]
    for param in params:
        param.grad = None
    during = ReplicaGradients(dist.group.WORLD, 2, torch.device("cpu"), bucket_bytes=40)
    during.arm(params, final_backward=1)
    for micro in range(2):
        backward(micro)
        during.backward_done()
    started_in_backward = during._step.from_hooks if during._step is not None else None
    during.flush()
    during.finish()
    equal = [
        a is None and p.grad is None or a is not None and p.grad is not None and torch.equal(a, p.grad)
        for a, p in zip(expected, params)
    ]
    # the second replica's last micro-batch reaches the parameters in two backward calls (as a reentrant
    # checkpoint does): its buckets started after the first, so both replicas average again after the backward
    twice = []
    for averager in (
        ReplicaGradients(dist.group.WORLD, 2, torch.device("cpu"), bucket_bytes=40),
        ReplicaGradients(dist.group.WORLD, 2, torch.device("cpu"), bucket_bytes=40),
    ):
        for param in params:
            param.grad = None
        overlapping = not twice
        if overlapping:
            averager.arm(params, final_backward=1)
        for call, micro in enumerate((0, 1, 1) if rank == 1 else (0, 1)):
            backward(micro)
            if overlapping and call == 0:
                averager.backward_done()
        if overlapping:
            averager.backward_done()
            averager.finish()
            repeated = averager.repeated_steps
        else:
            averager.average(params)
        twice.append([None if p.grad is None else p.grad.clone() for p in params])
    return {
        "buckets": [len(b) for b in during._layout],
        "started_in_backward": started_in_backward,
        "equal": equal,
        "none": [p.grad is None for p in params],
        "overlapped_steps": during.overlapped_steps,
        "twice_equal": [
            a is None and b is None or a is not None and b is not None and torch.equal(a, b)
            for a, b in zip(*twice)
        ],
        "repeated_steps": repeated,
    }


def test_the_average_started_in_the_backward_equals_the_one_after_it(tmp_path: Path) -> None:
    """Bit for bit in float64, a parameter only one replica has a gradient for included (zeros on the
    other), one no replica has a gradient for keeping None; the first four buckets start from the hooks
    while the backward runs, the last at the end, in the same order on both replicas. Where one replica's
    gradients accumulate again after their bucket started, both average after the backward instead."""
    results = run_spawned(_overlap_on_two_replicas, 2, tmp_path)
    assert all(result is not None and "error" not in result for result in results), results
    for result in results:
        assert result["buckets"] == [1, 1, 1, 1, 2]
        assert result["started_in_backward"] == 4
        assert result["equal"] == [True] * 6
        assert result["none"] == [True, False, False, False, False, False]
        assert result["overlapped_steps"] == 1
        assert result["twice_equal"] == [True] * 6 and result["repeated_steps"] == 1


# ----------------------------------------------------------------------------------------------- processes
@pytest.fixture(scope="module")
def runs(tmp_path_factory: pytest.TempPathFactory) -> tuple[dict, dict]:
    """Both scenarios under the pipeline (4 processes: 2 stages x 2 replicas) and under ddp (2 processes)."""
    workdir = tmp_path_factory.mktemp("replicas")
    names = ",".join(SCENARIOS)
    results = []
    for kind, processes in (("pipeline", 4), ("ddp", 2)):
        out = workdir / f"{kind}.json"
        run_torchrun("pipeline_replicas.py", processes, kind, str(out), str(workdir), names, timeout=300)
        results.append(json.loads(out.read_text()))
    return results[0], results[1]


def _close(got: list[float], want: list[float]) -> None:
    assert len(got) == len(want) and len(want) > 0, (got, want)
    for a, b in zip(got, want):
        assert abs(a - b) <= RTOL * abs(b), (got, want)


def _assert_states_equal_ddp(pipeline: dict, ddp: dict, ranks: int = 4) -> dict[str, torch.Tensor]:
    """Every pipeline rank's module after fit (its replica's whole model) equals ddp's rank 0 module, and the
    replicas are exactly equal to each other."""
    reference = torch.load(ddp["module"].format(rank=0))
    states = [torch.load(pipeline["module"].format(rank=rank)) for rank in range(ranks)]
    moved = max(float((reference[k] - states[0][k]).abs().max()) for k in reference)
    for rank, state in enumerate(states):
        assert set(state) == set(reference)
        for key, value in reference.items():
            torch.testing.assert_close(state[key], value, rtol=1e-7, atol=1e-10, msg=f"rank {rank}: {key}")
            assert torch.equal(state[key], states[0][key]), f"rank {rank} differs from rank 0 in {key}"
    assert moved < 1e-7  # (the comparison above bounds it; this keeps the figure in a failure's report)
    return reference


def test_two_stages_by_two_replicas_train_as_ddp_on_two_processes(runs: tuple[dict, dict]) -> None:
    """Adam, accumulation of 2 batches, clipping by the global norm, 2 epochs with validation: the losses,
    the ``sync_dist`` means the logger received, ``self.all_gather`` in the validation steps, every
    parameter after fit and the predictions after it equal ddp's; each replica read its own shard and
    averaged its gradients once per optimizer step."""
    pipeline, ddp = (run["adam_clip_accumulate"] for run in runs)
    _close(pipeline["losses"], ddp["losses"])  # rank 0: replica 0's batches, as ddp's rank 0
    for key in ("train_loss", "val_loss"):  # means over the replicas, as over ddp's ranks
        got = [row[key] for row in pipeline["logged"] if key in row]
        want = [row[key] for row in ddp["logged"] if key in row]
        _close(got, want)
    assert pipeline["gathered"] == ddp["gathered"] and len(ddp["gathered"][0]) == 2  # both replicas'
    reference = _assert_states_equal_ddp(pipeline, ddp)
    checkpoint = torch.load(pipeline["checkpoint"], map_location="cpu", weights_only=False)
    assert checkpoint["hier_pipeline"]["replicas"] == 2 and checkpoint["hier_pipeline"]["num_stages"] == 2
    for key, value in reference.items():
        torch.testing.assert_close(checkpoint["state_dict"][key], value, rtol=1e-7, atol=1e-10, msg=key)
    engines = sorted(pipeline["engines"], key=lambda e: e["rank"])
    assert [(e["stage"], e["replica"]) for e in engines] == [(1, 0), (0, 0), (1, 1), (0, 1)]
    assert [e["sampler"] for e in engines] == [{"num_replicas": 2, "rank": r} for r in (0, 0, 1, 1)]
    assert [e["averaged_steps"] for e in engines] == [pipeline["steps"]] * 4 == [4] * 4
    # trainer.predict: each replica's last stage returns its shard's predictions, as each ddp rank its own
    predicted, expected = pipeline["predictions_by_rank"], ddp["predictions_by_rank"]
    assert expected[0] and expected[0] != expected[1]
    assert predicted == [expected[0], [], expected[1], []]


def test_a_rebalance_migrates_alike_in_both_replicas_which_stay_equal_to_ddp(runs: tuple[dict, dict]) -> None:
    """A lopsided start checked every 2 steps: the layers move, the same ones in both replicas (every rank
    ends on the same partition after the same moves), and the training still equals ddp's, with a weight
    tied across the stages and the second replica's processes starting from other values."""
    pipeline, ddp = (run["rebalance_tied"] for run in runs)
    _close(pipeline["losses"], ddp["losses"])
    _close(
        [row["train_loss"] for row in pipeline["logged"] if "train_loss" in row],
        [row["train_loss"] for row in ddp["logged"] if "train_loss" in row],
    )
    assert pipeline["history"], "the lopsided start must be rebalanced"
    assert pipeline["history"][0]["old"]["starts"] != pipeline["history"][0]["new"]["starts"]
    engines = pipeline["engines"]
    assert engines[0]["moves"]
    for engine in engines:
        assert (engine["moves"], engine["partition"]) == (engines[0]["moves"], engines[0]["partition"])
    _assert_states_equal_ddp(pipeline, ddp)


def test_replicas_issue_every_collective_legally_under_nccl_in_one_order(tmp_path: Path) -> None:
    """The rebalancing scenario and a BatchNorm one with the groups built as on CUDA and every collective
    recorded: the replica groups' gradient averages (started from the backward's hooks), buffer broadcasts
    and memory plans, the averaged rebalance tables, the migrations inside each replica and the
    ``sync_dist`` means on the last stages mid-schedule are legal under NCCL (device tensors on groups
    with a device backend, host tensors on their CPU backend) and leave one issuing order without a cycle of
    waits between the ranks. (Validation is left out: the emulation's gloo refuses ``ReduceOp.AVG`` on the
    integer batch sizes Lightning's epoch means reduce, which NCCL accepts; see docs/gpu.md.)"""
    audit_dir = tmp_path / "audit"
    env = {DEVICE_BACKEND_ENV: EMULATED_NCCL, "LIGHTNING_HIER_AUDIT_DIR": str(audit_dir)}
    out = tmp_path / "pipeline.json"
    scenarios = "rebalance_tied,batchnorm_audit"
    run_torchrun("pipeline_replicas.py", 4, "pipeline", str(out), str(tmp_path), scenarios, env=env)
    result = json.loads(out.read_text())
    assert result["rebalance_tied"]["history"], "the layers must have migrated"
    engines = result["batchnorm_audit"]["engines"]
    assert all(e["buckets_from_hooks"] and e["buffer_broadcasts"] and e["memory_plan"] for e in engines)
    report = analyze(audit_dir, require_main_thread=True)
    assert sorted(report.records) == [0, 1, 2, 3]
    report.raise_if_problems()
    callers = {record["caller"] for record in report.select(package=True)}
    for where in ("pipeline/replicas.py", "pipeline/migration.py", "pipeline/tied_parameters.py"):
        assert any(where in caller for caller in callers), f"no collective from {where} was recorded"
    for op in ("broadcast", "all_reduce", "broadcast_object_list"):  # buffers, gradients, memory plans
        assert report.select(op=op, caller="pipeline/replicas.py"), f"no {op} from pipeline/replicas.py"
    served = {tuple(sorted(r["group_devices"])) for records in report.records.values() for r in records}
    assert served == {("cpu", "cuda")}


def _running_stats(state: dict) -> set[str]:
    return {key for key in state if "running_" in key}


def test_batchnorm_buffers_are_replica_0s_where_ddp_gives_rank_0s(runs: tuple[dict, dict]) -> None:
    """BatchNorm on both stages, 2 micro-batches per batch and 2 batches per optimizer step, 2 epochs with
    validation, against ``ddp`` on batches of the micro-batches' size accumulating 4: after every batch (two
    of ddp's) each pipeline rank's parameters and running statistics equal those of the ddp rank of its
    replica (ddp sends rank 0's buffers before the first forward of each accumulation window but the first
    of the second epoch, which follows validation, and before each validation), the ``sync_dist``
    validation losses (each replica evaluating with replica 0's statistics) equal ddp's, and so do the
    modules after fit and the checkpoint."""
    pipeline, ddp = (run["batchnorm"] for run in runs)
    rtol, atol = 1e-7, 1e-10
    got = [row["val_loss"] for row in pipeline["logged"] if "val_loss" in row]
    want = [row["val_loss"] for row in ddp["logged"] if "val_loss" in row]
    assert len(got) == len(want) == 2
    for a, b in zip(got, want):
        assert abs(a - b) <= rtol * abs(b), (got, want)
    traces, reference = pipeline["trace_by_rank"], ddp["trace_by_rank"]
    assert [len(trace) for trace in traces] == [8] * 4 and [len(t) for t in reference] == [8] * 2
    for rank, trace in enumerate(traces):
        replica = rank // 2
        for batch, (held, expected) in enumerate(zip(trace, reference[replica])):
            assert _running_stats(held), f"rank {rank} holds no BatchNorm"
            for key, value in held.items():
                torch.testing.assert_close(
                    torch.tensor(value),
                    torch.tensor(expected[key]),
                    rtol=rtol,
                    atol=atol,
                    msg=f"rank {rank} (replica {replica}) after batch {batch}: {key}",
                )
    # the ranks of a replica hold every running statistic between them, once
    for replica in (0, 1):
        held = [key for rank in (2 * replica, 2 * replica + 1) for key in traces[rank][0]]
        assert sorted(held) == sorted(reference[replica][0]) and len(_running_stats(dict.fromkeys(held))) == 8
    for rank in range(4):
        state = torch.load(pipeline["module"].format(rank=rank))
        expected_state = torch.load(ddp["module"].format(rank=rank // 2))
        assert set(state) == set(expected_state)
        for key, value in expected_state.items():
            torch.testing.assert_close(state[key], value, rtol=rtol, atol=atol, msg=f"rank {rank}: {key}")
    saved = torch.load(pipeline["checkpoint"], map_location="cpu", weights_only=False)["state_dict"]
    expected_saved = torch.load(ddp["checkpoint"], map_location="cpu", weights_only=False)["state_dict"]
    assert set(saved) == set(expected_saved) and len(_running_stats(saved)) == 8
    for key, value in expected_saved.items():
        torch.testing.assert_close(saved[key], value, rtol=rtol, atol=atol, msg=f"checkpoint: {key}")
    # 4 accumulation windows in 2 epochs: broadcasts before the first, second and fourth (the third follows
    # the first epoch's validation, whose forward took the broadcast) and before each epoch's validation
    assert [e["buffer_broadcasts"] for e in pipeline["engines"]] == [5] * 4


def test_the_replica_average_started_in_the_backward_trains_bit_equal(runs: tuple[dict, dict]) -> None:
    """The BatchNorm scenario with the replica average started from the last micro-batch's gradient hooks
    (several buckets each step) and with it run after the backward: every rank's parameters and buffers
    after every batch and after fit are bit-equal."""
    during, after = runs[0]["batchnorm"], runs[0]["batchnorm_after_backward"]
    assert [e["overlapped_steps"] for e in during["engines"]] == [4] * 4
    assert all(e["buckets_from_hooks"] > 4 for e in during["engines"]), during["engines"]
    assert [(e["overlapped_steps"], e["averaged_steps"]) for e in after["engines"]] == [(0, 4)] * 4
    assert during["trace_by_rank"] == after["trace_by_rank"]
    for rank in range(4):
        a = torch.load(during["module"].format(rank=rank))
        b = torch.load(after["module"].format(rank=rank))
        assert all(torch.equal(a[key], b[key]) for key in b), f"rank {rank}"


def test_memory_limit_with_replicas_trains_as_ddp_and_every_replica_runs_replica_0s_plan(
    runs: tuple[dict, dict],
) -> None:
    """A memory_limit that makes a stage swap or recompute, on 2 stages x 2 replicas, the second replica's
    host link measured 10^9 times slower than the first's: both replicas' stages run the plan replica 0's
    stage chose (not every layer kept), and training equals ddp's, which keeps everything."""
    pipeline, ddp = (run["memory_limit"] for run in runs)
    _close(pipeline["losses"], ddp["losses"])
    _assert_states_equal_ddp(pipeline, ddp)
    plans = {(e["replica"], e["stage"]): e["memory_plan"] for e in pipeline["engines"]}
    assert all(plan for plan in plans.values()), plans
    for stage in (0, 1):
        assert plans[(1, stage)] == plans[(0, stage)], f"stage {stage}: {plans}"
    assert any(policy != "keep" for plan in plans.values() for policy in plan.values()), plans
    assert len({e["memory_limit"] for e in pipeline["engines"]}) == 1

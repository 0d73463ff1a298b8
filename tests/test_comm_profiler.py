"""CommProfiler: byte counts equal what the strategies send, files and metrics appear, nothing stays wrapped.

The distributed part is this file run under torchrun (4 CPU processes, gloo): one launch trains
``ddp``, ``hier_sliced`` (2 virtual nodes x 2), ``hier_pipeline`` (4 stages) and ``hier_bsp`` (2 x 2)
in turn, each with a CommProfiler, and every rank writes what the profiler measured next to what
the test counted on its own (parameter counts and slice layouts by hand, the pipeline link's own
byte counter, the parameter server's superstep records).
"""

from __future__ import annotations

import csv
import json
import sys
from pathlib import Path
from typing import Any
from unittest import mock

import pytest
import torch
import torch.distributed as dist
import torch.distributed.distributed_c10d as c10d

from lightning_hier.profiling import CommStats, KindStats, read_csv, sent_bytes, summary_table
from lightning_hier.profiling.comm_stats import CommEvent
from lightning_hier.profiling.report import step_rows

STRATEGIES = ("ddp", "hier_sliced", "hier_pipeline", "hier_bsp")
STEPS = 6
_NAMES = ("all_reduce", "reduce_scatter", "all_gather_single", "broadcast", "isend", "batch_isend_irecv")
WATCHED = tuple(name for name in _NAMES if hasattr(dist, name))  # all_gather_single: torch 2.13 on


# ---------------------------------------------------------------------- unit tests (no processes)
def test_bytes_sent_per_collective_kind() -> None:
    s = torch.zeros(10, dtype=torch.float32)  # 40 bytes
    assert sent_bytes("all_reduce", {"tensor": s}, 4, False) == (40, 60)  # 2(N-1)/N S
    assert sent_bytes("reduce_scatter", {"input_list": [s, s, s, s]}, 4, False) == (160, 120)
    assert sent_bytes("reduce_scatter_single", {"input": torch.zeros(8)}, 2, False) == (32, 16)
    assert sent_bytes("all_gather_single", {"input_tensor": s}, 4, False) == (40, 120)  # (N-1) S
    assert sent_bytes("all_gather", {"tensor": s, "tensor_list": [s] * 4}, 4, False) == (40, 120)
    assert sent_bytes("broadcast", {"tensor": s}, 4, True) == (40, 40)
    assert sent_bytes("broadcast", {"tensor": s}, 4, False) == (0, 0)  # only the source sends
    assert sent_bytes("isend", {"tensor": torch.zeros(3, dtype=torch.int64)}, 2, False) == (24, 24)
    assert sent_bytes("recv", {"tensor": s}, 2, False) == (0, 0)
    assert sent_bytes("broadcast_object_list", {"object_list": [1]}, 4, True) == (0, 0)


def _event(kind: str, start: float, end: float, nbytes: int = 8) -> CommEvent:
    return CommEvent("all_reduce", kind, nbytes, nbytes, False, False, start, end)


def test_exposed_is_blocked_time_while_communication_runs() -> None:
    stats = CommStats()
    origin = stats.clock._origin_host
    events = [
        _event("intra", origin + 1.0, origin + 3.0),  # 2 s; blocked 2.5..3.0 shared with inter: 0.25 s
        _event("inter", origin + 2.0, origin + 6.0, 16),  # 4 s; blocked 2.5..3 shared, 3..3.5 and 5..6 alone
        _event("inter", origin + 4.0, origin + 5.0),  # inside the first inter: the union stays 4 s
    ]
    blocked = [(origin + 2.5, origin + 3.5), (origin + 5.0, origin + 7.0)]  # 6..7: no comm, not exposed
    step = stats._account(0, events, blocked, origin + 0.0, origin + 10.0)
    assert step.step_s == pytest.approx(10.0)
    assert step.kinds["intra"].time_s == pytest.approx(2.0)
    assert step.kinds["inter"].time_s == pytest.approx(4.0)
    assert step.kinds["intra"].exposed_s == pytest.approx(0.25)
    assert step.kinds["inter"].exposed_s == pytest.approx(0.25 + 0.5 + 1.0)
    assert step.kinds["inter"].hidden_s == pytest.approx(4.0 - 1.75)
    assert step.exposed_s == pytest.approx(1.0 + 1.0)  # blocked with any communication active
    assert step.compute_s == pytest.approx(8.0)
    assert (step.kinds["inter"].count, step.kinds["inter"].nbytes) == (2, 24)
    rows = step_rows([step], rank=3)
    assert [(r["kind"], r["bytes"]) for r in rows] == [("intra", 8), ("inter", 24)]
    assert "inter" in summary_table(rows)


class _DeviceStamp:
    """A stand-in for a recorded ``torch.cuda.Event``: a moment the device reaches when told."""

    def __init__(self, seconds: float) -> None:
        self.seconds, self.reached = seconds, False

    def query(self) -> bool:
        return self.reached


def _brute_force_account(
    events: list[CommEvent], blocked: list[tuple[float, float]], origin: float, end: int
) -> tuple[dict[str, float], dict[str, float], float]:
    """Per unit of a grid of whole seconds: which kinds run, whether the thread is blocked (the reference)."""
    time_s: dict[str, float] = {}
    exposed_s: dict[str, float] = {}
    exposed_total = 0.0
    for t in range(end):
        moment = origin + t + 0.5
        running = sorted({e.kind for e in events if e.issued <= moment < e.done})
        is_blocked = any(a <= moment < b for a, b in blocked)
        for kind in running:
            time_s[kind] = time_s.get(kind, 0.0) + 1.0
            if is_blocked:
                exposed_s[kind] = exposed_s.get(kind, 0.0) + 1.0 / len(running)
        if is_blocked and running:
            exposed_total += 1.0
    return time_s, exposed_s, exposed_total


@pytest.mark.parametrize(
    "choices",
    [("intra", "inter", "p2p"), ("p2p",), ("p2p", "world")],
    ids=["three_kinds", "one_kind", "apart"],
)
def test_accounting_sweep_matches_a_brute_force_count_on_random_steps(choices: tuple[str, ...]) -> None:
    """The sweep over start and end marks (tuned: kinds as small integers, a running counter), and the
    interval unions that replace it where kinds never run at once (a pipeline's p2p, then its loss
    broadcast: ``apart`` puts every ``world`` operation after every ``p2p`` one), against counting every
    second of a 60 s step by hand, on random overlapping operations."""
    import random

    rng = random.Random(13)
    stats = CommStats()
    origin = stats.clock._origin_host
    for _ in range(60):
        events = []
        for _ in range(rng.randint(0, 12)):
            kind = rng.choice(choices)
            if choices == ("p2p", "world"):  # p2p within [0, 45), world within [45, 60]
                a = rng.randint(0, 44) if kind == "p2p" else rng.randint(45, 59)
                b = rng.randint(a, 45 if kind == "p2p" else 60)
            else:
                a = rng.randint(0, 59)
                b = rng.randint(a, 60)
            events.append(_event(kind, origin + a, origin + b))
        blocked = []
        for _ in range(rng.randint(0, 12)):
            a = rng.randint(-5, 60)
            # a span may start before the step or end after it
            blocked.append((origin + a, origin + rng.randint(a, 66)))
        step = stats._account(0, events, blocked, origin + 0.0, origin + 60.0)
        time_s, exposed_s, exposed_total = _brute_force_account(events, blocked, origin, 60)
        assert step.exposed_s == pytest.approx(exposed_total, abs=1e-6)
        assert {kind: s.count for kind, s in step.kinds.items()} == {
            kind: sum(e.kind == kind for e in events) for kind in {e.kind for e in events}
        }
        for kind, kind_stats in step.kinds.items():
            assert kind_stats.time_s == pytest.approx(time_s.get(kind, 0.0), abs=1e-6)
            assert kind_stats.exposed_s == pytest.approx(exposed_s.get(kind, 0.0), abs=1e-6)


def test_steps_timed_on_the_device_are_accounted_once_it_got_there() -> None:
    stats = CommStats()
    origin = stats.clock._origin_host
    host = stats.clock.seconds
    stats.clock.seconds = lambda stamp: stamp.seconds if isinstance(stamp, _DeviceStamp) else host(stamp)
    issued, done = _DeviceStamp(0.25), _DeviceStamp(0.75)
    stats.begin_step(0)
    stats._events.append(CommEvent("all_reduce", "world", 8, 8, True, True, issued, done))
    assert stats.end_step() == []  # the device has not finished the step's collective
    stats.begin_step(1)
    assert stats.end_step() == []  # a later step waits behind it: steps are accounted in order
    issued.reached = done.reached = True
    stats.begin_step(2)
    accounted = stats.end_step()
    assert [step.index for step in accounted] == [0, 1, 2] and stats.steps == accounted
    assert accounted[0].kinds["world"].time_s == pytest.approx(0.5)
    assert accounted[0].kinds["world"].nbytes == 8 and not accounted[1].kinds
    late = _DeviceStamp(1.5)
    stats.begin_step(3)
    stats._events.append(CommEvent("all_reduce", "world", 16, 16, True, True, late, _DeviceStamp(2.0)))
    assert stats.end_step() == []
    stats.stop()  # waits for the device: nothing measured is dropped
    assert [step.index for step in stats.steps] == [0, 1, 2, 3]
    assert stats.steps[3].kinds["world"].time_s == pytest.approx(0.5)
    assert stats.unobserved_completions == 0 and origin == stats.clock._origin_host


def test_start_and_stop_restore_every_function() -> None:
    before = {name: getattr(dist, name) for name in WATCHED}
    wait = dist.Work.wait
    stats = CommStats()
    watched = KindStats()
    stats.watch(watched, "add")
    with stats:
        assert all(getattr(dist, name) is not before[name] for name in WATCHED)
        assert c10d.all_reduce is dist.all_reduce
        assert dist.Work.wait is not wait and "add" in vars(watched)
    assert all(getattr(dist, name) is before[name] for name in WATCHED)
    assert all(getattr(c10d, name) is before[name] for name in WATCHED)
    assert dist.Work.wait is wait and "add" not in vars(watched)


def test_a_host_operation_ends_where_its_issuer_sees_it_complete(tmp_path: Path) -> None:
    """Host (gloo) operations get no future callback (its cost slowed pipelines by 1.25x): their end is
    stamped by the issuer's wait, not at the step's end."""
    import time

    from helpers import init_gloo

    init_gloo(0, 1, str(tmp_path / "store"))
    try:
        stats = CommStats()
        stats.start()
        stats.begin_step(0)
        work = dist.all_reduce(torch.ones(4), async_op=True)
        work.wait()
        time.sleep(0.2)  # the step goes on after the operation was waited for
        (step,) = stats.end_step()
        stats.stop()
    finally:
        dist.destroy_process_group()
    assert stats.unobserved_completions == 0
    assert step.kinds["world"].count == 1
    assert step.kinds["world"].time_s < 0.1, step  # ended at the wait, not 0.2 s later at the step's end


def _sampled_steps(rank: int, world: int, store: str) -> list[tuple[int, bool, dict[str, tuple]]]:
    """Six identical steps (a blocking and an asynchronous all-reduce, a send and a receive in one batch)
    with every third step timed; per step: index, timed, and per kind (count, bytes, wire, time)."""
    from helpers import init_gloo

    init_gloo(rank, world, store)
    try:
        stats = CommStats(time_every=3)
        stats.start()
        peer = 1 - rank
        for step in range(6):
            stats.begin_step(step)
            dist.all_reduce(torch.ones(4))
            dist.all_reduce(torch.ones(8), async_op=True).wait()
            received = torch.empty(5)
            ops = [dist.P2POp(dist.isend, torch.ones(5), peer), dist.P2POp(dist.irecv, received, peer)]
            for work in dist.batch_isend_irecv(ops):
                work.wait()
            stats.end_step()
        stats.stop()
    finally:
        dist.destroy_process_group()
    return [
        (s.index, s.timed, {k: (v.count, v.nbytes, v.wire_bytes, v.time_s) for k, v in s.kinds.items()})
        for s in stats.steps
    ]


def test_steps_not_timed_count_the_same_operations_and_bytes(tmp_path: Path) -> None:
    """``time_every=3``: steps 0 and 3 are timed; every step counts what was sent, by hand: two all-reduces
    of 16 and 32 bytes (a ring of 2 puts 2(N-1)/N of that on the wire: the same), one isend of 20 bytes and
    one irecv (0)."""
    from helpers import run_spawned

    results = run_spawned(_sampled_steps, 2, tmp_path)
    for steps in results:
        assert isinstance(steps, list), steps
        assert [(index, timed) for index, timed, _ in steps] == [(i, i % 3 == 0) for i in range(6)]
        for index, timed, kinds in steps:
            assert {k: v[:3] for k, v in kinds.items()} == {"world": (2, 48, 48), "p2p": (2, 20, 20)}
            times = [v[3] for v in kinds.values()]
            assert all(t > 0 for t in times) if timed else times == [0.0, 0.0], (index, kinds)
    with pytest.raises(ValueError, match="time_every must be an integer >= 1"):
        CommStats(time_every=0)


def _wait_wrapped_per_step(rank: int, world: int, store: str) -> tuple[list[bool], int, bool]:
    """Four steps, every second timed; rank 1 posts a receive in timed step 0 that rank 0 sends only in
    step 1. Per step whether ``Work.wait`` is wrapped, the completions no wait saw, and whether torch's
    own ``Work.wait`` is back after ``stop``."""
    from helpers import init_gloo

    init_gloo(rank, world, store)
    torch_wait = dist.Work.wait
    try:
        stats = CommStats(time_every=2)
        stats.start()
        wrapped, pending = [], None
        for step in range(4):
            stats.begin_step(step)
            wrapped.append(dist.Work.wait is not torch_wait)
            if step == 0 and rank == 1:
                pending = dist.irecv(torch.empty(3), 0)
            if step == 1:
                if rank == 0:
                    dist.send(torch.ones(3), 1)
                else:
                    pending.wait()
            stats.end_step()
        stats.stop()
        restored = dist.Work.wait is torch_wait
    finally:
        dist.destroy_process_group()
    return wrapped, stats.unobserved_completions, restored


def test_work_wait_is_torchs_own_in_steps_not_timed(tmp_path: Path) -> None:
    """A step not timed has nothing to stamp at a wait (the pipeline waits dozens of times per step, on its
    critical path): ``Work.wait`` is torch's own there. It stays wrapped while a timed step's operation is
    still pending, so that its wait stamps its end (otherwise the end of step would find it finished at
    an unknown moment: an unobserved completion)."""
    from helpers import run_spawned

    rank0, rank1 = run_spawned(_wait_wrapped_per_step, 2, tmp_path)
    assert rank0 == ([True, False, True, False], 0, True)
    assert rank1 == ([True, True, True, False], 0, True)


def test_the_table_takes_times_from_timed_steps_and_bytes_from_every_step() -> None:
    """Hand-made rows of 4 steps, two timed: bytes and counts are means over the 4, times over the 2."""
    from lightning_hier.profiling.report import per_kind, per_step

    def row(step: int, timed: bool, nbytes: int, time_ms: float) -> dict[str, Any]:
        return {"rank": 0, "step": step, "kind": "inter", "count": 2, "bytes": nbytes, "wire_bytes": nbytes,
                "time_ms": time_ms, "exposed_ms": time_ms / 4, "hidden_ms": 3 * time_ms / 4,
                "step_ms": 10.0, "compute_ms": 10.0 - time_ms / 4, "timed": int(timed)}  # fmt: skip

    rows = [row(0, True, 100, 4.0), row(1, False, 300, 0.0), row(2, True, 100, 8.0), row(3, False, 300, 0.0)]
    inter = per_kind(rows)["inter"]
    assert (inter["count"], inter["bytes"]) == (2.0, 200.0)
    assert (inter["time_ms"], inter["exposed_ms"]) == (6.0, 1.5)
    assert [s[0] for s in per_step(rows)] == [0, 2]
    assert "4 step(s) x 1 rank(s) (times: 2 timed step(s))" in summary_table(rows)


def test_logged_metrics_of_a_step_not_timed_hold_no_times() -> None:
    from lightning_hier.callbacks.comm_profiler import CommProfiler, _metrics
    from lightning_hier.profiling.comm_stats import StepStats

    untimed = _metrics(StepStats(1, 0.5, 0.0, {"p2p": KindStats(3, 60, 60)}, timed=False))
    assert untimed == {"comm/step_ms": 500.0, "comm/p2p/bytes": 60.0, "comm/p2p/count": 3.0}
    timed = _metrics(StepStats(0, 0.5, 0.1, {"p2p": KindStats(3, 60, 60, 0.2, 0.1)}))
    assert timed["comm/p2p/time_ms"] == pytest.approx(200.0)
    assert timed["comm/exposed_ms"] == pytest.approx(100.0)
    for bad in (0, 1.5, True):
        with pytest.raises(ValueError, match="time_every_n_steps"):
            CommProfiler(time_every_n_steps=bad)


def test_by_default_only_the_pipeline_is_timed_every_tenth_step() -> None:
    from lightning_hier import HierBSPStrategy, HierPipelineStrategy, HierSlicedStrategy
    from lightning_hier.callbacks.comm_profiler import CommProfiler

    default, asked = CommProfiler(), CommProfiler(time_every_n_steps=3)
    assert default._time_every(HierPipelineStrategy()) == 10
    for strategy in (HierSlicedStrategy(), HierBSPStrategy(), object()):
        assert default._time_every(strategy) == 1
    assert asked._time_every(HierPipelineStrategy()) == 3 and asked._time_every(object()) == 3


# ---------------------------------------------------------------------- the 4-process run
@pytest.fixture(scope="module")
def measured(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    from helpers import run_torchrun

    out = tmp_path_factory.mktemp("comm_profiler")
    run_torchrun(str(Path(__file__).resolve()), 4, str(out), timeout=400)
    results: dict[str, Any] = {}
    for name in (*STRATEGIES, "ddp_raises", "hier_bsp_time", "ddp_accumulate"):
        results[name] = [json.loads((out / f"{name}_rank{r}.json").read_text()) for r in range(4)]
    return results


def _per_step(result: dict, kind: str) -> list[int]:
    return [step.get(kind, [0, 0])[1] for step in result["steps"]]


def test_ddp_timing_is_sampled_as_asked_and_bytes_are_exact_every_step() -> None:
    """Under ddp the profiler reads DDP's own timing; with ``timing_every=N`` (the CUDA default, where a
    timed step makes the host wait) DDP times its first ten iterations and then every N-th, and the
    steps in between carry the latest timing. Reference: DDP's own logging data read every step; bytes
    against the parameters counted by hand."""
    from torch.nn.parallel import DistributedDataParallel

    from lightning_hier.profiling.ddp_reducer import DDPReducerStats

    store = dist.TCPStore("127.0.0.1", 0, 1, True)  # port 0: the system's free port, bound at once (no race)
    dist.init_process_group("gloo", store=store, rank=0, world_size=1)
    try:
        torch.manual_seed(0)
        model = DistributedDataParallel(torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.Linear(16, 4)))
        stats = DDPReducerStats(model, timing_every=4)
        param_bytes = sum(p.numel() * p.element_size() for p in model.parameters())
        read, recorded, reads_of_ddp_data = [], [], []
        own_read = model._get_ddp_logging_data
        for step in range(18):
            model(torch.randn(3, 8)).sum().backward()
            with mock.patch.object(model, "_get_ddp_logging_data", side_effect=own_read) as counted:
                read.append(stats.read())
            reads_of_ddp_data += [step + 1] * counted.call_count
            data = own_read()
            recorded.append((data["iteration"], data["backward_comm_time"] * 1e-9))
    finally:
        dist.destroy_process_group()
    assert [r.nbytes for r in read] == [param_bytes] * 18
    assert [iteration for iteration, _ in recorded] == [*range(1, 11), 10, 12, 12, 12, 12, 16, 16, 16]
    assert [r.time_s for r in read] == [time for _, time in recorded]
    # DDP's logging data is read only where DDP has a new sample (it costs ~0.13 ms a read on a GPU host)
    assert reads_of_ddp_data == [*range(1, 11), 12, 16]
    with pytest.raises(ValueError, match="timing_every"):
        DDPReducerStats(model, timing_every=0)


def test_ddp_bytes_are_the_gradient_bytes(measured: dict) -> None:
    for result in measured["ddp"]:
        assert result["expected"]["max_diff_from_plain_ddp"] <= 1e-6  # same parameters as without it
        assert len(result["steps"]) == STEPS
        # every step all-reduces each trainable parameter's gradient once, in DDP's buckets
        assert _per_step(result, "world") == [result["expected"]["param_bytes"]] * STEPS
        assert all(step["world"][0] >= 1 for step in result["steps"])
        # DDP's own timing of its buckets (read from its logging data): every step spent time in them
        assert all(0 <= exposed <= time and time > 0 for time, exposed in result["world_time"]), result


def test_ddp_accumulating_batches_send_nothing(measured: dict) -> None:
    """accumulate_grad_batches=2: DDP reduces on every second batch only (no_sync on the others)."""
    for result in measured["ddp_accumulate"]:
        param_bytes = result["expected"]["param_bytes"]
        assert _per_step(result, "world") == [0, param_bytes] * (STEPS // 2)


def test_hier_sliced_bytes_follow_the_slice_layout(measured: dict) -> None:
    for result in measured["hier_sliced"]:
        params = result["expected"]["params"]  # one bucket (25 MB cap), float32
        padded = -(-params // 2) * 2  # equal slices: padded to a multiple of the 2 devices per node
        my_slice = padded // 2
        # reduce-scatter sends the whole bucket, the all-gather this rank's slice (intra); the
        # all-reduce across the 2 nodes sends this rank's slice (inter)
        assert _per_step(result, "intra") == [4 * (padded + my_slice)] * STEPS
        assert _per_step(result, "inter") == [4 * my_slice] * STEPS
        assert [step["intra"][0] for step in result["steps"]] == [2] * STEPS


def test_hier_pipeline_bytes_are_the_links_sends(measured: dict) -> None:
    """Timed every second step (``time_every_n_steps=2``): bytes equal the link's own count on every step,
    times are in the CSV for steps 0, 2, 4 only."""
    sends = 0
    for result in measured["hier_pipeline"]:
        assert _per_step(result, "p2p") == result["expected"]["p2p_per_step"]
        sends += sum(result["expected"]["p2p_per_step"])
    assert sends > 0
    rows = [r for r in read_csv(measured["hier_pipeline"][0]["csv_path"]) if r["kind"] == "p2p"]
    assert {(r["step"], r["timed"]) for r in rows} == {(s, int(s % 2 == 0)) for s in range(STEPS)}
    assert all((r["time_ms"] > 0) == bool(r["timed"]) for r in rows)


def test_hier_bsp_push_and_pull_bytes_per_superstep(measured: dict) -> None:
    for result in measured["hier_bsp"]:
        params = result["expected"]["params"]
        padded = -(-params // 2) * 2
        push_per, pull_per = 4 * (padded + padded // 2), 4 * (padded // 2)
        push = sum(_per_step(result, "ps_push")) + result["outside"].get("ps_push", [0, 0])[1]
        pull = sum(_per_step(result, "ps_pull")) + result["outside"].get("ps_pull", [0, 0])[1]
        supersteps = result["expected"]["supersteps"]
        # the profiler stops at the end of training, possibly between a superstep's reduce-scatter
        # (the whole bucket) and its all-reduce, or between its push and its pull; the drain after
        # training ends (the last superstep) may fall after it stopped
        full, rest = divmod(push, push_per)
        assert rest in (0, 4 * padded), (push, push_per)
        assert pull % pull_per == 0 and full - 1 <= pull // pull_per <= full, (pull, pull_per, full)
        assert STEPS - 1 <= full <= supersteps, (full, supersteps)


@pytest.mark.parametrize("name", STRATEGIES)
def test_csv_figure_and_logged_metrics(measured: dict, name: str) -> None:
    rank0 = measured[name][0]
    rows = read_csv(rank0["csv_path"])
    assert {r["rank"] for r in rows} == {0, 1, 2, 3}
    assert {r["step"] for r in rows} == set(range(STEPS))
    for result in measured[name]:  # the file holds what each rank measured
        for index, step in enumerate(result["steps"]):
            for kind, (count, nbytes) in step.items():
                (row,) = [
                    r for r in rows if (r["rank"], r["step"], r["kind"]) == (result["rank"], index, kind)
                ]
                assert (row["count"], row["bytes"]) == (count, nbytes)
                assert row["exposed_ms"] <= row["time_ms"] + 1e-6
    assert Path(rank0["figure_path"]).read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert "exposed" in rank0["summary"]
    with open(Path(rank0["log_dir"]) / "metrics.csv") as handle:
        logged = [r for r in csv.DictReader(handle) if r.get("comm/step_ms")]
    assert len(logged) == STEPS
    kind = {"ddp": "world", "hier_sliced": "inter", "hier_pipeline": "p2p", "hier_bsp": "ps_push"}[name]
    logged_bytes = [int(float(r[f"comm/{kind}/bytes"])) for r in logged if r.get(f"comm/{kind}/bytes")]
    assert logged_bytes == [b for b in _per_step(rank0, kind) if b] and logged_bytes  # rank 0's values


def test_hier_bsp_waits_stay_watched_when_time_buckets_rebuild_its_engine(measured: dict) -> None:
    for result in measured["hier_bsp_time"]:
        assert result["rebuilt"]  # the strategy replaced its engine during the fit
        # from the first batch on the new engine on, its waits for the server's model are watched
        assert result["watched"] and all(result["watched"]), result["watched"]
        assert result["unwrapped_after_fit"], result["still_wrapped"]


@pytest.mark.parametrize("name", (*STRATEGIES, "ddp_raises"))
def test_nothing_stays_wrapped_after_fit(measured: dict, name: str) -> None:
    for result in measured[name]:
        assert result["wrapped_during_training"]  # the check below can fail: it was installed
        assert result["unwrapped_after_fit"], result["still_wrapped"]
    if name == "ddp_raises":  # unwrapped on the exception that ended fit
        assert all(r["raised"] for r in measured[name])


# ---------------------------------------------------------------------- worker (under torchrun)
def _worker(out: Path) -> None:  # pragma: no cover - runs in the torchrun processes
    sys.path.insert(0, str(Path(__file__).parent / "scripts"))
    import lightning.pytorch as pl
    from lightning.pytorch.callbacks import Callback
    from lightning.pytorch.loggers import CSVLogger
    from models import EquivModel, loader
    from pipeline_models import SkewedNet
    from pipeline_models import loader as pipeline_loader

    from lightning_hier import (
        CommProfiler,
        HierBSPStrategy,
        HierPipelineStrategy,
        HierSlicedStrategy,
        TimeBuckets,
    )
    from lightning_hier.bsp.shared_memory import SharedModelMemory
    from lightning_hier.pipeline.schedule import _HEADER

    originals = {name: getattr(dist, name) for name in WATCHED}
    original_wait = dist.Work.wait
    memory_wait = SharedModelMemory.wait  # hier_bsp's worker waiting for the server's model

    def still_wrapped() -> list[str]:
        names = [
            n for n in WATCHED if getattr(dist, n) is not originals[n] or getattr(c10d, n) is not originals[n]
        ]
        names += ["SharedModelMemory.wait"] if SharedModelMemory.wait is not memory_wait else []
        return names + (["Work.wait"] if dist.Work.wait is not original_wait else [])

    class Independent(Callback):
        """What the test counts on its own, per training step."""

        def __init__(self) -> None:
            self.wrapped = False
            self.p2p: list[int] = []
            self._sent = 0

        def on_train_batch_start(self, trainer, pl_module, batch, batch_idx) -> None:  # noqa: ANN001
            self.wrapped = self.wrapped or bool(still_wrapped())
            engine = getattr(trainer.strategy, "engine", None)
            self._sent = getattr(getattr(engine, "link", None), "bytes_sent", 0)

        def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx) -> None:  # noqa: ANN001
            strategy = trainer.strategy
            if isinstance(strategy, HierPipelineStrategy):
                headers = (
                    0 if strategy.stage == strategy.num_stages - 1 else 8 * _HEADER * 2
                )  # 2 micro-batches
                self.p2p.append(strategy.engine.link.bytes_sent - self._sent + headers)

    class Raises(EquivModel):
        def training_step(self, batch, batch_idx):  # noqa: ANN001, ANN201
            if batch_idx == 2:
                raise RuntimeError("raised on purpose at batch 2")
            return super().training_step(batch, batch_idx)

    class WatchedWaits(Callback):
        """After hier_bsp rebuilt its engine: whether the new engine's waits are wrapped, per batch."""

        def __init__(self) -> None:
            self.first_engine: Any = None
            self.watched: list[bool] = []

        def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx) -> None:  # noqa: ANN001
            engine = trainer.strategy.engine
            self.first_engine = self.first_engine or engine
            if engine is not self.first_engine:
                self.watched.append(type(engine.memory).wait is not memory_wait)

    for name in (*STRATEGIES, "ddp_raises", "hier_bsp_time", "ddp_accumulate"):
        pl.seed_everything(0, verbose=False)
        if name == "hier_bsp_time":
            waits, profiler = WatchedWaits(), CommProfiler(save_figure=False, print_summary=False)
            strategy = HierBSPStrategy(
                devices_per_node=2, superstep=1, max_staleness=0,
                bucketing=TimeBuckets(profile_steps=1, warmup_steps=0, min_bucket_mb=0.0),
            )  # fmt: skip
            trainer = pl.Trainer(
                accelerator="cpu", devices=4, strategy=strategy, max_steps=STEPS, default_root_dir=str(out),
                callbacks=[profiler, waits], logger=False, enable_checkpointing=False,
                enable_progress_bar=False, enable_model_summary=False,
            )  # fmt: skip
            trainer.fit(EquivModel(hidden=64), train_dataloaders=loader(n=256))
            result = {
                "rebuilt": strategy.time_plan is not None, "watched": waits.watched,
                "still_wrapped": still_wrapped(), "unwrapped_after_fit": not still_wrapped(),
            }  # fmt: skip
            (out / f"{name}_rank{dist.get_rank()}.json").write_text(json.dumps(result))
            continue
        if name == "ddp_raises":
            independent, profiler = Independent(), CommProfiler()
            trainer = pl.Trainer(
                accelerator="cpu", devices=4, strategy="ddp", max_steps=STEPS,
                callbacks=[independent, profiler], logger=False, enable_checkpointing=False,
                enable_progress_bar=False, enable_model_summary=False,
            )  # fmt: skip
            try:
                trainer.fit(Raises(hidden=64), train_dataloaders=loader(n=256))
                raised = False
            except RuntimeError as error:
                raised = "on purpose" in str(error)
            result = {
                "raised": raised, "wrapped_during_training": independent.wrapped,
                "still_wrapped": still_wrapped(), "unwrapped_after_fit": not still_wrapped(),
            }  # fmt: skip
            (out / f"{name}_rank{dist.get_rank()}.json").write_text(json.dumps(result))
            continue
        if name in ("ddp", "ddp_accumulate"):
            strategy: Any = "ddp"
        elif name == "hier_sliced":
            strategy = HierSlicedStrategy(devices_per_node=2)
        elif name == "hier_pipeline":
            strategy = HierPipelineStrategy(partition="uniform", rebalance="never", micro_batches=2)
        else:
            strategy = HierBSPStrategy(devices_per_node=2, superstep=1, max_staleness=0)
        if name == "hier_pipeline":
            model: pl.LightningModule = SkewedNet(widths=(32, 32, 32, 32))
            data = pipeline_loader()
        else:
            model, data = EquivModel(hidden=64), loader(n=256)
        # the pipeline's messages timed every second step only: its bytes must still be exact every step
        every = 2 if name == "hier_pipeline" else 1
        independent, profiler = Independent(), CommProfiler(log_every_n_steps=1, time_every_n_steps=every)
        logger = CSVLogger(str(out), name=name)
        accumulate = 2 if name == "ddp_accumulate" else 1
        trainer = pl.Trainer(
            accelerator="cpu", devices=4, strategy=strategy, max_steps=STEPS // accumulate,
            accumulate_grad_batches=accumulate, callbacks=[independent, profiler], logger=logger,
            log_every_n_steps=1, enable_checkpointing=False, enable_progress_bar=False,
            enable_model_summary=False,
        )  # fmt: skip
        trainer.fit(model, train_dataloaders=data)
        rank = dist.get_rank()
        assert profiler.stats is not None
        trainable = [p for p in model.parameters() if p.requires_grad]
        expected: dict[str, Any] = {
            "params": sum(p.numel() for p in trainable),
            "param_bytes": sum(p.numel() * p.element_size() for p in trainable),
        }
        if name == "hier_pipeline":
            expected["p2p_per_step"] = independent.p2p
        if name == "hier_bsp":
            expected["supersteps"] = len(trainer.strategy.engine.records)
        if name == "ddp":  # the profiler's DDP hook keeps DDP's arithmetic: the same fit without it
            pl.seed_everything(0, verbose=False)
            plain = EquivModel(hidden=64)
            pl.Trainer(
                accelerator="cpu", devices=4, strategy="ddp", max_steps=STEPS, logger=False,
                enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False,
            ).fit(plain, train_dataloaders=loader(n=256))  # fmt: skip
            pairs = zip(model.parameters(), plain.parameters())
            diffs = [float((a - b).abs().max() / b.abs().max()) for a, b in pairs]
            expected["max_diff_from_plain_ddp"] = max(diffs)
        result = {
            "rank": rank,
            "steps": [
                {kind: [s.count, s.nbytes] for kind, s in step.kinds.items()} for step in profiler.stats.steps
            ],
            "outside": {kind: [s.count, s.nbytes] for kind, s in profiler.stats.outside.items()},
            "world_time": [
                [step.kinds["world"].time_s, step.kinds["world"].exposed_s]
                for step in profiler.stats.steps
                if "world" in step.kinds
            ],
            "expected": expected,
            "wrapped_during_training": independent.wrapped,
            "still_wrapped": still_wrapped(),
            "unwrapped_after_fit": not still_wrapped(),
            "csv_path": str(profiler.csv_path),
            "figure_path": str(profiler.figure_path),
            "summary": profiler.summary,
            "log_dir": logger.log_dir,
        }
        (out / f"{name}_rank{rank}.json").write_text(json.dumps(result))


if __name__ == "__main__":
    _worker(Path(sys.argv[1]))

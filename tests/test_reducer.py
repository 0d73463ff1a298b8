"""The gloo communication thread: one consumer, always, even after a close() that timed out."""

from __future__ import annotations

import threading
import time

import torch
import torch.distributed as dist

from lightning_hier.sliced.reducer import ReduceJob, ThreadedReducer


def _job() -> ReduceJob:
    flat = torch.arange(4.0)
    return ReduceJob(flat, [(0, 4)], torch.zeros(4))


def test_a_thread_still_busy_after_close_finishes_before_a_new_one_starts(one_process_group) -> None:  # noqa: ANN001
    # communication threads other tests left behind (daemon threads of engines that raised) do not count
    earlier = {t for t in threading.enumerate() if t.name == "lightning_hier-comm"}
    reducer = ThreadedReducer(one_process_group, one_process_group)
    started, release = threading.Event(), threading.Event()
    runs: list[tuple[threading.Thread, float, float, int]] = []
    original = reducer._scatter_piece

    def slow_scatter(job, piece, async_op):  # noqa: ANN001, ANN202
        begin = time.perf_counter()
        alive = sum(
            t.name == "lightning_hier-comm" and t.is_alive() and t not in earlier
            for t in threading.enumerate()
        )
        if not runs:
            started.set()
            release.wait(timeout=10)
        result = original(job, piece, async_op)
        runs.append(
            (threading.current_thread().name + str(threading.get_ident()), begin, time.perf_counter(), alive)
        )
        return result

    reducer._scatter_piece = slow_scatter  # type: ignore[method-assign]
    first = reducer.submit(_job())
    assert started.wait(timeout=10)
    reducer.close(timeout=0.05)  # the thread is stuck in a "collective": it cannot stop yet
    threading.Timer(0.3, release.set).start()
    second = reducer.submit(_job())  # must wait for the old consumer instead of starting a second one
    for job in (first, second):
        torch.testing.assert_close(reducer.wait(job), torch.arange(4.0))
    reducer.close()
    (thread_a, _, end_a, _), (thread_b, begin_b, _, alive_b) = runs
    assert thread_a is not thread_b and begin_b >= end_a
    assert alive_b == 1, "two communication threads were alive at once"


def test_a_thread_stopped_from_outside_is_replaced_at_the_next_submit(one_process_group) -> None:  # noqa: ANN001
    """Lightning's test harness stops leftover daemon threads through their ``stop()`` (a step run after
    teardown had closed the reducer restarts it); the next job must not be queued for a dead thread."""
    reducer = ThreadedReducer(one_process_group, one_process_group)
    first = reducer.submit(_job())
    torch.testing.assert_close(reducer.wait(first), torch.arange(4.0))
    thread = reducer._thread
    thread.stop()
    assert not thread.is_alive()
    second = reducer.submit(_job())
    assert second.scatter_done.wait(timeout=10), "queued for a thread that no longer runs"
    torch.testing.assert_close(reducer.wait(second), torch.arange(4.0))
    assert reducer._thread is not thread and reducer._thread.is_alive()
    reducer.close()


def test_inter_node_dtype_feeds_rounding_back_into_the_next_step(one_process_group) -> None:  # noqa: ANN001
    from lightning_hier.sliced.reducer import InlineReducer

    def delivered(residual: torch.Tensor | None, steps: int) -> torch.Tensor:
        reducer = InlineReducer(one_process_group, one_process_group, inter_dtype=torch.bfloat16)
        reducer._inter_size = 2  # the one-process group stands in for the inter-node hop (a sum of one)
        total = torch.zeros(4, dtype=torch.float64)
        for _ in range(steps):
            job = ReduceJob(gradient.clone(), [(0, 4)], torch.zeros(4), residual=residual)
            out = reducer.wait(reducer.submit(job))
            assert out.dtype == torch.float32  # widened back after the narrow reduce
            total += out.double()
        return total

    gradient = torch.full((4,), 1.0 + 2**-10)  # bf16 keeps 8 bits: a single step rounds it to 1.0
    residual = torch.zeros(4)
    with_feedback = delivered(residual, steps=16)
    # what arrived over 16 steps is what was given, less what is still owed (the last residual)
    torch.testing.assert_close(with_feedback, 16 * gradient.double() - residual.double())
    assert (16 * gradient.double() - with_feedback).abs().max() < 2**-7  # under one bf16 step at 1.0
    # without the residual every step loses the same 2^-10: sixteen times as much
    without = delivered(None, steps=16)
    torch.testing.assert_close(
        16 * gradient.double() - without, torch.full((4,), 16 * 2**-10, dtype=torch.float64)
    )


def _inter_in_flight(rank: int, world: int, store: str) -> dict:
    """Three 2 MB buckets submitted back to back to a gloo reducer of one device per node: how many inter-node
    all-reduces were still running whenever the thread issued the next, and the reduced values."""
    from helpers import init_gloo

    init_gloo(rank, world, store)
    try:
        intra, _ = dist.new_subgroups_by_enumeration([[r] for r in range(world)])
        reducer = ThreadedReducer(intra, dist.group.WORLD, chunk_bytes=1 << 30)
        issued: list[dist.Work] = []
        in_flight: list[int] = []
        original = reducer._all_reduce_piece

        def recording(job: ReduceJob, piece: object) -> dist.Work | None:
            in_flight.append(sum(not work.is_completed() for work in issued))
            work = original(job, piece)  # type: ignore[arg-type]
            if work is not None:
                issued.append(work)
            return work

        reducer._all_reduce_piece = recording  # type: ignore[method-assign]
        flats = [torch.full((1 << 19,), float(rank + 1 + b)) for b in range(3)]
        jobs = [reducer.submit(ReduceJob(flat, ((0, flat.numel()),), flat)) for flat in flats]
        sums = [reducer.wait(job)[0].item() for job in jobs]
        reducer.close()
    finally:
        dist.destroy_process_group()
    return {"in_flight": in_flight, "sums": sums}


def test_a_node_issues_its_inter_node_all_reduces_one_at_a_time(tmp_path) -> None:  # noqa: ANN001
    """gloo runs asynchronous collectives of one group side by side on its worker threads; on the slow link
    two of them only share it, and the earlier-ready bucket finishes later. Each is issued once the one before
    has finished (the next bucket's intra-node stage may still overlap it)."""
    from helpers import run_spawned

    results = run_spawned(_inter_in_flight, 2, tmp_path)
    for result in results:
        assert isinstance(result, dict), result
        assert result["in_flight"] == [0, 0, 0]
        assert result["sums"] == [3.0, 5.0, 7.0]  # (1 + b) + (2 + b) over the two ranks

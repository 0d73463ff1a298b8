"""bench_hier_sliced.py's report (ratios within each repeat, bytes against the fp32 bound, the first-step
loss check) and its HSDP anchor (torch FSDP2 on a replicate x shard mesh) against training on one process."""

from __future__ import annotations

import os
import sys
from pathlib import Path

import pytest
import torch
from helpers import free_port, run_spawned

BENCHMARKS = Path(__file__).resolve().parent.parent / "benchmarks"
sys.path.insert(0, str(BENCHMARKS))

import bench_hier_sliced as bench  # noqa: E402

GRAD_BYTES, STEPS = 1_000_000, 4  # two nodes: the fp32 bound is GRAD_BYTES per node and step


def _run(name: str, step_s: float, node_bytes: tuple[float, float] = (1e6, 1e6), first_loss: float = 1.0):
    worker = {
        "mean_step_s": step_s,
        "steps": STEPS,
        "num_nodes": 2,
        "grad_bytes": GRAD_BYTES,
        "first_loss": first_loss,
        "last_loss": 0.9,
    }
    tx = {"start": [10, 20], "end": [10 + int(STEPS * node_bytes[0]), 20 + int(STEPS * node_bytes[1])]}
    cpu = {"start": (0.0, 0.0, 0.0), "end": (2.0, 3.0, 2.0)}  # 1 CPU second of others over 2 s
    return bench.Run(name, worker=worker, tx_bytes=tx, cpu=cpu)


def _repeats() -> list[list[bench.Run]]:
    """int8 at 0.25, 0.40 and 0.30 of ddp in its own repeats (0.25 of the median ddp step over all), and
    behind HSDP in the third."""
    steps = [{"ddp": 2.0, "hsdp": 1.0, "hier_sliced_int8": 0.5},
             {"ddp": 1.0, "hsdp": 0.8, "hier_sliced_int8": 0.4},
             {"ddp": 4.0, "hsdp": 1.0, "hier_sliced_int8": 1.2}]  # fmt: skip
    int8_bytes = (260_000.0, 270_000.0)
    return [
        [_run(name, s, int8_bytes if name == "hier_sliced_int8" else (1e6, 1e6)) for name, s in r.items()]
        for r in steps
    ]


def test_summary_takes_each_ratio_within_its_repeat(capsys: pytest.CaptureFixture[str]) -> None:
    summary = bench.summarize(["ddp", "hsdp", "hier_sliced_int8"], _repeats())
    int8 = summary["hier_sliced_int8"]
    assert int8["vs_ddp"] == pytest.approx([0.25, 0.40, 0.30])
    assert int8["vs_hsdp"] == pytest.approx([0.5, 0.5, 1.2])
    assert int8["bytes_x_bound"] == pytest.approx([0.27] * 3)  # the worst node, against 1 MB
    assert int8["other_cores"] == pytest.approx([0.5] * 3)
    assert summary["ddp"]["vs_hsdp"] == pytest.approx([2.0, 1.25, 4.0])
    bench.print_summary(summary, 3)
    out = capsys.readouterr().out
    assert "hier_sliced_int8: step 0.300 x ddp (median; target <= 0.3) -> MET" in out
    assert "bytes 0.270 x fp32 bound (worst node and repeat; target <= 0.3) -> MET" in out
    assert "ahead of hsdp in every repeat -> NOT MET" in out
    assert "| `hier_sliced_int8` | 0.500 (0.500, 0.400, 1.200) | 0.300 (0.250, 0.400, 0.300) |" in out


def test_a_failed_anchor_leaves_its_repeat_out_of_that_ratio() -> None:
    repeats = _repeats()
    repeats[2][1] = bench.Run("hsdp", ok=False, error="x")
    int8 = bench.summarize(["ddp", "hsdp", "hier_sliced_int8"], repeats)["hier_sliced_int8"]
    assert int8["vs_hsdp"][:2] == pytest.approx([0.5, 0.5])
    assert int8["vs_hsdp"][2] != int8["vs_hsdp"][2]  # nan: no HSDP in that repeat
    assert bench.finite(int8["vs_hsdp"]) == pytest.approx([0.5, 0.5])


def test_a_compressed_bsp_push_is_compared_with_the_full_precision_push_within_each_repeat(
    capsys: pytest.CaptureFixture[str],
) -> None:
    steps = [
        {"ddp": 2.0, "hier_bsp": 0.5, "hier_bsp_int8": 0.25},
        {"ddp": 1.0, "hier_bsp": 0.2, "hier_bsp_int8": 0.3},
    ]
    repeats = [[_run(name, s) for name, s in r.items()] for r in steps]
    summary = bench.summarize(["ddp", "hier_bsp", "hier_bsp_int8"], repeats)
    assert summary["hier_bsp_int8"]["vs_bsp"] == pytest.approx([0.5, 1.5])
    assert summary["hier_bsp"]["vs_bsp"] == pytest.approx([1.0, 1.0])
    assert bench.finite(summary["ddp"]["vs_bsp"]) == []  # not a hier_bsp contender
    bench.print_summary(summary, 2)
    out = capsys.readouterr().out
    assert "hier_bsp_int8: mean step 1.000 (0.500, 1.500) x hier_bsp's" in out
    assert "in every repeat -> NOT MET" in out
    assert bench.DEFAULT_CONTENDERS == [
        "ddp",
        "hsdp",
        "ddp_bf16",
        "hier_sliced",
        "hier_sliced_bf16",
        "hier_sliced_int8",
    ]


def test_first_loss_check_names_the_contender_that_differs(capsys: pytest.CaptureFixture[str]) -> None:
    same = [_run("ddp", 1.0, first_loss=0.75), _run("hsdp", 1.0, first_loss=0.75 * (1 + 1e-7))]
    assert bench.first_loss_check(same)
    differs = [*same, _run("hier_sliced", 1.0, first_loss=0.7501)]
    assert not bench.first_loss_check(differs)
    assert "2 of 3 contenders equal ddp's 0.750000000 (rtol 1e-06); differ: hier_sliced 0.750100000" in (
        capsys.readouterr().out
    )


# ---------------------------------------------------------------------- the HSDP anchor
HIDDEN, LAYERS, BATCH, LR, WORLD, PER_NODE = 16, 3, 4, 0.5, 4, 2


def _batch(rank: int) -> tuple[torch.Tensor, torch.Tensor]:
    gen = torch.Generator().manual_seed(rank)
    return tuple(torch.randn(BATCH, HIDDEN, generator=gen) for _ in range(2))  # type: ignore[return-value]


def _hsdp(rank: int, world: int, store: str, port: int) -> dict:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank), WORLD_SIZE=str(world))
    os.environ["LOCAL_WORLD_SIZE"] = str(PER_NODE)
    import _hier_sliced_worker as worker
    from harness.worker import MLP, MarkedWindow

    torch.set_num_threads(1)
    torch.manual_seed(0)
    model = MLP(HIDDEN, LAYERS, lr=LR)
    losses = worker.fit_hsdp(model, _batch(rank), MarkedWindow(1, 2, signal_dir=None), 4, LR)
    # this rank's shards (the process group is gone): dim 0 split over the node's processes
    params = {name: p.to_local().clone() for name, p in model.net.named_parameters()}
    return {"losses": losses, "params": params}


def test_hsdp_anchor_trains_as_the_mean_gradient_on_one_process(tmp_path: Path) -> None:
    """Two nodes x 2 processes, 4 steps: every rank's loss and the final parameters equal SGD on the mean of
    the 4 processes' losses."""
    results = run_spawned(_hsdp, WORLD, tmp_path, free_port())
    for result in results:
        assert result is not None and "error" not in result, result
    from harness.worker import MLP

    torch.manual_seed(0)
    reference = MLP(HIDDEN, LAYERS, lr=LR)
    optimizer = torch.optim.SGD(reference.parameters(), lr=LR)
    batches = [_batch(rank) for rank in range(WORLD)]
    expected: list[list[float]] = [[] for _ in range(WORLD)]
    for _ in range(4):
        optimizer.zero_grad()
        losses = [torch.nn.functional.mse_loss(reference(x), y) for x, y in batches]
        for rank, loss in enumerate(losses):
            expected[rank].append(float(loss))
        (sum(losses) / WORLD).backward()
        optimizer.step()
    assert expected[0][0] != pytest.approx(expected[0][-1], rel=1e-3)  # it trained
    for rank, result in enumerate(results):
        assert result["losses"] == pytest.approx(expected[rank], rel=1e-5)
    for rank, result in enumerate(results):
        for name, value in reference.net.named_parameters():
            shard = value.detach().chunk(PER_NODE, dim=0)[rank % PER_NODE]
            torch.testing.assert_close(result["params"][name], shard, rtol=1e-5, atol=1e-6)

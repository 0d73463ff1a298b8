"""``inter_node_dtype="fp8"``: the int8 hop's blocks with each value as float8 e4m3 under the block's scale.

Every element comes back within 1/16 of itself down to ``2^-15`` of its block's largest (where int8 rounds it
to 0); the CPU's table lookup decodes exactly what torch's float8 conversion gives; the all-reduce across
nodes keeps the exact sum less what is owed (error feedback); and Adam on the digits example ends within
0.75 % of full precision's loss, where the int8 hop's equal steps leave it 1.8 % off.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
from helpers import init_gloo, run_spawned, run_torchrun

from lightning_hier import HierBSPStrategy, HierSlicedStrategy
from lightning_hier.sliced.compressed_hop import hop_bytes, start_compressed_all_reduce
from lightning_hier.sliced.int8_codec import BLOCK, FP8, INT8, dequantize, quantize

E4M3_MAX = 448.0


def _spanning(rows: int, numel: int, seed: int = 0) -> torch.Tensor:
    """Rows of magnitudes from 1e-4 to 1e2 changing every 500 elements (inside blocks)."""
    generator = torch.Generator().manual_seed(seed)
    magnitude = 10.0 ** ((torch.arange(numel) // 500) % 7 - 4).float()
    return torch.randn(rows, numel, generator=generator) * magnitude


def test_every_element_comes_back_within_a_sixteenth_of_itself_above_the_subnormals() -> None:
    x = _spanning(3, 5 * BLOCK + 77)
    q, scales = quantize(x, fmt=FP8)
    y = dequantize(q, scales, fmt=FP8)
    scale = scales.repeat_interleave(BLOCK, dim=1)[:, : x.shape[1]]
    # e4m3: 3 mantissa bits in its normal range (>= 2^-6), steps of 2^-9 below it; round to nearest
    bound = torch.maximum(x.abs() / 16, scale * 2.0**-10) * (1 + 1e-6)
    assert ((y - x).abs() <= bound).all(), ((y - x).abs() / bound).max()
    # the block's largest element is sent as e4m3's largest, so no value saturates
    assert scale.max() * E4M3_MAX == pytest.approx(float(x.abs().max()), rel=1e-6)
    # int8's equal steps round an element below half a step to 0; e4m3 keeps it
    small = x.abs() > scale * E4M3_MAX * 2.0**-12
    lost_int8 = dequantize(*quantize(x), dtype=torch.float32) == 0
    assert (lost_int8 & small).sum() > 1000
    assert ((y == 0) & small).sum() == 0


def test_the_cpu_decodes_by_table_what_torchs_conversion_gives() -> None:
    codes = torch.arange(256, dtype=torch.int32).to(torch.uint8).view(torch.int8)
    codes = codes[~codes.view(torch.float8_e4m3fn).float().isnan()].view(1, -1)  # NaN is never sent
    scales = torch.ones(1, 1)
    for dtype in (torch.float32, torch.float64):
        decoded = dequantize(codes, scales, block=codes.shape[1], dtype=dtype, fmt=FP8)
        assert torch.equal(decoded, codes.view(torch.float8_e4m3fn).to(dtype))


def test_the_formats_share_one_message_size() -> None:
    for numel, nodes in ((10_000, 2), (4097, 3)):
        assert hop_bytes(numel, 4, torch.float8_e4m3fn, nodes) == hop_bytes(numel, 4, torch.int8, nodes)
    assert INT8.top == 127 and FP8.top == E4M3_MAX


def _steps(rank: int, world: int, store: str, steps: int) -> dict:
    init_gloo(rank, world, store)
    try:
        gradient = _spanning(1, 5003, seed=100 + rank).view(-1)
        residual = torch.zeros_like(gradient)
        delivered = torch.zeros_like(gradient, dtype=torch.float64)
        for _ in range(steps):
            out = gradient.clone()
            work, finish = start_compressed_all_reduce(out, residual, torch.float8_e4m3fn, dist.group.WORLD)
            work.wait()
            finish()
            delivered += out.double()
        owed = residual.double().clone()
        dist.all_reduce(owed)
        return {"delivered": delivered, "owed": owed}
    finally:
        dist.destroy_process_group()


def test_error_feedback_delivers_the_exact_sum_less_what_is_owed(tmp_path: Path) -> None:
    steps = 20
    results = run_spawned(_steps, 2, tmp_path, steps)
    assert all(r is not None and "error" not in r for r in results), results
    given = steps * sum(_spanning(1, 5003, seed=100 + rank).view(-1).double() for rank in range(2))
    for result in results:
        torch.testing.assert_close(result["delivered"] + result["owed"], given, rtol=0, atol=1e-3)
        assert result["owed"].abs().max() > 0  # it did round


def test_both_strategies_take_fp8() -> None:
    assert HierSlicedStrategy(inter_node_dtype="fp8").inter_node_dtype == "fp8"
    assert HierBSPStrategy(inter_node_dtype="fp8").inter_node_dtype == "fp8"


def test_fp8_hop_keeps_adam_on_the_digits_example_within_three_quarters_of_a_percent(tmp_path: Path) -> None:
    out = tmp_path / "results.json"
    run_torchrun(
        "int8_hop_digits.py",
        4,
        str(out),
        "--optimizer",
        "adam",
        "--steps",
        "100",
        "--dtype",
        "fp8",
        timeout=600,
    )
    results = json.loads(out.read_text())
    full, fp8 = results["fp32"]["loss"], results["fp8"]["loss"]
    assert full < 0.5  # it trained (from ~2.3)
    assert abs(fp8 - full) / full < 0.0075, (full, fp8)
    for full_rank, fp8_rank in zip(results["fp32"]["inter_bytes"], results["fp8"]["inter_bytes"]):
        for (_, full_wire), (_, fp8_wire) in zip(full_rank, fp8_rank):
            assert 0.25 <= fp8_wire / full_wire <= 0.27  # int8's bytes

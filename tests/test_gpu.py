"""On a real CUDA device (skipped without one; CI has none): every strategy under NCCL against Lightning.

One process, NCCL with world size 1: the strategies build their groups as ``cuda:nccl,cpu:gloo``,
take their CUDA code paths, and must train to Lightning's own result on the same device. The
audit records every collective of the run and checks the device rule on the real backends.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest
import torch

sys.path.insert(0, str(Path(__file__).parent))

from helpers import run_torchrun  # noqa: E402

from lightning_hier.audit import analyze  # noqa: E402

needs_cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")

# float32 sums in another order differ by ~1e-7; mixed precision rounds activations to 8 or 11 bits,
# so the two runs may diverge by a rounding step there (the CPU tests hold bf16 to the same bound).
TOLERANCE = {"16_mixed": 1e-3, "bf16_mixed": 1e-2}
NEGATIVE_CONTROLS = ("bsp_lagging_unordered",)  # as in gpu_checks.py
BSP_ASYNC = ("bsp_default_async",)  # no reference run: checked for what it must keep instead


@needs_cuda
def test_every_strategy_on_cuda_matches_lightning(tmp_path: Path) -> None:
    out = tmp_path / "gpu.json"
    audit_dir = tmp_path / "audit"
    run_torchrun("gpu_checks.py", 1, str(out), env={"LIGHTNING_HIER_AUDIT_DIR": str(audit_dir)}, timeout=900)
    check_gpu_results(json.loads(out.read_text()), audit_dir)


# one device standing for many: the collectives of one-rank groups forced on, host-device syncs in
# steady-state steps raising, torch's stream sanitizer watching every kernel's accesses
FORCED_CASES = (
    "sliced_sgd_size,sliced_adam_time,sliced_adamw_none_clip,sliced_accumulate_thread_reducer,"
    "sliced_bf16_mixed,pipeline_keep,pipeline_timed_static_shapes,hybrid_sgd_32,bsp_plain_sgd_early_push,"
    "bsp_plain_time_buckets"
)


@needs_cuda
def test_forced_collectives_on_one_device_under_the_stream_sanitizer_without_syncs(tmp_path: Path) -> None:
    out = tmp_path / "gpu_forced.json"
    audit_dir = tmp_path / "audit"
    env = {
        "LIGHTNING_HIER_AUDIT_DIR": str(audit_dir),
        "LIGHTNING_HIER_FORCE_COLLECTIVES": "1",
        "LIGHTNING_HIER_SYNC_CHECK": "1",
        "TORCH_CUDA_SANITIZER": "1",
    }
    # through torchrun itself: the sanitizer is switched on when torch is imported, which the test helpers'
    # forking server did before this environment existed
    run_torchrun(
        "gpu_checks.py", 1, str(out), FORCED_CASES, env=env, timeout=900, launcher_args=("--max-restarts=0",)
    )
    results = json.loads(out.read_text())
    failures = {case: r["trace"] for case, r in results.items() if "error" in r}
    assert not failures, "\n".join(f"{case}:\n{trace}" for case, trace in failures.items())
    for case, result in results.items():
        tolerance = next((t for key, t in TOLERANCE.items() if key in case), 1e-5)
        assert result["max_rel_diff"] < tolerance and result["reference_moved"] > 1e-3, (case, result)
    report = analyze(audit_dir, require_main_thread=False)
    report.raise_if_problems()
    names = {r["op"] for r in report.records[0] if any(t[0] == "cuda" for t in r["tensors"])}
    assert any("reduce_scatter" in name for name in names), names  # the one-rank groups really reduced
    assert any("all_reduce" in name for name in names), names


def check_gpu_results(results: dict, audit_dir: Path) -> None:
    """What ``gpu_checks.py`` wrote must match Lightning; the audit must find NCCL-legal collectives."""
    failures = {case: r["trace"] for case, r in results.items() if "error" in r}
    assert not failures, "\n".join(f"{case}:\n{trace}" for case, trace in failures.items())
    for case, result in results.items():
        tolerance = next((t for key, t in TOLERANCE.items() if key in case), 1e-5)
        assert result["reference_moved"] > 1e-3, (case, result)
        if case in BSP_ASYNC:  # every micro-step computed is applied, none staler than allowed
            assert result["finite"] and result["computed"] == result["applied"] == 24, (case, result)
            assert result["staleness_seen"] <= result["max_staleness"], (case, result)
            continue
        if case in NEGATIVE_CONTROLS:  # the module's stream without its waits: the lag must show
            assert result["max_rel_diff"] > 1e-3, (case, result)
        else:
            assert result["max_rel_diff"] < tolerance, (case, result)
        if "optimizer_state_rel_diff" in result and case not in NEGATIVE_CONTROLS:  # as the fit leaves it
            assert result["optimizer_state_rel_diff"] < tolerance, (case, result)
    for case, result in results.items():  # the stage's CUDA events timed every layer of the stage
        if case.startswith("pipeline_") and "timed" in case:
            times = result["layer_times_ms"]
            assert len(times) == result["layers"], (case, result)
            assert all(forward > 0 for forward, _ in times.values()), (case, times)
            assert sum(backward for _, backward in times.values()) > 0, (case, times)
            # every micro-batch timed, yet the steps' ends did not wait for the device (they read the
            # CUDA marks it had passed, not a synchronize per step)
            assert result["synchronizes_in_fit"] < result["steps"], (case, result["synchronizes_in_fit"])
    if "bsp_plain_time_buckets" in results:
        assert results["bsp_plain_time_buckets"]["rebuilt_on_time_plan"], results["bsp_plain_time_buckets"]
    # CommProfiler under real NCCL: ddp's numbers come from DDP's own CUDA-event timing of its C++
    # all-reduces (profiling/ddp_reducer.py), so the profiler issues and times nothing itself there;
    # every step all-reduces every gradient byte
    ddp = results["profiler_ddp"]
    assert ddp["events"] == 0 and ddp["unobserved_completions"] == 0, ddp
    assert [step["kinds"]["world"][1] for step in ddp["steps"]] == [ddp["param_bytes"]] * len(ddp["steps"])
    assert all(step["kinds"]["world"][2] > 0 for step in ddp["steps"]), ddp  # DDP timed its all-reduce
    # what the package issues itself on device tensors is timed with CUDA events
    for case in ("profiler_hier_sliced", "profiler_hier_bsp", "profiler_hier_pipeline"):
        assert results[case]["unobserved_completions"] == 0, results[case]
    for step in ddp["steps"]:
        _count, _bytes, time_ms, exposed_ms = step["kinds"]["world"]
        assert time_ms >= 0 and 0 <= exposed_ms <= time_ms + 1e-6 and exposed_ms <= step["step_ms"], step
    assert all(results[case]["csv_written"] for case in results if case.startswith("profiler_"))
    report = analyze(audit_dir, require_main_thread=False)  # hier_bsp's collectives: its BSP thread
    report.raise_if_problems()
    devices = {tensor[0] for r in report.records[0] for tensor in r["tensors"]}
    assert "cuda" in devices, "no device tensor went through a recorded collective"

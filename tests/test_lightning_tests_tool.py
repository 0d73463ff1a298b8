"""tools/run_lightning_tests.py: the copy it prepares, the forcing onto processes, the outcomes it reads
from pytest's JUnit XML and the comparison it reports."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tools"))
from run_lightning_tests import (  # noqa: E402
    BOTH_FAILED,
    BOTH_PASSED,
    FORCE_PROCESSES_ENV,
    FORCE_STRATEGY_ENV,
    GAP,
    ONLY_STRATEGY,
    OTHER,
    Outcome,
    changed_packages,
    compare,
    differing_errors,
    failures_not_missing_packages,
    prepare,
    read_junit,
)

# Trainers of a fake Lightning test: each case's strategy class, start method and device count go to a file
TRAINERS = """
import os

import pytest
from lightning.pytorch import Trainer
from lightning.pytorch.accelerators import CPUAccelerator

CASES = {
    "nothing": {},
    "auto": {"strategy": "auto", "accelerator": "auto", "devices": "auto"},
    "cpu_one": {"accelerator": "cpu", "devices": 1},
    "ddp_asked": {"strategy": "ddp", "accelerator": "cpu", "devices": 2},
    "three_devices": {"accelerator": "cpu", "devices": 3},
    "accelerator_object": {"accelerator": CPUAccelerator(), "devices": 1},
}


@pytest.mark.parametrize("case", sorted(CASES))
def test_trainer(case):
    trainer = Trainer(logger=False, enable_checkpointing=False, enable_progress_bar=False, **CASES[case])
    start = getattr(trainer.strategy, "_start_method", None)
    with open(os.environ["OBSERVED"], "a") as observed:
        observed.write(f"{case} {type(trainer.strategy).__name__} {start} {trainer.num_devices}\\n")
"""


def fake_lightning(root: Path) -> Path:
    tests = root / "tests" / "tests_pytorch"
    (tests / "callbacks").mkdir(parents=True)
    (tests / "conftest.py").write_text("import pytest\n")
    (tests / "callbacks" / "test_x.py").write_text('STRATEGY = "ddp_spawn"\nOTHER = "ddp"\n')
    (tests / "test_trainers.py").write_text(TRAINERS)
    return root


def test_prepare_registers_both_start_methods_and_substitutes_spawn(tmp_path: Path) -> None:
    source = fake_lightning(tmp_path / "src")
    work = tmp_path / "work"
    prepare(source, work, "hier_bsp", ["tests_pytorch/callbacks/test_x.py::test_a"])
    assert (work / "tests_pytorch/callbacks/test_x.py").read_text() == (
        'STRATEGY = "hier_bsp_spawn"\nOTHER = "ddp"\n'
    )
    conftest = (work / "tests_pytorch/conftest.py").read_text()
    # the appended registration runs (the forcing plugin does nothing without its environment variable)
    assert FORCE_STRATEGY_ENV not in os.environ
    exec(conftest.split("import pytest\n", 1)[1], {"pytest": pytest})
    from lightning.pytorch.strategies import StrategyRegistry

    from lightning_hier.strategies.hier_bsp import HierBSPStrategy

    for start_method in ("spawn", "fork"):
        entry = StrategyRegistry[f"hier_bsp_{start_method}"]
        assert entry["strategy"] is HierBSPStrategy and entry["init_params"] == {"start_method": start_method}
    prepare(source, work, "hier_bsp", ["tests_pytorch/callbacks/test_x.py"], substitute=False)
    copied = (work / "tests_pytorch/callbacks/test_x.py").read_text()
    assert copied == 'STRATEGY = "ddp_spawn"\nOTHER = "ddp"\n'
    with pytest.raises(SystemExit, match="no test file"):
        prepare(source, work, "hier_bsp", ["tests_pytorch/missing.py"])


def test_forcing_puts_single_device_cpu_trainers_on_forked_processes(tmp_path: Path) -> None:
    source = fake_lightning(tmp_path / "src")
    work = tmp_path / "work"
    prepare(source, work, "hier_sliced", ["tests_pytorch/test_trainers.py"], substitute=False)
    observed = tmp_path / "observed.txt"
    env = {**os.environ, FORCE_STRATEGY_ENV: "hier_sliced_fork", FORCE_PROCESSES_ENV: "2"}
    env["OBSERVED"] = str(observed)
    command = [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "tests_pytorch"]
    run = subprocess.run(command, cwd=work, env=env, capture_output=True, text=True, timeout=300)
    assert run.returncode == 0, run.stdout[-3000:] + run.stderr[-3000:]
    found = dict(line.split(" ", 1) for line in observed.read_text().splitlines())
    assert found == {
        # no strategy or "auto", CPU or "auto", one device or "auto": forced
        "nothing": "HierSlicedStrategy fork 2",
        "auto": "HierSlicedStrategy fork 2",
        "cpu_one": "HierSlicedStrategy fork 2",
        # a strategy, a device count or an Accelerator object of the test's own: left as asked
        "ddp_asked": "DDPStrategy popen 2",
        "three_devices": "DDPStrategy popen 3",
        "accelerator_object": "SingleDeviceStrategy None 1",
    }


JUNIT = """<?xml version="1.0" encoding="utf-8"?>
<testsuites><testsuite name="pytest" errors="1" failures="2" skipped="1" tests="5">
<testcase classname="tests_pytorch.loops.test_a" name="test_ok" time="0.1" />
<testcase classname="tests_pytorch.loops.test_a.TestClass" name="test_rank[2]" time="0.1">
<failure message="torch.multiprocessing.spawn.ProcessRaisedException: &#10;&#10;-- Process 1 terminated with \
the following error:&#10;Traceback (most recent call last):&#10;  File &quot;x.py&quot;, line 3, in f&#10;\
    raise RuntimeError(&quot;...&quot;)&#10;RuntimeError: the ranks disagree&#10;&#10;rank 0: 1.0&#10;\
rank 1: 2.0">details</failure></testcase>
<testcase classname="tests_pytorch.loops.test_a" name="test_assert" time="0.1">
<failure message="assert 0 == 1&#10; +  where 0 = f()">details</failure></testcase>
<testcase classname="tests_pytorch.loops.test_b" name="test_import" time="0.1">
<error message="collection failure">E   ModuleNotFoundError: No module named 'fastapi'</error></testcase>
<testcase classname="tests_pytorch.loops.test_a" name="test_gpu" time="0.0">
<skipped type="pytest.skip" message="needs a GPU">skip</skipped></testcase>
</testsuite></testsuites>
"""


def test_read_junit_outcomes_and_first_error_lines(tmp_path: Path) -> None:
    report = tmp_path / "junit.xml"
    report.write_text(JUNIT)
    outcomes = read_junit(report)
    assert outcomes == {
        "tests_pytorch.loops.test_a::test_ok": Outcome("passed"),
        # a forked rank's error: the child's exception, not torch's wrapper
        "tests_pytorch.loops.test_a.TestClass::test_rank[2]": Outcome(
            "failed", "RuntimeError: the ranks disagree"
        ),
        "tests_pytorch.loops.test_a::test_assert": Outcome("failed", "assert 0 == 1"),
        "tests_pytorch.loops.test_b::test_import": Outcome("failed", "collection failure", True),
        "tests_pytorch.loops.test_a::test_gpu": Outcome("skipped"),
    }
    assert failures_not_missing_packages(outcomes) == [
        "tests_pytorch.loops.test_a.TestClass::test_rank[2]: RuntimeError: the ranks disagree",
        "tests_pytorch.loops.test_a::test_assert: assert 0 == 1",
    ]


def test_compare_counts_only_what_passes_under_ddp_as_a_gap() -> None:
    passed, skipped = Outcome("passed"), Outcome("skipped")
    ddp = {"a": passed, "b": Outcome("failed", "x"), "c": passed, "d": Outcome("failed", "y"), "e": skipped}
    strategy = {"a": passed, "b": Outcome("failed", "z"), "c": Outcome("failed", "E: c"), "d": passed}
    strategy["e"] = passed
    assert compare(ddp, strategy) == {
        BOTH_PASSED: ["a"],
        BOTH_FAILED: ["b"],
        GAP: ["c: E: c"],
        ONLY_STRATEGY: ["d: y"],
        OTHER: ["e: skipped / passed"],
    }


def test_packages_changed_between_the_two_runs_are_named() -> None:
    before = {"rich": "14.0.0", "torch": "2.13.0", "fastapi": "0.1"}
    after = {"rich": "15.0.0", "torch": "2.13.0", "tensorboard": "2.21.0"}
    assert changed_packages(before, after) == [
        "fastapi: 0.1 -> (none)",
        "rich: 14.0.0 -> 15.0.0",
        "tensorboard: (none) -> 2.21.0",
    ]


def test_errors_that_differ_in_more_than_addresses_and_names_are_listed() -> None:
    ddp = {
        "a": Outcome("failed", "assert <Mock id='139950320619664'> in [<lightning.p...7f48b9d2edd0>]"),
        "b": Outcome("failed", "<class 'lightning.pytorch.strategies.ddp.DDPStrategy'>."),
        "c": Outcome("failed", "AttributeError: 'TestModel' object has no attribute 'assertion_called'"),
        "d": Outcome("failed", "assert None == '/tmp/pytest-of-root/pytest-204/test_x0/checkpoints'"),
    }
    strategy = {
        "a": Outcome("failed", "assert <Mock id='140245511927696'> in [<lightning.p...7f8d708a8f10>]"),
        "b": Outcome("failed", "<class 'lightning_hier.strategies.hier_sliced.HierSlicedStrategy'>."),
        "c": Outcome("failed", "AssertionError: Scalars are not close!"),
        "d": Outcome("failed", "assert None == '/tmp/pytest-of-root/pytest-276/test_x0/checkpoints'"),
    }
    assert differing_errors(ddp, strategy, ["a", "b", "c", "d"]) == [
        ("c", ddp["c"].error, "AssertionError: Scalars are not close!")
    ]

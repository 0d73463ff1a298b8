"""tools/run_lightning_tests.py: the copy it prepares and the failures it reports."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tools"))
from run_lightning_tests import failures_not_missing_packages, prepare  # noqa: E402


def fake_lightning(root: Path) -> Path:
    tests = root / "tests" / "tests_pytorch"
    (tests / "callbacks").mkdir(parents=True)
    (tests / "conftest.py").write_text("import pytest\n")
    (tests / "callbacks" / "test_x.py").write_text('STRATEGY = "ddp_spawn"\nOTHER = "ddp"\n')
    return root


def test_prepare_registers_the_spawn_strategy_and_substitutes_it(tmp_path: Path) -> None:
    source = fake_lightning(tmp_path / "src")
    work = tmp_path / "work"
    prepare(source, work, "hier_bsp", ["tests_pytorch/callbacks/test_x.py"])
    assert (work / "tests_pytorch/callbacks/test_x.py").read_text() == (
        'STRATEGY = "hier_bsp_spawn"\nOTHER = "ddp"\n'
    )
    conftest = (work / "tests_pytorch/conftest.py").read_text()
    namespace: dict = {}
    exec(conftest.split("import pytest\n", 1)[1], namespace)  # the appended registration runs
    from lightning.pytorch.strategies import StrategyRegistry

    from lightning_hier.strategies.hier_bsp import HierBSPStrategy

    entry = StrategyRegistry["hier_bsp_spawn"]
    assert entry["strategy"] is HierBSPStrategy and entry["init_params"] == {"start_method": "spawn"}
    with pytest.raises(SystemExit, match="no test file"):
        prepare(source, work, "hier_bsp", ["tests_pytorch/missing.py"])


def test_failures_leave_out_missing_packages() -> None:
    log = (
        "....F.F\n"
        "___________________ test_a ___________________\n\n"
        "E       ModuleNotFoundError: No module named 'tensorboardX'\n"
        "___________________ test_b[2-cpu] ___________________\n\n"
        "    assert x\n"
        "E       assert tensor(False)\n"
        "E       more\n"
        "=========== short test summary info ===========\n"
    )
    assert failures_not_missing_packages(log) == ["test_b[2-cpu]: E       assert tensor(False)"]

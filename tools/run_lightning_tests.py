"""Run Lightning's own tests with ``ddp_spawn`` replaced by one of this package's strategies.

Lightning's test suite exercises the whole Trainer contract (hooks, callbacks, checkpoints, loggers,
precision) against ``ddp_spawn`` on CPU. This copies ``tests/tests_pytorch`` from a Lightning source
checkout, registers ``<strategy>_spawn`` (the strategy with ``start_method="spawn"``, so pytest's own
process hands the trained module back, as ``ddp_spawn`` does) and substitutes it for ``"ddp_spawn"`` in
the chosen test files, runs pytest there, and lists the failures that are not a missing optional
package (``tensorboard``, ``fastapi``, ...)::

    git clone --depth 1 --branch 2.6.5 https://github.com/Lightning-AI/pytorch-lightning /tmp/pl
    python tools/run_lightning_tests.py --lightning-src /tmp/pl --strategy hier_bsp
    python tools/run_lightning_tests.py --lightning-src /tmp/pl --strategy hier_sliced \\
        --files tests_pytorch/callbacks/test_spike.py -- -x

Take the tag of the installed Lightning (``pip show lightning``). Not part of CI (the tests are not on
PyPI); docs/lightning_tests.md has the last runs and the failures that follow from a strategy's design.
"""

from __future__ import annotations

import argparse
import re
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

STRATEGY_CLASSES = {
    "hier_sliced": "lightning_hier.strategies.hier_sliced:HierSlicedStrategy",
    "hier_bsp": "lightning_hier.strategies.hier_bsp:HierBSPStrategy",
    "hier_pipeline": "lightning_hier.strategies.hier_pipeline:HierPipelineStrategy",
}

# files with CPU tests on "ddp_spawn" (GPU-, XLA- and registry-only files left out)
DEFAULT_FILES = (
    "tests_pytorch/strategies/test_common.py",
    "tests_pytorch/strategies/test_ddp.py",
    "tests_pytorch/strategies/test_ddp_integration.py",
    "tests_pytorch/strategies/launchers/test_multiprocessing.py",
    "tests_pytorch/trainer/optimization/test_manual_optimization.py",
    "tests_pytorch/trainer/logging_/test_distributed_logging.py",
    "tests_pytorch/trainer/logging_/test_train_loop_logging.py",
    "tests_pytorch/trainer/properties/test_get_model.py",
    "tests_pytorch/trainer/flags/test_overfit_batches.py",
    "tests_pytorch/trainer/connectors/test_data_connector.py",
    "tests_pytorch/trainer/test_dataloaders.py",
    "tests_pytorch/trainer/test_trainer.py",
    "tests_pytorch/callbacks/test_early_stopping.py",
    "tests_pytorch/callbacks/test_stochastic_weight_avg.py",
    "tests_pytorch/callbacks/test_weight_averaging.py",
    "tests_pytorch/callbacks/test_pruning.py",
    "tests_pytorch/callbacks/test_spike.py",
    "tests_pytorch/models/test_cpu.py",
    "tests_pytorch/models/test_restore.py",
    "tests_pytorch/models/test_amp.py",
    "tests_pytorch/loggers/test_all.py",
    "tests_pytorch/checkpointing/test_model_checkpoint.py",
    "tests_pytorch/checkpointing/test_torch_saving.py",
    "tests_pytorch/plugins/precision/test_double.py",
    "tests_pytorch/utilities/test_all_gather_grad.py",
    "tests_pytorch/utilities/test_dtype_device_mixin.py",
    "tests_pytorch/profilers/test_profiler.py",
)

REGISTRATION = """

# added by lightning_hier's tools/run_lightning_tests.py
import lightning_hier  # noqa: E402,F401
from {module} import {cls} as _Substitute  # noqa: E402
from lightning.pytorch.strategies import StrategyRegistry as _Registry  # noqa: E402

if "{name}" not in _Registry:
    _Registry.register("{name}", _Substitute, start_method="spawn")
"""


def prepare(source: Path, work: Path, strategy: str, files: list[str]) -> None:
    """Copy Lightning's tests into ``work`` and point the chosen files' ``ddp_spawn`` at ``strategy``."""
    tests = source / "tests" / "tests_pytorch"
    if not (tests / "conftest.py").is_file():
        raise SystemExit(f"{source} is not a Lightning source checkout (no tests/tests_pytorch/conftest.py)")
    target = work / "tests_pytorch"
    if target.exists():
        shutil.rmtree(target)
    shutil.copytree(tests, target)
    module, cls = STRATEGY_CLASSES[strategy].split(":")
    name = f"{strategy}_spawn"
    with open(target / "conftest.py", "a") as conftest:
        conftest.write(REGISTRATION.format(module=module, cls=cls, name=name))
    for relative in files:
        path = work / relative
        if not path.is_file():
            raise SystemExit(f"no test file {relative} in {source}")
        path.write_text(path.read_text().replace('"ddp_spawn"', f'"{name}"'))


def failures_not_missing_packages(log: str) -> list[str]:
    """``name: first error line`` of each failure in pytest's output whose error is not a missing package."""
    found = []
    blocks = re.split(r"\n_{5,} (\S.*?) _{5,}\n", log)
    for name, body in zip(blocks[1::2], blocks[2::2]):
        errors = [line for line in body.splitlines() if line.startswith("E ")]
        if any("ModuleNotFoundError" in line for line in errors):
            continue
        found.append(f"{name}: {errors[0] if errors else '(no error line)'}")
    return found


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--lightning-src", type=Path, required=True, help="a Lightning source checkout")
    parser.add_argument("--strategy", choices=sorted(STRATEGY_CLASSES), default="hier_sliced")
    parser.add_argument("--files", nargs="+", default=list(DEFAULT_FILES), help="test files, from tests/")
    parser.add_argument("--work", type=Path, default=None, help="where the copy goes (default: a temp dir)")
    parser.add_argument("pytest_args", nargs="*", help="after --: passed to pytest")
    args = parser.parse_args()
    work = args.work or Path(tempfile.mkdtemp(prefix=f"lightning-tests-{args.strategy}-"))
    prepare(args.lightning_src, work, args.strategy, args.files)
    # a file whose imports need a missing package (onnxruntime, ...) must not stop the others from running
    options = ["-q", "-p", "no:cacheprovider", "--continue-on-collection-errors"]
    command = [sys.executable, "-m", "pytest", *options, *args.files, *args.pytest_args]
    print(f"+ ({work}) {' '.join(command)}", flush=True)
    run = subprocess.run(command, cwd=work, capture_output=True, text=True)
    (work / "pytest.log").write_text(run.stdout + run.stderr)
    print(run.stdout.strip().splitlines()[-1] if run.stdout.strip() else run.stderr[-2000:])
    found = failures_not_missing_packages(run.stdout)
    print(f"{len(found)} failure(s) not due to a missing package (full log: {work / 'pytest.log'})")
    for line in found:
        print(f"  {line}")
    if found:
        return 1
    return 0 if run.returncode in (0, 1) else run.returncode  # 1: only missing-package failures


if __name__ == "__main__":
    sys.exit(main())

"""Run Lightning's own tests with one of this package's strategies in place of Lightning's ``ddp``.

Lightning's test suite exercises the whole Trainer contract (hooks, callbacks, checkpoints, loggers,
precision). The tool copies ``tests/tests_pytorch`` from a Lightning source checkout, registers
``<strategy>_spawn`` and ``<strategy>_fork`` (the strategy with that start method) and runs pytest there
in one of two modes:

- default: the chosen files' ``"ddp_spawn"`` replaced by ``<strategy>_spawn`` (pytest's own process gets
  the trained module back, as under ``ddp_spawn``); lists the failures that are not a missing optional
  package (``fastapi``, ...).
- ``--force-processes N``: every Trainer of the chosen files that asks for one CPU device on the default
  strategy runs on N CPU processes started by ``fork`` (a test's local classes need no pickling), first
  under Lightning's ``ddp_fork``, then under ``<strategy>_fork``; lists the tests that pass under ``ddp``
  and fail under the strategy (the contract's gaps). Tests that fail under forced ``ddp`` too (an
  assertion in pytest's process on state that only the forked processes saw) are left out by design.

::

    git clone --depth 1 --branch 2.6.5 https://github.com/Lightning-AI/pytorch-lightning /tmp/pl
    pip install tensorboard pytest-timeout
    python tools/run_lightning_tests.py --lightning-src /tmp/pl --strategy hier_bsp
    python tools/run_lightning_tests.py --lightning-src /tmp/pl --strategy hier_sliced --force-processes 2
    python tools/run_lightning_tests.py --lightning-src /tmp/pl --strategy hier_sliced \\
        --files tests_pytorch/callbacks/test_spike.py -- -x

Take the tag of the installed Lightning (``pip show lightning``). Outcomes are read from pytest's JUnit
XML; each test is bounded by ``--timeout`` seconds (with ``pytest-timeout``; without it each file runs
as its own pytest under ``timeout``). Not part of CI (the tests are not on PyPI); docs/lightning_tests.md
has the latest results and the failures that follow from a strategy's design.
"""

from __future__ import annotations

import argparse
import importlib.metadata
import importlib.util
import os
import re
import shutil
import subprocess
import sys
import tempfile
import xml.etree.ElementTree as ElementTree
from pathlib import Path
from typing import NamedTuple

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

# single-device CPU tests forced onto several processes (--force-processes): checkpoints, optimizers and
# schedulers, hooks, loops, gradient clipping, callbacks (progress bars and fine-tuning included), trainer
# properties. Files or pytest node ids, from tests/ (checkpointing/test_legacy_checkpoints.py is left out:
# it needs Lightning's downloaded legacy checkpoints to be collected)
FORCE_FILES = (
    "tests_pytorch/checkpointing/test_checkpoint_callback_frequency.py",
    "tests_pytorch/checkpointing/test_model_checkpoint.py",
    "tests_pytorch/checkpointing/test_torch_saving.py",
    "tests_pytorch/checkpointing/test_trainer_checkpoint.py",
    "tests_pytorch/trainer/optimization/test_backward_calls.py",
    "tests_pytorch/trainer/optimization/test_manual_optimization.py",
    "tests_pytorch/trainer/optimization/test_multiple_optimizers.py",
    "tests_pytorch/trainer/optimization/test_optimizers.py",
    "tests_pytorch/models/test_hooks.py",
    "tests_pytorch/loops/optimization/test_automatic_loop.py",
    "tests_pytorch/loops/optimization/test_closure.py",
    "tests_pytorch/loops/optimization/test_manual_loop.py",
    "tests_pytorch/loops/test_all.py",
    "tests_pytorch/loops/test_double_iter_in_iterable_dataset.py",
    "tests_pytorch/loops/test_evaluation_loop.py",
    "tests_pytorch/loops/test_evaluation_loop_flow.py",
    "tests_pytorch/loops/test_fetchers.py",
    "tests_pytorch/loops/test_flow_warnings.py",
    "tests_pytorch/loops/test_loop_state_dict.py",
    "tests_pytorch/loops/test_loops.py",
    "tests_pytorch/loops/test_prediction_loop.py",
    "tests_pytorch/loops/test_progress.py",
    "tests_pytorch/loops/test_training_epoch_loop.py",
    "tests_pytorch/loops/test_training_loop.py",
    "tests_pytorch/loops/test_training_loop_flow_dict.py",
    "tests_pytorch/loops/test_training_loop_flow_scalar.py",
    "tests_pytorch/trainer/test_trainer.py::test_gradient_clipping_by_norm",
    "tests_pytorch/trainer/test_trainer.py::test_gradient_clipping_by_value",
    "tests_pytorch/trainer/test_trainer.py::test_invalid_gradient_clip_value",
    "tests_pytorch/trainer/test_trainer.py::test_invalid_gradient_clip_algo",
    "tests_pytorch/core/test_lightning_module.py::test_lightning_module_configure_gradient_clipping",
    "tests_pytorch/core/test_lightning_module.py::"
    "test_lightning_module_configure_gradient_clipping_different_argument_values",
    "tests_pytorch/callbacks/progress/test_rich_progress_bar.py",
    "tests_pytorch/callbacks/progress/test_tqdm_progress_bar.py",
    "tests_pytorch/callbacks/test_callback_hook_outputs.py",
    "tests_pytorch/callbacks/test_callbacks.py",
    "tests_pytorch/callbacks/test_device_stats_monitor.py",
    "tests_pytorch/callbacks/test_early_stopping.py",
    "tests_pytorch/callbacks/test_finetuning_callback.py",
    "tests_pytorch/callbacks/test_gradient_accumulation_scheduler.py",
    "tests_pytorch/callbacks/test_lambda_function.py",
    "tests_pytorch/callbacks/test_lr_monitor.py",
    "tests_pytorch/callbacks/test_model_checkpoint_additional_cases.py",
    "tests_pytorch/callbacks/test_model_checkpoint_edge_cases.py",
    "tests_pytorch/callbacks/test_model_checkpoint_manual_opt.py",
    "tests_pytorch/callbacks/test_model_checkpoint_step_interval_val_metric.py",
    "tests_pytorch/callbacks/test_model_summary.py",
    "tests_pytorch/callbacks/test_prediction_writer.py",
    "tests_pytorch/callbacks/test_pruning.py",
    "tests_pytorch/callbacks/test_rich_model_summary.py",
    "tests_pytorch/callbacks/test_spike.py",
    "tests_pytorch/callbacks/test_stochastic_weight_avg.py",
    "tests_pytorch/callbacks/test_throughput_monitor.py",
    "tests_pytorch/callbacks/test_timer.py",
    "tests_pytorch/callbacks/test_weight_averaging.py",
    "tests_pytorch/trainer/properties/test_estimated_stepping_batches.py",
    "tests_pytorch/trainer/properties/test_get_model.py",
    "tests_pytorch/trainer/properties/test_log_dir.py",
    "tests_pytorch/trainer/properties/test_loggers.py",
)

# the environment variables the forcing plugin reads: the registered strategy name, the process count
FORCE_STRATEGY_ENV = "LIGHTNING_TESTS_FORCE_STRATEGY"
FORCE_PROCESSES_ENV = "LIGHTNING_TESTS_FORCE_PROCESSES"

REGISTRATION = """

# added by lightning_hier's tools/run_lightning_tests.py: <strategy>_spawn and <strategy>_fork
import lightning_hier  # noqa: E402,F401
from {module} import {cls} as _Substitute  # noqa: E402
from lightning.pytorch.strategies import StrategyRegistry as _Registry  # noqa: E402

for _start_method in ("spawn", "fork"):
    if f"{name}_{{_start_method}}" not in _Registry:
        _Registry.register(f"{name}_{{_start_method}}", _Substitute, start_method=_start_method)
"""

FORCING = f"""

# added by lightning_hier's tools/run_lightning_tests.py: with {FORCE_STRATEGY_ENV} set, a Trainer that asks
# for one CPU device on the default strategy gets that strategy on {FORCE_PROCESSES_ENV} CPU processes
import functools as _functools  # noqa: E402
import multiprocessing as _multiprocessing  # noqa: E402
import os as _os  # noqa: E402

import lightning.pytorch as _lightning_pytorch  # noqa: E402

_FORCED_STRATEGY = _os.environ.get("{FORCE_STRATEGY_ENV}")
_FORCED_PROCESSES = int(_os.environ.get("{FORCE_PROCESSES_ENV}", "2"))


def _asks_for_one_cpu_device(kwargs):
    # `x in (...)` compares with ==, so an Accelerator, Strategy or device list is never matched
    return (
        kwargs.get("strategy") in (None, "auto")
        and kwargs.get("accelerator") in (None, "auto", "cpu")
        and kwargs.get("devices") in (None, "auto", 1, "1")
    )


if _FORCED_STRATEGY:
    _trainer_init = _lightning_pytorch.Trainer.__init__

    @_functools.wraps(_trainer_init)
    def _forced_trainer_init(self, *args, **kwargs):
        if _asks_for_one_cpu_device(kwargs):
            kwargs.update(strategy=_FORCED_STRATEGY, devices=_FORCED_PROCESSES, accelerator="cpu")
        _trainer_init(self, *args, **kwargs)

    _lightning_pytorch.Trainer.__init__ = _forced_trainer_init

    @pytest.fixture(autouse=True)
    def _no_forked_process_outlives_its_test():
        # a test stopped by its timeout leaves its forked ranks waiting in a collective
        yield
        for _child in _multiprocessing.active_children():
            _child.kill()
            _child.join(10)
"""


class Outcome(NamedTuple):
    """One test's result in a JUnit XML report."""

    status: str  # "passed", "failed" (a failure or an error) or "skipped" (xfail included)
    error: str = ""  # the first line of the error, for a failed test
    missing_package: bool = False  # the error is a ModuleNotFoundError


def prepare(source: Path, work: Path, strategy: str, files: list[str], substitute: bool = True) -> None:
    """Copy Lightning's tests into ``work``, register the strategy's names and add the forcing plugin;
    with ``substitute``, point the chosen files' ``"ddp_spawn"`` at ``<strategy>_spawn``."""
    tests = source / "tests" / "tests_pytorch"
    if not (tests / "conftest.py").is_file():
        raise SystemExit(f"{source} is not a Lightning source checkout (no tests/tests_pytorch/conftest.py)")
    for relative in files:
        if not (tests.parent / relative.split("::")[0]).is_file():
            raise SystemExit(f"no test file {relative} in {source}")
    target = work / "tests_pytorch"
    if target.exists():
        shutil.rmtree(target)
    shutil.copytree(tests, target)
    module, cls = STRATEGY_CLASSES[strategy].split(":")
    with open(target / "conftest.py", "a") as conftest:
        conftest.write(REGISTRATION.format(module=module, cls=cls, name=strategy))
        conftest.write(FORCING)
    if substitute:
        for relative in {relative.split("::")[0] for relative in files}:
            path = work / relative
            path.write_text(path.read_text().replace('"ddp_spawn"', f'"{strategy}_spawn"'))


def _first_error_line(message: str) -> str:
    """The line that names the error: for a forked or spawned rank's exception, the child's own."""
    raw = message.splitlines()
    lines = [line.strip() for line in raw if line.strip()]
    if not lines:
        return "(no error message)"
    if "terminated with the following error" in message:
        # torch's ProcessRaisedException carries the child's traceback: the exception is the first line
        # after its last frame that is not indented (a message may go on over several lines)
        frames = [index for index, line in enumerate(raw) if line.lstrip().startswith('File "')]
        start = frames[-1] + 1 if frames else 0
        after = [line for line in raw[start:] if line.strip() and not line[0].isspace()]
        return (after[0] if after else lines[-1])[:300]
    return lines[0][:300]


def read_junit(path: Path) -> dict[str, Outcome]:
    """Each test of a JUnit XML report by ``module.Class::name`` with its outcome."""
    found: dict[str, Outcome] = {}
    for case in ElementTree.parse(path).getroot().iter("testcase"):
        name = f"{case.get('classname')}::{case.get('name')}"
        problems = [child for child in case if child.tag in ("failure", "error")]
        if problems:
            text = "\n".join((child.get("message") or "") + "\n" + (child.text or "") for child in problems)
            missing = "ModuleNotFoundError" in text or "No module named" in text
            found[name] = Outcome("failed", _first_error_line(problems[0].get("message") or ""), missing)
        elif case.find("skipped") is not None:
            found[name] = Outcome("skipped")
        else:
            found[name] = Outcome("passed")
    return found


def failures_not_missing_packages(outcomes: dict[str, Outcome]) -> list[str]:
    """``name: first error line`` of each failure whose error is not a missing package."""
    return [
        f"{name}: {outcome.error}"
        for name, outcome in outcomes.items()
        if outcome.status == "failed" and not outcome.missing_package
    ]


# the classes of compare(), in the order they are reported
BOTH_PASSED = "passed under both"
BOTH_FAILED = "failed under both (excluded)"
GAP = "passed ddp, failed strategy"
ONLY_STRATEGY = "failed ddp, passed strategy"
OTHER = "skipped or not run under one"


def compare(ddp: dict[str, Outcome], strategy: dict[str, Outcome]) -> dict[str, list[str]]:
    """The tests in each class of the forced mode's comparison (gaps with the strategy's error line)."""
    classes: dict[str, list[str]] = {BOTH_PASSED: [], BOTH_FAILED: [], GAP: [], ONLY_STRATEGY: [], OTHER: []}
    for name in sorted(set(ddp) | set(strategy)):
        under_ddp, under_strategy = ddp.get(name, Outcome("missing")), strategy.get(name, Outcome("missing"))
        pair = (under_ddp.status, under_strategy.status)
        if pair == ("passed", "passed"):
            classes[BOTH_PASSED].append(name)
        elif pair == ("failed", "failed"):
            classes[BOTH_FAILED].append(name)
        elif pair == ("passed", "failed"):
            classes[GAP].append(f"{name}: {under_strategy.error}")
        elif pair == ("failed", "passed"):
            classes[ONLY_STRATEGY].append(f"{name}: {under_ddp.error}")
        else:
            classes[OTHER].append(f"{name}: {under_ddp.status} / {under_strategy.status}")
    return classes


SUMMARY_LINE = re.compile(r"\b(passed|failed|errors?|skipped|no tests ran)\b.* in [\d.]+s")


# what differs between two runs' error lines without saying anything: addresses, ids, pytest's temp
# directories, the strategy's class
_INCIDENTAL = (
    (re.compile(r"0x[0-9a-f]+|\b7f[0-9a-f]{10}\b"), "0x?"),
    (re.compile(r"\d{8,}"), "?"),
    (re.compile(r"id='\d+'"), "id=?"),
    (re.compile(r"pytest-\d+"), "pytest-?"),
    (re.compile(r"[\w.]*\b(DDP|HierSliced|HierBSP|HierPipeline)Strategy\b"), "Strategy"),
)


def differing_errors(
    ddp: dict[str, Outcome], strategy: dict[str, Outcome], names: list[str]
) -> list[tuple[str, str, str]]:
    """``(name, ddp's error, the strategy's error)`` of the tests that failed under both where the errors
    differ in more than addresses, temp paths and the strategy's name: a failure under forced ``ddp``
    that the fork explains may hide another under the strategy (a hook's assertion in a rank)."""
    found = []
    for name in names:
        ours, theirs = strategy[name].error, ddp[name].error
        for pattern, replacement in _INCIDENTAL:
            ours, theirs = pattern.sub(replacement, ours), pattern.sub(replacement, theirs)
        if ours != theirs:
            found.append((name, ddp[name].error, strategy[name].error))
    return found


def run_pytest(
    work: Path, files: list[str], pytest_args: list[str], report: Path, timeout: int, env: dict[str, str]
) -> dict[str, Outcome]:
    """Run pytest in ``work`` on ``files``; each test's outcome, from the JUnit XML written to ``report``."""
    # a file whose imports need a missing package (onnxruntime, ...) must not stop the others from running
    options = ["-q", "-p", "no:cacheprovider", "--continue-on-collection-errors"]
    if importlib.util.find_spec("pytest_timeout") is not None:
        runs = [([*options, f"--timeout={timeout}", *files], None)]
    else:
        # no per-test bound: each file is its own pytest, bounded as a whole, so one hang costs one file
        runs = [([*options, file], max(timeout * 20, 600)) for file in files]
    outcomes: dict[str, Outcome] = {}
    log_path = report.with_suffix(".log")  # pytest's output as it runs (tail -f)
    log_path.write_text("")
    for index, (arguments, limit) in enumerate(runs):
        part = report if len(runs) == 1 else report.with_suffix(f".{index}.xml")
        command = [sys.executable, "-m", "pytest", *arguments, f"--junitxml={part}", *pytest_args]
        if limit is not None:
            command = ["timeout", "-k", "30", str(limit), *command]
        print(f"+ ({work}) {' '.join(command)}", flush=True)
        with open(log_path, "a") as log:
            run = subprocess.run(command, cwd=work, stdout=log, stderr=subprocess.STDOUT, env=env)
        # pytest's summary line (a progress bar's stderr may come after it)
        lines = [line for line in log_path.read_text().splitlines() if SUMMARY_LINE.search(line)]
        print(lines[-1] if lines else f"(no summary line, exit status {run.returncode})", flush=True)
        if part.is_file():
            outcomes.update(read_junit(part))
        else:
            print(f"no JUnit report from {arguments[len(options) :]} (exit status {run.returncode})")
    print(f"pytest's output: {log_path}", flush=True)
    return outcomes


def installed_packages() -> dict[str, str]:
    """Each installed distribution's version, by name."""
    return {str(dist.metadata["Name"]).lower(): dist.version for dist in importlib.metadata.distributions()}


def changed_packages(before: dict[str, str], after: dict[str, str]) -> list[str]:
    """``name: old -> new`` for each package installed, removed or upgraded between two snapshots."""
    return [
        f"{name}: {before.get(name, '(none)')} -> {after.get(name, '(none)')}"
        for name in sorted(set(before) | set(after))
        if before.get(name) != after.get(name)
    ]


def summary(outcomes: dict[str, Outcome]) -> str:
    """``N passed, N failed, N skipped``."""
    counts = {status: 0 for status in ("passed", "failed", "skipped")}
    for outcome in outcomes.values():
        counts[outcome.status] += 1
    return ", ".join(f"{count} {status}" for status, count in counts.items())


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--lightning-src", type=Path, required=True, help="a Lightning source checkout")
    parser.add_argument("--strategy", choices=sorted(STRATEGY_CLASSES), default="hier_sliced")
    parser.add_argument(
        "--force-processes",
        type=int,
        default=None,
        metavar="N",
        help="run single-device CPU tests on N forked processes, under ddp and under the strategy",
    )
    parser.add_argument("--files", nargs="+", default=None, help="test files or node ids, from tests/")
    parser.add_argument("--timeout", type=int, default=120, help="seconds per test (default 120)")
    parser.add_argument("--work", type=Path, default=None, help="where the copy goes (default: a temp dir)")
    parser.add_argument("pytest_args", nargs="*", help="after --: passed to pytest")
    args = parser.parse_args()
    forced = args.force_processes is not None
    files = args.files or list(FORCE_FILES if forced else DEFAULT_FILES)
    work = args.work or Path(tempfile.mkdtemp(prefix=f"lightning-tests-{args.strategy}-"))
    prepare(args.lightning_src, work, args.strategy, files, substitute=not forced)
    env = {key: value for key, value in os.environ.items() if key != FORCE_STRATEGY_ENV}
    # which lightning_hier the tests get (PYTHONPATH picks a worktree's)
    where = "import lightning_hier; print(lightning_hier.__file__)"
    located = subprocess.run([sys.executable, "-c", where], cwd=work, env=env, capture_output=True, text=True)
    print(f"lightning_hier: {located.stdout.strip() or located.stderr.strip()[-300:]}", flush=True)

    if not forced:
        outcomes = run_pytest(work, files, args.pytest_args, work / "junit.xml", args.timeout, env)
        found = failures_not_missing_packages(outcomes)
        print(f"{summary(outcomes)}; {len(found)} failure(s) not due to a missing package (in {work})")
        for line in found:
            print(f"  {line}")
        return 1 if found else 0

    processes = args.force_processes
    if processes < 2:
        raise SystemExit("--force-processes needs 2 or more")
    results = {}
    # an optional package installed between the two runs (rich, ...) changes which tests run and how
    packages = installed_packages()
    for name in ("ddp", args.strategy):
        forced_env = {**env, FORCE_STRATEGY_ENV: f"{name}_fork", FORCE_PROCESSES_ENV: str(processes)}
        report = work / f"junit-{name}.xml"
        results[name] = run_pytest(work, files, args.pytest_args, report, args.timeout, forced_env)
        print(f"forced onto {processes} processes under {name}_fork: {summary(results[name])}")
    classes = compare(results["ddp"], results[args.strategy])
    lines = [f"{title}: {len(names)}" for title, names in classes.items()]
    changed = changed_packages(packages, installed_packages())
    if changed:
        lines = ["packages changed while the two runs ran, the comparison mixes both:", *changed, "", *lines]
    for title in (GAP, ONLY_STRATEGY):
        lines += [f"\n{title}:", *(f"  {name}" for name in classes[title])]
    print("\n".join(lines))
    differing = differing_errors(results["ddp"], results[args.strategy], classes[BOTH_FAILED])
    lines += ["", f"{BOTH_FAILED}:", *(f"  {name}" for name in classes[BOTH_FAILED])]
    lines += ["", f"{BOTH_FAILED}, with another error under {args.strategy} (to read):"]
    lines += [f"  {name}\n    ddp: {ddp}\n    {args.strategy}: {ours}" for name, ddp, ours in differing]
    lines += ["", f"{OTHER}:", *(f"  {name}" for name in classes[OTHER])]
    (work / "comparison.txt").write_text("\n".join(lines) + "\n")
    print(f"(every class listed in {work / 'comparison.txt'})")
    return 1 if classes[GAP] else 0


if __name__ == "__main__":
    sys.exit(main())

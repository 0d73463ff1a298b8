"""hier_pipeline end to end on several gloo processes, against a single-process Lightning run.

Each scenario trains ``SkewedNet`` with ``strategy=HierPipelineStrategy(...)`` under torchrun
(tests/scripts/pipeline_checks.py) and is compared with the same module trained by Lightning on
one device: migration, swapping and recomputing change placement, never the math.
"""

from __future__ import annotations

import json
import subprocess
import sys
import time
from pathlib import Path
from unittest import mock

import lightning.pytorch as pl
import pytest
import torch
from helpers import SCRIPTS, run_torchrun
from lightning.pytorch.callbacks import ModelCheckpoint

sys.path.insert(0, str(SCRIPTS))
from pipeline_models import (  # noqa: E402
    CompiledBlocksNet,
    CountingScheduledNet,
    DirectOneLayerNet,
    DropNet,
    ExampleInputNet,
    GainNet,
    GatherNet,
    LitAutoEncoder,
    NanoStyleGPT,
    OneLayerNet,
    SkewedNet,
    SkippingNet,
    StoppingNet,
    TinyGPT,
    TwiceNet,
    WrapperNet,
    flagged_loader,
    gain_loader,
    loader,
    token_loader,
)

from lightning_hier.pipeline.partition import StagePartition  # noqa: E402

LOSS_RTOL = 1e-5


class _Losses(pl.Callback):
    def __init__(self) -> None:
        self.values: list[float] = []

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):  # noqa: ANN001
        if outputs:  # a skipped step (training_step returned None) has none
            self.values.append(float(outputs["loss"]))


def _plain_trainer(losses: _Losses, **trainer_kwargs) -> pl.Trainer:  # noqa: ANN003
    settings = dict(
        accelerator="cpu",
        devices=1,
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        num_sanity_val_steps=0,
        callbacks=[losses],
    )
    return pl.Trainer(**{**settings, **trainer_kwargs})


def reference(
    optimizer: str,
    resume_after: int | None = None,
    tmp: Path | None = None,
    model_class: type[pl.LightningModule] = SkewedNet,
    batch_size: int = 32,
    model_kwargs: dict | None = None,
    optimizer_state_out: dict | None = None,
    **trainer_kwargs,
) -> tuple[list[float], dict[str, torch.Tensor]]:
    """Single-process Lightning; with ``resume_after`` it saves after that many steps and resumes,
    so Lightning's own resume bookkeeping (which epoch/batch comes next) is the same as compared.
    ``optimizer_state_out`` receives the optimizer's ``state_dict()`` as the fit leaves it."""
    pl.seed_everything(0, verbose=False)
    model = model_class(optimizer=optimizer, **(model_kwargs or {}))
    losses = _Losses()
    ckpt_path = None
    if resume_after is not None:
        assert tmp is not None
        first = _plain_trainer(losses, **{**trainer_kwargs, "max_steps": resume_after})
        first.fit(model, loader())
        ckpt_path = str(tmp / "reference_resume.ckpt")
        first.save_checkpoint(ckpt_path)
        pl.seed_everything(0, verbose=False)
        model = model_class(optimizer=optimizer)
    if issubclass(model_class, SkippingNet):
        data = flagged_loader(batch_size)
    elif issubclass(model_class, GainNet):
        data = gain_loader(batch_size)
    elif issubclass(model_class, TinyGPT):
        data = token_loader(batch_size)
    else:
        data = loader(batch_size)
    trainer = _plain_trainer(losses, **trainer_kwargs)
    trainer.fit(model, data, ckpt_path=ckpt_path)
    if optimizer_state_out is not None:
        optimizer_state_out.update(trainer.optimizers[0].state_dict())
    return losses.values, {k: v.detach().clone() for k, v in model.state_dict().items()}


def run_scenario(name: str, nproc: int, workdir: Path, launcher_args: tuple[str, ...] = ()) -> dict:
    out = workdir / f"{name}.json"
    run_torchrun(
        "pipeline_checks.py", nproc, name, str(out), str(workdir), timeout=300, launcher_args=launcher_args
    )
    return json.loads(out.read_text())


def assert_losses_match(losses: list[float], expected: list[float]) -> None:
    assert len(losses) == len(expected)
    for got, want in zip(losses, expected):
        assert abs(got - want) <= LOSS_RTOL * abs(want), (losses, expected)


def assert_checkpoint_matches(
    path: str, expected: dict[str, torch.Tensor], atol: float = 1e-5, model_class: type = SkewedNet
) -> None:
    """The consolidated checkpoint loads into the bare module (no strategy) and equals the reference."""
    state = torch.load(path, map_location="cpu", weights_only=False)["state_dict"]
    model = model_class()
    model.load_state_dict(state)  # strict: every name of the LightningModule, full shapes
    for key, value in expected.items():
        torch.testing.assert_close(state[key], value, rtol=1e-4, atol=atol, msg=key)


def assert_every_rank_holds(pattern: str, ranks: int, expected: dict[str, torch.Tensor]) -> None:
    """The user's module on every rank after a run: the whole model (no stage's empty tensors)."""
    for rank in range(ranks):
        state = torch.load(pattern.format(rank=rank))
        assert set(state) == set(expected), rank
        for key, value in expected.items():
            torch.testing.assert_close(state[key], value, rtol=1e-4, atol=1e-5, msg=f"rank {rank}: {key}")


def assert_every_rank_optimizer_holds(pattern: str, ranks: int, expected: dict) -> None:
    """The user's optimizer on every rank after a fit: the whole state, as one process leaves it (not only
    the state of the rank's own stage's parameters)."""
    for rank in range(ranks):
        state = torch.load(pattern.format(rank=rank))
        assert state["param_groups"] == expected["param_groups"], rank
        assert sorted(state["state"]) == sorted(expected["state"]), rank
        for index, entry in expected["state"].items():
            for key, value in entry.items():
                torch.testing.assert_close(
                    state["state"][index][key], value, rtol=1e-4, atol=1e-6, msg=f"rank {rank}: {index}.{key}"
                )


def test_four_stages_rebalance_and_migrate_live_matching_one_process(tmp_path: Path) -> None:
    result = run_scenario("rebalance_adam_1f1b", 4, tmp_path)
    expected_optimizer: dict = {}
    expected_losses, expected_state = reference(
        "adam", max_steps=8, precision="64-true", optimizer_state_out=expected_optimizer
    )
    assert_losses_match(result["losses"], expected_losses)
    assert_checkpoint_matches(result["checkpoint"], expected_state)
    assert_every_rank_holds(result["module_after_fit"], 4, expected_state)
    assert_every_rank_optimizer_holds(result["optimizer_after_fit"], 4, expected_optimizer)
    # every stage but the first split the backward of each step's last 3 micro-batches (8 steps x 3: the
    # drain), checked it against a plain backward after each split it ran on (the start and every move),
    # and never fell back
    split = sorted(result["split_by_rank"], key=lambda counts: counts["stage"])
    assert split[0]["input"] is None
    moves = len(result["history"])
    for counts in split[1:]:
        assert counts["input"] == counts["weight"] == 24, split
        assert 1 <= counts["checked"] <= 1 + moves and counts["fell_back"] == 0, split
    assert split[-1]["linear"] > 0  # the last stage's linear layers took the one-matmul weights' pass
    history = result["history"]
    assert history, "the lopsided start [1, 1, 1, 17] must be rebalanced"
    first = history[0]
    assert first["old"]["starts"] == [0, 1, 2, 3]
    assert first["imbalance_before"] > 1.0
    assert first["imbalance_after"] < first["imbalance_before"]  # predicted ...
    # ... and measured: the check after the first move timed the new split, and it is more even (on a
    # loaded host the first check may find the move not worth it yet, so look for the one that moved)
    checks = result["checks"]
    moved_at = next(i for i, check in enumerate(checks) if check["changed"])
    assert moved_at + 1 < len(checks), checks
    before, after = checks[moved_at], checks[moved_at + 1]
    assert before["step"] < after["step"]

    def imbalance(times: list[float]) -> float:
        return (max(times) - min(times)) / (sum(times) / len(times))

    assert imbalance(after["stage_times"]) < imbalance(before["stage_times"]), (before, after)
    moved = sum(r["bytes_sent"] for r in first["migration"])
    received = sum(r["bytes_received"] for r in first["migration"])
    assert moved > 0 and moved == received
    # every move is reported by both of its stages (the source and the target), and some layer moved
    listed = [move for r in first["migration"] for move in r["layers"]]
    assert listed and all(listed.count(move) == 2 for move in listed), listed
    # the StageRebalancer wrote its log and figure
    assert (tmp_path / "rebalancer" / "pipeline_rebalance.json").exists()
    assert (tmp_path / "rebalancer" / "pipeline_stage_times.png").exists()
    # the checkpoint records the partition the run ended with
    meta = torch.load(result["checkpoint"], map_location="cpu", weights_only=False)["hier_pipeline"]
    assert StagePartition.from_dict(meta["partition"]).to_dict() == result["partition"]
    assert_only_layers_held_elsewhere_refuse_calls(result)


def assert_later_stages_split(result: dict) -> None:
    """``split_backward=True``: every stage but the first split (input and weights' passes in pairs), none
    fell back; the first stage has no split."""
    split = sorted(result["split_by_rank"], key=lambda counts: counts["stage"])
    assert split[0]["input"] is None, split
    for counts in split[1:]:
        assert counts["input"] == counts["weight"] > 0 and counts["fell_back"] == 0, split


def assert_only_layers_held_elsewhere_refuse_calls(result: dict) -> None:
    """At every step, through the migrations, the modules that raise when called on a stage are exactly those
    whose own weights that stage released (empty here); after fit every rank holds the whole model and none
    does."""
    for rank, (mismatches, guarded_counts, hooked_after_fit) in enumerate(result["guard_by_rank"]):
        assert mismatches == [], (rank, mismatches[:2])
        assert min(guarded_counts) > 0, rank  # 4 stages: each holds a part only
        assert hooked_after_fit == [], rank


def test_shared_and_tied_modules_migrate_once_matching_one_process(tmp_path: Path) -> None:
    result = run_scenario("shared_modules_migrate", 4, tmp_path)
    expected_losses, expected_state = reference(
        "adam", max_steps=6, precision="64-true", model_class=TwiceNet
    )
    assert result["history"], "the lopsided start must be rebalanced (layers with shared state move)"
    assert_losses_match(result["losses"], expected_losses)
    assert_checkpoint_matches(result["checkpoint"], expected_state, model_class=TwiceNet)


def test_parameters_tied_across_stages_are_replicated_and_match_one_process(tmp_path: Path) -> None:
    """Layers sharing a parameter (a block applied twice, tied encoder/decoder weights) split over stages:
    each stage using it holds a replica, the replicas' gradients are summed before the step (and counted
    once in the clipping norm), and layers with replicas migrate; the run equals one process's."""
    result = run_scenario("tied_split_migrate", 4, tmp_path)
    assert_only_layers_held_elsewhere_refuse_calls(result)
    expected_losses, expected_state = reference(
        "adam", max_steps=8, precision="64-true", model_class=TwiceNet, gradient_clip_val=0.5
    )
    assert result["history"], "the lopsided start must be rebalanced (layers with replicas move)"
    assert any(len(stages) > 1 for _, stages in result["tied_seen"]), result["tied_seen"]
    assert_losses_match(result["losses"], expected_losses)
    assert_checkpoint_matches(result["checkpoint"], expected_state, model_class=TwiceNet)
    assert_later_stages_split(result)  # split_backward=True with the replicas' gradients summed after


def test_tied_replicas_start_from_rank_0s_values(tmp_path: Path) -> None:
    """A process that built the shared weight differently (no common seed) gets rank 0's values for its
    replica, as ddp broadcasts rank 0's module: without that the replicas would train apart."""
    result = run_scenario("tied_split_apart_at_start", 2, tmp_path)
    assert ["enc.weight", [0, 1]] in result["tied_seen"], result["tied_seen"]
    expected_losses, expected_state = reference(
        "adam", max_steps=4, precision="64-true", model_class=TwiceNet
    )
    assert_losses_match(result["losses"], expected_losses)
    assert_checkpoint_matches(result["checkpoint"], expected_state, model_class=TwiceNet)


def test_a_tied_embedding_language_model_over_three_stages_matches_one_process(tmp_path: Path) -> None:
    """GPT-2-style weight tying (the output layer is the token embedding) over 3 stages: replicas on the
    first and the last stage, layers migrating every 2 steps, AdamW with weight decay, clipping."""
    result = run_scenario("gpt_tied_3_stages", 3, tmp_path)
    assert result["tied_seen"] == [["tok.weight", [0, 2]]], result["tied_seen"]  # the blocks migrate
    assert result["history"], "layers must migrate during the run"
    # the replicas' stages sum over a group of their own: a flag and the gradient per optimizer step on
    # ranks 0 and 2 (the last and the first stage), nothing on the middle stage (rank 1)
    assert result["tied_all_reduces_by_rank"] == [12, 0, 12], result["tied_all_reduces_by_rank"]
    expected_losses, expected_state = reference(
        "adamw", max_steps=6, precision="64-true", model_class=TinyGPT, gradient_clip_val=1.0
    )
    assert_losses_match(result["losses"], expected_losses)
    assert_checkpoint_matches(result["checkpoint"], expected_state, model_class=TinyGPT)


def test_dropout_masks_do_not_depend_on_placement_or_migration(tmp_path: Path) -> None:
    four = run_scenario("dropout_migrate", 4, tmp_path)
    one = run_scenario("dropout_one_stage", 1, tmp_path)
    assert four["history"], "layers (dropout among them) must migrate during the run"
    assert_losses_match(four["losses"], one["losses"])
    state = torch.load(one["checkpoint"], map_location="cpu", weights_only=False)["state_dict"]
    assert_checkpoint_matches(four["checkpoint"], state, model_class=DropNet)


def test_gpipe_sgd_with_global_norm_clipping_and_accumulation(tmp_path: Path) -> None:
    result = run_scenario("gpipe_sgd_clip_accumulate", 2, tmp_path)
    # Lightning's backward hooks ran on every stage once per batch (4 steps x 2 accumulated), and
    # on_after_backward saw each stage's gradients; on_before_zero_grad once per optimizer step, as under
    # ddp (not twice)
    assert result["backward_hooks_by_rank"] == [[8, 8, 8, 4], [8, 8, 8, 4]]
    expected_losses, expected_state = reference(
        "sgd", max_steps=4, gradient_clip_val=0.05, accumulate_grad_batches=2
    )
    assert_losses_match(result["losses"], expected_losses)
    assert_checkpoint_matches(result["checkpoint"], expected_state)
    assert_later_stages_split(result)  # GPipe with split_backward=True: 8 batches x the last micro-batch
    assert [c["input"] for c in result["split_by_rank"] if c["stage"] == 1] == [8]


def test_a_model_with_an_example_input_and_the_model_summary_on_matches_one_process(tmp_path: Path) -> None:
    """``example_input_array`` set and Lightning's model summary on (it runs the example through the whole
    model on every rank at fit start): the fit runs as one process's, and every rank's module has its
    example input back afterwards (a regression would show as the summary's forward failing on both
    stages)."""
    result = run_scenario("example_input_summary", 2, tmp_path)
    expected_losses, expected_state = reference(
        "sgd", model_class=ExampleInputNet, max_steps=4, gradient_clip_val=0.05, accumulate_grad_batches=2
    )
    assert_losses_match(result["losses"], expected_losses)
    assert_checkpoint_matches(result["checkpoint"], expected_state, model_class=ExampleInputNet)
    assert result["example_input_after_fit_by_rank"] == [True, True]


def test_static_shapes_send_each_cut_spec_once_per_shape_and_match_one_process(tmp_path: Path) -> None:
    result = run_scenario("static_shapes_migrate", 2, tmp_path)
    expected_losses, expected_state = reference("adam", batch_size=48, max_epochs=2, precision="64-true")
    assert_losses_match(result["losses"], expected_losses)
    assert_checkpoint_matches(result["checkpoint"], expected_state)
    # 12 steps x 3 micro-batches cross the cut; with static_shapes a header goes only for a micro-batch
    # shape (16 rows; 6 and 5 rows in each epoch's last batch) not yet seen since the cut last moved
    history = result["history"]
    assert history, "the lopsided start [1, 19] must be rebalanced"
    last_stage_headers, first_stage_headers = result["headers_sent_by_rank"]
    assert last_stage_headers == 0
    assert 1 <= first_stage_headers <= 3 * (1 + len(history)) < 12 * 3, (first_stage_headers, history)


def test_extra_warmup_forwards_train_as_one_process(tmp_path: Path) -> None:
    """``extra_warmup=2``: stage 0 runs all 4 forwards before its first backward and stage 1 receives the
    surplus ahead; the losses and weights are those of one process (static shapes, a smaller last batch)."""
    result = run_scenario("extra_warmup_static", 2, tmp_path)
    expected_losses, expected_state = reference("adam", batch_size=48, max_epochs=2, precision="64-true")
    assert_losses_match(result["losses"], expected_losses)
    assert_checkpoint_matches(result["checkpoint"], expected_state)
    assert result["peak_in_flight_by_rank"] == [1, 4]  # rank 0 is the last stage


def test_resume_with_a_different_number_of_stages(tmp_path: Path) -> None:
    first = run_scenario("resume_first_2_stages", 2, tmp_path)
    assert first["history"], "rebalance=1 from [2, 18] must migrate before the checkpoint"
    second = run_scenario("resume_then_4_stages", 4, tmp_path)
    expected_losses, expected_state = reference(
        "adam", resume_after=3, tmp=tmp_path, max_steps=6, limit_train_batches=3
    )
    assert_losses_match(first["losses"] + second["losses"], expected_losses)
    assert_checkpoint_matches(second["checkpoint"], expected_state)


def test_validation_metrics_checkpoint_monitor_and_predict(tmp_path: Path) -> None:
    result = run_scenario("validate_predict_monitor", 2, tmp_path)
    # every stage process sees the last stage's val_loss (ModelCheckpoint monitors it everywhere)
    assert len(set(result["val_loss_by_rank"])) == 1
    # save_top_k=1: the best score is the lowest val_loss of the epochs (seen on every stage)
    assert abs(result["best_score"] - min(result["val_losses"])) < 1e-6, result["val_losses"]
    assert len(result["val_losses"]) == 2
    assert Path(result["best_path"]).exists()
    # partition="time": a forced check from measured times after profile_steps, then one per epoch
    assert [check["step"] for check in result["checks"]] == [2, 4, 8]
    pl.seed_everything(0, verbose=False)
    model = SkewedNet(optimizer="adam")
    trainer = _plain_trainer(_Losses(), max_epochs=2, limit_train_batches=4, limit_val_batches=2)
    trainer.fit(model, loader(), loader(batch_size=32, seed=1))
    assert abs(float(trainer.callback_metrics["val_loss"]) - result["val_loss_by_rank"][0]) < 1e-5
    expected_batches = trainer.predict(model, loader(batch_size=32, seed=2))
    expected = torch.cat(expected_batches)
    assert torch.equal(torch.tensor(result["predictions"]), expected)
    # one replica: the last stage (rank 0) returns and writes every prediction, the other stage none
    # (not a None per batch, which a writer's merge could not concatenate)
    assert result["predict_returned_by_rank"] == [len(expected_batches), 0]
    # the metrics copy the strategy installs for a run leaves trainer.callbacks as the user made it, during
    # the run as well as after it (no callback of its own first in the list meanwhile)
    assert result["callbacks_as_before_by_rank"] == [True, True]
    # a metric the module logs in its own on_train_epoch_end reaches the other stage before the monitoring
    # callbacks run (a copy taken before that hook would leave the other stage the previous epoch's value)
    last_epoch = result["losses"][-4:]  # limit_train_batches=4
    assert result["train_epoch_loss_by_rank"] == [pytest.approx(sum(last_epoch) / 4, rel=1e-6)] * 2
    assert result["callbacks_during_fit_as_before_by_rank"] == [True, True]
    files = [torch.load(result["prediction_files"].format(rank=r)) for r in range(2)]
    assert torch.equal(torch.cat(files[0]["predictions"]), expected)
    assert len(files[0]["batch_indices"][0]) == len(expected_batches)
    assert files[1]["predictions"] == [] and files[1]["batch_indices"] == [[]]
    # a batch-interval writer writes each prediction once too, on the last stage (not a None per batch on
    # the other stage)
    assert torch.equal(torch.cat(files[0]["batch_writes"]), expected) and files[1]["batch_writes"] == []
    # the best checkpoint, validated by a fresh Trainer with another initial split, and by Lightning alone
    best = SkewedNet()
    metrics = _plain_trainer(_Losses()).validate(
        best, loader(batch_size=32, seed=1), ckpt_path=result["best_path"]
    )
    # trainer.validate() returns the last stage's metrics on every rank (not an empty dict on rank 1)
    for returned in result["fresh_validate_val_loss_by_rank"]:
        assert abs(returned - metrics[0]["val_loss"]) < 1e-5, result["fresh_validate_val_loss_by_rank"]
    assert_every_rank_holds(result["module_after_predict"], 2, model.state_dict())


def test_all_gather_in_steps_and_hooks_returns_what_one_process_returns(tmp_path: Path) -> None:
    """A pipeline is one data-parallel replica: ``self.all_gather`` gives what Lightning gives one process
    (the tensor unchanged), in the steps only the last stage runs (a gather there would be one the other
    stages never join, a hang) and in hooks every stage runs."""
    result = run_scenario("all_gather", 2, tmp_path)
    pl.seed_everything(0, verbose=False)
    model = GatherNet(optimizer="adam")
    trainer = _plain_trainer(_Losses(), max_epochs=1, limit_train_batches=3, limit_val_batches=2)
    trainer.fit(model, loader(), loader(batch_size=32, seed=1))
    gathered = result["gathered"]  # the last stage's (rank 0)
    assert len(gathered["train"]) == 3 and len(gathered["val"]) == 2, gathered
    assert gathered["val"] == model.gathered["val"], (gathered, model.gathered)
    for got, want in zip(gathered["train"], model.gathered["train"]):
        assert abs(got - want) <= LOSS_RTOL * abs(want), (gathered, model.gathered)
    assert gathered["epoch_end"] == model.gathered["epoch_end"] == [[7.0]]


def test_top_k_checkpoints_follow_an_improving_loss_like_lightning_alone(tmp_path: Path) -> None:
    result = run_scenario("top_k_improving", 2, tmp_path)
    pl.seed_everything(0, verbose=False)
    checkpoint = ModelCheckpoint(
        dirpath=tmp_path / "ref", monitor="val_loss", save_top_k=2, filename="{epoch}"
    )
    trainer = _plain_trainer(
        _Losses(),
        max_epochs=5,
        limit_train_batches=4,
        limit_val_batches=2,
        enable_checkpointing=True,
        callbacks=[checkpoint],  # as the pipeline run: no default ModelCheckpoint beside it
    )
    with mock.patch("torch.save", wraps=torch.save) as reference_saves:
        trainer.fit(SkewedNet(optimizer="adam"), loader(), loader(batch_size=32, seed=1))
    expected = sorted(p.name for p in (tmp_path / "ref").iterdir())
    losses = result["val_losses"]
    assert min(losses[2:]) < max(losses[:2]), losses  # a later epoch beats a kept one: the files must move on
    assert result["top_k_files"] == expected
    assert result["top_k_files"] != ["epoch=0.ckpt", "epoch=1.ckpt"]
    # only rank 0 writes, as often as Lightning alone, and the other stage never calls torch.save: its
    # share of the consolidated state and the metrics it receives travel without it (tensors pickled with
    # torch.save would call it on every rank, and Lightning's
    # test_model_checkpoint_no_extraneous_invocations counts the calls)
    assert reference_saves.call_count > 0
    assert result["torch_save_calls_by_rank"] == [reference_saves.call_count, 0]


def test_memory_limit_picks_swap_and_recompute_and_stays_under_it(tmp_path: Path) -> None:
    result = run_scenario("memory_cap", 2, tmp_path)
    expected_losses, expected_state = reference("adam", max_steps=5, precision="64-true")
    assert_losses_match(result["losses"], expected_losses)
    assert_checkpoint_matches(result["checkpoint"], expected_state)
    limit = result["memory_limit"]
    assert all(peak <= limit for peak in result["measured_peak_by_rank"]), result
    policies = [p for plan in result["memory_plan_by_rank"] for _, p in plan["policies"]]
    assert any(p != "keep" for p in policies), "the limit is below keeping everything on some stage"
    # StageRebalancer recorded the plans (decided after profile_steps=2)
    logged = json.loads((tmp_path / "rebalancer" / "pipeline_rebalance.json").read_text())["memory_plans"]
    assert logged[0]["step"] == 2 and len(logged[0]["plans"]) == 2
    swapped = sum(plan["counts"]["swap"] + plan["counts"]["recompute"] for plan in logged[0]["plans"])
    assert swapped == sum(p != "keep" for p in policies)
    # a memory policy stashes activations its own way: with split_backward=True the later stage still ran
    # plain backward passes
    later = [counts for counts in result["split_by_rank"] if counts["stage"] > 0]
    assert later and all(counts["input"] == 0 for counts in later), result["split_by_rank"]


def test_recomputing_every_layer_matches_and_survives_migration(tmp_path: Path) -> None:
    result = run_scenario("recompute_everything", 2, tmp_path)
    expected_losses, expected_state = reference("sgd", max_steps=5)
    assert_losses_match(result["losses"], expected_losses)
    assert_checkpoint_matches(result["checkpoint"], expected_state)
    assert result["checks"], "rebalance=2 checks the split during the run"


def test_memory_limit_below_the_minimum_names_it(tmp_path: Path) -> None:
    with pytest.raises(AssertionError) as info:
        run_scenario("memory_limit_too_small", 2, tmp_path)
    assert "MemoryLimitError" in str(info.value)
    assert "memory_limit=1 bytes is below" in str(info.value)
    assert "raise memory_limit to at least" in str(info.value)


def test_crash_during_migration_leaves_a_resumable_checkpoint(tmp_path: Path) -> None:
    start = time.monotonic()
    with pytest.raises(AssertionError) as info:
        # torchrun stops the whole job 0.1 s after a worker exits by default: on a loaded host the
        # survivor could be killed before it raised the error this test reads; give it 5 s
        run_scenario("crash_during_migration", 2, tmp_path, launcher_args=("--monitor-interval=5",))
    assert time.monotonic() - start < 120, "a peer dying mid-migration must end the job, not hang it"
    assert "hier_pipeline: migrating layer" in str(info.value) and "resume from it" in str(info.value)
    last = tmp_path / "every" / "last.ckpt"
    checkpoint = torch.load(last, map_location="cpu", weights_only=False)
    assert checkpoint["global_step"] == 2  # saved after step 2; the crash is in step 3's migration
    partition = StagePartition.from_dict(checkpoint["hier_pipeline"]["partition"])
    assert partition.starts == (0, 1) and partition.num_clusters == 20
    result = run_scenario("crash_resume", 2, tmp_path)
    expected_losses, expected_state = reference("adam", max_steps=6, limit_train_batches=2)
    assert_losses_match(result["losses"], expected_losses[2:])
    assert_checkpoint_matches(result["checkpoint"], expected_state)


def test_every_stage_reads_the_same_shuffled_batches_despite_dropout(tmp_path: Path) -> None:
    """Dropout on stage 0 consumes its RNG differently; the loader order must not follow it."""
    result = run_scenario("shuffled_loader_with_dropout", 2, tmp_path)
    first, second = result["batches_by_rank"]
    assert len(first) == 9 and first == second
    assert first[:3] != first[3:6]  # still shuffled, differently each epoch


def test_a_model_with_fewer_layers_than_stages_runs_with_relay_stages(tmp_path: Path) -> None:
    """Lightning's BoringModel (one Linear) on more devices than layers trains as one process does; the
    stages without a layer pass the output on."""
    result = run_scenario("relay_stages", 3, tmp_path)
    expected_losses, expected_state = reference(
        "sgd", model_class=OneLayerNet, max_epochs=2, limit_train_batches=3
    )
    assert_losses_match(result["losses"], expected_losses)
    assert_checkpoint_matches(result["checkpoint"], expected_state, model_class=OneLayerNet)
    assert_every_rank_holds(result["module_after_fit"], 3, expected_state)
    # the last validation: the trained model's mean loss over the two validation batches
    model = OneLayerNet()
    model.load_state_dict(expected_state)
    with torch.no_grad():
        batches = list(loader(batch_size=32, seed=1))[:2]
        want = sum(float(torch.nn.functional.cross_entropy(model(x), y)) for x, y in batches) / 2
    assert len(result["val_losses"]) == 2
    assert abs(result["val_losses"][-1] - want) <= 1e-5 * abs(want)


def test_a_boring_model_whose_steps_call_its_layer_itself_matches_one_process(tmp_path: Path) -> None:
    """The same one-Linear model with ``training_step`` / ``validation_step`` calling ``self.only(x)``
    (what ``forward`` returns; many of Lightning's own tests write their BoringModel's steps so): on 3
    stages it trains and validates as one process, the stages without the layer included."""
    result = run_scenario("relay_stages_direct_calls", 3, tmp_path)
    expected_losses, expected_state = reference(
        "sgd", model_class=DirectOneLayerNet, max_epochs=2, limit_train_batches=3
    )
    assert_losses_match(result["losses"], expected_losses)
    assert_checkpoint_matches(result["checkpoint"], expected_state, model_class=DirectOneLayerNet)
    model = DirectOneLayerNet()
    model.load_state_dict(expected_state)
    with torch.no_grad():
        batches = list(loader(batch_size=32, seed=1))[:2]
        want = sum(float(torch.nn.functional.cross_entropy(model(x), y)) for x, y in batches) / 2
    assert abs(result["val_losses"][-1] - want) <= 1e-5 * abs(want)


def test_stages_must_match_processes_before_any_collective() -> None:
    code = (
        f"import lightning.pytorch as pl, sys; sys.path.insert(0, {str(SCRIPTS)!r})\n"
        "from pipeline_models import SkewedNet, loader\n"
        "from lightning_hier import HierPipelineStrategy\n"
        "pl.Trainer(accelerator='cpu', devices=2, strategy=HierPipelineStrategy(stages=3), max_steps=1,"
        " logger=False).fit(SkewedNet(), loader())\n"
    )
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert proc.returncode != 0
    assert "stages=3 but the Trainer launches 2" in proc.stderr


def test_skipped_micro_batches_and_an_overridden_backward_match_one_process(tmp_path: Path) -> None:
    """training_step returning None for a micro-batch adds no gradient (the schedule sends zeros back),
    and the last stage backpropagates through the user's ``backward`` (here doubling the loss under
    SGD); a regression would show as a TypeError on None or ``backward`` never called."""
    result = run_scenario("skipped_micro_batches_custom_backward", 2, tmp_path)
    expected_losses, expected_state = reference("sgd", model_class=SkippingNet, max_steps=5)
    assert_losses_match(result["losses"], expected_losses)
    assert_checkpoint_matches(result["checkpoint"], expected_state, model_class=SkippingNet)
    # the reference itself differs from a run that ignores the override (the test can fail)
    _, without_override = reference("sgd", model_class=_PlainBackward, max_steps=5)
    assert not torch.allclose(without_override["head.weight"], expected_state["head.weight"], atol=1e-4)


def test_a_further_input_of_forward_reaches_every_stage_that_reads_it(tmp_path: Path) -> None:
    """``forward(x, gain)`` with the gain read after every block: the blocks are still separate clusters
    (the gain does not block every cut, which would make the model one cluster), and three stages, each
    binding the gain from its own call of forward, rebalancing every 2 steps, train as one process does."""
    from lightning_hier.pipeline.graph import LayerGraph

    assert LayerGraph(GainNet()).num_clusters >= 10
    result = run_scenario("further_input_three_stages", 3, tmp_path)
    expected_losses, expected_state = reference("sgd", model_class=GainNet, max_steps=6, precision="64-true")
    assert_losses_match(result["losses"], expected_losses)
    assert_checkpoint_matches(result["checkpoint"], expected_state, model_class=GainNet)


def test_the_skip_flag_broadcast_apart_from_the_loss_trains_as_one_process(tmp_path: Path) -> None:
    """On a GPU the step's skip flag goes over the host backend and the loss over the device's, so no
    stage reads a device value at the step's end; forced here on CPU: the same losses and model as one
    process, skipped micro-batches included."""
    result = run_scenario("skipped_micro_batches_host_flag", 2, tmp_path)
    expected_losses, expected_state = reference("sgd", model_class=SkippingNet, max_steps=5)
    assert_losses_match(result["losses"], expected_losses)
    assert_checkpoint_matches(result["checkpoint"], expected_state, model_class=SkippingNet)


@pytest.mark.parametrize("scenario", ["stop_in_training_step", "stop_in_training_step_host_flag"])
def test_should_stop_set_in_the_last_stages_training_step_stops_every_stage(
    tmp_path: Path, scenario: str
) -> None:
    """The user's ``training_step`` runs on the last stage only; a ``trainer.should_stop`` it sets there
    reaches every stage with the step's loss, so all stop after the same step as one process does
    (a regression would show as the first stage training on and the fit hanging)."""
    result = run_scenario(scenario, 2, tmp_path)
    expected_losses, expected_state = reference("sgd", model_class=StoppingNet, max_epochs=3)
    assert len(expected_losses) == StoppingNet.stop_after_step + 1  # one per step, the epoch has 8
    assert_losses_match(result["losses"], expected_losses)
    assert_checkpoint_matches(result["checkpoint"], expected_state, model_class=StoppingNet)
    # on the host (gloo) the first stage (rank 1) posts the receive of each step's loss and flags once its
    # last message is out, before the last of its 2 backwards, so it lands during that backward; not where
    # the flag travels apart (the GPU's path); the last stage (rank 0) sends it
    steps, ahead = len(expected_losses), not scenario.endswith("host_flag")
    assert result["loss_receive_posted_by_rank"] == [[None] * steps, [1 if ahead else None] * steps]


def test_compiled_blocks_run_as_layers_and_migrate_matching_one_process(tmp_path: Path) -> None:
    """Blocks ``torch.compile``'d one by one are opaque layers (fx cannot trace into them; traced, they
    would raise a PipelineTraceError) that run compiled and migrate between stages; the result is one
    process's."""
    result = run_scenario("compiled_blocks_migrate", 2, tmp_path)
    assert result["history"], "the lopsided start must be rebalanced: compiled blocks migrate"
    expected_losses, expected_state = reference("sgd", model_class=CompiledBlocksNet, max_steps=6)
    assert_losses_match(result["losses"], expected_losses)
    assert_checkpoint_matches(result["checkpoint"], expected_state, model_class=CompiledBlocksNet)


def test_a_compiled_module_runs_uncompiled_and_matches_one_process(tmp_path: Path) -> None:
    """A ``torch.compile``'d LightningModule passed to fit: the compiled steps cannot trace through the
    stages' exchange (it would crash inside AOT autograd on the first stage), so it runs uncompiled, with
    a warning, and trains as one process does."""
    result = run_scenario("compiled_module", 2, tmp_path)
    expected_losses, expected_state = reference("sgd", max_steps=4)
    assert_losses_match(result["losses"], expected_losses)
    assert_checkpoint_matches(result["checkpoint"], expected_state)


def test_a_nanogpt_style_forward_traces_migrates_and_matches_one_process(tmp_path: Path) -> None:
    """nanoGPT's forward idioms, which plain fx cannot trace (a regression would show as
    ``PipelineTraceError`` at the assert, then at the mask buffer sliced by a traced length):
    ``b, t = idx.size()``, ``assert t <= block_size``, ``torch.arange(0, t, device=idx.device)``, a causal
    mask buffer cut to ``[:T, :T]``. Two stages from a
    lopsided start, blocks (with their mask buffers) migrating, AdamW: one process's losses and weights."""
    result = run_scenario("nano_gpt_migrate", 2, tmp_path)
    assert result["history"], "layers must migrate during the run"
    expected_losses, expected_state = reference(
        "adamw", max_steps=6, precision="64-true", model_class=NanoStyleGPT
    )
    assert_losses_match(result["losses"], expected_losses)
    assert_checkpoint_matches(result["checkpoint"], expected_state, model_class=NanoStyleGPT)


def test_a_buffer_counted_in_forward_and_a_schedule_sized_in_configure_optimizers_match_one_process(
    tmp_path: Path,
) -> None:
    """``self.samples_seen += n`` in forward is an in-place node of the graph, run by the stage that holds the
    buffer (the trace must not leave an fx Proxy in the module, or setup fails in ``model.to``), and a
    ``configure_optimizers`` that reads ``trainer.estimated_stepping_batches`` keeps the user's unshuffled
    loader (not Lightning's shuffling DistributedSampler, which the data would get if it loaded before the
    strategy's setup). Losses, weights, schedule and the count equal one process's."""
    result = run_scenario("counting_scheduled", 2, tmp_path)
    expected_losses, expected_state = reference("sgd", model_class=CountingScheduledNet, max_epochs=1)
    assert int(expected_state["samples_seen"]) == 256  # one epoch
    assert_losses_match(result["losses"], expected_losses)
    assert_checkpoint_matches(result["checkpoint"], expected_state, model_class=CountingScheduledNet)
    assert_every_rank_holds(result["module_after_fit"], 2, expected_state)


@pytest.mark.parametrize(
    ("scenario", "where"),
    [("rank_sharded_loader", "epoch 0"), ("rank_sharded_val_loader", "the validation run")],
)
def test_stages_reading_different_batches_are_refused_at_the_first_batch(
    tmp_path: Path, scenario: str, where: str
) -> None:
    """A loader sharded by rank gives each stage its own batches: the pipeline would pair one sample's
    inputs with another's labels and train on (or report validation metrics) silently. The stages compare
    the first batch of each epoch and of each validation loader (shapes, integer values) and every one
    raises, naming the cause and the fix."""
    start = time.monotonic()
    with pytest.raises(AssertionError) as info:
        run_scenario(scenario, 2, tmp_path)
    assert f"the stages read different batches ({where}'s first batch" in str(info.value)
    assert "distributed_sampler_kwargs" in str(info.value)
    assert time.monotonic() - start < 120


def test_inputs_that_differ_off_the_first_stage_are_not_refused_and_train_as_one_process(
    tmp_path: Path,
) -> None:
    """Random augmentation drawn per process makes the float inputs differ between stages while the labels
    agree; only stage 0 computes on inputs, so that is no error: the run trains as one process on stage 0's
    data (the clean set here)."""
    result = run_scenario("inputs_differ_off_stage_0", 2, tmp_path)
    expected_losses, expected_state = reference("sgd", max_epochs=2)
    assert_losses_match(result["losses"], expected_losses)
    assert_checkpoint_matches(result["checkpoint"], expected_state)


class _PlainBackward(SkippingNet):
    backward = pl.LightningModule.backward


def test_whole_steps_skipped_on_one_process_match_lightning(tmp_path: Path) -> None:
    """A step all of whose micro-batches return None is skipped on every stage (no optimizer step), as
    Lightning skips it on one device (a regression would show as a TypeError)."""
    result = run_scenario("skipped_steps_one_stage", 1, tmp_path)
    expected_losses, expected_state = reference(
        "sgd", model_class=SkippingNet, model_kwargs=dict(skip_every=3), max_steps=5
    )
    assert len(expected_losses) < 5 * 2, "the reference skipped no step"
    assert_losses_match(result["losses"], expected_losses)
    assert_checkpoint_matches(result["checkpoint"], expected_state, model_class=SkippingNet)


def test_a_step_pulling_from_dataloader_iter_runs_on_three_stages_like_one_process(tmp_path: Path) -> None:
    """``training_step(dataloader_iter)``: the batch is not visible to the strategy, so the step runs as
    one micro-batch, and every stage (the middle one too) pulls its batches; the extra key the step
    returns reaches ``on_train_batch_end`` on the last stage (a regression would show as "could not find
    a batch dimension", or as extra keys dropped)."""
    result = run_scenario("dataloader_iter_three_stages", 3, tmp_path)
    expected_losses, expected_state = reference("adam", max_steps=5)
    assert_losses_match(result["losses"], expected_losses)
    assert_checkpoint_matches(result["checkpoint"], expected_state)
    assert result["extra_keys"] == [["rows"]] * 5


def test_steps_calling_the_submodule_forward_hands_its_input_to_match_one_process(tmp_path: Path) -> None:
    """``forward`` only hands its input to ``self.model`` and the steps call ``self.model(x)`` themselves (a
    wrapped torchvision / timm / Hugging Face model): on 2 stages from a lopsided start, migrating, those
    calls run as ``self(...)`` and the fit equals one process's, its validation loss included (a
    regression would show as the stages failing on a layer the calling stage does not hold)."""
    result = run_scenario("delegating_wrapper", 2, tmp_path)
    expected_losses, expected_state = reference(
        "adam", model_class=WrapperNet, max_epochs=1, precision="64-true"
    )
    assert result["history"], "the lopsided start [1, 10] must be rebalanced"
    assert_losses_match(result["losses"], expected_losses)
    assert_checkpoint_matches(result["checkpoint"], expected_state, model_class=WrapperNet)
    model = WrapperNet().double()
    model.load_state_dict(expected_state)
    with torch.no_grad():
        batches = [(x.double(), y) for x, y in loader(batch_size=32, seed=1)]
        expected_val = sum(torch.nn.functional.cross_entropy(model(x), y).item() for x, y in batches)
    assert result["val_losses"] == pytest.approx([expected_val / len(batches)], rel=1e-6)


def test_lightnings_readme_autoencoder_trains_on_two_stages_as_one_process(tmp_path: Path) -> None:
    """Lightning's ``LitAutoEncoder``: ``forward`` returns ``self.encoder(x)``; ``training_step`` calls
    ``self.encoder`` and then ``self.decoder`` (state no layer of forward uses: the last stage's). On 2
    stages the encoder call runs as ``self(...)``; the fit equals one process's (a regression would show
    as a failure inside torch, ``mat2 must be a matrix``)."""
    result = run_scenario("lightning_autoencoder", 2, tmp_path)
    expected_losses, expected_state = reference(
        "adam", model_class=LitAutoEncoder, max_steps=8, precision="64-true"
    )
    assert_losses_match(result["losses"], expected_losses)
    assert_checkpoint_matches(result["checkpoint"], expected_state, model_class=LitAutoEncoder)


def test_a_sigterm_on_rank_0_ends_every_stage_at_the_step_ddp_ends_at(tmp_path: Path) -> None:
    # Lightning broadcasts rank 0's SIGTERM flag before each step; hier_pipeline's rank 0 does not wait
    # for the others to receive it, and the flag must still stop every rank where it stops them under ddp
    found = {}
    for kind in ("ddp", "hier_pipeline"):
        run_torchrun("pipeline_sigterm.py", 2, str(tmp_path / kind), kind)
        found[kind] = [json.loads((tmp_path / f"{kind}.{rank}").read_text()) for rank in range(2)]
    # each rank leaves the fit as under ddp: rank 0 with SIGTERMException, rank 1 as Lightning's own ddp
    # leaves it (its peer gone once rank 0 exits); both after the 3 steps before the flag was broadcast
    ended = {kind: [(r["raised"].split("(")[0], r["global_step"]) for r in rs] for kind, rs in found.items()}
    assert ended["hier_pipeline"] == ended["ddp"], ended
    assert ended["ddp"][0] == ("SIGTERMException", 3) and ended["ddp"][1][1] == 3, ended
    # the pipeline's loss reached both stages, the same as ddp's rank 0 computed on the same batches
    assert found["hier_pipeline"][0]["losses"] == found["hier_pipeline"][1]["losses"]
    assert len(found["hier_pipeline"][0]["losses"]) == 3

"""Run under torchrun: Lightning-level checks of ``HierSlicedStrategy`` against Lightning's own strategies.

``strategy_checks.py single OUT`` (1 process): hier_sliced vs the default single-device strategy
(SGD+momentum and Adam), and manual optimization.

``strategy_checks.py eval OUT`` (4 processes, 2 x 2): fit with validation inside, then
``trainer.validate``, ``trainer.test`` and ``trainer.predict`` on the same Trainer, under ``ddp``
and under ``hier_sliced``; and manual optimization against ``ddp``.

Rank 0 writes a JSON summary to OUT.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

import torch
import torch.distributed as dist

sys.path.insert(0, str(Path(__file__).parent))

import lightning.pytorch as pl  # noqa: E402
from lightning.pytorch.strategies import DDPStrategy  # noqa: E402
from models import EquivModel, loader  # noqa: E402
from torch import nn  # noqa: E402
from train_equivalence import max_rel_diff  # noqa: E402

from lightning_hier import HierSlicedStrategy  # noqa: E402

TRAINER = dict(
    accelerator="cpu",
    logger=False,
    enable_checkpointing=False,
    enable_progress_bar=False,
    enable_model_summary=False,
)


def state(model: torch.nn.Module) -> dict:
    return {k: v.detach().clone().float() for k, v in model.state_dict().items()}


class ManualModel(EquivModel):
    """Manual optimization as Lightning documents it: ``manual_backward``, ``clip_gradients``, a step
    (and the scheduler's) every ``accumulate`` batches, then ``zero_grad``; ``skip_every`` batches
    backward a loss and throw its gradients away with ``zero_grad`` (a skipped step). ``raw_backward``:
    ``loss.backward()`` instead of ``manual_backward`` (which DDP synchronises as well)."""

    def __init__(
        self,
        optimizer: str = "sgd",
        accumulate: int = 1,
        clip: float | None = None,
        raw_backward: bool = False,
    ) -> None:
        super().__init__(optimizer=optimizer, scheduler=True, quirks=True)
        self.automatic_optimization = False
        self.accumulate = accumulate
        self.clip = clip
        self.raw_backward = raw_backward
        self.steps_run = 0
        # per step: whether every trainable parameter's .grad is unset as it starts (zero_grad unsets it)
        self.grads_unset: list[bool] = []

    def _backward(self, loss: torch.Tensor) -> None:
        if self.raw_backward:
            loss.backward()
        else:
            self.manual_backward(loss)

    def training_step(self, batch, batch_idx):  # noqa: ANN001, ANN201
        self.steps_run += 1
        self.grads_unset.append(all(p.grad is None for p in self.parameters() if p.requires_grad))
        optimizer = self.optimizers()
        x, y = batch
        loss = nn.functional.cross_entropy(self(x), y)
        if batch_idx % 5 == 4:  # a batch whose gradient is dropped before any step
            self._backward(loss)
            optimizer.zero_grad()
            return loss
        self._backward(loss / self.accumulate)
        if (batch_idx + 1) % self.accumulate == 0:
            if self.clip is not None:
                self.clip_gradients(optimizer, gradient_clip_val=self.clip, gradient_clip_algorithm="norm")
            optimizer.step()
            optimizer.zero_grad()
            self.lr_schedulers().step()
        return loss


class GanModel(pl.LightningModule):
    """Lightning's GAN pattern: two optimizers stepped by hand, each backward fed by one of them
    (``toggle=True``, Lightning's ``toggle_optimizer``) or by both (``toggle=False``: the generator's
    loss also leaves gradients on the discriminator, which its next backward adds to, as under ddp)."""

    def __init__(self, toggle: bool = True, features: int = 16, noise: int = 4) -> None:
        super().__init__()
        self.automatic_optimization = False
        self.toggle = toggle
        self.noise = noise
        self.generator = nn.Sequential(nn.Linear(noise, 32), nn.ReLU(), nn.Linear(32, features))
        self.discriminator = nn.Sequential(nn.Linear(features, 32), nn.LeakyReLU(0.2), nn.Linear(32, 1))
        self.steps_run = 0

    def _toggled(self, optimizer, on: bool) -> None:  # noqa: ANN001
        if self.toggle:
            (self.toggle_optimizer if on else self.untoggle_optimizer)(optimizer)

    def training_step(self, batch, batch_idx):  # noqa: ANN001, ANN201
        self.steps_run += 1
        g_opt, d_opt = self.optimizers()
        real, _ = batch
        z = torch.tanh(real[:, : self.noise] * 1.5)  # the same "noise" under every strategy
        bce = nn.functional.binary_cross_entropy_with_logits
        ones, zeros = torch.ones(len(real), 1), torch.zeros(len(real), 1)
        self._toggled(g_opt, True)
        fake = self.generator(z)
        g_loss = bce(self.discriminator(fake), ones)
        self.manual_backward(g_loss)
        g_opt.step()
        g_opt.zero_grad()
        self._toggled(g_opt, False)
        self._toggled(d_opt, True)
        d_loss = bce(self.discriminator(real), ones) + bce(self.discriminator(fake.detach()), zeros)
        self.manual_backward(d_loss)
        self.clip_gradients(d_opt, gradient_clip_val=0.5, gradient_clip_algorithm="norm")
        d_opt.step()
        d_opt.zero_grad()
        self._toggled(d_opt, False)

    def configure_optimizers(self):  # noqa: ANN201
        g_opt = torch.optim.Adam(self.generator.parameters(), lr=2e-3, betas=(0.5, 0.999))
        d_opt = torch.optim.SGD(self.discriminator.parameters(), lr=0.05, momentum=0.9)
        return g_opt, d_opt


def gan_run(strategy, devices: int, toggle: bool, checkpoint: Path) -> dict:  # noqa: ANN001
    pl.seed_everything(5, verbose=False)
    model = GanModel(toggle=toggle)
    initial = state(model)
    trainer = pl.Trainer(
        devices=devices, strategy=strategy, max_epochs=2, use_distributed_sampler=devices > 1, **TRAINER
    )
    trainer.fit(model, train_dataloaders=loader())
    trainer.save_checkpoint(checkpoint)
    return {
        "steps_run": model.steps_run,
        "strategy": type(trainer.strategy).__name__,
        "moved": max_rel_diff(state(model), initial),
        "state": state(model),
        "checkpoint": checkpoint,
    }


def optimizer_states_rel_diff(reference: Path, hier: Path) -> float:
    """Largest relative difference between the two checkpoints' optimizer states (each optimizer's
    per-parameter tensors, in the unsharded optimizer's numbering)."""
    a = torch.load(reference, weights_only=False)["optimizer_states"]
    b = torch.load(hier, weights_only=False)["optimizer_states"]
    assert len(a) == len(b) == 2, (len(a), len(b))
    flat_a, flat_b = {}, {}
    for k, (sa, sb) in enumerate(zip(a, b)):
        assert sorted(sa["state"]) == sorted(sb["state"]), (k, sorted(sa["state"]), sorted(sb["state"]))
        for index in sa["state"]:
            for key, value in sa["state"][index].items():
                if torch.is_tensor(value) and value.dim() > 0:
                    flat_a[f"{k}.{index}.{key}"] = value.float()
                    flat_b[f"{k}.{index}.{key}"] = sb["state"][index][key].float()
    return max_rel_diff(flat_a, flat_b)


def compare_gan(reference: dict, hier: dict) -> dict:
    return {
        **compare_manual(reference, hier),
        "optimizer_state_rel_diff": optimizer_states_rel_diff(reference["checkpoint"], hier["checkpoint"]),
    }


MANUAL_VARIANTS = {
    "sgd": dict(optimizer="sgd"),
    "adam_accumulate_clip": dict(optimizer="adam", accumulate=2, clip=0.05),
    "raw_backward_accumulate": dict(optimizer="adam", accumulate=2, raw_backward=True),
}


class EvalModel(EquivModel):
    """EquivModel (with BatchNorm) plus validation / test / predict steps."""

    def validation_step(self, batch, batch_idx):  # noqa: ANN001, ANN201
        x, y = batch
        logits = self(x)
        self.log("val_loss", nn.functional.cross_entropy(logits, y), sync_dist=True)
        self.log("val_acc", (logits.argmax(-1) == y).float().mean(), sync_dist=True)

    def test_step(self, batch, batch_idx):  # noqa: ANN001, ANN201
        x, y = batch
        self.log("test_loss", nn.functional.cross_entropy(self(x), y), sync_dist=True)

    def predict_step(self, batch, batch_idx):  # noqa: ANN001, ANN201
        x, _ = batch
        return self(x)


class RecordValLoss(pl.Callback):
    def __init__(self) -> None:
        self.values: list[float] = []

    def on_validation_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        if not trainer.sanity_checking:
            self.values.append(float(trainer.callback_metrics["val_loss"]))


def manual_optimization(strategy, devices: int, variant: str, reference: bool = False) -> dict:  # noqa: ANN001
    """``reference``: train with ``manual_backward`` whatever the variant says."""
    pl.seed_everything(3, verbose=False)
    settings = dict(MANUAL_VARIANTS[variant])
    if reference:
        settings["raw_backward"] = False
    model = ManualModel(**settings)
    initial = state(model)
    # on one process a DDP-derived strategy would inject a shuffling DistributedSampler: keep the
    # loader's order there, so both runs see the same batches
    trainer = pl.Trainer(
        devices=devices, strategy=strategy, max_epochs=2, use_distributed_sampler=devices > 1, **TRAINER
    )
    trainer.fit(model, train_dataloaders=loader())
    return {
        "steps_run": model.steps_run,
        "grads_unset": model.grads_unset,
        "strategy": type(trainer.strategy).__name__,
        "moved": max_rel_diff(state(model), initial),
        "state": state(model),
    }


def compare_manual(reference: dict, hier: dict) -> dict:
    return {
        "strategies": [reference["strategy"], hier["strategy"]],
        "steps_run": [reference["steps_run"], hier["steps_run"]],
        "grads_unset": [reference.get("grads_unset"), hier.get("grads_unset")],
        "reference_moved": reference["moved"],
        "max_rel_diff": max_rel_diff(reference["state"], hier["state"]),
    }


def rel(a: float, b: float) -> float:
    return abs(a - b) / (abs(a) + 1e-12)


def single(out: Path) -> None:
    results: dict = {}
    for optimizer, hier in (("sgd", "hier_sliced"), ("adam", HierSlicedStrategy(bucket_cap_mb=0.002))):
        runs = {}
        for name, strategy in (("reference", "auto"), ("hier", hier)):
            pl.seed_everything(1234, verbose=False)
            model = EquivModel(optimizer=optimizer, batch_norm=True)
            initial = state(model)
            # a DDP-derived strategy injects a shuffling DistributedSampler even on one process; keep
            # the loader's own (sequential) order so both runs see the same batches
            trainer = pl.Trainer(
                devices=1, strategy=strategy, max_steps=6, use_distributed_sampler=False, **TRAINER
            )
            trainer.fit(model, train_dataloaders=loader())
            engine = getattr(trainer.strategy, "engine", None)
            buckets = 0 if engine is None else len(engine.buckets)
            runs[name] = (type(trainer.strategy).__name__, state(model), trainer.global_step, buckets)
        results[optimizer] = {
            "reference_strategy": runs["reference"][0],
            "hier_strategy": runs["hier"][0],
            "steps": [runs["reference"][2], runs["hier"][2]],
            "hier_buckets": runs["hier"][3],
            "max_rel_diff": max_rel_diff(runs["reference"][1], runs["hier"][1]),
            "reference_moved": max_rel_diff(runs["reference"][1], initial),
        }
    for variant in MANUAL_VARIANTS:
        results[f"manual_{variant}"] = compare_manual(
            manual_optimization("auto", 1, variant, reference=True),
            manual_optimization("hier_sliced", 1, variant),
        )
    results["gan_toggle"] = compare_gan(
        gan_run("auto", 1, True, out.parent / "gan_single.ckpt"),
        gan_run("hier_sliced", 1, True, out.parent / "gan_hier_single.ckpt"),
    )
    out.write_text(json.dumps(results, indent=2))


def attempt(fn, *args, **kwargs):  # noqa: ANN001, ANN002, ANN003, ANN201
    """``(result, None)``, or ``(None, "Type: message")`` when the Trainer entry point raised.

    A failure inside ``Trainer.setup`` happens identically on every rank before any collective,
    so the ranks stay in step and the remaining checks can still run.
    """
    try:
        return fn(*args, **kwargs), None
    except Exception as err:
        return None, f"{type(err).__name__}: {err}"


def eval_run(strategy, world: int, batch_norm: bool) -> dict:  # noqa: ANN001
    pl.seed_everything(1234, verbose=False)
    model = EvalModel(optimizer="sgd", batch_norm=batch_norm)
    initial = state(model)
    recorder = RecordValLoss()  # validation inside fit, at steps 3 and 6
    trainer = pl.Trainer(
        devices=world, strategy=strategy, max_steps=6, val_check_interval=3, callbacks=[recorder], **TRAINER
    )
    trainer.fit(model, train_dataloaders=loader(), val_dataloaders=loader(n=64, seed=1))
    result = {
        "strategy": type(trainer.strategy).__name__,
        "fit_val_loss": list(recorder.values),
        "state": state(model),
        "initial": initial,
    }
    validated, result["validate_error"] = attempt(
        trainer.validate, model, dataloaders=loader(n=64, seed=1), verbose=False
    )
    if validated is not None:
        result["val_loss"] = float(validated[0]["val_loss"])
        result["val_acc"] = float(validated[0]["val_acc"])
    tested, result["test_error"] = attempt(
        trainer.test, model, dataloaders=loader(n=64, seed=2), verbose=False
    )
    if tested is not None:
        result["test_loss"] = float(tested[0]["test_loss"])
    predicted, result["predict_error"] = attempt(trainer.predict, model, dataloaders=loader(n=64, seed=3))
    if predicted is not None:
        result["predictions"] = torch.cat(predicted).float()
    return result


def compare_predictions(ddp: dict, hier: dict) -> dict:
    """Each rank predicts its own share of the data: compare locally, then take the worst rank."""
    if "predictions" not in ddp or "predictions" not in hier:
        return {}
    if ddp["predictions"].shape != hier["predictions"].shape:
        diff = float("inf")
    else:
        diff = (ddp["predictions"] - hier["predictions"]).abs().max().item()
    stats = torch.tensor([diff, ddp["predictions"].abs().max().item()])
    count = torch.tensor([float(len(ddp["predictions"])), float(len(hier["predictions"]))])
    dist.all_reduce(stats, op=dist.ReduceOp.MAX)
    dist.all_reduce(count)
    return {
        "prediction_max_abs_diff": stats[0].item(),
        "prediction_scale": stats[1].item(),
        "num_predictions": count.tolist(),
    }


def compare(ddp: dict, hier: dict) -> dict:
    keys = [k for k in ("val_loss", "val_acc", "test_loss") if k in ddp and k in hier]
    return {
        "strategies": [ddp["strategy"], hier["strategy"]],
        "errors": {
            name: [ddp[f"{name}_error"], hier[f"{name}_error"]] for name in ("validate", "test", "predict")
        },
        "fit_val_loss": [ddp["fit_val_loss"], hier["fit_val_loss"]],
        "fit_val_loss_rel_diff": max(
            [rel(a, b) for a, b in zip(ddp["fit_val_loss"], hier["fit_val_loss"])]
            + [float(len(ddp["fit_val_loss"]) != len(hier["fit_val_loss"]))]
        ),
        "metrics": {key: [ddp[key], hier[key]] for key in keys},
        "metric_rel_diff": {key: rel(ddp[key], hier[key]) for key in keys},
        "param_max_rel_diff": max_rel_diff(ddp["state"], hier["state"]),
        "reference_moved": max_rel_diff(ddp["state"], ddp["initial"]),
        **compare_predictions(ddp, hier),
    }


def evaluate(out: Path) -> None:
    world = dist.get_world_size() if dist.is_initialized() else 4
    results: dict = {"world_size": world}
    for toggle in (True, False):
        name = "gan_toggle" if toggle else "gan_no_toggle"
        results[name] = compare_gan(
            gan_run(DDPStrategy(find_unused_parameters=True), world, toggle, out.parent / f"{name}_ddp.ckpt"),
            gan_run(
                HierSlicedStrategy(devices_per_node=2, bucket_cap_mb=0.002),
                world,
                toggle,
                out.parent / f"{name}_hier.ckpt",
            ),
        )
    for variant in MANUAL_VARIANTS:
        results[f"manual_{variant}"] = compare_manual(
            # the raw-backward variant's reference is ddp with manual_backward: Lightning prepares DDP's
            # reducer only there, and a raw backward of this model (frozen, tied and unused parameters)
            # under ddp trains something else (0.44 relative from it, measured)
            manual_optimization(DDPStrategy(find_unused_parameters=True), world, variant, reference=True),
            # ddp's own keyword, as a config written for ddp passes it: accepted, and the result is ddp's
            manual_optimization(
                HierSlicedStrategy(devices_per_node=2, bucket_cap_mb=0.002, find_unused_parameters=True),
                world,
                variant,
            ),
        )
    for name, batch_norm in (("plain", False), ("batch_norm", True)):
        ddp = eval_run(DDPStrategy(), world, batch_norm)
        hier = eval_run(HierSlicedStrategy(devices_per_node=2, bucket_cap_mb=0.002), world, batch_norm)
        results[name] = compare(ddp, hier)
    if dist.get_rank() == 0:
        out.write_text(json.dumps(results, indent=2))


def main() -> None:
    mode, out = sys.argv[1], Path(sys.argv[2])
    {"single": single, "eval": evaluate}[mode](out)


if __name__ == "__main__":
    main()

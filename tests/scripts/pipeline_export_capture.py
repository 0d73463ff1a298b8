"""Hugging Face models (random init, tiny configs, nothing downloaded) under hier_pipeline, captured with
torch.export because torch.fx cannot trace them.

    pipeline_export_capture.py SCENARIO OUT_JSON WORKDIR        (under torchrun)

Rank 0 (the last stage) writes JSON with the per-step losses, the partition, the rebalance history and the
path of the whole model's state after fit; ``tests/test_pipeline_export_capture.py`` compares them with
:func:`reference`: one process running the same micro-batches, each loss weighted by its share of the batch,
with one optimizer step per batch.
"""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path
from typing import Any

import lightning.pytorch as pl
import torch
import torch.nn.functional as F
from torch.utils.data import DataLoader, TensorDataset

VOCAB = 64
BATCH = 8


def _gpt2() -> torch.nn.Module:
    from transformers import GPT2Config, GPT2LMHeadModel

    config = GPT2Config(
        n_layer=4, n_embd=32, n_head=2, vocab_size=VOCAB, n_positions=32, bos_token_id=0, eos_token_id=0,
        resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0, use_cache=False,
    )  # fmt: skip
    return GPT2LMHeadModel(config)


def _llama() -> torch.nn.Module:
    from transformers import LlamaConfig, LlamaForCausalLM

    config = LlamaConfig(
        vocab_size=VOCAB, hidden_size=32, intermediate_size=64, num_hidden_layers=4, num_attention_heads=2,
        num_key_value_heads=2, max_position_embeddings=32, bos_token_id=0, eos_token_id=0, pad_token_id=0,
        use_cache=False,
    )  # fmt: skip
    return LlamaForCausalLM(config)


def _resnet() -> torch.nn.Module:
    from transformers import ResNetConfig, ResNetForImageClassification

    config = ResNetConfig(
        num_channels=3,
        embedding_size=8,
        hidden_sizes=[8, 16],
        depths=[1, 1],
        layer_type="basic",
        num_labels=5,
    )
    return ResNetForImageClassification(config)


class CausalLM(pl.LightningModule):
    """A Hugging Face causal language model trained on next-token prediction; ``forward`` returns logits."""

    def __init__(self, kind: str = "gpt2", lr: float = 1e-2) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.model = {"gpt2": _gpt2, "llama": _llama}[kind]()
        self.lr = lr

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        return self.model(input_ids=ids, use_cache=False).logits

    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        (ids,) = batch
        logits = self(ids[:, :-1])
        return F.cross_entropy(logits.reshape(-1, VOCAB), ids[:, 1:].reshape(-1))

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.AdamW(self.parameters(), lr=self.lr, weight_decay=0.01)


class ImageClassifier(pl.LightningModule):
    """A Hugging Face ResNet with BatchNorm (its running statistics change at every training forward)."""

    def __init__(self, lr: float = 1e-2) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.model = _resnet()
        self.lr = lr
        # the capture's example input (the language models take theirs from the first batch)
        self.example_input_array = torch.zeros(2, 3, 16, 16)

    def forward(self, pixels: torch.Tensor) -> torch.Tensor:
        return self.model(pixel_values=pixels).logits

    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        pixels, labels = batch
        return F.cross_entropy(self(pixels), labels)

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.Adam(self.parameters(), lr=self.lr)


def make_model(kind: str) -> pl.LightningModule:
    return ImageClassifier() if kind == "resnet" else CausalLM(kind)


def batches(kind: str, steps: int) -> list[tuple[torch.Tensor, ...]]:
    """The training batches, the same in every process (fixed generator)."""
    generator = torch.Generator().manual_seed(1)
    if kind == "resnet":
        pixels = torch.randn(steps * BATCH, 3, 16, 16, generator=generator)
        labels = torch.randint(0, 5, (steps * BATCH,), generator=generator)
        return [(pixels[i : i + BATCH], labels[i : i + BATCH]) for i in range(0, steps * BATCH, BATCH)]
    ids = torch.randint(0, VOCAB, (steps * BATCH, 17), generator=generator)
    return [(ids[i : i + BATCH],) for i in range(0, steps * BATCH, BATCH)]


def loader(kind: str, steps: int) -> DataLoader:
    data = batches(kind, steps)
    tensors = [torch.cat([batch[k] for batch in data]) for k in range(len(data[0]))]
    return DataLoader(TensorDataset(*tensors), batch_size=BATCH, shuffle=False)


def reference(kind: str, steps: int, micro_batches: int) -> tuple[list[float], dict[str, torch.Tensor]]:
    """One process, float64: each batch's micro-batches run forward and backward in turn, each loss
    weighted by its share of the batch, then one optimizer step (what the pipeline computes)."""
    model = make_model(kind).double()
    optimizer = model.configure_optimizers()
    losses = []
    for batch in batches(kind, steps):
        batch = tuple(t.double() if t.is_floating_point() else t for t in batch)
        optimizer.zero_grad()
        total = torch.zeros((), dtype=torch.float64)
        for part in zip(*(t.tensor_split(micro_batches) for t in batch)):
            loss = model.training_step(part, 0) * (len(part[0]) / BATCH)
            loss.backward()
            total += loss.detach()
        optimizer.step()
        losses.append(float(total))
    return losses, {k: v.detach().clone() for k, v in model.state_dict().items()}


SCENARIOS: dict[str, dict[str, Any]] = {
    # stage 1 begins at the third GPT-2 block: the cut carries the hidden state alone (the causal mask is
    # recomputed on each stage); the tied embedding and output weights are replicated on both stages
    "gpt2_split_points": dict(
        kind="gpt2",
        steps=3,
        strategy=dict(
            split_points=["model.transformer.h.2"], micro_batches=2, rebalance="never"
        ),  # fmt: skip
    ),
    # the split balancing parameter counts; rotary cos/sin and the mask are recomputed on each stage and the
    # frequencies buffer held by both
    "llama_parameters": dict(kind="llama", steps=3, strategy=dict(micro_batches=2, rebalance="never")),
    # BatchNorm's running statistics updated in place by the exported layers, on both stages
    "resnet_parameters": dict(kind="resnet", steps=3, strategy=dict(micro_batches=2, rebalance="never")),
    # a lopsided start (stage 0 holds the input layers only) rebalanced every 2 steps: GPT-2 blocks migrate
    "gpt2_rebalance": dict(kind="gpt2", steps=6, strategy=dict(partition=[3, 9], micro_batches=2)),
}


class LossRecorder(pl.Callback):
    def __init__(self) -> None:
        self.losses: list[float] = []

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx) -> None:  # noqa: ANN001
        if outputs:
            self.losses.append(float(outputs["loss"]))


def main() -> None:
    from lightning_hier import HierPipelineStrategy, Rebalance

    name, out, workdir = sys.argv[1], Path(sys.argv[2]), Path(sys.argv[3])
    spec = SCENARIOS[name]
    strategy_args = dict(spec["strategy"])
    if name == "gpt2_rebalance":  # a check every 2 steps that re-splits on any predicted gain
        strategy_args["rebalance"] = Rebalance(every=2, imbalance_threshold=0.01, min_gain=0.0)
    model = make_model(spec["kind"])
    recorder = LossRecorder()
    strategy = HierPipelineStrategy(**strategy_args)
    trainer = pl.Trainer(
        accelerator="cpu",
        devices=int(os.environ.get("WORLD_SIZE", "1")),
        strategy=strategy,
        precision="64-true",
        max_steps=spec["steps"],
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        callbacks=[recorder],
        default_root_dir=str(workdir),
    )
    trainer.fit(model, loader(spec["kind"], spec["steps"]))
    engine = strategy.engine
    assert engine is not None
    if trainer.global_rank != 0:
        return
    state = workdir / f"{name}.state.pt"
    torch.save(model.state_dict(), state)  # every rank holds the whole model after fit
    graph = engine.graph
    result = {
        "losses": recorder.losses,
        "state": str(state),
        "capture": graph.capture,
        "layers": [layer.name for layer in graph.layers],
        "cluster_starts": [graph.layers[c.start].name for c in graph.clusters],
        "partition": engine.partition.to_dict(),
        "history": [event.to_dict() for event in engine.history],
        "tied": [[t.name, list(t.stages)] for t in engine.tied],
        "replicable_buffers": sorted(graph.replicable_buffers),
    }
    out.write_text(json.dumps(result))


if __name__ == "__main__":
    main()

"""Popular models nobody here wrote (Hugging Face BERT, DistilBERT, T5, ViT; a torch LSTM language model),
tiny and randomly initialised, trained under Lightning ``ddp`` and the package's strategies.

    real_models.py MODEL OUT_JSON STRATEGY [STRATEGY ...]        (under torchrun, 2 processes)

Every run starts from the same weights and reads the same samples per step in float64 without dropout:
``ddp`` and the data-parallel strategies read rank-interleaved shards of each batch (an explicit
``DistributedSampler`` without shuffling), ``hier_pipeline`` (one 2-stage replica) reads the whole batch in
two micro-batches. Each strategy's parameters after fit must equal ``ddp``'s to rounding; rank 0 writes
``{"moved": ..., STRATEGY: {"max_diff": ..., "worst": name}}`` (``max_diff`` relative, per element) to
OUT_JSON.
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
from torch import nn
from torch.utils.data import DataLoader, Dataset, DistributedSampler

VOCAB = 100
SEQ = 10
BATCH = 8  # the whole batch; each ddp rank reads half of it
STEPS = 3


def _bert() -> nn.Module:
    from transformers import BertConfig, BertForMaskedLM

    config = BertConfig(
        vocab_size=VOCAB, hidden_size=32, num_hidden_layers=2, num_attention_heads=2, intermediate_size=64,
        max_position_embeddings=16, type_vocab_size=2, hidden_dropout_prob=0.0,
        attention_probs_dropout_prob=0.0,
    )  # fmt: skip
    return BertForMaskedLM(config)  # the decoder's weight is the word embedding's


def _distilbert() -> nn.Module:
    from transformers import DistilBertConfig, DistilBertForMaskedLM

    config = DistilBertConfig(
        vocab_size=VOCAB, dim=32, n_layers=2, n_heads=2, hidden_dim=64, max_position_embeddings=16,
        dropout=0.0, attention_dropout=0.0,
    )  # fmt: skip
    return DistilBertForMaskedLM(config)


def _t5() -> nn.Module:
    from transformers import T5Config, T5ForConditionalGeneration

    config = T5Config(
        vocab_size=VOCAB, d_model=32, d_kv=16, d_ff=64, num_layers=2, num_decoder_layers=2, num_heads=2,
        relative_attention_num_buckets=8, dropout_rate=0.0, decoder_start_token_id=0, pad_token_id=0,
        use_cache=False,
    )  # fmt: skip
    return T5ForConditionalGeneration(config)  # encoder, decoder and head share one embedding


def _vit() -> nn.Module:
    from transformers import ViTConfig, ViTForImageClassification

    config = ViTConfig(
        image_size=8, patch_size=4, num_channels=3, hidden_size=32, num_hidden_layers=2,
        num_attention_heads=2, intermediate_size=64, hidden_dropout_prob=0.0,
        attention_probs_dropout_prob=0.0, num_labels=5,
    )  # fmt: skip
    return ViTForImageClassification(config)


class LSTMLanguageModel(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.emb = nn.Embedding(VOCAB, 32)
        self.lstm = nn.LSTM(32, 32, num_layers=2, batch_first=True)
        self.head = nn.Linear(32, VOCAB)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        out, _ = self.lstm(self.emb(ids))
        return self.head(out)


class Samples(Dataset):
    """Dict samples: token ids with padding masks and token types, or images with labels."""

    def __init__(self, kind: str) -> None:
        generator = torch.Generator().manual_seed(1)
        n = STEPS * BATCH
        self.kind = kind
        self.pixels = torch.randn(n, 3, 8, 8, generator=generator)
        self.classes = torch.randint(0, 5, (n,), generator=generator)
        self.ids = torch.randint(1, VOCAB, (n, SEQ + 1), generator=generator)
        lengths = torch.randint(SEQ // 2, SEQ + 1, (n,), generator=generator)
        self.mask = (torch.arange(SEQ)[None] < lengths[:, None]).long()
        self.targets = torch.randint(1, VOCAB, (n, 6), generator=generator)

    def __len__(self) -> int:
        return STEPS * BATCH

    def __getitem__(self, i: int) -> dict[str, torch.Tensor]:
        if self.kind == "vit":
            return {"pixel_values": self.pixels[i], "labels": self.classes[i]}
        sample = {"input_ids": self.ids[i, :SEQ], "attention_mask": self.mask[i], "labels": self.ids[i, 1:]}
        if self.kind == "bert":
            sample["token_type_ids"] = (torch.arange(SEQ) >= SEQ // 2).long()
        elif self.kind == "t5":
            sample["decoder_input_ids"], sample["labels"] = self.targets[i, :-1], self.targets[i, 1:]
        elif self.kind == "lstm":
            del sample["attention_mask"]
        return sample


class Wrapped(pl.LightningModule):
    """``training_step`` takes a dict batch and calls ``self(...)`` with the model's named inputs."""

    build: Any = None
    inputs: tuple[str, ...] = ()

    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.model = type(self).build()

    def training_step(self, batch: dict[str, torch.Tensor], batch_idx: int) -> torch.Tensor:
        logits = self(**{name: batch[name] for name in self.inputs})
        return F.cross_entropy(logits.reshape(-1, logits.shape[-1]), batch["labels"].reshape(-1))

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.AdamW(self.parameters(), lr=1e-2, weight_decay=0.01)


class Bert(Wrapped):
    build, inputs = staticmethod(_bert), ("input_ids", "attention_mask", "token_type_ids")

    def forward(self, input_ids: torch.Tensor, attention_mask: torch.Tensor, token_type_ids: torch.Tensor):
        return self.model(
            input_ids=input_ids, attention_mask=attention_mask, token_type_ids=token_type_ids
        ).logits


class DistilBert(Wrapped):
    build, inputs = staticmethod(_distilbert), ("input_ids", "attention_mask")

    def forward(self, input_ids: torch.Tensor, attention_mask: torch.Tensor) -> torch.Tensor:
        return self.model(input_ids=input_ids, attention_mask=attention_mask).logits


class T5(Wrapped):
    build, inputs = staticmethod(_t5), ("input_ids", "attention_mask", "decoder_input_ids")

    def forward(
        self, input_ids: torch.Tensor, attention_mask: torch.Tensor, decoder_input_ids: torch.Tensor
    ) -> torch.Tensor:
        return self.model(
            input_ids=input_ids, attention_mask=attention_mask, decoder_input_ids=decoder_input_ids,
            use_cache=False,
        ).logits  # fmt: skip


class ViT(Wrapped):
    build, inputs = staticmethod(_vit), ("pixel_values",)

    def forward(self, pixel_values: torch.Tensor) -> torch.Tensor:
        return self.model(pixel_values=pixel_values).logits


class LSTM(Wrapped):
    build, inputs = LSTMLanguageModel, ("input_ids",)

    def forward(self, input_ids: torch.Tensor) -> torch.Tensor:
        return self.model(input_ids)


MODELS = {"bert": Bert, "distilbert": DistilBert, "t5": T5, "vit": ViT, "lstm": LSTM}


def make_strategy(name: str) -> Any:
    from lightning_hier import HierBSPStrategy, HierPipelineStrategy, HierSlicedStrategy

    return {
        "ddp": lambda: "ddp",
        "hier_sliced": HierSlicedStrategy,
        # one device per node: the inter-node path runs between the 2 processes
        "hier_sliced_inter_node": lambda: HierSlicedStrategy(devices_per_node=1),
        # lockstep: a superstep of one step and no staleness is ddp's step
        "hier_bsp": lambda: HierBSPStrategy(superstep=1, max_staleness=0),
        "hier_pipeline": lambda: HierPipelineStrategy(micro_batches=2, rebalance="never"),
    }[name]()


def fit(kind: str, strategy: str) -> dict[str, torch.Tensor]:
    world, rank = int(os.environ["WORLD_SIZE"]), int(os.environ["RANK"])
    data = Samples(kind)
    if strategy == "hier_pipeline":  # both stages read every batch
        loader = DataLoader(data, batch_size=BATCH, shuffle=False)
    else:
        sampler = DistributedSampler(data, num_replicas=world, rank=rank, shuffle=False)
        loader = DataLoader(data, batch_size=BATCH // world, sampler=sampler)
    model = MODELS[kind]()
    trainer = pl.Trainer(
        accelerator="cpu",
        devices=world,
        strategy=make_strategy(strategy),
        precision="64-true",
        max_steps=STEPS,
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
    )
    trainer.fit(model, loader)
    return {k: v.detach().clone() for k, v in model.state_dict().items()}  # every rank holds it all


def main() -> None:
    kind, out, strategies = sys.argv[1], Path(sys.argv[2]), sys.argv[3:]
    initial = {k: v.double() for k, v in MODELS[kind]().state_dict().items()}
    reference = fit(kind, "ddp")
    result: dict[str, Any] = {
        "moved": max((reference[k] - initial[k]).abs().max().item() for k in reference if k in initial)
    }
    for strategy in strategies:
        state = fit(kind, strategy)
        # relative per element, with a floor: an attention key's bias has a zero gradient in exact
        # arithmetic, so it moves by rounding noise alone
        diffs = {
            k: ((state[k] - ref).abs() / (ref.abs() + 1e-4)).max().item()
            for k, ref in reference.items()
            if ref.is_floating_point()
        }
        worst = max(diffs, key=diffs.get)
        result[strategy] = {"max_diff": diffs[worst], "worst": worst}
    if int(os.environ["RANK"]) == 0:
        out.write_text(json.dumps(result))


if __name__ == "__main__":
    main()

"""The GPT-2 of ``bench_pipeline.py --model gpt2``: the LightningModule hier_pipeline captures with
torch.export, the batches, and torch's hand-built stages on the split the engine ended with (random init,
nothing downloaded)."""

from __future__ import annotations

from typing import Any

import lightning.pytorch as pl
import torch
import torch.nn.functional as F
from torch import nn

# a small GPT-2: 4 blocks of width 256, 4 heads, 64 tokens, a 2,048-token vocabulary (tied input and output
# embeddings, as GPT-2's own); no dropout, so every contender computes the same numbers
N_LAYER, N_EMBD, N_HEAD, VOCAB, SEQ = 4, 256, 4, 2048, 64
ADAMW = {"lr": 1e-3, "weight_decay": 0.01}


def gpt2() -> nn.Module:
    """``GPT2LMHeadModel`` from a small config, seeded: the same weights in every job."""
    from transformers import GPT2Config, GPT2LMHeadModel

    config = GPT2Config(
        n_layer=N_LAYER, n_embd=N_EMBD, n_head=N_HEAD, vocab_size=VOCAB, n_positions=SEQ, bos_token_id=0,
        eos_token_id=0, resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0, use_cache=False,
        attn_implementation="sdpa",
    )  # fmt: skip
    torch.manual_seed(0)
    return GPT2LMHeadModel(config)


def next_token_loss(logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    return F.cross_entropy(logits.reshape(-1, VOCAB), targets.reshape(-1))


class GPT2LM(pl.LightningModule):
    """Next-token prediction; ``forward`` returns the logits (what hier_pipeline captures), AdamW."""

    def __init__(self) -> None:
        super().__init__()
        self.model = gpt2()

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        return self.model(input_ids=ids, use_cache=False).logits

    def training_step(self, batch: tuple[torch.Tensor, torch.Tensor], batch_idx: int) -> torch.Tensor:
        x, y = batch
        return next_token_loss(self(x), y)

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.AdamW(self.parameters(), **ADAMW)


def make_batches(batch_size: int) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """4 seeded ``(tokens, next tokens)`` batches (cycled), the same in every job."""
    g = torch.Generator().manual_seed(1234)
    batches = []
    for _ in range(4):
        ids = torch.randint(0, VOCAB, (batch_size, SEQ + 1), generator=g)
        batches.append((ids[:, :-1].contiguous(), ids[:, 1:].contiguous()))
    return batches


# ---------------------------------------------------------------------- torch's hand-built stages
# The pieces a hand-built stage runs, in order: the embeddings (token + position, dropout), each block, the
# final norm, the output layer. A cut between two pieces carries the hidden state (the causal mask is
# recomputed by every block: no mask is passed, so SDPA runs causal attention).
PIECES = ["embed", *(f"h.{i}" for i in range(N_LAYER)), "ln_f", "lm_head"]


def piece_of_module(owner: str | None) -> int:
    """The piece where a stage beginning at the layer of module ``owner`` begins (a ``ValueError`` where no
    hand-built stage can begin there: a cut inside the embeddings)."""
    name = (owner or "").removeprefix("model.").removeprefix("transformer.")
    if name in PIECES[1:]:
        return PIECES.index(name)
    if name in ("transformer", ""):  # the reshape after the final norm or the model's own output slicing
        return PIECES.index("lm_head")
    raise ValueError(f"no hand-built GPT-2 stage begins at {owner!r}")


def pieces_of_split(starts: list[int], owners: list[str | None]) -> list[int]:
    """The first piece of every stage, for the engine's split ``starts`` (first cluster of each stage) of the
    clusters whose first layers' modules are ``owners``. The layers between the final norm and the output
    layer (the reshape, the output slicing) compute no values of note: a cut there is the cut before it."""
    pieces = [0]
    for start in starts[1:]:
        owner = owners[start]
        if owner in ("model.transformer", "model") and start < owners.index("model.transformer.h.0"):
            raise ValueError(f"no hand-built GPT-2 stage begins inside the embeddings (cluster {start})")
        pieces.append(piece_of_module(owner))
    return pieces


class HandStage(nn.Module):
    """Pieces ``[first, end)`` of a ``GPT2LMHeadModel``, holding its own modules (the same parameters)."""

    def __init__(self, model: nn.Module, first: int, end: int) -> None:
        super().__init__()
        t = model.transformer
        self.first, self.end = first, end
        self.wte = t.wte if first == 0 else None
        self.wpe = t.wpe if first == 0 else None
        self.drop = t.drop if first == 0 else None
        self.blocks = nn.ModuleList(t.h[max(first, 1) - 1 : max(min(end, 1 + N_LAYER), 1) - 1])
        self.ln_f = t.ln_f if first <= PIECES.index("ln_f") < end else None
        self.lm_head = model.lm_head if end > PIECES.index("lm_head") else None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.first == 0:
            positions = torch.arange(x.shape[1], device=x.device).unsqueeze(0)
            x = self.drop(self.wte(x) + self.wpe(positions))
        for block in self.blocks:
            x = block(x)
        if self.ln_f is not None:
            x = self.ln_f(x)
        if self.lm_head is not None:
            x = self.lm_head(x)
        return x


def hand_stages(model: nn.Module, pieces: list[int]) -> list[HandStage]:
    """One :class:`HandStage` per stage, stage ``k`` from ``pieces[k]`` up to the next one's."""
    ends = [*pieces[1:], len(PIECES)]
    return [HandStage(model, a, b) for a, b in zip(pieces, ends)]


def tied_weight(model: nn.Module) -> torch.nn.Parameter | None:
    """The weight the input and output embeddings share (``None`` if the config unties them)."""
    weight = model.lm_head.weight
    return weight if weight is model.transformer.wte.weight else None


def check_pieces(batch: Any) -> float:
    """The largest difference between the hand-built stages in a row and the model's own logits."""
    model = gpt2()
    x, _ = batch
    out = x
    for stage in hand_stages(model, [0, 3, 6]):
        out = stage(out)
    return float((out - model(input_ids=x, use_cache=False).logits).abs().max())

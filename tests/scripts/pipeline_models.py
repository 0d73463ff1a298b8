"""Models and data for the hier_pipeline tests (plain LightningModules, as a user writes them)."""

from __future__ import annotations

import math

import lightning.pytorch as pl
import torch
from torch import nn
from torch.utils.data import DataLoader, TensorDataset


class Residual(nn.Module):
    """A fork/join block: two branches joined by an add (one cluster)."""

    def __init__(self, width: int) -> None:
        super().__init__()
        self.left = nn.Linear(width, width)
        self.right = nn.Linear(width, width)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.tanh(self.left(x)) + self.right(x)


class SkewedNet(pl.LightningModule):
    """Blocks of very different widths; ``heavy`` blocks are wide (slow), the rest narrow."""

    def __init__(
        self,
        in_features: int = 16,
        classes: int = 4,
        widths: tuple[int, ...] = (32, 32, 256, 256, 32, 32, 32, 32),
        optimizer: str = "adam",
        lr: float = 0.01,
        dropout: float = 0.0,
    ) -> None:
        super().__init__()
        self.optimizer_name = optimizer
        self.lr = lr
        self.stem = nn.Linear(in_features, widths[0])
        self.drop = nn.Dropout(dropout)
        self.blocks = nn.ModuleList()
        prev = widths[0]
        for width in widths:
            self.blocks.append(nn.Sequential(nn.Linear(prev, width), nn.Tanh()))
            prev = width
        self.res = Residual(prev)
        self.head = nn.Linear(prev, classes)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = self.drop(self.stem(x))
        for block in self.blocks:
            x = block(x)
        return self.head(self.res(x))

    def training_step(self, batch, batch_idx):  # noqa: ANN001
        x, y = batch
        loss = nn.functional.cross_entropy(self(x), y)
        self.log("train_loss", loss)
        return loss

    def validation_step(self, batch, batch_idx):  # noqa: ANN001
        x, y = batch
        logits = self(x)
        self.log("val_loss", nn.functional.cross_entropy(logits, y))
        self.log("val_acc", (logits.argmax(-1) == y).float().mean())

    def predict_step(self, batch, batch_idx):  # noqa: ANN001
        return self(batch[0]).argmax(-1)

    def configure_optimizers(self):  # noqa: ANN201
        if self.optimizer_name == "sgd":
            return torch.optim.SGD(self.parameters(), lr=self.lr, momentum=0.9)
        return torch.optim.Adam(self.parameters(), lr=self.lr)


class TwiceNet(SkewedNet):
    """Shared state inside clusters: every block applies its one ``Linear`` twice, and two layers
    share a weight (tied), so a migration carries the same tensors for several layers."""

    def __init__(self, optimizer: str = "adam", lr: float = 0.01) -> None:
        super().__init__(widths=(32,) * 6, optimizer=optimizer, lr=lr)
        self.enc = nn.Linear(32, 32, bias=False)
        self.dec = nn.Linear(32, 32, bias=False)
        self.dec.weight = self.enc.weight

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = self.stem(x)
        for block in self.blocks:
            x = block(block(x))
        x = torch.tanh(self.dec(torch.tanh(self.enc(x))))
        return self.head(self.res(x))


class DropNet(SkewedNet):
    """Dropout after the stem and after every block: random layers on every stage, some of which migrate."""

    def __init__(self, optimizer: str = "adam", lr: float = 0.01, p: float = 0.2) -> None:
        super().__init__(optimizer=optimizer, lr=lr, dropout=p)
        for block in self.blocks:
            block.append(nn.Dropout(p))


class GatherNet(SkewedNet):
    """Calls ``self.all_gather`` where users do: on the loss in ``training_step``, on the predictions in
    ``validation_step`` (steps a pipeline runs on its last stage only), and in an epoch-end hook (every
    process). Records what came back."""

    def __init__(self, optimizer: str = "adam") -> None:
        super().__init__(optimizer=optimizer)
        self.gathered: dict[str, list] = {"train": [], "val": [], "epoch_end": []}

    def training_step(self, batch, batch_idx):  # noqa: ANN001
        loss = super().training_step(batch, batch_idx)
        self.gathered["train"].append(self.all_gather(loss.detach()).tolist())
        return loss

    def validation_step(self, batch, batch_idx):  # noqa: ANN001
        super().validation_step(batch, batch_idx)
        self.gathered["val"].append(self.all_gather(self(batch[0]).argmax(-1)).tolist())

    def on_validation_epoch_end(self) -> None:
        self.gathered["epoch_end"].append(self.all_gather(torch.tensor([7.0])).tolist())


class OneLayerNet(SkewedNet):
    """One ``Linear``, as Lightning's ``BoringModel``: a single cluster, fewer than the stages. Beside it,
    state no traced layer holds: a module ``forward`` never calls whose weight is tied to the layer's (as
    in Lightning's test_memory_sharing_disabled), and a temperature the training step learns."""

    def __init__(self, optimizer: str = "adam", lr: float = 0.01) -> None:
        super().__init__(optimizer=optimizer, lr=lr)
        del self.stem, self.drop, self.blocks, self.res, self.head
        self.only = nn.Linear(16, 4)
        self.unused_tied = nn.Linear(16, 4)
        self.unused_tied.weight = self.only.weight
        self.temperature = nn.Parameter(torch.tensor(1.5))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.only(x)

    def training_step(self, batch, batch_idx):  # noqa: ANN001
        x, y = batch
        loss = nn.functional.cross_entropy(self(x) / self.temperature, y)
        self.log("train_loss", loss)
        return loss


class DirectOneLayerNet(OneLayerNet):
    """Lightning's BoringModel as many of its tests subclass it: ``forward`` returns ``self.only(x)`` and the
    steps call ``self.only`` themselves."""

    def training_step(self, batch, batch_idx):  # noqa: ANN001
        x, y = batch
        loss = nn.functional.cross_entropy(self.only(x) / self.temperature, y)
        self.log("train_loss", loss)
        return loss

    def validation_step(self, batch, batch_idx):  # noqa: ANN001
        x, y = batch
        self.log("val_loss", nn.functional.cross_entropy(self.only(x), y))


class ExampleInputNet(SkewedNet):
    """Sets ``example_input_array``, as Lightning's docs suggest for the model summary's In/Out sizes."""

    def __init__(self, **kwargs) -> None:  # noqa: ANN003
        super().__init__(**kwargs)
        self.example_input_array = torch.zeros(2, 16)


class SkippingNet(SkewedNet):
    """Uses Lightning's "return None to skip" and overrides ``backward``, both as a user writes them.

    Batches carry a third tensor, ``skip``, per row (:func:`flagged_loader`): rows flagged ``True``
    add nothing to the loss, and a step whose rows are all flagged returns ``None`` (after calling
    ``self(x)``, as a pipeline of several stages needs). With ``skip_every`` every batch ``i`` with
    ``i % skip_every == 1`` returns ``None`` before running the model (one process only: Lightning refuses
    skipped steps on several). ``backward`` doubles the loss, so a strategy that bypasses it trains
    differently under SGD.
    """

    def __init__(self, optimizer: str = "sgd", lr: float = 0.01, skip_every: int = 0) -> None:
        super().__init__(optimizer=optimizer, lr=lr)
        self.skip_every = skip_every

    def training_step(self, batch, batch_idx):  # noqa: ANN001
        x, y, skip = batch
        if self.skip_every and batch_idx % self.skip_every == 1:
            return None
        logits = self(x)
        keep = ~skip
        if not keep.any():
            return None
        loss = nn.functional.cross_entropy(logits[keep], y[keep]) * keep.float().mean()
        self.log("train_loss", loss)
        return loss

    def backward(self, loss, *args, **kwargs):  # noqa: ANN001, ANN002, ANN003
        (2.0 * loss).backward(*args, **kwargs)


class StoppingNet(SkewedNet):
    """Stops the fit from its own ``training_step`` after its loss is computed (as a user's "stop once the
    loss is low enough" does): under hier_pipeline only the last stage gets that far in the step."""

    stop_after_step = 3

    def training_step(self, batch, batch_idx):  # noqa: ANN001
        loss = super().training_step(batch, batch_idx)
        if self.global_step >= self.stop_after_step:
            self.trainer.should_stop = True
        return loss


class CompiledBlocksNet(SkewedNet):
    """Each block ``torch.compile``'d on its own (dynamo's ``eager`` backend: the same arithmetic as
    uncompiled, so one process without compilation is the reference, and no compile time)."""

    def __init__(self, optimizer: str = "sgd", lr: float = 0.01) -> None:
        super().__init__(optimizer=optimizer, lr=lr)
        for i, block in enumerate(self.blocks):
            self.blocks[i] = torch.compile(block, backend="eager")


class CountingScheduledNet(SkewedNet):
    """As users write them: ``forward`` counts the samples it trains on in a buffer (in place, as
    ``self.count += n`` does), and ``configure_optimizers`` sizes a OneCycleLR with
    ``trainer.estimated_stepping_batches``, which makes Lightning load the train data right there."""

    def __init__(self, optimizer: str = "sgd", lr: float = 0.01) -> None:
        super().__init__(optimizer=optimizer, lr=lr)
        self.register_buffer("samples_seen", torch.zeros((), dtype=torch.long))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        self.samples_seen += x.shape[0]
        return super().forward(x)

    def configure_optimizers(self):  # noqa: ANN201
        optimizer = torch.optim.SGD(self.parameters(), lr=self.lr, momentum=0.9)
        total = int(self.trainer.estimated_stepping_batches)
        schedule = torch.optim.lr_scheduler.OneCycleLR(optimizer, max_lr=0.05, total_steps=total)
        return [optimizer], [{"scheduler": schedule, "interval": "step"}]


class IterNet(SkewedNet):
    """Pulls each batch from Lightning's ``dataloader_iter`` and returns an extra key beside the loss."""

    def training_step(self, dataloader_iter):  # noqa: ANN001
        (x, y), _, _ = next(dataloader_iter)
        loss = nn.functional.cross_entropy(self(x), y)
        self.log("train_loss", loss, batch_size=x.shape[0])  # Lightning cannot infer it from an iterator
        return {"loss": loss, "rows": x.shape[0]}


class EpochLoggingNet(SkewedNet):
    """Logs its epoch's mean training loss in its own ``on_train_epoch_end`` (where the loss is computed:
    the last stage), the hook Lightning runs before the monitoring callbacks."""

    def __init__(self, **kwargs) -> None:  # noqa: ANN003
        super().__init__(**kwargs)
        self.epoch_losses: list[torch.Tensor] = []

    def training_step(self, batch, batch_idx):  # noqa: ANN001
        loss = super().training_step(batch, batch_idx)
        self.epoch_losses.append(loss.detach())
        return loss

    def on_train_epoch_end(self) -> None:
        if self.epoch_losses:
            self.log("train_epoch_loss", torch.stack(self.epoch_losses).mean())
        self.epoch_losses.clear()


class GainNet(SkewedNet):
    """``forward(x, gain)``: a per-row gain (a further input, as a padding mask is) scales the activation
    after every block, so every stage's layers read it. Batches are ``(x, y, gain)`` (:func:`gain_loader`)."""

    def forward(self, x: torch.Tensor, gain: torch.Tensor) -> torch.Tensor:
        x = self.stem(x)
        for block in self.blocks:
            x = block(x) * gain
        return self.head(self.res(x))

    def training_step(self, batch, batch_idx):  # noqa: ANN001
        x, y, gain = batch
        loss = nn.functional.cross_entropy(self(x, gain), y)
        self.log("train_loss", loss)
        return loss


class CausalBlock(nn.Module):
    """Pre-norm causal self-attention and MLP, each added to the residual stream."""

    def __init__(self, width: int, heads: int) -> None:
        super().__init__()
        self.heads = heads
        self.ln1, self.ln2 = nn.LayerNorm(width), nn.LayerNorm(width)
        self.qkv, self.proj = nn.Linear(width, 3 * width), nn.Linear(width, width)
        self.fc1, self.fc2 = nn.Linear(width, 4 * width), nn.Linear(4 * width, width)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, t, c = x.shape
        q, k, v = self.qkv(self.ln1(x)).split(c, dim=-1)
        q, k, v = (z.view(b, t, self.heads, c // self.heads).transpose(1, 2) for z in (q, k, v))
        y = nn.functional.scaled_dot_product_attention(q, k, v, is_causal=True)
        x = x + self.proj(y.transpose(1, 2).reshape(b, t, c))
        return x + self.fc2(nn.functional.gelu(self.fc1(self.ln2(x))))


class TinyGPT(pl.LightningModule):
    """A causal language model as users write one: token and learned position embeddings, pre-norm
    attention blocks, and the output layer tied to the token embedding (GPT-2's weight tying)."""

    def __init__(self, optimizer: str = "adamw", lr: float = 3e-3, vocab: int = 37, width: int = 32) -> None:
        super().__init__()
        self.optimizer_name, self.lr, self.vocab = optimizer, lr, vocab
        self.tok = nn.Embedding(vocab, width)
        self.pos = nn.Parameter(0.02 * torch.randn(TOKENS_PER_SEQUENCE, width))
        self.blocks = nn.ModuleList(CausalBlock(width, heads=4) for _ in range(3))
        self.norm = nn.LayerNorm(width)
        self.lm_head = nn.Linear(width, vocab, bias=False)
        self.lm_head.weight = self.tok.weight

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        x = self.tok(tokens) + self.pos[: tokens.shape[1]]
        for block in self.blocks:
            x = block(x)
        return self.lm_head(self.norm(x))

    def training_step(self, batch, batch_idx):  # noqa: ANN001
        tokens, targets = batch
        loss = nn.functional.cross_entropy(self(tokens).reshape(-1, self.vocab), targets.reshape(-1))
        self.log("train_loss", loss)
        return loss

    def configure_optimizers(self):  # noqa: ANN201
        return torch.optim.AdamW(self.parameters(), lr=self.lr, weight_decay=0.1)


class MaskedAverage(nn.Module):
    """An assert on a traced length and a buffer cut by it, as nanoGPT's forward has both."""

    def __init__(self, block: int = 6) -> None:
        super().__init__()
        self.block = block
        self.lin = nn.Linear(4, 4)
        self.register_buffer("mask", torch.tril(torch.ones(block, block)))
        self.out = nn.Linear(4, 2)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, t, c = x.size()
        assert t <= self.block, "sequence too long"
        h = self.lin(x)
        h = (self.mask[:t, :t] / t) @ h  # a causal average over the positions so far
        return self.out(h)


class NanoStyleAttention(nn.Module):
    """Causal attention as nanoGPT writes it: a lower-triangular mask buffer cut to the sequence length read
    from ``x.size()``, and the scale by ``math.sqrt`` of a traced size."""

    def __init__(self, width: int, heads: int, block_size: int) -> None:
        super().__init__()
        self.heads, self.width = heads, width
        self.qkv, self.proj = nn.Linear(width, 3 * width), nn.Linear(width, width)
        mask = torch.tril(torch.ones(block_size, block_size)).view(1, 1, block_size, block_size)
        self.register_buffer("bias", mask)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        B, T, C = x.size()  # noqa: N806 - nanoGPT's names
        q, k, v = self.qkv(x).split(self.width, dim=2)
        q, k, v = (z.view(B, T, self.heads, C // self.heads).transpose(1, 2) for z in (q, k, v))
        att = (q @ k.transpose(-2, -1)) * (1.0 / math.sqrt(k.size(-1)))
        att = att.masked_fill(self.bias[:, :, :T, :T] == 0, float("-inf"))
        y = nn.functional.softmax(att, dim=-1) @ v
        return self.proj(y.transpose(1, 2).contiguous().view(B, T, C))


class NanoStyleBlock(nn.Module):
    def __init__(self, width: int, heads: int, block_size: int) -> None:
        super().__init__()
        self.ln1, self.ln2 = nn.LayerNorm(width), nn.LayerNorm(width)
        self.attn = NanoStyleAttention(width, heads, block_size)
        self.mlp = nn.Sequential(nn.Linear(width, 4 * width), nn.GELU(), nn.Linear(4 * width, width))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x + self.attn(self.ln1(x))
        return x + self.mlp(self.ln2(x))


class NanoStyleGPT(TinyGPT):
    """nanoGPT's forward idioms, which fx could not trace: ``b, t = idx.size()``, an ``assert`` on ``t``,
    positions from ``torch.arange(0, t, device=idx.device)`` and a causal mask buffer indexed by ``t``."""

    block_size = 16

    def __init__(self, optimizer: str = "adamw", lr: float = 3e-3, vocab: int = 37, width: int = 32) -> None:
        super().__init__(optimizer=optimizer, lr=lr, vocab=vocab, width=width)
        del self.pos
        self.wpe = nn.Embedding(self.block_size, width)
        self.blocks = nn.ModuleList(NanoStyleBlock(width, 4, self.block_size) for _ in range(3))

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        device = tokens.device
        b, t = tokens.size()
        assert t <= self.block_size, f"Cannot forward sequence of length {t}, block size {self.block_size}"
        pos = torch.arange(0, t, dtype=torch.long, device=device)
        x = self.tok(tokens) + self.wpe(pos)
        for block in self.blocks:
            x = block(x)
        return self.lm_head(self.norm(x))


TOKENS_PER_SEQUENCE = 12


class WrapperNet(pl.LightningModule):
    """A model built elsewhere, wrapped: ``forward`` hands its input to ``self.model``, and the steps call
    ``self.model`` themselves (as many users of torchvision, timm or Hugging Face models write them)."""

    def __init__(self, optimizer: str = "adam", lr: float = 0.01) -> None:
        super().__init__()
        self.optimizer_name, self.lr = optimizer, lr
        widths = (16, 32, 256, 256, 32, 32)
        layers: list[nn.Module] = []
        for inp, out in zip(widths, widths[1:]):
            layers += [nn.Linear(inp, out), nn.Tanh()]
        self.model = nn.Sequential(*layers, nn.Linear(widths[-1], 4))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.model(x)

    def training_step(self, batch, batch_idx):  # noqa: ANN001
        x, y = batch
        loss = nn.functional.cross_entropy(self.model(x), y)
        self.log("train_loss", loss)
        return loss

    def validation_step(self, batch, batch_idx):  # noqa: ANN001
        x, y = batch
        self.log("val_loss", nn.functional.cross_entropy(self.model(x), y))

    def configure_optimizers(self):  # noqa: ANN201
        return torch.optim.Adam(self.parameters(), lr=self.lr)


class LitAutoEncoder(pl.LightningModule):
    """Lightning's README model: ``forward`` returns the embedding (for inference), and ``training_step``
    runs the encoder and the decoder itself."""

    def __init__(self, optimizer: str = "adam", lr: float = 0.01) -> None:
        super().__init__()
        self.optimizer_name, self.lr = optimizer, lr
        self.encoder = nn.Sequential(
            nn.Linear(16, 32), nn.ReLU(), nn.Linear(32, 32), nn.ReLU(), nn.Linear(32, 3)
        )
        self.decoder = nn.Sequential(nn.Linear(3, 32), nn.ReLU(), nn.Linear(32, 16))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        # in lightning, forward defines the prediction/inference actions
        embedding = self.encoder(x)
        return embedding

    def training_step(self, batch, batch_idx):  # noqa: ANN001
        x, _ = batch
        x = x.view(x.size(0), -1)
        z = self.encoder(x)
        x_hat = self.decoder(z)
        loss = nn.functional.mse_loss(x_hat, x)
        self.log("train_loss", loss)
        return loss

    def configure_optimizers(self):  # noqa: ANN201
        return torch.optim.Adam(self.parameters(), lr=self.lr)


def token_loader(batch_size: int = 32, n: int = 256, vocab: int = 37) -> DataLoader:
    """Sequences following ``next = (3 * token + 1) mod vocab`` from random starts: inputs and the
    next-token targets."""
    start = torch.randint(0, vocab, (n, 1), generator=torch.Generator().manual_seed(0))
    steps = [start]
    for _ in range(TOKENS_PER_SEQUENCE):
        steps.append((3 * steps[-1] + 1) % vocab)
    sequences = torch.cat(steps, dim=1)
    return DataLoader(TensorDataset(sequences[:, :-1], sequences[:, 1:]), batch_size=batch_size)


MODELS = {
    "skewed": SkewedNet,
    "epoch_logging": EpochLoggingNet,
    "twice": TwiceNet,
    "gpt": TinyGPT,
    "drop": DropNet,
    "gather": GatherNet,
    "one": OneLayerNet,
    "one_direct": DirectOneLayerNet,
    "example_input": ExampleInputNet,
    "skipping": SkippingNet,
    "stopping": StoppingNet,
    "compiled_blocks": CompiledBlocksNet,
    "iter": IterNet,
    "counting_scheduled": CountingScheduledNet,
    "nano_gpt": NanoStyleGPT,
    "gain": GainNet,
    "wrapper": WrapperNet,
    "autoencoder": LitAutoEncoder,
}


def dataset(n: int = 256, in_features: int = 16, classes: int = 4, seed: int = 0) -> TensorDataset:
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(n, in_features, generator=g)
    w = torch.randn(in_features, classes, generator=g)
    y = (x @ w).argmax(-1)
    return TensorDataset(x, y)


def loader(batch_size: int = 32, shuffle: bool = False, **kwargs) -> DataLoader:  # noqa: ANN003
    return DataLoader(dataset(**kwargs), batch_size=batch_size, shuffle=shuffle)


def flagged_loader(batch_size: int = 32) -> DataLoader:
    """:func:`loader`'s data with a ``skip`` flag on the first half of every ``batch_size`` rows (for
    :class:`SkippingNet`): split into two micro-batches, the first of each batch is skipped whole."""
    x, y = dataset().tensors
    skip = (torch.arange(len(x)) % batch_size) < batch_size // 2
    return DataLoader(TensorDataset(x, y, skip), batch_size=batch_size, shuffle=False)


def gain_loader(batch_size: int = 32) -> DataLoader:
    """:func:`loader`'s data with a per-row gain in [0.5, 1.5] (shape ``(N, 1)``) for :class:`GainNet`."""
    x, y = dataset().tensors
    gain = 0.5 + torch.rand(len(x), 1, generator=torch.Generator().manual_seed(3))
    return DataLoader(TensorDataset(x, y, gain), batch_size=batch_size, shuffle=False)

"""Run under torchrun (4 processes as 2 nodes x 2): HybridEmbedding in the distributed setting.

Rank 0 writes JSON to argv[1]; argv[2] is a scratch directory.
"""

from __future__ import annotations

import contextlib
import copy
import json
import os
import sys
from collections.abc import Iterator
from pathlib import Path

import torch
import torch.distributed as dist
from torch import nn
from torch.utils.data import DataLoader, Dataset

sys.path.insert(0, str(Path(__file__).parent))

import lightning.pytorch as pl  # noqa: E402
from lightning.pytorch.strategies import DDPStrategy  # noqa: E402

from lightning_hier import HierSlicedStrategy, HybridEmbedding, Topology  # noqa: E402
from lightning_hier.sparse.staging import NodeStaging, packed_row_bytes  # noqa: E402
from lightning_hier.sparse.sync import frequency_average, hierarchical_frequency_average  # noqa: E402

VOCAB, DIM, BAG = 12, 4, 4


class AllIdsEverywhere(Dataset):
    """Every rank's batch of 3 bags x 4 ids covers all 12 ids (one permutation per rank and batch)."""

    def __init__(self, rank: int, batches: int = 8, batch: int = 3) -> None:
        generator = torch.Generator().manual_seed(rank)  # this rank's own data, in order
        self.ids = torch.cat(
            [torch.randperm(VOCAB, generator=generator).view(batch, BAG) for _ in range(batches)]
        )
        self.targets = torch.randn(len(self.ids), 1, generator=generator)

    def __len__(self) -> int:
        return len(self.ids)

    def __getitem__(self, i: int):  # noqa: ANN204
        return self.ids[i], self.targets[i]


class Click(pl.LightningModule):
    def __init__(
        self, hybrid: bool, optimizer: str, hashed: bool = False, node_merge: str = "leader"
    ) -> None:  # noqa: E501
        super().__init__()
        self.optimizer_name = optimizer
        self.hashed = hashed
        self.head = nn.Linear(DIM, 1)  # first: nn.EmbeddingBag's init would shift the global RNG
        if hybrid:
            self.emb = HybridEmbedding(
                VOCAB, DIM, mode="sum", optimizer=optimizer, lr=0.1, seed=3, hashed_ids=hashed,
                node_merge=node_merge,
            )  # fmt: skip
        else:
            self.emb = nn.EmbeddingBag(VOCAB, DIM, mode="sum")
            reference = HybridEmbedding(VOCAB, DIM, mode="sum", seed=3)
            reference.attach()
            self.emb.weight.data.copy_(reference.weight)

    def training_step(self, batch, batch_idx):  # noqa: ANN001, ANN201
        ids, target = batch
        if self.hashed:
            ids = raw_ids(ids)
        return (self.head(self.emb(ids)) - target).pow(2).mean()

    def configure_optimizers(self):  # noqa: ANN201
        cls = torch.optim.SGD if self.optimizer_name == "sgd" else torch.optim.Adagrad
        return cls(self.parameters(), lr=0.1)


def loader() -> DataLoader:
    # each rank reads its own data (no DistributedSampler: Lightning's would shuffle across ranks)
    return DataLoader(AllIdsEverywhere(int(os.environ["RANK"])), batch_size=3, shuffle=False)


def raw_ids(ids: torch.Tensor) -> torch.Tensor:
    return ids * 1_000_000_007 + 2**40  # 64-bit feature ids


def fit(
    strategy, hybrid: bool, optimizer: str, epochs: int = 1, ckpt_path=None, hashed=False, node_merge="leader"
):  # noqa: ANN001, ANN201, E501
    pl.seed_everything(0, verbose=False)
    model = Click(hybrid, optimizer, hashed, node_merge)
    trainer = pl.Trainer(
        accelerator="cpu", devices=4, strategy=strategy, max_epochs=epochs, logger=False,
        enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False,
        use_distributed_sampler=False,
    )  # fmt: skip
    trainer.fit(model, train_dataloaders=loader(), ckpt_path=ckpt_path)
    return trainer, model


def mapped_segments() -> list[str]:
    with open("/proc/self/maps") as maps:
        return sorted({line.split()[-2] if line.rstrip().endswith("(deleted)") else line.split()[-1]
                       for line in maps if "lightning_hier-" in line})  # fmt: skip


@contextlib.contextmanager
def counting_sends() -> Iterator[list[int]]:
    """Count this process's point-to-point sends (``dist.isend``) while the block runs."""
    count, isend = [0], dist.isend

    def counted(*args, **kwargs):  # noqa: ANN002, ANN003, ANN202
        count[0] += 1
        return isend(*args, **kwargs)

    dist.isend = counted
    try:
        yield count
    finally:
        dist.isend = isend


def main() -> None:
    out, scratch = Path(sys.argv[1]), Path(sys.argv[2])
    results: dict = {}
    rank = dist.get_rank() if dist.is_initialized() else None

    # 1. the hierarchical exchange gives the single-process rule (ids in 1, 2 and all trainers)
    _, model = fit(HierSlicedStrategy(devices_per_node=2), hybrid=True, optimizer="sgd")  # also inits dist
    rank = dist.get_rank()
    topology = Topology(4, rank, 2).build_groups()
    parts = [
        (torch.tensor([0, 5]), torch.tensor([[1.0, 2.0], [1.0, 1.0]])),
        (torch.tensor([1, 5]), torch.tensor([[3.0, 3.0], [2.0, 2.0]])),
        (torch.tensor([1, 5]), torch.tensor([[5.0, 1.0], [3.0, 3.0]])),
        (torch.tensor([5, 9]), torch.tensor([[4.0, 4.0], [7.0, 0.0]])),
    ]
    got = hierarchical_frequency_average(
        *parts[rank], topology.intra_group, topology.inter_group, rank % 2 == 0
    )
    want = frequency_average(parts)
    mine = None
    if got is not None:
        mine = {
            "ids_equal": got[0].tolist() == want[0].tolist(),
            "max_diff": (got[1] - want[1]).abs().max().item(),
        }
    rules = [None] * 4
    dist.all_gather_object(rules, mine)
    results["rule"] = [r for r in rules if r is not None]

    # 1b. uneven ranks (one with none, one past its mailbox): both merges give the rule, to the bit alike
    generator = torch.Generator().manual_seed(rank)
    count = [40, 300, 0, 7][rank]  # rank 1 overflows a 256-row mailbox and sends by message
    uneven = (
        torch.randperm(1000, generator=generator)[:count] - 500,
        torch.randn(count, 3, generator=generator),
    )
    everyone = [None] * 4
    dist.all_gather_object(everyone, uneven)
    want = frequency_average(everyone)
    staging = NodeStaging.attach(topology.intra_group, 3, "test", mailbox_bytes=256 * packed_row_bytes(3))
    modes = {
        "leader": {},
        "leader_mailboxes": {"staging": staging},
        "shared_messages": {"share_merge": True},
        "shared_mailboxes": {"share_merge": True, "staging": staging},
    }
    groups = (topology.intra_group, topology.inter_group)
    leads = rank % 2 == 0
    got, sends = {}, {}
    for name, kw in modes.items():
        with counting_sends() as count:
            got[name] = hierarchical_frequency_average(*uneven, *groups, leads, **kw)
        sends[name] = count[0]
    everyones_sends = [None] * 4
    dist.all_gather_object(everyones_sends, sends)
    results["uneven_sends"] = everyones_sends
    results["leader_merge_in_training_has_mailboxes"] = model.emb._staging is not None
    mine = None
    if leads:
        leader_ids, leader_rows = got["leader"]
        mine = {
            "ids_equal": leader_ids.tolist() == want[0].tolist(),
            "max_diff": (leader_rows - want[1]).abs().max().item(),
            "shared_bitwise": all(
                torch.equal(got[name][0], leader_ids) and torch.equal(got[name][1], leader_rows)
                for name in ("leader_mailboxes", "shared_messages", "shared_mailboxes")
            ),
        }
    rules = [None] * 4
    dist.all_gather_object(rules, mine)
    results["uneven_rule"] = [r for r in rules if r is not None]

    # 2. node-shared table: same segment within a node, different across nodes; updated rows everywhere
    segments = [None] * 4
    dist.all_gather_object(segments, mapped_segments())
    tables = [None] * 4
    dist.all_gather_object(tables, model.emb.weight.clone())
    results["segments"] = segments
    results["tables_equal_everywhere"] = all(torch.equal(t, tables[0]) for t in tables)
    initial = HybridEmbedding(VOCAB, DIM, mode="sum", seed=3)
    initial.attach()
    results["table_moved"] = (tables[0] - initial.weight).abs().max().item()  # equal, and trained

    # 3. equivalence with ddp + dense EmbeddingBag when every id is in every batch
    for optimizer in ("sgd", "adagrad"):
        _, reference = fit(DDPStrategy(), hybrid=False, optimizer=optimizer)
        _, contender = fit(HierSlicedStrategy(devices_per_node=2), hybrid=True, optimizer=optimizer)
        table_diff = (reference.emb.weight.detach() - contender.emb.weight).abs().max().item()
        head_diff = (reference.head.weight - contender.head.weight).abs().max().item()
        initial = HybridEmbedding(VOCAB, DIM, mode="sum", seed=3)
        initial.attach()
        moved = (reference.emb.weight.detach() - initial.weight).abs().max().item()
        results[f"ddp_{optimizer}"] = {"table_diff": table_diff, "head_diff": head_diff, "moved": moved}
        strategy = HierSlicedStrategy(devices_per_node=2)
        _, shared = fit(strategy, hybrid=True, optimizer=optimizer, node_merge="shared")
        same = torch.equal(shared.emb.weight, contender.emb.weight)
        results[f"shared_merge_{optimizer}_bitwise"] = bool(same)

    # 4. checkpoint -> resume bit for bit (adam: moments and step count restored)
    ckpt = str(scratch / "hybrid.ckpt")
    _, whole = fit(HierSlicedStrategy(devices_per_node=2), hybrid=True, optimizer="adam", epochs=2)
    trainer, _ = fit(HierSlicedStrategy(devices_per_node=2), hybrid=True, optimizer="adam", epochs=1)
    trainer.save_checkpoint(ckpt)
    _, resumed = fit(
        HierSlicedStrategy(devices_per_node=2), hybrid=True, optimizer="adam", epochs=2, ckpt_path=ckpt
    )
    results["resume_bit_for_bit"] = bool(torch.equal(whole.emb.weight, resumed.emb.weight))
    results["tables_dir"] = sorted(p.name for p in Path(ckpt + ".tables").iterdir()) if rank == 0 else None

    # 5. the same with hashed ids: the id index is saved and restored (rows compared through it)
    def by_id(model: Click) -> torch.Tensor:
        rows = model.emb.index.lookup(raw_ids(torch.arange(VOCAB)).numpy())
        return model.emb.weight[torch.from_numpy(rows)].clone()

    hashed_ckpt = str(scratch / "hashed.ckpt")
    hier = lambda: HierSlicedStrategy(devices_per_node=2)  # noqa: E731
    _, whole = fit(hier(), hybrid=True, optimizer="adagrad", epochs=2, hashed=True)
    trainer, _ = fit(hier(), hybrid=True, optimizer="adagrad", epochs=1, hashed=True)
    trainer.save_checkpoint(hashed_ckpt)
    _, resumed = fit(hier(), hybrid=True, optimizer="adagrad", epochs=2, ckpt_path=hashed_ckpt, hashed=True)
    results["hashed_resume_bit_for_bit"] = bool(torch.equal(by_id(whole), by_id(resumed)))

    # 6. a callback that copies the model once the strategy attached the tables (an EMA's shadow copy)
    class ShadowCopy(pl.Callback):
        def on_fit_start(self, trainer, pl_module):  # noqa: ANN001, ANN201
            self.shadow = copy.deepcopy(pl_module)

    shadow = ShadowCopy()
    pl.seed_everything(0, verbose=False)
    model = Click(True, "sgd")
    trainer = pl.Trainer(
        accelerator="cpu", devices=4, strategy=HierSlicedStrategy(devices_per_node=2), max_epochs=1,
        logger=False, enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False,
        use_distributed_sampler=False, callbacks=[shadow],
    )  # fmt: skip
    trainer.fit(model, train_dataloaders=loader())
    ids = torch.arange(VOCAB).view(3, BAG)
    with torch.no_grad():  # the copy reads the node's trained table
        results["shadow_reads_the_trained_table"] = bool(torch.equal(shadow.shadow.emb(ids), model.emb(ids)))
    if rank == 0:
        out.write_text(json.dumps(results, indent=2))


if __name__ == "__main__":
    main()

"""Checks over every rank's record that no single rank can make.

NCCL matches collectives by their order on each communicator, and point-to-point messages by
their order between two ranks; one device runs the kernels of its communicators in the order the
host enqueued them. A run is safe when

1. no tensor reached a group without a backend for its device (recorded at the call);
2. every member of a group issued the same collectives on it, in the same order;
3. every send met a receive of the same shape and dtype, in order, on the other rank;
4. one global order of all these operations exists that every rank's own orders agree with
   (operations of one ``batch_isend_irecv`` are unordered among themselves): a cycle means two
   ranks each wait for what the other has queued behind its own wait, which deadlocks on GPUs.
   A rank's own orders are each thread's program order and the device's order, the order in which
   the rank issued its device operations (those with a CUDA tensor, and those with no tensor, which
   torch runs on the device backend), whatever thread issued them. Host-tensor operations of two
   threads have no order between them: each blocks only its own thread;
5. each group was used by one thread on each rank (two threads on one communicator interleave in no
   fixed order), and (with ``require_main_thread``) that thread is the main thread.
"""

from __future__ import annotations

import json
from collections import defaultdict, deque
from collections.abc import Iterable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from lightning_hier.audit.recorder import POINT_TO_POINT, SENDS

Record = dict[str, Any]
Node = tuple[Any, ...]


@dataclass
class AuditReport:
    """What :func:`analyze` found over the ranks' records."""

    records: dict[int, list[Record]]
    problems: list[str] = field(default_factory=list)

    @property
    def ok(self) -> bool:
        return not self.problems

    def raise_if_problems(self) -> None:
        if self.problems:
            shown = "\n  ".join(self.problems[:20])
            more = f"\n  ... and {len(self.problems) - 20} more" if len(self.problems) > 20 else ""
            raise AssertionError(f"{len(self.problems)} collective rule violation(s):\n  {shown}{more}")

    def select(
        self, op: str | None = None, caller: str | None = None, package: bool | None = None
    ) -> list[Record]:
        """Records of every rank matching an op name, a substring of the caller, and/or the package flag."""
        return [
            r
            for records in self.records.values()
            for r in records
            if (op is None or r["op"] == op)
            and (caller is None or caller in r["caller"])
            and (package is None or r["package"] == package)
        ]

    def summary(self) -> str:
        total = sum(len(r) for r in self.records.values())
        ops: dict[str, int] = defaultdict(int)
        for records in self.records.values():
            for r in records:
                ops[r["op"]] += 1
        listed = ", ".join(f"{op} x{n}" for op, n in sorted(ops.items()))
        status = "no problems" if self.ok else f"{len(self.problems)} problem(s)"
        return f"{len(self.records)} rank(s), {total} operations ({listed}): {status}"


def load_records(directory: str | Path) -> dict[int, list[Record]]:
    """Every ``rank<N>.json`` in ``directory``."""
    records = {}
    for path in sorted(Path(directory).glob("rank*.json")):
        payload = json.loads(path.read_text())
        records[int(payload["rank"])] = payload["records"]
    if not records:
        raise FileNotFoundError(f"no rank<N>.json audit records in {directory}")
    return records


def analyze(source: str | Path | dict[int, list[Record]], require_main_thread: bool = True) -> AuditReport:
    """Check the five rules above over a directory of records (or loaded records)."""
    records = source if isinstance(source, dict) else load_records(source)
    report = AuditReport(records)
    for rank, items in sorted(records.items()):
        for r in items:
            if r["violation"]:
                report.problems.append(f"rank {rank}: {r['violation']} (issued at {r['caller']})")
            if require_main_thread and not r["main_thread"]:
                report.problems.append(
                    f"rank {rank}: {r['op']} on group {r['group']} issued from thread {r['thread']!r} "
                    f"(at {r['caller']}); one issuing thread per rank keeps one order"
                )
    report.problems += _check_one_thread_per_group(records)
    report.problems += _check_group_sequences(records)
    report.problems += _check_point_to_point(records)
    report.problems += _check_global_order(records)
    return report


def _check_one_thread_per_group(records: dict[int, list[Record]]) -> list[str]:
    problems = []
    for rank, items in sorted(records.items()):
        threads: dict[str, set[str]] = defaultdict(set)
        for r in items:
            threads[r["group"]].add(r["thread"])
        for group, names in sorted(threads.items()):
            if len(names) > 1:
                problems.append(f"rank {rank}: group {group} used from threads {sorted(names)}")
    return problems


def _is_p2p(r: Record) -> bool:
    return r["op"] in POINT_TO_POINT


def _signature(r: Record) -> tuple[str, str]:
    dtype = r["tensors"][0][1] if r["tensors"] else ""
    return r["op"], dtype


def _check_group_sequences(records: dict[int, list[Record]]) -> list[str]:
    problems = []
    sequences: dict[str, dict[int, list[Record]]] = defaultdict(dict)
    members: dict[str, list[int]] = {}
    for rank, items in records.items():
        for r in items:
            if not _is_p2p(r):
                sequences[r["group"]].setdefault(rank, []).append(r)
                members[r["group"]] = r["group_ranks"]
    for group, per_rank in sorted(sequences.items()):
        present = [rank for rank in members[group] if rank in records]
        reference_rank = present[0]
        reference = per_rank.get(reference_rank, [])
        for rank in present[1:]:
            mine = per_rank.get(rank, [])
            for k in range(max(len(mine), len(reference))):
                a = _signature(reference[k]) if k < len(reference) else None
                b = _signature(mine[k]) if k < len(mine) else None
                if a != b:
                    where_a = reference[k]["caller"] if k < len(reference) else "-"
                    where_b = mine[k]["caller"] if k < len(mine) else "-"
                    problems.append(
                        f"group {group}: collective #{k} is {a} on rank {reference_rank} ({where_a}) but {b} "
                        f"on rank {rank} ({where_b})"
                    )
                    break
    return problems


def _p2p_shape(r: Record) -> Any:
    return "object" if r["op"].endswith("_object_list") else (r["tensors"][0][1], r["tensors"][0][2])


def _channels(records: dict[int, list[Record]]) -> tuple[dict[tuple[int, int], list[Record]], ...]:
    sends: dict[tuple[int, int], list[Record]] = defaultdict(list)
    recvs: dict[tuple[int, int], list[Record]] = defaultdict(list)
    for rank, items in records.items():
        for r in items:
            if _is_p2p(r):
                if r["op"] in SENDS:
                    sends[(rank, r["peer"])].append(r)
                else:
                    recvs[(r["peer"], rank)].append(r)
    return sends, recvs


def _check_point_to_point(records: dict[int, list[Record]]) -> list[str]:
    problems = []
    sends, recvs = _channels(records)
    for channel in sorted(set(sends) | set(recvs)):
        src, dst = channel
        if src not in records or dst not in records:
            continue
        out, into = sends.get(channel, []), recvs.get(channel, [])
        if len(out) != len(into):
            problems.append(f"{src}->{dst}: {len(out)} send(s) but {len(into)} receive(s)")
        for k, (s, r) in enumerate(zip(out, into)):
            if _p2p_shape(s) != _p2p_shape(r):
                problems.append(
                    f"{src}->{dst} message #{k}: sent {_p2p_shape(s)} at {s['caller']}, "
                    f"received as {_p2p_shape(r)} at {r['caller']}"
                )
                break
    return problems


def _on_device(record: Record) -> bool:
    return not record["tensors"] or any(device != "cpu" for device, _, _ in record["tensors"])


def _chains(rank: int, items: list[Record]) -> list[list[list[Node]]]:
    """The orders this rank's operations must keep: each thread's, and the device's (rule 4)."""
    by_thread: dict[str, list[list[Node]]] = defaultdict(list)
    device: list[list[Node]] = []
    for position, first in _positions(rank, items):
        by_thread[first["thread"]].append(position)
        if _on_device(first):
            device.append(position)
    return [*by_thread.values(), device]


def _positions(rank: int, items: list[Record]) -> list[tuple[list[Node], Record]]:
    """This rank's operations as positions in its order (one batch is one position), each with its
    first record (a batch's operations share thread and devices)."""
    group_count: dict[str, int] = defaultdict(int)
    channel_count: dict[tuple[int, int], int] = defaultdict(int)
    positions: list[tuple[list[Node], Record]] = []
    last_batch = None
    for r in items:
        if _is_p2p(r):
            channel = (rank, r["peer"]) if r["op"] in SENDS else (r["peer"], rank)
            node: Node = ("p2p", *channel, channel_count[channel])
            channel_count[channel] += 1
        else:
            node = ("group", r["group"], group_count[r["group"]])
            group_count[r["group"]] += 1
        if r["batch"] is not None and r["batch"] == last_batch:
            positions[-1][0].append(node)
        else:
            positions.append(([node], r))
        last_batch = r["batch"]
    return positions


def _check_global_order(records: dict[int, list[Record]]) -> list[str]:
    edges: dict[Node, set[Node]] = defaultdict(set)
    indegree: dict[Node, int] = defaultdict(int)
    nodes: set[Node] = set()
    for rank, items in records.items():
        for position, _ in _positions(rank, items):
            nodes.update(position)
        for chain in _chains(rank, items):
            for before, after in zip(chain, chain[1:]):
                for a in before:
                    for b in after:
                        if b not in edges[a]:
                            edges[a].add(b)
                            indegree[b] += 1
    ready = deque(n for n in nodes if indegree[n] == 0)
    seen = 0
    while ready:
        node = ready.popleft()
        seen += 1
        for nxt in edges[node]:
            indegree[nxt] -= 1
            if indegree[nxt] == 0:
                ready.append(nxt)
    if seen == len(nodes):
        return []
    stuck = sorted((n for n in nodes if indegree[n] > 0), key=str)[:6]
    return [
        f"no global issuing order exists (ranks wait on each other in a cycle); blocked: {_describe(stuck)}"
    ]


def _describe(nodes: Iterable[Node]) -> str:
    parts = []
    for node in nodes:
        if node[0] == "p2p":
            parts.append(f"message #{node[3]} {node[1]}->{node[2]}")
        else:
            parts.append(f"collective #{node[2]} on group {node[1]}")
    return ", ".join(parts)

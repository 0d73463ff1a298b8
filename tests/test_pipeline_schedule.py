"""1F1B and GPipe on 2 and 4 gloo stages: the math of one process, and the NCCL issuing rules.

The schedules pair each forward send with the matching backward receive (and each backward send
with the next forward receive) in one ``batch_isend_irecv``. Recorded with ``CollectiveAudit``,
every rank's operations must admit one global order (no two stages each waiting on a send queued
behind its own receive), every send must meet a receive of its shape, and no send buffer may be
held past the step.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from helpers import run_torchrun

from lightning_hier.audit import analyze
from lightning_hier.audit.emulation import EMULATED_NCCL
from lightning_hier.pipeline.schedule import PipelineSchedule
from lightning_hier.topology import DEVICE_BACKEND_ENV


@pytest.mark.parametrize("stages", [2, 4])
def test_paired_schedules_match_one_process_and_admit_one_issuing_order(stages: int, tmp_path: Path) -> None:
    out = tmp_path / "out.json"
    run_torchrun(
        "schedule_pairing.py", stages, str(out), env={DEVICE_BACKEND_ENV: EMULATED_NCCL}, timeout=300
    )
    per_stage = json.loads(out.read_text())
    for rank, rank_results in enumerate(per_stage):
        stage = stages - 1 - rank
        for case, result in rank_results.items():
            assert result["max_diff"] < 1e-6, (case, result)
            assert result["held_sends_after_step"] == 0, case
            # the next header's (or known spec's data) receive is posted ahead of use, never past the
            # step's last micro-batch
            assert result["receives_pending_after_step"] == 0, case
            micro = int(case.split("/")[1])
            if case.startswith("extra/"):
                # the stage held as many micro-batches as its warm-up count, and the memory plan is told so
                extra = [int(v) for v in case.split("/")[2].split(",")]
                expected_warmup = min(
                    micro, sum(1 + (extra[t] if t < stages - 1 else 0) for t in range(stage, stages))
                )
                assert result["peak_in_flight"] == expected_warmup == result["in_flight_limit"], (
                    case,
                    result,
                )
            headers = 2 if case.endswith("static") else micro  # static: one per new row count
            assert result["headers_received"] == (headers if stage > 0 else 0), (case, result)
            assert result["headers_sent"] == (headers if stage < stages - 1 else 0), (case, result)
            # static, rows 3, 3, 2, 2, 2: micro-batches 1, 3 and 4 have a spec known from memory, so on
            # gloo their data receives are posted while the one before computes
            # (with extra warm-up the surplus activations are received ahead by the schedule instead)
            ahead = 3 if case.endswith("static") else 0
            if not case.startswith("extra/"):
                assert result["activations_posted_ahead"] == (ahead if stage > 0 else 0), (case, result)
    report = analyze(tmp_path / "audit")
    report.raise_if_problems()
    records = report.records
    # the steady state really pairs: some batch holds a send and a receive (middle and end stages)
    paired = {
        rank
        for rank, items in records.items()
        for batch in {r["batch"] for r in items if r["batch"] is not None}
        if {r["op"] for r in items if r["batch"] == batch} == {"isend", "irecv"}
    }
    assert paired == set(range(stages)), paired


class _RecordingLink:
    """The last of two stages' link, without processes: records what the schedule asks of it and when."""

    stage, num_stages = 1, 2

    def __init__(self, events: list[str]) -> None:
        self.events = events
        self.known: set = set()
        self.pending = False

    def knows_spec(self, key: object) -> bool:
        return key is not None and key in self.known

    def expect_header(self) -> None:
        self.events.append("post next header")
        self.pending = True

    def recv_header(self, key: object = None) -> tuple[list[int], torch.dtype, bool]:
        if not self.knows_spec(key):
            self.events.append("read header" + (" (posted ahead)" if self.pending else ""))
            self.pending = False
            if key is not None:
                self.known.add(key)
        return [2, 3], torch.float32, True

    def recv_activation_op(self, header: tuple) -> tuple[str, torch.Tensor]:
        return "recv", torch.ones(header[0])

    posts_data_ahead = True  # as on gloo

    def expect_activation(self, spec: tuple) -> None:
        self.events.append("post next data")
        self.posted = ("work", torch.ones(spec[0]), spec)

    def take_expected_activation(self) -> tuple | None:
        posted, self.posted = getattr(self, "posted", None), None
        return posted

    def send_grad_op(self, grad: torch.Tensor) -> str:
        return "send"

    def exchange(self, ops: list, posted: list = ()) -> None:  # type: ignore[assignment]
        if posted:
            self.events.append("wait data (posted ahead)")

    def post_sends(self, ops: list) -> None:
        pass

    def wait(self) -> None:
        pass

    sends_gradients_early = False  # see _EarlyGradientLink


class _EarlyGradientLink(_RecordingLink):
    """As on gloo: records when a gradient goes out, alone ahead of its pair or inside the exchange."""

    sends_gradients_early = True

    def post_early_sends(self, ops: list) -> list:
        self.events += ["send gradient (early)" for op in ops if op == "send"]
        return ["sent"]

    def exchange(self, ops: list, posted: list = ()) -> None:  # type: ignore[assignment]
        self.events += ["send gradient (paired)" for op in ops if op == "send"]
        if "sent" in posted:
            self.events.append("wait gradient")


@pytest.mark.parametrize("kind", ["1f1b", "gpipe"])
@pytest.mark.parametrize("keys", [None, ["a", "a", "b", "b"]], ids=["headers", "static"])
def test_the_next_header_is_received_while_the_stage_computes(kind: str, keys: list | None) -> None:
    """On gloo a message lands only once its receive is posted and the sender's thread answers; posted
    after the stage's compute it would wait on a busy sender (3-4 ms per micro-batch on 2 CPU cores). The
    receive of micro-batch m+1's header must be posted before m's forward runs, and none after the last;
    where m+1's spec is known from memory (``static_shapes``), its data receive instead (gloo)."""
    events: list[str] = []

    def forward(m: int, received: torch.Tensor | None) -> torch.Tensor:
        events.append(f"forward {m}")
        assert received is not None
        return (received * 2).sum()

    PipelineSchedule(_RecordingLink(events), kind).train_step(4, forward, keys)  # type: ignore[arg-type]
    if keys is None:
        expected = ["read header", "post next header", "forward 0"]
        for m in (1, 2, 3):
            ahead = ["post next header"] if m < 3 else []
            expected += ["read header (posted ahead)", *ahead, f"forward {m}"]
    else:  # a header only where the key is new (micro-batch 2): posted ahead during micro-batch 1; where
        # the key is known (1, 3), the data receive itself is posted ahead
        expected = ["read header", "post next data", "forward 0", "wait data (posted ahead)"]
        expected += ["post next header", "forward 1", "read header (posted ahead)", "post next data"]
        expected += ["forward 2", "wait data (posted ahead)", "forward 3"]
    assert events == expected


def test_on_gloo_the_gradient_goes_out_before_the_stage_waits_for_the_next_header() -> None:
    """The previous stage is blocked on this stage's gradient: posted only after the next activation's
    header has arrived, it would wait for this stage to wake up on that header. On gloo each gradient but
    the last (sent after the step's last forward) goes out as soon as its backward ends, before the header
    read, and is waited in the exchange that receives the next activation."""
    events: list[str] = []

    def forward(m: int, received: torch.Tensor | None) -> torch.Tensor:
        events.append(f"forward {m}")
        assert received is not None
        return (received * 2).sum()

    PipelineSchedule(_EarlyGradientLink(events), "1f1b").train_step(3, forward)  # type: ignore[arg-type]
    expected = ["read header", "post next header", "forward 0"]
    for m in (1, 2):
        ahead = ["post next header"] if m < 2 else []
        expected += ["send gradient (early)", "read header (posted ahead)", "wait gradient"]
        expected += [*ahead, f"forward {m}"]
    assert events == expected

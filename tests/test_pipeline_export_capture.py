"""hier_pipeline on models torch.fx cannot trace, captured with torch.export; ``split_points``.

Hugging Face's GPT-2 and Llama build their masks in code fx cannot trace, and its ResNet checks its input
channels in its embedder the same way: each is captured with ``torch.export`` (``export_capture.py``),
grouped into layers by module, and trained on 2 gloo processes exactly as one process running the same
micro-batches (float64, ``tests/scripts/pipeline_export_capture.py``). Tiny configs, random init, nothing
downloaded.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

import lightning.pytorch as pl
import pytest
import torch
import torch.nn.functional as F
from helpers import SCRIPTS, run_torchrun
from torch import nn
from torch.utils.data import DataLoader, RandomSampler, TensorDataset

pytest.importorskip("transformers")
sys.path.insert(0, str(SCRIPTS))
from pipeline_export_capture import CausalLM, ImageClassifier, reference  # noqa: E402

from lightning_hier.pipeline import export_capture  # noqa: E402
from lightning_hier.pipeline.graph import LayerGraph, PipelineTraceError  # noqa: E402
from lightning_hier.pipeline.partition import StagePartition  # noqa: E402
from lightning_hier.pipeline.settings import PipelineSettings, initial_partition  # noqa: E402
from lightning_hier.pipeline.stage import StageExecutor  # noqa: E402

TOKENS = torch.randint(0, 64, (4, 16), generator=torch.Generator().manual_seed(3))


def _two_stages(graph: LayerGraph, starts: tuple[int, int], *args: torch.Tensor) -> tuple[torch.Tensor, ...]:
    """Stage 0 then stage 1 of ``graph`` split at ``starts``, forward and backward of the output's square
    sum, as two processes would run them; returns the output."""
    partition = StagePartition(starts, graph.num_clusters)
    first, second = (StageExecutor(graph, partition, stage) for stage in range(2))
    sent = first.forward(*args)
    received = sent.detach().requires_grad_(sent.is_floating_point())
    out = second.forward_received(received)
    out.square().sum().backward()
    if received.requires_grad:
        sent.backward(received.grad)
    return out


@pytest.fixture(scope="module")
def gpt2() -> tuple[CausalLM, LayerGraph]:
    model = CausalLM("gpt2").double()
    return model, LayerGraph(model, example_input=((TOKENS,), {}), split_points=["model.transformer.h.2"])


def test_gpt2_is_captured_with_export_one_block_per_cluster(gpt2: tuple[CausalLM, LayerGraph]) -> None:
    """fx stops at the mask helpers; export captures the forward with every block its own cluster (the
    causal mask every block reads is recomputed in each, so only the hidden state crosses a cut)."""
    model, graph = gpt2
    assert graph.capture == "export"
    owners = [graph.layers[c.start].owner for c in graph.clusters]
    assert [f"model.transformer.h.{i}" for i in range(4)] == [o for o in owners if o and ".h." in o]
    # the embedding layer reads the tied weight under its own name, the output layer under its own
    layers = {layer.owner: layer for layer in graph.layers}
    assert layers["model.transformer.wte"].state_names == ("model.transformer.wte.weight",)
    assert layers["model.lm_head"].state_names == ("model.lm_head.weight",)
    assert graph.split_point_starts(["model.transformer.h.2"]) == (0, owners.index("model.transformer.h.2"))


@pytest.mark.parametrize("training", [True, False])
def test_gpt2_split_at_a_block_matches_the_eager_model(
    gpt2: tuple[CausalLM, LayerGraph], training: bool
) -> None:
    """Two stages split at ``h.2`` give the eager forward's logits and gradients, in both modes and for
    another batch and sequence size than the capture's."""
    model, graph = gpt2
    model.train(training)
    try:
        for tokens in (TOKENS, TOKENS[:3, :9]):
            model.zero_grad()
            expected = model(tokens)
            expected.square().sum().backward()
            grads = {n: p.grad.clone() for n, p in model.named_parameters()}
            model.zero_grad()
            (start,) = graph.split_point_starts(["model.transformer.h.2"])[1:]
            out = _two_stages(graph, (0, start), tokens)
            torch.testing.assert_close(out, expected, rtol=0, atol=1e-12)
            for name, param in model.named_parameters():
                torch.testing.assert_close(param.grad, grads[name], rtol=0, atol=1e-12, msg=name)
    finally:
        model.train()


def test_a_device_written_into_the_graph_follows_the_layers_tensors() -> None:
    """The capture runs on the host and records ``device=cpu`` (``torch.arange(t, device=...)``, the mask
    helpers' ``.to(device)``); a stage whose tensors live elsewhere must create its tensors there. The
    ``meta`` device stands in for a GPU here: a host tensor in a layer fails against it."""
    model = CausalLM("gpt2")
    graph = LayerGraph(model, example_input=((TOKENS,), {}))
    model.to("meta")
    partition = StagePartition(
        (0, graph.split_point_starts(["model.transformer.h.2"])[1]), graph.num_clusters
    )
    first, second = (StageExecutor(graph, partition, stage) for stage in range(2))
    out = second.forward_received(first.forward(TOKENS.to("meta")))
    assert out.device.type == "meta" and out.shape == (4, 16, 64)


def test_resnet_batchnorm_statistics_update_in_place_as_in_the_eager_model() -> None:
    """The exported layers update BatchNorm's running statistics of the model itself (train mode) and use
    them in eval mode, at every cut."""
    eager, piped = ImageClassifier().double(), ImageClassifier().double()
    graph = LayerGraph(piped, example_input=((torch.zeros(2, 3, 16, 16, dtype=torch.float64),), {}))
    assert graph.capture == "export"
    images = torch.randn(4, 3, 20, 20, dtype=torch.float64)
    for start in range(1, graph.num_clusters):
        for training in (True, False):
            eager.train(training)
            piped.train(training)
            expected = eager(images)
            out = _two_stages(graph, (0, start), images)
            torch.testing.assert_close(out, expected, rtol=0, atol=1e-12)
            for (name, mine), theirs in zip(piped.state_dict().items(), eager.state_dict().values()):
                torch.testing.assert_close(mine, theirs, rtol=0, atol=1e-12, msg=name)


def test_a_forward_neither_path_captures_names_both_failures_and_split_points() -> None:
    class Branchy(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.lin = nn.Linear(4, 4)

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            if x.sum() > 0:  # on a value: neither fx nor export can follow it
                return self.lin(x)
            return -x

    with pytest.raises(PipelineTraceError) as info:
        LayerGraph(Branchy(), example_input=((torch.ones(2, 4),), {}))
    message = str(info.value)
    assert "torch.fx:" in message and "torch.export" in message, message
    assert message.count("test_pipeline_export_capture.py:") == 2, message  # the line, for each path
    assert "leaf_modules" in message and "split_points" in message, message
    # without an example input, the export part says where to give one
    with pytest.raises(PipelineTraceError, match="example_input_array"):
        LayerGraph(Branchy())


def test_split_points_are_checked_before_any_process_group() -> None:
    model = CausalLM("gpt2")
    settings = PipelineSettings(split_points=["model.transformer.h.2"])
    settings.check_split_points(2, model)  # one name for 2 stages
    with pytest.raises(ValueError, match=r"3 stages need 2"):
        settings.check_split_points(3, model)
    with pytest.raises(ValueError, match=r"not submodules of CausalLM.*did you mean 'model.transformer.h.2'"):
        PipelineSettings(split_points=["model.transformer.h2"]).check_split_points(2, model)
    with pytest.raises(ValueError, match="appears twice"):
        PipelineSettings(split_points=["model.lm_head", "model.lm_head"])
    with pytest.raises(ValueError, match="list of module names"):
        PipelineSettings(split_points="model.lm_head")  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="give one of them"):
        PipelineSettings(split_points=["model.lm_head"], partition="uniform")


def test_split_points_order_and_cut_are_checked_on_the_captured_graph(
    gpt2: tuple[CausalLM, LayerGraph],
) -> None:
    _, graph = gpt2
    with pytest.raises(
        ValueError, match=r"order forward runs them: \['model.transformer.h.1', 'model.lm_head'\]"
    ):
        graph.split_point_starts(["model.lm_head", "model.transformer.h.1"])
    with pytest.raises(ValueError, match="runs no layer"):
        graph.split_point_starts(["model.transformer.h.1.attn"])  # inside the block's one layer
    settings = PipelineSettings(split_points=["model.transformer.h.1", "model.lm_head"])
    partition = initial_partition(graph, settings, 3)
    owners = [graph.layers[graph.clusters[s].start].owner for s in partition.starts]
    assert owners == ["model.transformer", "model.transformer.h.1", "model.lm_head"]


def test_a_split_point_inside_a_residual_block_names_the_values_the_cut_would_carry() -> None:
    class Block(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.inner = nn.Linear(4, 4)
            self.outer = nn.Linear(4, 4)

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            return x + self.outer(torch.relu(self.inner(x)))

    class Net(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.blocks = nn.ModuleList([Block(), Block()])

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            if x.shape[-1] != 4:  # a check fx cannot trace
                raise ValueError("four features")
            for block in self.blocks:
                x = block(x)
            return x

    example = ((torch.randn(3, 4),), {})
    carried = r"would carry `blocks_0` \(from blocks\.0\), `blocks_1` \(from blocks\.1\), .*one tensor"
    with pytest.raises(ValueError, match=carried):  # the block's input and its inner branch
        LayerGraph(Net(), example_input=example, split_points=["blocks.1.outer"])
    graph = LayerGraph(Net(), example_input=example, split_points=["blocks.1"])
    assert graph.capture == "export"
    assert graph.split_point_starts(["blocks.1"]) == (0, 1)


def test_models_fx_traces_keep_their_fx_graph() -> None:
    model = nn.Sequential(nn.Linear(4, 4), nn.ReLU(), nn.Linear(4, 2))
    graph = LayerGraph(model, example_input=((torch.randn(2, 4),), {}))
    assert graph.capture == "fx"
    assert [layer.name for layer in graph.layers] == ["_0", "_1", "_2"]


class _FirstBatchNet(pl.LightningModule):
    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(4, 2)

    def forward(self, x: torch.Tensor, scale: float = 1.0) -> torch.Tensor:
        return self.lin(x) * scale

    def training_step(self, batch: tuple[torch.Tensor, torch.Tensor], batch_idx: int) -> torch.Tensor:
        x, y = batch
        return F.mse_loss(self(x[:, :4] * 2), y)

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.SGD(self.parameters(), lr=0.1)


def test_the_example_input_is_the_first_batch_as_the_step_calls_forward_with_the_rng_untouched() -> None:
    """Read from the loader at setup, as the step passes it to ``self(...)``; the fit then reads the same
    first batch (a shuffling sampler's order comes from the global generator, which the read leaves as it
    was)."""
    data = TensorDataset(torch.randn(12, 5), torch.randn(12, 2))
    loader = DataLoader(data, batch_size=4, sampler=RandomSampler(data))
    seen: dict = {}

    class Capture(pl.Callback):
        def setup(self, trainer: pl.Trainer, pl_module: pl.LightningModule, stage: str) -> None:
            before = torch.get_rng_state()
            seen["example"] = export_capture.forward_example(pl_module)
            seen["rng_untouched"] = torch.equal(before, torch.get_rng_state())

        def on_train_batch_start(self, trainer, pl_module, batch, batch_idx) -> None:  # noqa: ANN001
            seen.setdefault("first_batch", batch)

    trainer = pl.Trainer(
        accelerator="cpu", devices=1, max_steps=1, logger=False, enable_progress_bar=False,
        enable_checkpointing=False, enable_model_summary=False, callbacks=[Capture()],
    )  # fmt: skip
    trainer.fit(_FirstBatchNet(), loader)
    args, kwargs = seen["example"]
    assert seen["rng_untouched"]
    assert kwargs == {} and len(args) == 1
    torch.testing.assert_close(args[0], seen["first_batch"][0][:, :4] * 2)


def _scenario(name: str, tmp_path: Path) -> dict:
    out = tmp_path / f"{name}.json"
    run_torchrun("pipeline_export_capture.py", 2, name, str(out), str(tmp_path), timeout=600)
    return json.loads(out.read_text())


def _assert_matches_one_process(result: dict, kind: str, steps: int) -> None:
    losses, state = reference(kind, steps, micro_batches=2)
    assert result["capture"] == "export"
    assert len(result["losses"]) == steps
    torch.testing.assert_close(torch.tensor(result["losses"]), torch.tensor(losses), rtol=1e-10, atol=0)
    trained = torch.load(result["state"])
    assert set(trained) == set(state)
    for name, value in state.items():
        torch.testing.assert_close(trained[name], value, rtol=1e-9, atol=1e-12, msg=name)


def test_gpt2_on_two_stages_split_at_a_block_trains_as_one_process(tmp_path: Path) -> None:
    result = _scenario("gpt2_split_points", tmp_path)
    starts = result["partition"]["starts"]
    assert result["cluster_starts"][starts[1]] == "model_transformer_h_2"
    # the tied embedding and output weights: a replica on each stage, gradients summed
    assert result["tied"] == [["model.transformer.wte.weight", [0, 1]]]
    _assert_matches_one_process(result, "gpt2", 3)


def test_llama_split_between_decoder_layers_trains_as_one_process(tmp_path: Path) -> None:
    result = _scenario("llama_parameters", tmp_path)
    start = result["cluster_starts"][result["partition"]["starts"][1]]
    assert start.startswith("model_model_layers_"), result["cluster_starts"]  # a cut between decoder layers
    assert "model.model.rotary_emb.inv_freq" in result["replicable_buffers"]
    _assert_matches_one_process(result, "llama", 3)


def test_resnet_with_batchnorm_trains_as_one_process(tmp_path: Path) -> None:
    result = _scenario("resnet_parameters", tmp_path)
    _assert_matches_one_process(result, "resnet", 3)


def test_live_rebalancing_migrates_exported_layers_and_trains_as_one_process(tmp_path: Path) -> None:
    result = _scenario("gpt2_rebalance", tmp_path)
    assert result["history"], "the lopsided start [3, 9] must be rebalanced"
    moved = [move for event in result["history"] for r in event["migration"] for move in r["layers"]]
    assert any(move.startswith("model_transformer_h_") for move in moved), moved
    _assert_matches_one_process(result, "gpt2", 6)

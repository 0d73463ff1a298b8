"""Layer tracing, cluster detection and stage execution of hier_pipeline (single process)."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest
import torch
from torch import nn

sys.path.insert(0, str(Path(__file__).parent / "scripts"))

from lightning_hier.pipeline.batching import split_batch  # noqa: E402
from lightning_hier.pipeline.graph import LayerGraph, PipelineTraceError
from lightning_hier.pipeline.partition import StagePartition, partition_uniform
from lightning_hier.pipeline.rebalance import decide_rebalance
from lightning_hier.pipeline.settings import PipelineSettings, initial_partition
from lightning_hier.pipeline.stage import StageExecutor
from lightning_hier.pipeline.tied_parameters import canonical_names, find_tied, parameter_shapes


class InceptionBlock(nn.Module):
    def __init__(self, width: int) -> None:
        super().__init__()
        self.branch_a = nn.Linear(width, width)
        self.branch_b1 = nn.Linear(width, width)
        self.branch_b2 = nn.Linear(width, width)
        self.branch_c = nn.Linear(width, width)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        a = self.branch_a(x)
        b = self.branch_b2(torch.relu(self.branch_b1(x)))
        c = self.branch_c(x)
        return torch.cat([a, b, c], dim=-1)


class BranchyNet(nn.Module):
    """stem -> inception (fork into 3, join by cat) -> proj -> residual (fork, join by add) -> head."""

    def __init__(self, width: int = 8) -> None:
        super().__init__()
        self.stem = nn.Linear(4, width)
        self.inception = InceptionBlock(width)
        self.proj = nn.Linear(3 * width, width)
        self.res = nn.Linear(width, width)
        self.head = nn.Linear(width, 3)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = self.stem(x)
        x = self.proj(self.inception(x))
        x = torch.tanh(self.res(x)) + x
        return self.head(x)


def _cluster_names(graph: LayerGraph) -> list[list[str]]:
    return [[layer.name for layer in graph.cluster_layers(c)] for c in graph.clusters]


def test_branches_joining_form_one_cluster() -> None:
    graph = LayerGraph(BranchyNet())
    assert _cluster_names(graph) == [
        ["stem"],
        [
            "inception_branch_a",
            "inception_branch_b1",
            "relu",
            "inception_branch_b2",
            "inception_branch_c",
            "cat",
        ],
        ["proj"],
        ["res", "tanh", "add"],
        ["head"],
    ]
    # the value leaving each cluster is its last layer's output
    assert [c.exit_value for c in graph.clusters] == ["stem", "cat", "proj", "add", None]


def test_plain_stack_is_one_cluster_per_layer() -> None:
    model = nn.Sequential(nn.Linear(4, 8), nn.ReLU(), nn.Linear(8, 8), nn.Tanh(), nn.Linear(8, 2))
    graph = LayerGraph(model)
    assert graph.num_clusters == 5
    assert graph.layer_counts() == [1] * 5
    assert graph.parameter_counts() == [40, 0, 72, 0, 18]


def test_shared_module_and_long_skip_stay_in_one_cluster() -> None:
    class Shared(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.a, self.b, self.c = nn.Linear(4, 4), nn.Linear(4, 4), nn.Linear(4, 4)

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            x = self.a(x)
            x = self.b(x)
            x = self.a(x)  # `a` again: a..a cannot be split
            return self.c(x)

    graph = LayerGraph(Shared(), split_tied_parameters=False)
    assert _cluster_names(graph) == [["a", "b", "a_1"], ["c"]]
    # by default only shared buffers hold layers together: `a`'s parameters get a replica per stage
    assert _cluster_names(LayerGraph(Shared())) == [["a"], ["b"], ["a_1"], ["c"]]

    class SharedNorm(Shared):
        def __init__(self) -> None:
            super().__init__()
            self.a = nn.BatchNorm1d(4)  # running statistics: a buffer cannot have replicas

    assert _cluster_names(LayerGraph(SharedNorm())) == [["a", "b", "a_1"], ["c"]]

    class LongSkip(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.a, self.b, self.c, self.d = (nn.Linear(4, 4) for _ in range(4))

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            h = self.a(x)
            return self.d(self.c(self.b(h)) + h)

    graph = LayerGraph(LongSkip())
    assert _cluster_names(graph) == [["a"], ["b", "c", "add"], ["d"]]


class TiedLM(nn.Module):
    """A language model whose output layer reuses the input embedding's weight (GPT-2, T5, ...)."""

    def __init__(self, vocab: int = 11, width: int = 6, depth: int = 3) -> None:
        super().__init__()
        self.embed = nn.Embedding(vocab, width)
        self.blocks = nn.Sequential(
            *(nn.Sequential(nn.Linear(width, width), nn.Tanh()) for _ in range(depth))
        )
        self.lm_head = nn.Linear(width, vocab, bias=False)
        self.lm_head.weight = self.embed.weight

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        return self.lm_head(self.blocks(self.embed(tokens)))


def test_an_output_layer_tied_to_the_embedding_splits_with_a_replica_on_both_ends() -> None:
    model = TiedLM()
    # kept together, the whole model is one cluster: no pipeline at all
    assert LayerGraph(model, split_tied_parameters=False).num_clusters == 1
    graph = LayerGraph(model)
    assert _cluster_names(graph)[0] == ["embed"] and _cluster_names(graph)[-1] == ["lm_head"]
    canonical = canonical_names(model)
    assert canonical["lm_head.weight"] == "embed.weight"
    shapes = parameter_shapes(model)
    partition = partition_uniform(graph.layer_counts(), 2)
    (tied,) = find_tied(graph, partition, canonical, shapes)
    assert (tied.name, tied.stages, tied.shape) == ("embed.weight", (0, 1), (11, 6))
    # one stage holds the whole model: nothing is tied across stages
    assert find_tied(graph, partition_uniform(graph.layer_counts(), 1), canonical, shapes) == []
    # the two stages run in sequence equal the whole model, and each half's gradient of the shared weight
    # adds up to the whole model's (what sum_tied_gradients gives every replica)
    tokens = torch.tensor([[1, 4, 7], [2, 9, 10]])
    whole = model(tokens)
    whole.square().sum().backward()
    expected = model.embed.weight.grad.clone()
    model.zero_grad()
    first, second = (StageExecutor(graph, partition, stage) for stage in (0, 1))
    middle = first.forward(tokens)
    received = middle.detach().requires_grad_()
    out = second.forward(received)
    torch.testing.assert_close(out, whole)
    out.square().sum().backward()
    from_head = model.embed.weight.grad.clone()
    model.zero_grad()
    middle.backward(received.grad)
    torch.testing.assert_close(model.embed.weight.grad + from_head, expected)
    assert from_head.abs().sum() > 0 and model.embed.weight.grad.abs().sum() > 0


def test_untraceable_model_names_the_call_and_leaf_modules_fix_it() -> None:
    class Gate(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.lin = nn.Linear(4, 4)

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            if x.sum() > 0:  # data-dependent control flow
                return self.lin(x)
            return -x

    model = nn.Sequential(nn.Linear(4, 4), Gate(), nn.Linear(4, 2))
    with pytest.raises(PipelineTraceError, match=r"test_pipeline_graph.py:\d+ `if x.sum\(\) > 0:") as info:
        LayerGraph(model)
    assert "leaf_modules" in str(info.value)
    graph = LayerGraph(model, leaf_modules=["1"])
    assert [layer.name for layer in graph.layers] == ["_0", "_1", "_2"]
    with pytest.raises(ValueError, match="not submodules"):
        LayerGraph(model, leaf_modules=["nope"])


@pytest.mark.parametrize("starts", [(0,), (0, 2), (0, 1, 3, 4), (0, 2, 3)])
def test_stages_in_sequence_equal_the_whole_model(starts: tuple[int, ...]) -> None:
    torch.manual_seed(0)
    model = BranchyNet().double()
    graph = LayerGraph(model)
    partition = StagePartition(starts, graph.num_clusters)
    x = torch.randn(5, 4, dtype=torch.float64, requires_grad=True)
    expected = model(x)
    expected.sum().backward()
    expected_grads = [p.grad.clone() for p in model.parameters()]
    expected_input_grad = x.grad.clone()
    model.zero_grad()
    x.grad = None

    value = x
    executors = [StageExecutor(graph, partition, s) for s in range(partition.num_stages)]
    for executor in executors:
        value = executor.forward(value)
    torch.testing.assert_close(value, expected, rtol=0, atol=0)
    value.sum().backward()
    for executor in executors:
        executor.finish_backward()
    for p, g in zip(model.parameters(), expected_grads):
        torch.testing.assert_close(p.grad, g, rtol=0, atol=0)
    torch.testing.assert_close(x.grad, expected_input_grad, rtol=0, atol=0)
    # every layer with a differentiable output got forward and backward time
    times = [e.times for e in executors]
    for e, t in zip(executors, times):
        for i in e.layer_range:
            assert t.forward_count[i] == 1 and t.forward[i] > 0


class Switched(nn.Module):
    """Branches on plain arguments, as real models do (``if extra:``, ``if mask is not None:``)."""

    def __init__(self) -> None:
        super().__init__()
        self.a, self.b, self.c = nn.Linear(4, 4), nn.Linear(4, 4), nn.Linear(4, 2)

    def forward(
        self, x: torch.Tensor, extra: bool = False, mask: torch.Tensor | None = None, scale: float = 2.0
    ):  # noqa: ANN201
        h = torch.relu(self.a(x))
        if extra:
            h = h + 1
        if mask is not None:
            h = h * mask
        return self.c(torch.relu(self.b(h))) * scale


def test_plain_default_arguments_are_traced_as_their_defaults_and_other_values_fail_loudly() -> None:
    """Plain fx cannot trace such a forward ("symbolically traced variables cannot be used as inputs to
    control flow"); here the defaults are traced as constants and hier_pipeline takes the model."""
    torch.manual_seed(0)
    model = Switched()
    graph = LayerGraph(model)
    partition = StagePartition((0, 2), graph.num_clusters)
    executors = [StageExecutor(graph, partition, s) for s in range(2)]
    x = torch.randn(3, 4)
    for kwargs in ({}, {"extra": False, "mask": None, "scale": 2.0}):
        value = executors[0].forward(x, **kwargs)
        torch.testing.assert_close(executors[1].forward(value), model(x), rtol=0, atol=0)
    # another value is refused before any layer runs, naming the argument and the fix (not fx's
    # "has been specialized" assertion from inside the graph)
    with pytest.raises(
        ValueError, match=r"traced Switched.forward with extra=False, its default .* passes True"
    ):
        executors[0].forward(x, extra=True)
    with pytest.raises(
        ValueError, match=r"with mask=None, its default .* passes a Tensor\. Make 'mask' a required"
    ):
        executors[0].forward(x, mask=torch.ones(3, 4))
    with pytest.raises(ValueError, match=r"with scale=2\.0, its default .* passes 3\.0"):
        executors[0].forward(x, False, None, 3.0)  # positional too


class MaskedByDefaultNone(nn.Module):
    """Hugging Face's signature: ``attention_mask=None``, used as a tensor (no ``is None`` branch), beside a
    flag default that a branch reads."""

    def __init__(self) -> None:
        super().__init__()
        self.a, self.b = nn.Linear(4, 4), nn.Linear(4, 2)

    def forward(self, x: torch.Tensor, attention_mask: torch.Tensor | None = None, extra: bool = False):  # noqa: ANN201
        h = torch.relu(self.a(x)) * attention_mask.unsqueeze(-1)
        if extra:
            h = h + 1
        return self.b(h)


def test_a_none_default_forward_uses_as_a_tensor_is_traced_as_an_input() -> None:
    """Tracing it as None would fail (``'NoneType' object has no attribute 'unsqueeze'``) and refuse the
    model. It is an input instead (the other defaults stay constants), every call must pass it, and the
    stages compute the model's own output."""
    torch.manual_seed(0)
    model = MaskedByDefaultNone()
    graph = LayerGraph(model)
    assert graph.none_traced_as_input == ["attention_mask"] and graph.specialized == {"extra": False}
    partition = StagePartition((0, 1), graph.num_clusters)
    executors = [StageExecutor(graph, partition, s) for s in range(2)]
    x, mask = torch.randn(3, 4), torch.tensor([1.0, 0.0, 1.0])  # one mask value per sample
    value = executors[0].forward(x, attention_mask=mask)
    last = executors[1].forward_received(value, (x,), {"attention_mask": mask})  # it may read the mask too
    torch.testing.assert_close(last, model(x, attention_mask=mask), rtol=0, atol=0)
    with pytest.raises(ValueError, match=r"with 'attention_mask' as an input .* this call leaves it None"):
        executors[0].forward(x)
    with pytest.raises(ValueError, match=r"with extra=False, its default .* passes True"):
        executors[0].forward(x, attention_mask=mask, extra=True)
    # a None default that traces as None (a branch on it) stays a constant
    assert LayerGraph(Switched()).none_traced_as_input == []


def test_initial_partitions_and_their_errors() -> None:
    graph = LayerGraph(BranchyNet(width=8))
    by_params = initial_partition(graph, PipelineSettings(partition="parameters"), 2)
    counts = graph.parameter_counts()
    costs = [sum(counts[a:b]) for a, b in by_params.stage_ranges()]
    assert max(costs) == min(max(sum(counts[:k]), sum(counts[k:])) for k in range(1, graph.num_clusters))
    assert initial_partition(graph, PipelineSettings(partition="uniform"), 2) == partition_uniform(
        graph.layer_counts(), 2
    )
    assert initial_partition(graph, PipelineSettings(partition=[2, 3]), 2).starts == (0, 2)
    assert initial_partition(graph, PipelineSettings(partition=["proj"]), 2).starts == (0, 2)
    with pytest.raises(ValueError, match="only 5 cluster"):
        initial_partition(graph, PipelineSettings(), 6)
    # a module holding layers names the cluster its first layer begins
    by_module = initial_partition(graph, PipelineSettings(partition=["inception"]), 2)
    assert (
        by_module.starts
        == initial_partition(graph, PipelineSettings(partition=["inception.branch_a"]), 2).starts
    )
    assert by_module.starts == (0, 1)
    valid = r"Valid split points \(a module holding them works too\): "
    valid += r"\['inception.branch_a', 'proj', 'res', 'head'\]"
    with pytest.raises(ValueError, match=valid):
        initial_partition(graph, PipelineSettings(partition=["relu"]), 2)
    with pytest.raises(ValueError, match="'inception.branch_b1' does not"):  # inside the inception cluster
        initial_partition(graph, PipelineSettings(partition=["inception.branch_b1"]), 2)
    with pytest.raises(ValueError, match="covers 4 clusters"):
        initial_partition(graph, PipelineSettings(partition=[2, 2]), 2)


@pytest.mark.parametrize(
    "kwargs, match",
    [
        (dict(stages=0), "stages"),
        (dict(micro_batches=0), "micro_batches"),
        (dict(schedule="interleaved"), "schedule"),
        (dict(partition="fastest"), "partition"),
        (dict(partition=[2, 0]), "at least one cluster"),
        (dict(rebalance="always"), "rebalance"),
        (dict(rebalance=0), "rebalance"),
        (dict(imbalance_threshold=-1.0), "imbalance_threshold"),
        (dict(memory_limit=0), "memory_limit"),
        (dict(swap_bandwidth=0.0), "swap_bandwidth"),
        (dict(activation_policy="offload"), "activation_policy"),
        (dict(split_tied_parameters="yes"), "split_tied_parameters"),
    ],
)
def test_bad_settings_fail_with_the_setting_named(kwargs: dict, match: str) -> None:
    with pytest.raises(ValueError, match=match):
        PipelineSettings(**kwargs)


def test_relay_stages_pass_a_one_layer_model_through_unchanged() -> None:
    """Fewer clusters than stages: the extra stages hold a parameter-free relay each, and the stages in
    sequence compute the model's output and gradients exactly."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(4, 3)).double()
    graph = LayerGraph(model)
    assert graph.pad_with_relays(1) == 0
    assert graph.pad_with_relays(3) == 2
    assert graph.num_clusters == 3 and graph.num_relays == 2
    assert [layer.state_names for layer in graph.layers] == [("0.weight", "0.bias"), (), ()]
    assert initial_partition(graph, PipelineSettings(), 3).starts == (0, 1, 2)
    x = torch.randn(5, 4, dtype=torch.float64, requires_grad=True)
    expected = model(x)
    (expected * expected).sum().backward()
    expected_grads = [p.grad.clone() for p in model.parameters()]
    model.zero_grad()
    value = x.detach().requires_grad_()
    executors = [StageExecutor(graph, StagePartition((0, 1, 2), 3), s) for s in range(3)]
    for executor in executors:
        value = executor.forward(value)
    torch.testing.assert_close(value, expected, rtol=0, atol=0)
    (value * value).sum().backward()
    for executor in executors:
        executor.finish_backward()
    for p, g in zip(model.parameters(), expected_grads):
        torch.testing.assert_close(p.grad, g, rtol=0, atol=0)


class LSTMNet(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.emb = nn.Linear(4, 8)
        self.lstm = nn.LSTM(8, 8, batch_first=True)
        self.fc = nn.Linear(8, 3)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out, (h, c) = self.lstm(torch.tanh(self.emb(x)))
        return self.fc(out[:, -1])


def test_no_cut_after_a_layer_that_returns_a_tuple() -> None:
    """``nn.LSTM`` returns ``(output, (h, c))``: a cut there would send a tuple (a TypeError at the
    first step on one stage and a lost connection on the other)."""
    torch.manual_seed(0)
    model = LSTMNet().double()
    graph = LayerGraph(model)
    assert "lstm" not in [cluster.exit_value for cluster in graph.clusters]
    unpacking = ["lstm", "getitem", "getitem_1", "getitem_2", "getitem_3"]
    assert _cluster_names(graph)[1:3] == [["tanh"], unpacking]
    x = torch.randn(5, 6, 4, dtype=torch.float64)
    partition = partition_uniform(graph.layer_counts(), 2)
    value = x
    for stage in range(2):
        value = StageExecutor(graph, partition, stage).forward(value)
    torch.testing.assert_close(value, model(x), rtol=0, atol=0)


class FunctionalDropoutNet(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.a = nn.Linear(4, 8)
        self.b = nn.Linear(8, 3)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = nn.functional.dropout(torch.relu(self.a(x)), 0.5, self.training)
        return nn.functional.dropout(self.b(x), 0.2, True)  # always on (Monte Carlo dropout)


@pytest.mark.parametrize("traced_in_train_mode", [True, False])
def test_functional_dropout_follows_the_mode_it_runs_in(traced_in_train_mode: bool) -> None:
    """``F.dropout(x, p, self.training)`` traces to a constant: the stages re-read the mode at each call
    (otherwise dropout would stay on in validation when traced in train mode); a literal ``True`` stays on."""
    torch.manual_seed(0)
    model = FunctionalDropoutNet().double().train(traced_in_train_mode)
    graph = LayerGraph(model)
    assert model.training is traced_in_train_mode
    assert graph.mode_args == {"dropout": [("training", True, False)]}
    partition = partition_uniform(graph.layer_counts(), 2)
    executors = [StageExecutor(graph, partition, stage) for stage in range(2)]
    x = torch.randn(6, 4, dtype=torch.float64)
    for training in (False, True):
        model.train(training)
        torch.manual_seed(1)
        expected = model(x)
        torch.manual_seed(1)
        value = x
        for executor in executors:
            value = executor.forward(value)
        torch.testing.assert_close(value, expected, rtol=0, atol=0)


def test_a_branch_on_the_mode_is_warned_about() -> None:
    class Branchy(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.a = nn.Linear(4, 4)

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            return self.a(x) * 2 if self.training else self.a(x)

    with pytest.warns(UserWarning, match="traces to different layers in train and eval mode"):
        LayerGraph(Branchy())


def test_a_forward_returning_several_values_cannot_be_relayed() -> None:
    class Pair(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.layer = nn.Linear(4, 4)

        def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
            y = self.layer(x)
            return y, y

    graph = LayerGraph(Pair())
    with pytest.raises(ValueError, match="returns several values"):
        graph.pad_with_relays(2)


def test_world_size_must_match_stages() -> None:
    with pytest.raises(ValueError, match="stages=3 but the Trainer launches 4"):
        PipelineSettings(stages=3).check_world_size(4)
    with pytest.raises(ValueError, match="describes 3 stages"):
        PipelineSettings(partition=[1, 1, 1]).check_world_size(2)


def test_split_batch_into_micro_batches() -> None:
    x, y = torch.arange(10).view(10, 1), torch.arange(10)
    parts, total = split_batch((x, y, "tag"), 4)
    assert total == 10 and [n for _, n in parts] == [3, 3, 2, 2]
    assert torch.equal(torch.cat([p[0][0] for p in parts]), x)
    assert all(p[0][2] == "tag" for p in parts)
    parts, _ = split_batch({"x": x[:2]}, 4)
    assert len(parts) == 2
    # nothing to split (plain values, a dataloader_iter): one micro-batch, passed on unchanged
    batch = ["no tensors", 3]
    parts, total = split_batch(batch, 2)
    assert parts == [(batch, 1)] and parts[0][0] is batch and total == 1


def test_rebalance_needs_a_real_gain_and_an_imbalance() -> None:
    graph = LayerGraph(nn.Sequential(*(nn.Linear(4, 4) for _ in range(4))))
    current = StagePartition((0, 2), 4)
    exits = [64, 64, 64, 0]

    def times(*costs: float) -> dict[int, tuple[float, float]]:
        return {i: (c / 3, 2 * c / 3) for i, c in enumerate(costs)}

    # balanced within the threshold: nothing to do
    d = decide_rebalance(graph, current, times(1, 1, 1, 1.1), exits, threshold=0.1)
    assert d.new is None and "balanced" in d.reason
    # imbalanced, and moving layer 1 makes the slowest stage 3 -> 2: applied
    d = decide_rebalance(graph, current, times(2, 1, 0.5, 0.5), exits, threshold=0.1)
    assert d.new is not None and d.new.starts == (0, 1)
    assert d.stage_times == (3.0, 1.0) and d.predicted_times == (2.0, 2.0)
    # imbalanced by granularity, best split only 2% faster: kept (no back-and-forth on noise)
    # (stages 0.5 | 1.0; the best split gives 0.98 | 0.52)
    lopsided = StagePartition((0, 1), 4)
    d = decide_rebalance(graph, lopsided, times(0.5, 0.48, 0.26, 0.26), exits, threshold=0.1)
    assert d.new is None and "faster" in d.reason
    d = decide_rebalance(graph, lopsided, times(0.5, 0.48, 0.26, 0.26), exits, 0.1, min_gain=0.0)
    assert d.new is not None and d.new.starts == (0, 2)


class TorchContainersWithDropout(nn.Module):
    """torch's own leaves that draw random numbers inside: an encoder layer (``nn.Dropout`` children and
    attention dropout), a recurrent layer (dropout between its layers, a float attribute)."""

    def __init__(self) -> None:
        super().__init__()
        self.encoder = nn.TransformerEncoderLayer(8, 2, 16, dropout=0.3, batch_first=True)
        self.lstm = nn.LSTM(8, 8, num_layers=2, dropout=0.3, batch_first=True)
        self.head = nn.Linear(8, 3)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = torch.tanh(self.encoder(x))
        out, _ = self.lstm(x)
        return self.head(out[:, -1])


def _pipeline_forward(graph: LayerGraph, stages: int, x: torch.Tensor, global_draws: int) -> torch.Tensor:
    """``x`` through ``stages`` executors seeded per layer, each stage's process RNG advanced differently."""
    partition = partition_uniform(graph.layer_counts(), stages)
    value = x
    for stage in range(stages):
        executor = StageExecutor(graph, partition, stage)
        executor.rng_base, executor.rng_position = 1234, (3, 1)
        torch.manual_seed(stage)
        torch.rand(global_draws + stage)  # what else this process drew before (data loading, other layers)
        value = executor.forward(value)
    return value


def test_torch_leaves_holding_dropout_draw_from_the_per_layer_stream() -> None:
    """An ``nn.TransformerEncoderLayer`` or ``nn.LSTM(dropout=...)`` leaf gets the same masks on any stage
    and whatever its process drew before, as ``nn.Dropout`` does (asking only the leaf's own type would
    leave these drawing from the process's global stream, their masks following the placement)."""
    torch.manual_seed(0)
    model = TorchContainersWithDropout().double().train()
    graph = LayerGraph(model)
    x = torch.randn(4, 5, 8, dtype=torch.float64)
    one_stage = _pipeline_forward(graph, 1, x, global_draws=0)
    for draws in (0, 7):
        torch.testing.assert_close(_pipeline_forward(graph, 2, x, draws), one_stage, rtol=0, atol=0)
    model.eval()
    torch.testing.assert_close(_pipeline_forward(graph, 2, x, 7), model(x), rtol=0, atol=0)


@pytest.mark.parametrize(
    ("module", "draws"),
    [
        (nn.Linear(4, 4), False),
        (nn.TransformerEncoderLayer(8, 2, 16, dropout=0.1), True),
        (nn.TransformerEncoderLayer(8, 2, 16, dropout=0.0), False),
        (nn.MultiheadAttention(8, 2, dropout=0.1), True),
        (nn.GRU(4, 4, num_layers=2, dropout=0.2), True),
        (nn.GRU(4, 4, num_layers=2), False),
        (nn.Sequential(nn.Linear(4, 4), nn.Dropout(0.1)), True),
        (nn.Sequential(nn.Linear(4, 4), nn.Dropout(0.1)).eval(), False),
    ],
)
def test_which_torch_leaves_may_draw_random_numbers(module: nn.Module, draws: bool) -> None:
    from lightning_hier.pipeline.layer_rng import may_draw_random

    node = LayerGraph(nn.Sequential(module)).graph_module.graph.find_nodes(op="call_module")[0]
    assert may_draw_random(node, module) is draws


class MaskedEncoder(nn.Module):
    """A padding mask passed to ``forward`` beside the token ids and read by every encoder layer."""

    def __init__(self, layers: int = 4) -> None:
        super().__init__()
        self.emb = nn.Embedding(20, 8)
        self.layers = nn.ModuleList(
            [nn.TransformerEncoderLayer(8, 2, 16, dropout=0.0, batch_first=True) for _ in range(layers)]
        )
        self.head = nn.Linear(8, 3)

    def forward(self, ids: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
        h = self.emb(ids)
        for layer in self.layers:
            h = layer(h, src_key_padding_mask=mask)
        return self.head(h.mean(1))


def test_a_further_input_of_forward_does_not_hold_the_layers_that_read_it_on_one_stage() -> None:
    """The mask is read by every encoder layer, yet each layer is its own cluster: a later stage binds the
    mask from its own call of forward (every process holds the batch) instead of receiving it (otherwise the
    mask would block every cut, making ``emb`` and all encoder layers one cluster on one stage). Three stages
    of executors, fed the call's inputs, equal the model."""
    torch.manual_seed(0)
    model = MaskedEncoder().double()
    graph = LayerGraph(model)
    assert _cluster_names(graph) == [
        ["emb"],
        ["layers_0"],
        ["layers_1"],
        ["layers_2"],
        ["layers_3"],
        ["mean"],
        ["head"],
    ]
    ids = torch.randint(1, 20, (5, 7))
    mask = torch.zeros(5, 7, dtype=torch.bool)
    mask[:, -2:] = True
    partition = partition_uniform(graph.layer_counts(), 3)
    executors = [StageExecutor(graph, partition, stage) for stage in range(3)]
    assert [e.reads_inputs for e in executors] == [[], ["mask"], ["mask"]]
    value = executors[0].forward(ids, mask)
    for executor in executors[1:]:
        value = executor.forward_received(value, (ids,), {"mask": mask})
    torch.testing.assert_close(value, model(ids, mask), rtol=0, atol=0)


def test_the_first_input_read_again_still_holds_its_block_together() -> None:
    """The first input is what flows through the stages: a residual over it keeps its block in one
    cluster (unlike a further input, which each stage binds itself)."""

    class InputSkip(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.a, self.b, self.c = nn.Linear(4, 4), nn.Linear(4, 4), nn.Linear(4, 4)

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            return self.c(self.b(torch.relu(self.a(x))) + x)

    assert _cluster_names(LayerGraph(InputSkip())) == [["a", "relu", "b", "add"], ["c"]]


def test_a_dropout_switched_on_after_the_stage_was_built_still_draws_from_the_per_layer_stream() -> None:
    """The executor resolves each node once per partition; whether a torch dropout draws is still asked
    at every call, so one built with ``p=0`` in eval mode and switched on later gets per-layer masks,
    the same whatever the process drew before."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(8, 8), nn.Dropout(0.0), nn.Linear(8, 8)).double().eval()
    graph = LayerGraph(model)
    executor = StageExecutor(graph, partition_uniform(graph.layer_counts(), 1), 0)
    executor.rng_base, executor.rng_position = 1234, (3, 1)
    model[1].p = 0.5
    model.train()
    x = torch.randn(16, 8, dtype=torch.float64)
    outputs = []
    for draws in (0, 7):
        torch.rand(draws)  # what else this process drew before
        outputs.append(executor.forward(x))
    torch.testing.assert_close(outputs[0], outputs[1], rtol=0, atol=0)
    assert not torch.equal(outputs[0], model[2](model[0](x)))  # the dropout did draw a mask


class _Writing(nn.Module):
    """A forward that writes to its module as models do: a counting buffer updated in place, an attribute
    kept for inspection, a tensor constant (which fx stores on the module it traces)."""

    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(4, 2)
        self.register_buffer("seen", torch.zeros((), dtype=torch.long))
        self.last_input = None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        self.seen += x.shape[0]
        self.last_input = x
        return self.lin(x) + torch.tensor([1.0, -1.0])


def test_a_trace_leaves_the_model_as_it_was_and_keeps_in_place_buffer_updates() -> None:
    """fx runs forward once with proxies, which could leave ``self.seen`` an fx Proxy on the user's model
    (and Lightning's ``model.to`` would fail on it). The model is as before the trace, the in-place update is
    a layer of the graph, and the attribute that the graph cannot set is warned about."""
    model = _Writing()
    seen = model.seen
    with pytest.warns(UserWarning, match=r"_Writing.forward sets last_input"):
        graph = LayerGraph(model)
    assert model.seen is seen and model.last_input is None
    executor = StageExecutor(graph, StagePartition((0,), graph.num_clusters), 0)
    x = torch.randn(3, 4)
    torch.testing.assert_close(executor.forward(x), model.lin(x) + torch.tensor([1.0, -1.0]))
    assert int(model.seen) == 3  # the graph's add_ on the model's own buffer
    model.to(torch.float64)  # what would fail on a proxy left behind
    assert model.seen.dtype == torch.long


def test_a_buffer_or_parameter_replaced_in_forward_is_refused_by_name() -> None:
    """``self.mean = 0.9 * self.mean + ...`` rebinds the buffer: the graph keeps no assignment, so under the
    pipeline it would never change. That is refused, naming it and the in-place way, and the model is left
    as it was."""

    class RunningMean(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.lin = nn.Linear(4, 4)
            self.register_buffer("mean", torch.zeros(4))

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            self.mean = 0.9 * self.mean + 0.1 * x.mean(0)
            return self.lin(x - self.mean)

    model = RunningMean()
    mean = model.mean
    with pytest.raises(PipelineTraceError, match=r"assigns new values to mean: .* in place"):
        LayerGraph(model)
    assert model.mean is mean

    class Reset(nn.Module):  # a parameter rebuilt in forward (fx cannot trace one made from a proxy)
        def __init__(self) -> None:
            super().__init__()
            self.inner = nn.Linear(4, 4)

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            self.inner.bias = nn.Parameter(torch.zeros(4))
            return self.inner(x)

    model = Reset()
    bias = model.inner.bias
    with pytest.raises(PipelineTraceError, match=r"assigns new values to inner.bias"):
        LayerGraph(model)
    assert model.inner.bias is bias


def test_batch_fingerprints_compare_shapes_and_integer_values_not_float_values() -> None:
    """What the stages compare at each epoch's first batch: a different order of the labels or another
    batch size is a different batch; inputs drawn with other random augmentation (floats) are not."""
    from lightning_hier.pipeline.batch_agreement import batch_fingerprint

    x, y = torch.randn(8, 4), torch.arange(8) % 3
    mask = torch.ones(8, 5, dtype=torch.bool)
    batch = {"x": x, "y": y, "mask": mask}
    same = batch_fingerprint({"x": x.clone(), "y": y.clone(), "mask": mask.clone()})
    assert torch.equal(batch_fingerprint(batch), same)
    assert torch.equal(batch_fingerprint(batch), batch_fingerprint({**batch, "x": torch.randn(8, 4)}))
    swapped = y.clone()
    swapped[[0, 1]] = swapped[[1, 0]]  # same values, other rows: another sample's label
    assert not torch.equal(batch_fingerprint(batch), batch_fingerprint({**batch, "y": swapped}))
    other_mask = mask.clone()
    other_mask[3, 4] = False
    assert not torch.equal(batch_fingerprint(batch), batch_fingerprint({**batch, "mask": other_mask}))
    assert not torch.equal(batch_fingerprint([x, y]), batch_fingerprint([x[:7], y[:7]]))


def test_an_assert_on_a_traced_value_is_checked_at_run_time_and_a_buffer_cut_by_one_traces() -> None:
    """Plain fx fails on both (it cannot turn a traced value into a bool, and a plain buffer tensor cannot
    be indexed by a traced length). The assert is a layer that raises, with its location, on the stage that
    runs it, and the split model equals the whole one."""
    from pipeline_models import MaskedAverage  # outside the tests: pytest rewrites a test module's asserts

    torch.manual_seed(0)
    model = MaskedAverage().double()
    graph = LayerGraph(model)
    partition = StagePartition((0, graph.num_clusters - 1), graph.num_clusters)
    executors = [StageExecutor(graph, partition, s) for s in range(2)]
    x = torch.randn(3, 5, 4, dtype=torch.float64)
    value = x
    for executor in executors:
        value = executor.forward(value)
    torch.testing.assert_close(value, model(x), rtol=0, atol=0)
    value = torch.randn(3, 7, 4, dtype=torch.float64)  # longer than the mask: the assert fires
    with pytest.raises(AssertionError, match=r"pipeline_models.py:\d+ `assert t <= self.block"):
        executors[0].forward(value)


def test_a_branch_on_a_traced_value_stays_an_error_naming_the_line() -> None:
    class Branchy(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.lin = nn.Linear(4, 4)

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            if x.size(1) > 3:  # a branch (not an assert): fx cannot know which way it goes
                x = x * 2
            return self.lin(x)

    with pytest.raises(PipelineTraceError, match=r"test_pipeline_graph.py:\d+ `if x.size\(1\) > 3:"):
        LayerGraph(Branchy())


def _two_stages_forward_backward(graph: LayerGraph, x: torch.Tensor) -> None:
    """Forward through a first stage of one cluster and a second of the rest, then backward of the sum."""
    partition = StagePartition((0, graph.num_clusters - 1), graph.num_clusters)
    executors = [StageExecutor(graph, partition, s) for s in range(2)]
    value = x
    for executor in executors:
        value = executor.forward(value)
    value.sum().backward()
    for executor in executors:
        executor.finish_backward()


class _ReverseGradient(torch.autograd.Function):
    """Identity forward, negated and scaled backward (domain-adversarial training's gradient reversal)."""

    @staticmethod
    def forward(ctx, x: torch.Tensor, alpha: float) -> torch.Tensor:  # noqa: ANN001
        ctx.alpha = alpha
        return x.view_as(x)

    @staticmethod
    def backward(ctx, grad: torch.Tensor) -> tuple[torch.Tensor, None]:  # noqa: ANN001
        return -ctx.alpha * grad, None


class _Adversarial(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.features = nn.Linear(4, 8)
        self.task = nn.Linear(8, 2)
        self.domain = nn.Linear(8, 2)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = torch.tanh(self.features(x))
        return self.task(h) + self.domain(_ReverseGradient.apply(h, 0.5))


def test_a_custom_autograd_function_is_one_layer_keeping_its_backward() -> None:
    """fx would trace through ``Function.apply`` into its forward (a ``view_as``) and lose the custom
    backward: the stages would train the feature layer with the domain gradient's sign flipped back,
    silently. The apply is one layer, and the split model's gradients equal the whole model's."""
    torch.manual_seed(0)
    model = _Adversarial().double()
    graph = LayerGraph(model)
    assert any(
        n.op == "call_function" and "_ReverseGradient" in repr(n.target)
        for n in graph.graph_module.graph.nodes
    )
    x = torch.randn(5, 4, dtype=torch.float64)
    model(x).sum().backward()
    expected = [p.grad.clone() for p in model.parameters()]
    model.zero_grad()
    _two_stages_forward_backward(graph, x)
    for param, grad in zip(model.parameters(), expected):
        torch.testing.assert_close(param.grad, grad, rtol=0, atol=0)


class _Distilled(nn.Module):
    """A teacher run under ``torch.no_grad()`` inside ``forward``, as distillation code writes it."""

    def __init__(self) -> None:
        super().__init__()
        self.teacher = nn.Sequential(nn.Linear(4, 8), nn.Tanh(), nn.Linear(8, 2))
        self.student = nn.Sequential(nn.Linear(4, 8), nn.ReLU(), nn.Linear(8, 2))
        self.head = nn.Linear(2, 2)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        with torch.no_grad():
            target = self.teacher(x)
        return self.head(self.student(x) + 0.5 * target)


def test_a_no_grad_block_in_forward_keeps_its_teacher_without_gradients() -> None:
    """fx does not record ``with torch.no_grad():``; traced as is, the stages would run the teacher with
    gradients and the optimizer would train it (0.34 relative off one process's teacher after 16 steps).
    The block's values leave it through a stop-gradient layer: the split model's gradients are the whole
    model's, and the teacher gets none."""
    torch.manual_seed(0)
    model = _Distilled().double()
    graph = LayerGraph(model)
    x = torch.randn(5, 4, dtype=torch.float64)
    model(x).sum().backward()
    expected = {n: None if p.grad is None else p.grad.clone() for n, p in model.named_parameters()}
    assert all(expected[n] is None for n in expected if n.startswith("teacher"))
    model.zero_grad(set_to_none=True)
    _two_stages_forward_backward(graph, x)
    for name, param in model.named_parameters():
        if expected[name] is None:
            assert param.grad is None or not param.grad.any(), name
        else:
            torch.testing.assert_close(param.grad, expected[name], rtol=0, atol=0, msg=name)


def test_an_autocast_block_in_forward_is_warned_about_with_its_line() -> None:
    """fx does not record ``with torch.autocast(...)``; the graph would run the block under the Trainer's
    precision instead. The user is told where, and that a leaf module keeps it."""

    class FullPrecisionHead(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.body, self.head = nn.Linear(4, 4), nn.Linear(4, 2)

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            h = self.body(x)
            with torch.autocast("cpu", dtype=torch.bfloat16):
                return self.head(h)

    with pytest.warns(
        UserWarning, match=r"switches autocast \(at .*test_pipeline_graph.py:\d+ .*leaf_modules"
    ):
        LayerGraph(FullPrecisionHead())

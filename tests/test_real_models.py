"""Popular models nobody here wrote, under the package's strategies, against Lightning ``ddp``.

Hugging Face BERT (masked LM: tied embeddings, token types, padding mask), DistilBERT, T5 (encoder-decoder,
shared embedding, relative position bias), ViT and a torch ``nn.LSTM`` language model, tiny and randomly
initialised, each wrapped in a LightningModule whose step calls ``self(...)`` with a dict batch's named
inputs. Each trains 3 AdamW steps in float64 on 2 gloo processes under ``ddp`` and under the strategies
below (``tests/scripts/real_models.py``); every parameter after fit must equal ``ddp``'s to rounding.
``hier_bsp`` runs in lockstep (``superstep=1, max_staleness=0``, ddp's step); ``hier_pipeline`` is one
2-stage replica captured by torch.fx (LSTM) or torch.export (the Hugging Face models).
"""

from __future__ import annotations

import ast
import json
import sys
from collections.abc import Callable
from pathlib import Path

import pytest
import torch
from helpers import SCRIPTS, run_torchrun

pytest.importorskip("transformers")
sys.path.insert(0, str(SCRIPTS))
from real_models import T5, Samples  # noqa: E402

from lightning_hier.pipeline.graph import LayerGraph  # noqa: E402

PAIRS = {
    "bert": ("hier_sliced_inter_node", "hier_bsp", "hier_pipeline"),
    "distilbert": ("hier_sliced", "hier_pipeline"),
    "t5": ("hier_sliced_inter_node", "hier_bsp", "hier_pipeline"),
    "vit": ("hier_sliced", "hier_pipeline"),
    "lstm": ("hier_bsp", "hier_pipeline"),
}


@pytest.fixture(scope="module")
def runs(tmp_path_factory: pytest.TempPathFactory) -> Callable[[str], dict]:
    """One 2-process launch per model (ddp, then its strategies), run on first use."""
    cache: dict[str, dict] = {}
    workdir = tmp_path_factory.mktemp("real_models")

    def get(model: str) -> dict:
        if model not in cache:
            out = Path(workdir) / f"{model}.json"
            run_torchrun("real_models.py", 2, model, str(out), *PAIRS[model], timeout=300)
            cache[model] = json.loads(out.read_text())
        return cache[model]

    return get


@pytest.mark.parametrize(
    ("model", "strategy"),
    [(model, strategy) for model, strategies in PAIRS.items() for strategy in strategies],
)
def test_trains_as_ddp(runs: Callable[[str], dict], model: str, strategy: str) -> None:
    """The strategy's parameters after 3 steps equal ddp's to 1e-7 relative (ddp moved them by ~1e-2)."""
    result = runs(model)
    assert result["moved"] > 1e-3, result  # the comparison is not between untrained models
    assert result[strategy]["max_diff"] < 1e-7, (model, strategy, result[strategy])


def test_t5_split_points_name_only_modules_that_begin_a_stage() -> None:
    """T5 calls its stacks' dropout twice and its relative position bias crosses every encoder block, so few
    modules can begin a stage. The root module (whose first layer is forward's first) is refused by name, and
    every module the error offers, once each, begins its own stage when named."""
    samples = Samples("t5")
    batch = {k: torch.stack([samples[i][k] for i in range(4)]) for k in T5.inputs}
    graph = LayerGraph(T5(), example_input=(tuple(batch.values()), {}))
    with pytest.raises(ValueError, match="'model': its first layer .* is the first of forward") as info:
        graph.split_point_starts(["model"])
    offered = ast.literal_eval(str(info.value).split("modules that can begin a stage: ")[1])
    assert "model.encoder.dropout" in offered and len(set(offered)) == len(offered), offered
    starts = [graph.split_point_starts([name])[1] for name in offered]
    assert all(start > 0 for start in starts) and starts == sorted(set(starts)), (offered, starts)
    assert [graph.layers[graph.clusters[s].start].owner for s in starts] == offered

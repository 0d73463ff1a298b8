"""Tensors sent through object collectives as raw bytes (lightning_hier/pipeline/object_wire.py)."""

from __future__ import annotations

import contextlib
import pickle
from unittest import mock

import torch

from lightning_hier.pipeline.object_wire import WireTensor, from_wire, to_wire


def test_nested_tensors_round_trip_exactly_without_torch_save() -> None:
    state = {
        "weight": torch.randn(3, 4, dtype=torch.bfloat16),
        "optim": [torch.tensor(5.0, dtype=torch.float64), torch.tensor([True, False, True])],
        "empty": (torch.empty(0, 3), 7, "name"),
        "strided": torch.arange(6, dtype=torch.int32).reshape(2, 3).t(),
    }
    with mock.patch("torch.save") as save:
        sent = pickle.dumps(to_wire(state))
        back = from_wire(pickle.loads(sent))
    assert save.call_count == 0
    for key in ("weight", "strided"):
        assert back[key].dtype == state[key].dtype and torch.equal(back[key], state[key])
    assert torch.equal(back["optim"][0], state["optim"][0]) and back["optim"][0].dim() == 0
    assert torch.equal(back["optim"][1], state["optim"][1])
    assert back["empty"][0].shape == (0, 3) and back["empty"][1:] == (7, "name")
    assert isinstance(to_wire(state)["weight"], WireTensor)


def test_a_pickled_tensor_would_call_torch_save() -> None:
    """Why the wire format exists: pickling a tensor goes through ``torch.save``."""
    # the mock writes nothing usable; the call is what counts
    with mock.patch("torch.save") as save, contextlib.suppress(Exception):
        pickle.dumps(torch.ones(2))
    assert save.call_count >= 1

import os
import sys
from pathlib import Path

import pytest
import torch.distributed as dist

sys.path.insert(0, str(Path(__file__).parent))
sys.path.insert(0, str(Path(__file__).parent / "scripts"))


@pytest.fixture(autouse=True)
def _isolated_process_state():
    """Each test starts from the environment and process-group state the previous one found: tests that
    run Lightning in pytest's own process leave ``MASTER_PORT``, ``LOCAL_RANK`` and a default process group
    behind, which would make a later test reuse a port or meet an initialised group."""
    environ = dict(os.environ)
    yield
    os.environ.clear()
    os.environ.update(environ)
    from lightning_hier.topology import forget_groups

    if dist.is_available() and dist.is_initialized():
        dist.destroy_process_group()
    forget_groups()


@pytest.fixture
def one_process_group() -> dist.ProcessGroup:
    """A one-rank gloo default group for the test's duration (reducers, engines and codecs on one process)."""
    from helpers import free_port

    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(free_port()))
    dist.init_process_group("gloo", rank=0, world_size=1)
    yield dist.group.WORLD
    dist.destroy_process_group()

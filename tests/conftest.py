import os
import uuid

import pytest
import torch

torch.set_num_threads(1)


@pytest.fixture
def memory_url():
    """A fresh memory:// run; the memory filesystem is process-global, so each test gets its own prefix."""
    import fsspec

    url = f"memory://vckpt-tests/{uuid.uuid4().hex}"
    yield url
    fs = fsspec.filesystem("memory")
    path = url.removeprefix("memory://")
    if fs.exists(path):
        fs.rm(path, recursive=True)


@pytest.fixture
def local_url(tmp_path):
    return os.fspath(tmp_path / "run")

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
def one_rank(tmp_path):
    """A real one-rank gloo group: DDP buckets the gradients and the guard's communication hook runs (FSDP2 shards
    each parameter as a DTensor over it). Even with one rank an all-reduce has not always completed when the hook
    attaches its callback, which then runs on gloo's thread (``tools/bench/count_checks.Counted`` follows it)."""
    import torch.distributed as dist

    dist.init_process_group("gloo", store=dist.FileStore(str(tmp_path / "store"), 1), rank=0, world_size=1)
    try:
        yield
    finally:
        dist.destroy_process_group()


@pytest.fixture
def local_url(tmp_path):
    return os.fspath(tmp_path / "run")


@pytest.fixture(scope="session")
def s3_server(tmp_path_factory):
    """One real S3 server (SeaweedFS ``weed mini``) on free loopback ports for the whole session."""
    import seaweed

    handle = seaweed.start(tmp_path_factory.mktemp("seaweed"))
    yield handle
    seaweed.stop(handle)


@pytest.fixture
def s3_bucket(s3_server):
    """A fresh bucket per test; s3fs instance caches cleared so no test sees another's listings."""
    import s3fs

    s3fs.S3FileSystem.clear_instance_cache()
    fs = s3fs.S3FileSystem(**s3_server.storage_options())
    bucket = f"t-{uuid.uuid4().hex[:16]}"
    fs.mkdir(bucket)
    yield bucket
    s3fs.S3FileSystem.clear_instance_cache()
    fs = s3fs.S3FileSystem(**s3_server.storage_options())
    try:
        fs.rm(bucket, recursive=True)
    except FileNotFoundError:
        pass


# The slowest test files, slowest first (their in-suite wall seconds on the 2-core host, measured with a per-test
# timer). `make test` runs two workers a file at a time in this order (`--no-loadscope-reorder`: xdist would
# otherwise hand out the files with the most tests first, and these few-test, slow files ran alone at the end).
SLOW_FIRST = ("test_campaign.py", "test_guard_fsdp.py", "test_service.py", "test_integrations_hf.py", "test_hf_fsdp.py",
              "test_integrations_lightning_tp.py", "test_titan_plans.py", "test_titan_real.py", "test_rollback_dist.py", "test_s3.py",
              "test_integrations_lightning.py", "test_guard_dist.py", "test_crash_records.py", "test_story.py",
              "test_async_and_crash.py", "test_recovery.py", "test_replay.py", "test_guard_models.py", "test_hostile.py", "test_ledger.py",
              "test_guard_contract.py", "test_sharded.py", "test_guard_pipeline.py", "test_guard_structure.py",
              "test_single_owner.py", "test_activation_checkpointing.py", "test_fleet_bounds.py", "test_owner_save.py",
              "test_chain_replicated.py", "test_run_output.py", "test_consensus_counted.py")


def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    rank = {name: i for i, name in enumerate(SLOW_FIRST)}
    items.sort(key=lambda item: rank.get(item.path.name, len(SLOW_FIRST)))  # stable: file order kept otherwise

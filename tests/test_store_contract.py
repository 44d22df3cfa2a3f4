"""The store contract on memory://, a local folder, a file:// URL and a real S3 server (SeaweedFS on loopback)."""

import contextlib
import uuid

import pytest
import s3fs

from store_contract import LocalDiskContract, StoreContract
from verified_ckpt.errors import StorageError
from verified_ckpt.store import RunStore

pytestmark = pytest.mark.timeout(60)


class TestMemoryStore(StoreContract):
    @pytest.fixture
    def url(self, memory_url):
        return memory_url


class TestLocalStore(StoreContract, LocalDiskContract):
    local_disk = True

    @pytest.fixture
    def url(self, local_url):
        return local_url


class TestFileURLStore(StoreContract, LocalDiskContract):
    local_disk = True

    @pytest.fixture
    def url(self, tmp_path):
        return f"file://{tmp_path}/run"


@pytest.fixture(scope="module")
def contract_bucket(s3_server):
    """One bucket for the S3 contract; each test gets a fresh prefix in it (a run is everything under its URL, so
    a prefix isolates as a bucket would, without a bucket's creation and removal per test: 1.6 s each here)."""
    fs = s3fs.S3FileSystem(**s3_server.storage_options())
    bucket = f"contract-{uuid.uuid4().hex[:12]}"
    fs.mkdir(bucket)
    yield bucket
    s3fs.S3FileSystem.clear_instance_cache()
    with contextlib.suppress(FileNotFoundError):
        s3fs.S3FileSystem(**s3_server.storage_options()).rm(bucket, recursive=True)


class TestS3Store(StoreContract):
    """The same contract against a real S3 server through s3fs, and what only an object store can refuse."""

    @pytest.fixture(autouse=True)
    def _options(self, s3_server):
        self.storage_options = s3_server.storage_options()

    @pytest.fixture
    def url(self, contract_bucket):
        s3fs.S3FileSystem.clear_instance_cache()  # no test sees another's cached listings
        return f"s3://{contract_bucket}/{uuid.uuid4().hex}/run"

    def test_a_denied_bucket_is_one_line_naming_the_credentials_and_no_secret(self, url):
        bad = {**self.storage_options, "secret": "wrong-secret-vckpt"}
        s3fs.S3FileSystem.clear_instance_cache()
        store = RunStore(url, bad)
        for attempt in (lambda: store.commit_manifest("c1", b"{}"), lambda: store.records.append("incident", b"{}"),
                        lambda: store.write_aside("c1", "rank-00000.json", b"{}")):
            with pytest.raises(StorageError, match="denied: check the credentials") as e:
                attempt()
            assert "\n" not in str(e.value) and "wrong-secret-vckpt" not in str(e.value)
        s3fs.S3FileSystem.clear_instance_cache()
        assert list(RunStore(url, self.storage_options).committed()) == []  # nothing was written

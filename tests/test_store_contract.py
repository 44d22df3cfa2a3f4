"""The store contract on memory:// and a local folder (S3 joins in the S3 issue)."""

import pytest

from store_contract import StoreContract


class TestMemoryStore(StoreContract):
    @pytest.fixture
    def url(self, memory_url):
        return memory_url


class TestLocalStore(StoreContract):
    @pytest.fixture
    def url(self, local_url):
        return local_url


class TestFileURLStore(StoreContract):
    @pytest.fixture
    def url(self, tmp_path):
        return f"file://{tmp_path}/run"


class TestS3Store(StoreContract):
    """The same contract against a real S3 server (SeaweedFS on loopback) through s3fs."""

    @pytest.fixture(autouse=True)
    def _options(self, s3_server):
        self.storage_options = s3_server.storage_options()

    @pytest.fixture
    def url(self, s3_bucket):
        return f"s3://{s3_bucket}/run"

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

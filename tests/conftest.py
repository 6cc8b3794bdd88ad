"""Every test runs with its own empty memplan cache directory (local device profiles live there)."""

import pytest


@pytest.fixture(autouse=True)
def _memplan_cache(tmp_path_factory, monkeypatch):
    monkeypatch.setenv("MEMPLAN_CACHE", str(tmp_path_factory.mktemp("memplan-cache")))

"""Tests across simulated hosts (tests/hosts/harness.py): skipped, with the reason, where
network and mount namespaces cannot be made (not root, tools missing)."""

import pytest

from tests.hosts.harness import available


def pytest_collection_modifyitems(config, items):
    reason = available()
    for item in items:
        if "tests/hosts/" in str(item.fspath):
            item.add_marker(pytest.mark.e2e)
            if reason:
                item.add_marker(pytest.mark.skip(reason=reason))

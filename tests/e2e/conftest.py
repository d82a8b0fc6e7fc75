"""E2E tests start real server processes with real NIXL (DRAM over UCX)."""

import pytest


def pytest_collection_modifyitems(items):
    for item in items:
        if "tests/e2e/" in str(item.fspath):
            item.add_marker(pytest.mark.e2e)


def pytest_terminal_summary(terminalreporter):
    from tests.e2e.test_matrix import REPORT

    if not REPORT:
        return
    tr = terminalreporter
    tr.section("kvsvc e2e matrix: descriptors per D rank (coalesced) and the bound they must stay under")
    tr.write_line(f"{'cell':<22}{'category':<18}{'P->D':>6}{'bytes':>10}  {'descriptors per D rank':<34}bound")
    for r in REPORT:
        per = ",".join(f"{k}:{v}" for k, v in sorted(r["descriptors_per_rank"].items()))
        if len(per) > 32:
            per = per[:29] + "..."
        tr.write_line(f"{r['cell']:<22}{r['category']:<18}{str(r['p_tp']) + '->' + str(r['d_tp']):>6}"
                      f"{r['bytes']:>10}  {per:<34}{r['bound'] if r['bound'] is not None else 'n/a (block ratio)'}")

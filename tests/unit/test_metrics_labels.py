"""Metric labels taken from requests are bounded: a caller cannot grow the registry without limit."""

from __future__ import annotations

from kvsvc.service.metrics import MAX_LABEL_VALUES, Metrics


def test_peer_engine_and_reason_labels_are_capped():
    m = Metrics("e")
    for i in range(MAX_LABEL_VALUES + 50):
        m.transfer_failed(f"peer-{i}", f"REASON_{i}")
    samples = [s for fam in m.registry.collect() if fam.name == "kvsvc_transfers" for s in fam.samples
               if s.name == "kvsvc_transfers_total"]
    peers = {s.labels["peer_engine"] for s in samples}
    assert len(peers) == MAX_LABEL_VALUES + 1 and "other" in peers
    other = [s for s in samples if s.labels["peer_engine"] == "other"]
    assert sum(s.value for s in other) == 50
    assert sum(s.value for s in samples) == MAX_LABEL_VALUES + 50  # nothing lost, only folded

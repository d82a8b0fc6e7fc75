"""Each injected fault (service/faults.py) with real servers: the transfer it hits ends with
its typed error and no wrong bytes, P's lease ends, and the next transfer is right. The
engine-level matrix (tests/vllm/test_chaos_engines.py) relies on these being exact."""

from __future__ import annotations

from kvsvc.cli.procs import ServerProcess, start_server
from kvsvc.errors import KvsvcError
from tests.e2e.harness import layout_table, leases_drained, session

LAYOUT = layout_table(k=4)
# Transfer / lease i gets point i of its cycle: six faults, then two clean transfers.
D_CYCLE = ["read_error", "cancel_mid_read", "claim_lost", "corrupt_landed", "-", "-", "-", "-"]
P_CYCLE = ["-", "-", "-", "-", "lease_released", "block_rewritten", "-", "-"]
WANT = ["NIXL_ERROR", "CANCELLED", "PEER_UNAVAILABLE", "DIGEST_MISMATCH", "LEASE_EXPIRED", "DIGEST_MISMATCH", None, None]


def start(engine: str, role: str, cycle: list[str], tmp_path) -> ServerProcess:
    cfg = tmp_path / f"{engine}.toml"
    cfg.write_text("[server]\ncontent_digest = true\n")
    return start_server(engine_id=engine, role=role, tp_size=1, layout=LAYOUT, config_file=str(cfg),
                        extra_env={"KVSVC_FAULTS": ",".join(cycle)})


async def test_every_fault_point_ends_its_transfer_typed_and_the_next_one_is_right(tmp_path):
    p, d = start("f-p", "prefill", P_CYCLE, tmp_path), start("f-d", "decode", D_CYCLE, tmp_path)
    try:
        async with session(p, d) as s:
            assert "faults" in (await s.dc.get_info()).capabilities
            got = []
            for i in range(len(WANT)):
                s.pe.fill([[1 + i, 20 + i]])
                pub = await s.pc.publish_blocks(f"f{i}", [[1 + i, 20 + i]])
                try:
                    await s.dc.transfer(f"d-f{i}", pub.params, [[10 + i, 18 + i]])
                    got.append(None)
                    assert not s.de.check([[10 + i, 18 + i]]), i  # what passes is right
                except KvsvcError as e:
                    got.append(str(e.reason))
                assert await leases_drained(s.pc) == 0, (i, got)  # P's lease ended either way
            assert got == WANT
    finally:
        p.stop()
        d.stop()

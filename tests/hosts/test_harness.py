"""The host harness itself: hosts are apart, and nothing of them outlives it."""

from __future__ import annotations

import contextlib
import errno
import os
import select
import signal
import subprocess
import sys
import time

from tests.hosts.harness import hosts, own_links, remove_stale


def _ours(pid: int) -> list[str]:
    return [n for n in own_links() if f"{pid}h" in n or n.endswith(str(pid))]


def test_hosts_are_apart_and_reach_each_other():
    with hosts(2) as (a, b):
        assert a.run(["hostname"]).stdout.strip() == "kvsvc-h0" != b.run(["hostname"]).stdout.strip()
        a.run(["sh", "-c", f"echo x > /dev/shm/mine && echo y > {a.tmp}/mine"])
        assert b.run(["sh", "-c", f"ls /dev/shm {b.tmp}"]).stdout.split() == ["/dev/shm:", f"{b.tmp}:"], "private"
        assert not os.path.exists("/dev/shm/mine") and not os.path.exists(f"{a.tmp}/mine")
        assert a.run(["sh", "-c", "echo $TMPDIR"]).stdout.strip() == a.tmp
        reach = [sys.executable, "-c", "import socket,sys; socket.create_connection((sys.argv[1], int(sys.argv[2])), 5)"]
        server = b.popen([sys.executable, "-c", "import socket; s=socket.create_server(('0.0.0.0', 7777)); "
                                                "print('up', flush=True); s.accept()"], stdout=subprocess.PIPE)
        assert server.stdout is not None and server.stdout.readline().strip() == "up"
        assert a.run([*reach, b.address, "7777"]).returncode == 0
        server.wait(10)
        b.link(False)  # unplugged: a cannot reach b any more
        assert a.run([*reach, b.address, "7777"], check=False).returncode != 0
    assert not _ours(os.getpid())


def test_nothing_outlives_a_harness_that_is_killed():
    """A test process killed mid-run (SIGKILL: no cleanup code runs): its hosts' processes die
    with it, their namespaces and veths with them; the next harness removes its bridge."""
    child = subprocess.Popen(
        [sys.executable, "-c", "import sys, time\nfrom tests.hosts.harness import hosts\n"
         "with hosts(2) as hs:\n    hs[0].popen(['sleep', '600'])\n"
         "    print(' '.join(str(h.pid) for h in hs), flush=True)\n    time.sleep(600)\n"],
        stdout=subprocess.PIPE, text=True, cwd=os.getcwd())
    assert child.stdout is not None
    inits = [int(p) for p in child.stdout.readline().split()]
    assert len(inits) == 2 and _ours(child.pid)
    # Kill only once the host's `sleep 600` runs: setpriv sets its parent-death signal just
    # before it execs, and a parent killed before that moment is not seen by the child
    # (it then lives on, reparented). A CI run once killed the harness that early. Its pid,
    # as the harness's child: another `sleep 600` on the machine is not this one.
    sleep = _started(child.pid, "^sleep 600$")
    child.send_signal(signal.SIGKILL)
    child.wait(GONE_S)
    child.stdout.close()
    # Their parents' deaths sent them SIGKILL; waited for as each exits (a pidfd), not polled
    # against a short deadline: on a loaded host a 10 s poll once still found the sleep running.
    assert not _outliving(inits), "a host's processes outlived the harness"
    assert not _outliving([sleep]), "the host's sleep outlived the harness"
    removed = remove_stale()
    assert f"kvb{child.pid}" in removed and not _ours(child.pid)


# Bounds on waits for what a correct harness does at once; reached only if it is broken.
GONE_S = 120.0


def _started(parent: int, pattern: str) -> int:
    """The pid of parent's child whose command line matches pattern, once it runs."""
    deadline = time.monotonic() + GONE_S
    while True:
        found = subprocess.run(["pgrep", "-P", str(parent), "-f", pattern], capture_output=True, text=True)
        if found.returncode == 0:
            return int(found.stdout.split()[0])
        assert time.monotonic() < deadline, f"no child of {parent} matching {pattern!r} started"
        time.sleep(0.05)


def _outliving(pids: list[int]) -> list[int]:
    """Those of pids still running after waiting up to GONE_S for each to exit (on its pidfd)."""
    fds: dict[int, int] = {}
    for pid in pids:
        with contextlib.suppress(ProcessLookupError):
            fds[pid] = os.pidfd_open(pid)
    try:
        deadline = time.monotonic() + GONE_S
        waiting = dict(fds)
        while waiting and (left := deadline - time.monotonic()) > 0:
            ready, _, _ = select.select(list(waiting.values()), [], [], left)
            waiting = {pid: fd for pid, fd in waiting.items() if fd not in ready}
        return [pid for pid in pids if _alive(pid)]
    finally:
        for fd in fds.values():
            os.close(fd)


def _alive(pid: int) -> bool:
    """Running (a zombie waiting for whoever reaps orphans counts as gone)."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] != "Z"
    except FileNotFoundError:
        return False


def test_a_rebooted_host_keeps_its_address_and_loses_everything_else():
    """reboot(): every process on the host dies (those started through its launcher by
    someone else too), its /dev/shm and temp dir come back empty, its boot id is new, and
    it answers at the same address."""
    with hosts(2) as (a, b):
        outsider = subprocess.Popen([*a.launcher, "sleep", "600"])  # not in a.procs
        a.run(["sh", "-c", f"echo x > /dev/shm/mine && echo y > {a.tmp}/mine"])
        boot_id = a.run(["cat", "/proc/sys/kernel/random/boot_id"]).stdout
        a.reboot()
        assert outsider.wait(10) == -signal.SIGKILL
        assert a.run(["sh", "-c", f"ls /dev/shm {a.tmp}"]).stdout.split() == ["/dev/shm:", f"{a.tmp}:"]
        assert a.run(["cat", "/proc/sys/kernel/random/boot_id"]).stdout != boot_id
        # Reachable: a closed port answers "connection refused" (an unplugged host would not answer).
        knock = [sys.executable, "-c", "import socket,sys; s=socket.socket(); s.settimeout(5); "
                 "print(s.connect_ex((sys.argv[1], 9)))", a.address]
        assert b.run(knock).stdout.strip() == str(errno.ECONNREFUSED)
    assert not _ours(os.getpid())

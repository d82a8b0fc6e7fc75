"""Simulated hosts on one Linux machine, for kvsvc across hosts.

A host is a process (its "init": `sleep infinity`) in namespaces of its own -- network
(its own address on a bridge this harness made, in 198.18.0.0/15, the range RFC 2544 sets
aside for benchmarking and no network routes), mount (a private /dev/shm and temp dir, so
no shared memory segment or Unix socket is visible from another host, and a boot id of its
own, by which UCX tells machines apart) and UTS (its own hostname) -- and the commands run
in it through nsenter, with TMPDIR set to the host's temp dir. That dir is a tmpfs mounted,
in each host, over one path made for the purpose (not over /tmp: the checkout running the
tests may live under /tmp and must stay visible). Only the addresses made here are ever dialled. Not simulated: RDMA
NICs, NIC and NUMA affinity, real link latency and loss (no tc netem in this kernel).

Nothing outlives the harness: every process started in a host, and the init, get SIGKILL
when the process that started them dies (PR_SET_PDEATHSIG, through setpriv), which takes
the network namespace and its veth pair with them; the bridge is deleted on close, and one
left by a harness that was itself killed is deleted by the next one (names carry the
owner's pid). (A process whose starter dies in the instant before setpriv sets its signal
outlives it: setpriv does not check for that.) Needs root (CAP_NET_ADMIN and CAP_SYS_ADMIN); available() says why not.

    python -m tests.hosts.harness 2     # two hosts, a shell prompt's worth of how to use them
"""

from __future__ import annotations

import contextlib
import os
import re
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field

SUBNET = "198.18"  # RFC 2544's benchmarking range: nothing outside this machine answers there
BRIDGE = "kvb{pid}"
VETH = "kvv{pid}h{n}"  # the host's cable, bridge side (15 characters at most)
OWNED = re.compile(r"kv[bv](\d+)(?:h\d+)?")
TOOLS = ("ip", "nsenter", "unshare", "setpriv")


def available() -> str | None:
    """None when hosts can be made here, else why not."""
    missing = [t for t in TOOLS if shutil.which(t) is None]
    if missing:
        return f"needs {', '.join(missing)}"
    if os.geteuid() != 0:
        return "needs root (CAP_NET_ADMIN and CAP_SYS_ADMIN) for network and mount namespaces"
    return None


def _ip(*args: str, check: bool = True) -> subprocess.CompletedProcess[str]:
    return subprocess.run(["ip", *args], capture_output=True, text=True, check=check, timeout=30)


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def own_links() -> list[str]:
    """Links (bridges, veths) some harness made, whoever owns them."""
    names = re.findall(r"^\d+: ([^:@\s]+)", _ip("-o", "link", "show").stdout, re.M)
    return [n for n in names if OWNED.fullmatch(n)]


def remove_stale() -> list[str]:
    """Delete the links of harnesses that died without cleaning up (their veths went with
    their namespaces; a bridge stays). Returns what was removed."""
    removed = []
    for name in own_links():
        m = OWNED.fullmatch(name)
        assert m is not None
        if not _alive(int(m.group(1))):
            if _ip("link", "del", name, check=False).returncode == 0:
                removed.append(name)
    return removed


def _free_subnet() -> str:
    used = set(re.findall(rf"inet {re.escape(SUBNET)}\.(\d+)\.", _ip("-o", "-4", "addr", "show").stdout))
    for k in [os.getpid() % 250 + 1, *range(1, 251)]:
        if str(k) not in used:
            return f"{SUBNET}.{k}"
    raise RuntimeError(f"every {SUBNET}.k.0/24 is taken on this machine")


def _launcher(pid: int, tmp: str) -> list[str]:
    """Run a command in host `pid`'s namespaces, with its temp dir; it dies with whoever started it."""
    return ["nsenter", f"--target={pid}", "--net", "--mount", "--uts", "--",
            "setpriv", "--pdeathsig", "KILL", "--", "env", f"TMPDIR={tmp}"]


@dataclass
class Host:
    name: str
    address: str
    veth: str
    bridge: str
    tmp: str  # this host's temp dir (TMPDIR of everything run on it)
    init: subprocess.Popen[str] | None = None
    procs: list[subprocess.Popen[str]] = field(default_factory=list)

    @property
    def pid(self) -> int:
        assert self.init is not None, f"host {self.name} is not running"
        return self.init.pid

    @property
    def launcher(self) -> list[str]:
        """Prefix for a command to run on this host (as kvsvc.cli.procs.start_server's launcher)."""
        return _launcher(self.pid, self.tmp)

    def run(self, argv: Sequence[str], timeout_s: float = 60, check: bool = True) -> subprocess.CompletedProcess[str]:
        return subprocess.run([*self.launcher, *argv], capture_output=True, text=True, timeout=timeout_s, check=check)

    def popen(self, argv: Sequence[str], **kw) -> subprocess.Popen[str]:
        p = subprocess.Popen([*self.launcher, *argv], text=True, **kw)
        self.procs.append(p)
        return p

    def write(self, path: str, text: str) -> str:
        """Write a file at `path` as this host sees it (its temp dir is its own); returns path."""
        with open(f"/proc/{self.pid}/root{path}", "w") as f:
            f.write(text)
        return path

    @property
    def shm_dir(self) -> str:
        """This host's /dev/shm as seen from outside it (to map a server's pools)."""
        return f"/proc/{self.pid}/root/dev/shm"

    def link(self, up: bool) -> None:
        """Plug or unplug this host's cable (its bridge-side veth): a network partition."""
        _ip("link", "set", self.veth, "up" if up else "down")

    def connections(self, pid: int | None = None) -> set[tuple[str, str]]:
        """Established TCP connections on this host as (local, peer) "ip:port" pairs, of
        process `pid` only when given (from ss, run on the host)."""
        argv = ["ss", "-tnH", *(["-p"] if pid is not None else []), "state", "established"]
        pairs = set()
        for line in self.run(argv).stdout.splitlines():
            cols = line.split()
            if len(cols) < 4 or (pid is not None and f"pid={pid}," not in line):
                continue
            pairs.add((_plain(cols[2]), _plain(cols[3])))
        return pairs

    def boot(self) -> None:
        """Start the host: its init in new namespaces, its cable plugged into the bridge."""
        # A boot id of its own too: UCX tells hosts apart by it (same boot id: same machine,
        # and it would read across "hosts" with cma, which only one kernel can do).
        setup = ("mount --make-rprivate / && mount -t tmpfs -o size=4g,mode=1777 tmpfs /dev/shm && "
                 "mount -t tmpfs -o mode=0700 tmpfs \"$2\" && mkdir -m 0700 \"$2/.host\" && "
                 "cat /proc/sys/kernel/random/uuid > \"$2/.host/boot_id\" && "
                 "mount --bind \"$2/.host/boot_id\" /proc/sys/kernel/random/boot_id && "
                 "hostname \"$1\" && ip link set lo up && echo ready && exec sleep infinity")
        init = subprocess.Popen(["setpriv", "--pdeathsig", "KILL", "--", "unshare", "--net", "--mount", "--uts",
                                 "sh", "-c", setup, "sh", f"kvsvc-{self.name}", self.tmp],
                                stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
        assert init.stdout is not None
        if init.stdout.readline().strip() != "ready":
            init.kill()
            raise RuntimeError(f"host {self.name} did not start: {init.stderr.read() if init.stderr else ''}")
        self.init = init
        inner = self.veth.replace("kvv", "kvi", 1)
        try:
            _ip("link", "add", self.veth, "type", "veth", "peer", "name", inner)
            _ip("link", "set", inner, "netns", str(init.pid))
            _ip("link", "set", self.veth, "master", self.bridge, "up")
            # The NIC's MAC follows from the address, so a host that reboots keeps it, as a
            # machine does (a new one would leave its neighbours' ARP caches pointing at the
            # old card for many seconds).
            mac = "02:00:" + ":".join(f"{int(x):02x}" for x in self.address.split("."))
            for cmd in (["link", "set", inner, "name", "eth0"], ["link", "set", "eth0", "address", mac],
                        ["addr", "add", f"{self.address}/24", "dev", "eth0"], ["link", "set", "eth0", "up"]):
                self.run(["ip", *cmd])
        except BaseException:
            self.halt()
            raise

    def halt(self) -> None:
        """Kill everything on the host, whoever started it (its namespaces, /dev/shm and temp
        dir go with the last process; the cable with the network namespace)."""
        if self.init is None:
            return
        ns = os.readlink(f"/proc/{self.init.pid}/ns/net")
        for p in self.procs:
            _stop(p)
        for pid in _pids_in(ns):  # processes started by others (a server through the launcher)
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGKILL)
        _stop(self.init)
        deadline = time.monotonic() + 10
        while _pids_in(ns) and time.monotonic() < deadline:
            time.sleep(0.02)
        _wait_gone(self.veth)
        self.init, self.procs = None, []

    def reboot(self) -> None:
        """Power-cycle: everything on it killed, its memory gone; the same name, address and
        cable come back (a new boot id: to UCX, a new machine run)."""
        self.halt()
        self.boot()


def _plain(endpoint: str) -> str:
    """ss's "[::ffff:1.2.3.4]:80" (an IPv4 peer of an IPv6 socket) as "1.2.3.4:80"."""
    return endpoint.replace("[::ffff:", "").replace("]", "")


def _pids_in(net_ns: str) -> list[int]:
    """Processes in the network namespace named by `net_ns` (a readlink of /proc/PID/ns/net)."""
    pids = []
    for entry in os.listdir("/proc"):
        if entry.isdigit():
            with contextlib.suppress(OSError):
                if os.readlink(f"/proc/{entry}/ns/net") == net_ns:
                    pids.append(int(entry))
    return pids


class Hosts:
    """N hosts on one bridge; the machine running this is on it too (at .254)."""

    def __init__(self, count: int) -> None:
        reason = available()
        if reason:
            raise RuntimeError(reason)
        remove_stale()
        self.pid = os.getpid()
        self.bridge = BRIDGE.format(pid=self.pid)
        self.hosts: list[Host] = []
        self.tmp = f"{tempfile.gettempdir()}/kvsvc-hosts-{self.pid}"  # each host mounts its own tmpfs here
        try:
            os.makedirs(self.tmp, mode=0o700, exist_ok=True)
            self.subnet = _free_subnet()
            _ip("link", "add", self.bridge, "type", "bridge")
            _ip("addr", "add", f"{self.subnet}.254/24", "dev", self.bridge)
            _ip("link", "set", self.bridge, "up")
            for n in range(count):
                host = Host(f"h{n}", f"{self.subnet}.{n + 1}", VETH.format(pid=self.pid, n=n), self.bridge, self.tmp)
                host.boot()
                self.hosts.append(host)
        except BaseException:
            self.close()
            raise

    def __enter__(self) -> list[Host]:
        return self.hosts

    def __exit__(self, *exc: object) -> None:
        self.close()

    def close(self) -> None:
        """Kill everything on every host (their namespaces and veths go with their last
        process), then the bridge."""
        for h in self.hosts:
            h.halt()
        _ip("link", "del", self.bridge, check=False)
        self.hosts = []
        with contextlib.suppress(OSError):
            os.rmdir(self.tmp)


def _stop(p: subprocess.Popen[str]) -> None:
    if p.poll() is None:
        p.send_signal(signal.SIGKILL)
    with contextlib.suppress(subprocess.TimeoutExpired):
        p.wait(10)
    for f in (p.stdin, p.stdout, p.stderr):
        if f is not None:
            with contextlib.suppress(OSError):
                f.close()


def _wait_gone(link: str, timeout_s: float = 10) -> None:
    """The kernel removes a namespace's veth pair a moment after its last process died."""
    deadline = time.monotonic() + timeout_s
    while _ip("link", "show", link, check=False).returncode == 0:
        if time.monotonic() > deadline:
            _ip("link", "del", link, check=False)
            return
        time.sleep(0.05)


@contextlib.contextmanager
def hosts(count: int) -> Iterator[list[Host]]:
    with Hosts(count) as made:
        yield made


def main(argv: list[str] | None = None) -> int:
    count = int((argv or sys.argv[1:] or ["2"])[0])
    with hosts(count) as made:
        for h in made:
            print(f"{h.name}: {h.address} (init pid {h.pid}): {' '.join(h.launcher)} <command>")
        print("press Enter to tear them down", flush=True)
        with contextlib.suppress(EOFError):
            input()
    return 0


if __name__ == "__main__":
    sys.exit(main())

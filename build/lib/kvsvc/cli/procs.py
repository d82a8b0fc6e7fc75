"""Start `kvsvc serve` as a child process on a free loopback port, and stop it cleanly."""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

_LISTENING = re.compile(r"kvsvc listening on ([^\s,]+)")


@dataclass
class ServerProcess:
    """A running `kvsvc serve`; .address is its host:port, .output what it printed."""

    proc: subprocess.Popen[str]
    address: str
    output: list[str] = field(default_factory=list)
    _reader: threading.Thread | None = None

    def stop(self, timeout_s: float = 15.0) -> int:
        """SIGTERM (graceful shutdown), then SIGKILL if it does not exit in time; returns the exit code."""
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(timeout_s)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
        if self._reader is not None:
            self._reader.join(2)
        if self.proc.stdout is not None:
            self.proc.stdout.close()
        return self.proc.returncode

    def dump_stacks(self) -> None:
        """Ask the server where its threads and tasks wait (SIGUSR1): the lines land in .output."""
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGUSR1)

    def kill(self) -> None:
        if self.proc.poll() is None:
            self.proc.kill()
            self.proc.wait()


def split_ranks(tp_size: int, servers: int) -> list[list[int]]:
    """TP ranks split as evenly as possible over `servers` servers, in order."""
    if not 1 <= servers <= tp_size:
        raise ValueError(f"cannot split TP {tp_size} over {servers} servers")
    return [list(range(tp_size))[i * tp_size // servers:(i + 1) * tp_size // servers] for i in range(servers)]


def start_engine(*, engine_id: str, role: str, tp_size: int, layout: Mapping[str, Any], servers: int = 1,
                 listens: Sequence[str] | None = None, **kw: Any) -> list[ServerProcess]:
    """An engine as `servers` server processes, ranks split evenly; the first lists the others as
    siblings (PublishBlocks goes there). listens: fixed addresses (restarts), else free ports."""
    groups = split_ranks(tp_size, servers)
    listens = list(listens or ["127.0.0.1:0"] * servers)
    started: list[ServerProcess] = []
    try:
        for ranks, listen in list(zip(groups, listens, strict=True))[1:]:
            started.append(start_server(engine_id=engine_id, role=role, tp_size=tp_size, layout=layout,
                                        ranks=ranks, listen=listen, **kw))
        lead = start_server(engine_id=engine_id, role=role, tp_size=tp_size, layout=layout, ranks=groups[0],
                            listen=listens[0], siblings=[sp.address for sp in started] if role != "decode" else (),
                            **kw)
    except BaseException:
        for sp in started:
            sp.stop()
        raise
    return [lead, *started]


def start_server(
    *, engine_id: str, role: str, tp_size: int, layout: Mapping[str, Any], ranks: Sequence[int] | None = None,
    memory: str = "dram", listen: str = "127.0.0.1:0", extra_env: Mapping[str, str] | None = None,
    timeout_s: float = 60.0, config_file: str | None = None, siblings: Sequence[str] = (),
    global_args: Sequence[str] = (), launcher: Sequence[str] = (),
) -> ServerProcess:
    """Spawn a server and wait until it prints its address (raises with its output if it dies).

    launcher: a command prefix the server runs under (e.g. nsenter into a simulated host)."""
    env = dict(os.environ, **(extra_env or {}))
    cmd = [*launcher, sys.executable, "-m", "kvsvc.cli.main", *(["-vv"] if env.get("KVSVC_DEBUG") else []), *global_args, "serve", "--listen", listen, "--engine-id", engine_id,
           "--role", role, "--tp-size", str(tp_size), "--memory", memory, "--layout-json", json.dumps(layout)]
    if ranks is not None:
        cmd += ["--ranks", ",".join(map(str, ranks))]
    if config_file is not None:
        cmd += ["--config", config_file]
    if siblings:
        cmd += ["--siblings", ",".join(siblings)]
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=env)
    out: list[str] = []
    deadline = time.monotonic() + timeout_s
    assert proc.stdout is not None
    while True:
        line = proc.stdout.readline()
        if not line:
            proc.wait()
            proc.stdout.close()
            raise RuntimeError(f"kvsvc serve exited ({proc.returncode}) before listening:\n{''.join(out)}")
        out.append(line)
        m = _LISTENING.search(line)
        if m:
            break
        if time.monotonic() > deadline:
            proc.kill()
            proc.wait()
            proc.stdout.close()
            raise RuntimeError(f"kvsvc serve did not start in {timeout_s} s:\n{''.join(out)}")
    sp = ServerProcess(proc, m.group(1), out)

    def drain() -> None:  # keep the pipe empty so the child never blocks on its logs
        assert proc.stdout is not None
        for line in proc.stdout:
            out.append(line)

    sp._reader = threading.Thread(target=drain, daemon=True)
    sp._reader.start()
    return sp

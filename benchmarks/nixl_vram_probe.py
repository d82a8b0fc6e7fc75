"""Raw NIXL between two processes over GPU memory, with no kvsvc in the way: which UCX
transport a READ of VRAM takes, and how fast, depending on the thread that makes the agents.

    python benchmarks/nixl_vram_probe.py [--mib 256] [--runs 5]

For each mode a P process registers a VRAM tensor with NIXL and a D process (this one)
READs all of it into its own, times the READ and checks the bytes:
  main           agents made and driven on the thread that allocated the tensors (torch
                 made the CUDA context current there);
  thread         agents made and driven on another thread, where no CUDA context is current;
  thread+device  the same after torch.cuda.set_device on that thread (what kvsvc's NIXL thread does).
UCX's protocol choice (UCX_PROTO_INFO) is printed per mode.
"""

from __future__ import annotations

import argparse
import concurrent.futures
import json
import os
import select
import subprocess
import sys
import tempfile
import time

MODES = ("main", "thread", "thread+device")


def _runner(mode: str):
    """How NIXL calls run in this mode: a call-through, or a one-thread executor."""
    if mode == "main":
        return lambda f, *a: f(*a)
    pool = concurrent.futures.ThreadPoolExecutor(1)
    if mode == "thread+device":
        import torch

        pool.submit(torch.cuda.set_device, 0).result()
    return lambda f, *a: pool.submit(f, *a).result()


KIND = "VRAM"
DEVICE = "cuda"


def _agent(name: str, mode: str, tensor):
    from nixl._api import nixl_agent, nixl_agent_config

    run = _runner(mode)
    agent = run(nixl_agent, name, nixl_agent_config(enable_prog_thread=False, backends=["UCX"]))
    run(agent.register_memory, [(tensor.data_ptr(), tensor.numel(), 0, "")], KIND)
    return run, agent


def _pattern(nbytes: int):
    import torch

    out = torch.arange(nbytes, dtype=torch.int64, device=DEVICE).to(torch.uint8)
    _sync()
    return out


def _sync() -> None:
    if DEVICE == "cuda":
        import torch

        torch.cuda.synchronize()


def serve(mode: str, nbytes: int) -> None:
    src = _pattern(nbytes)
    run, agent = _agent(f"probe-p-{mode}", mode, src)
    meta = run(agent.get_agent_metadata)
    print(json.dumps({"meta": bytes(meta).hex(), "addr": src.data_ptr()}), flush=True)
    # Progress until D is done: the connection's wire-up needs both sides to progress
    # (the READ itself then runs without P).
    while not select.select([sys.stdin], [], [], 0.001)[0]:
        run(agent.get_new_notifs)


def probe(mode: str, nbytes: int, runs: int, p_log: str) -> dict:
    import torch

    env = dict(os.environ, UCX_PROTO_INFO="y", UCX_LOG_FILE=p_log)
    p = subprocess.Popen([sys.executable, __file__, "--serve", mode, "--bytes", str(nbytes), "--memory", DEVICE],
                         stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True, env=env)
    try:
        assert p.stdout is not None and p.stdin is not None
        line = ""
        while not line.startswith('{"meta"'):  # NIXL may print to stdout first
            line = p.stdout.readline()
            if not line:
                raise RuntimeError(f"P exited ({p.wait()})")
        hello = json.loads(line)
        dst = torch.zeros(nbytes, dtype=torch.uint8, device=DEVICE)
        _sync()
        run, agent = _agent(f"probe-d-{mode}", mode, dst)
        peer = run(agent.add_remote_agent, bytes.fromhex(hello["meta"]))
        local = run(agent.get_xfer_descs, [(dst.data_ptr(), nbytes, 0)], KIND)
        remote = run(agent.get_xfer_descs, [(hello["addr"], nbytes, 0)], KIND)
        times = []
        for i in range(runs + 1):
            handle = run(agent.initialize_xfer, "READ", local, remote, peer)
            t0 = time.perf_counter()
            state = run(agent.transfer, handle)
            while state == "PROC":
                state = run(agent.check_xfer_state, handle)
            _sync()
            if i:
                times.append(time.perf_counter() - t0)
            run(agent.release_xfer_handle, handle)
            if state != "DONE":
                raise RuntimeError(f"READ ended {state}")
        ok = bool(torch.equal(dst, _pattern(nbytes)))
        times.sort()
        return {"mode": mode, "gbps": nbytes / times[len(times) // 2] / 1e9, "verified": ok}
    finally:
        if p.stdin:
            p.stdin.write("\n")
            p.stdin.close()
        p.wait(30)


def read_tables(lines: list[str]) -> list[str]:
    """UCX's protocol tables for remote reads (ucp_get*) from its log: title and rows."""
    out: list[str] = []
    keep, title = False, ""
    for ln in lines:
        cell = ln.split("]", 2)[-1].strip()
        if "cfg#" in cell:
            keep, title = False, cell
        elif "read by ucp_get" in cell:
            keep = True
            out += [title, cell]
        elif keep and cell.startswith("|"):
            out.append(cell)
    return out[:40]


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--mib", type=int, default=256)
    ap.add_argument("--runs", type=int, default=5)
    ap.add_argument("--modes", default=",".join(MODES))
    ap.add_argument("--memory", choices=("cuda", "cpu"), default="cuda", help="cpu: host memory (a check of the probe)")
    ap.add_argument("--serve", help=argparse.SUPPRESS)
    ap.add_argument("--bytes", type=int, help=argparse.SUPPRESS)
    args = ap.parse_args()
    global KIND, DEVICE
    DEVICE, KIND = args.memory, ("VRAM" if args.memory == "cuda" else "DRAM")
    if args.serve:
        serve(args.serve, args.bytes)
        return 0
    logdir = tempfile.mkdtemp(prefix="probe-ucx-")
    d_log = f"{logdir}/d.log"
    os.environ.update(UCX_PROTO_INFO="y", UCX_LOG_FILE=d_log)  # read once, at this process's first agent
    seen = 0
    for mode in args.modes.split(","):
        p_log = f"{logdir}/p-{mode}.log"
        try:
            res = probe(mode, args.mib << 20, args.runs, p_log)
        except Exception as e:  # one mode failing must not hide the others
            res = {"mode": mode, "error": f"{type(e).__name__}: {e}"}
        print(json.dumps(res), flush=True)
        for label, path in (("D", d_log), ("P", p_log)):
            try:
                with open(path, errors="replace") as fh:
                    lines = [ln.rstrip() for ln in fh]
            except OSError:
                continue
            new = lines[seen:] if label == "D" else lines
            if label == "D":
                seen = len(lines)
            print(f"  UCX log of {label} ({mode}): {len(new)} lines", *read_tables(new), sep="\n    ")
    return 0


if __name__ == "__main__":
    sys.exit(main())

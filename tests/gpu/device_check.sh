#!/usr/bin/env bash
# The GPU checks in one bounded run, for a machine with an NVIDIA GPU: facts about the
# machine, tests/gpu, then `kvsvc bench` over VRAM and over DRAM side by side.
#
#   bash tests/gpu/device_check.sh [OUT_DIR]
#
# Uses the python3 on PATH (or $PY), which must have a CUDA torch. Where the machine cannot
# install packages, put wheels of what it lacks in .whl/ (nixl, nixl-cuXX, grpcio-*,
# protobuf, opentelemetry-*, pytest-asyncio): they are unpacked into a private directory
# first. Each step has its own time limit, so one hang still leaves the others' results.
set -u
OUT=${1:-${OUT:-gpu-out}}
PY=${PY:-python3}
mkdir -p "$OUT"
export PYTHONUNBUFFERED=1 PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}"
if compgen -G ".whl/*.whl" >/dev/null; then
    site=$(mktemp -d /tmp/kvsvc-site-XXXX)
    for w in .whl/*.whl; do "$PY" -m zipfile -e "$w" "$site" || echo "could not unpack $w"; done
    export PYTHONPATH="$site:$PYTHONPATH"
fi

step() { echo; echo "=== $1 ($(date +%T))"; }

step "machine"
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv 2>&1 | tee "$OUT/nvidia-smi.txt"
timeout 120 "$PY" - <<'EOF' 2>&1 | tee "$OUT/facts.txt"
import platform, torch
print("python", platform.python_version(), "torch", torch.__version__, "cuda", torch.version.cuda,
      "devices", torch.cuda.device_count(), torch.cuda.get_device_name(0) if torch.cuda.is_available() else "-")
from kvsvc.transport.nixl_agents import load_nixl
api = load_nixl()
print("nixl api", api.__file__)
import grpc, google.protobuf
print("grpcio", grpc.__version__, "protobuf", google.protobuf.__version__)
EOF

if [ -z "${NO_PROBE:-}" ]; then
step "raw NIXL over VRAM between two processes, by thread (benchmarks/nixl_vram_probe.py)"
timeout 120 "$PY" benchmarks/nixl_vram_probe.py --mib 256 --runs 5 2>&1 | grep -v "NIXL INFO" | tee "$OUT/probe.txt"
echo "--- the same on the allocating thread with UCX_TLS=cuda_ipc,cuda_copy,sm,self (no TCP)"
UCX_TLS=cuda_ipc,cuda_copy,sm,self timeout 60 "$PY" benchmarks/nixl_vram_probe.py --mib 256 --runs 5 --modes main 2>&1 \
    | grep -v "NIXL INFO" | tail -30 | tee -a "$OUT/probe.txt"
fi

step "bench: VRAM"
timeout 200 "$PY" -m kvsvc.cli.main bench --memory vram --runs 5 --max-mib 256 --requests 200 -q \
    --json "$OUT/bench-vram.json" 2>&1 | tee "$OUT/bench-vram.txt" | tail -45

step "tests/gpu"
timeout 300 "$PY" -m pytest -p no:cacheprovider -p no:warnings -q -rfE -p no:logging --timeout 120 -s tests/gpu \
    2>&1 | tee "$OUT/pytest-gpu.txt" | tail -60

if [ -n "${WITH_DRAM:-}" ]; then
step "bench: DRAM, same machine"
timeout 150 "$PY" -m kvsvc.cli.main bench --memory dram --runs 5 --max-mib 64 --requests 200 -q \
    --json "$OUT/bench-dram.json" 2>&1 | tee "$OUT/bench-dram.txt" | tail -45
fi

step "vLLM P/D on one GPU: kvsvc and NixlConnector against the aggregated engine, then kvsvc streamed (tests/gpu/vllm_pd_one_gpu.py)"
if "$PY" -c "import vllm" 2>/dev/null; then
    timeout 540 "$PY" -m tests.gpu.vllm_pd_one_gpu --out "$OUT" 2>&1 | tee "$OUT/vllm-pd.txt" | tail -20
else
    echo "vLLM is not installed for $PY: skipped (install vllm==0.32.0 and kvsvc[vllm] to run it)"
fi

step "done"

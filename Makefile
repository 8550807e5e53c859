# Quick start: `make example` and `make test`. Both install what is missing
# (Debian 12, as root or with sudo), configure, build and run.
BUILD ?= build
BUILD_TYPE ?= Release
JOBS ?= $(shell nproc)
CMAKE_ARGS ?=

DEBIAN_PACKAGES := cmake g++ make libtorch-dev googletest libgtest-dev libbenchmark-dev python3-torch

.PHONY: deps configure build test example bench clean

deps:
	@./scripts/install-deps $(DEBIAN_PACKAGES)

configure: deps
	cmake -S . -B $(BUILD) -DCMAKE_BUILD_TYPE=$(BUILD_TYPE) $(CMAKE_ARGS)

build: configure
	cmake --build $(BUILD) -j $(JOBS)

test: build
	cd $(BUILD) && ctest --output-on-failure -j $(JOBS)

example: configure
	cmake --build $(BUILD) -j $(JOBS) --target attention_loop
	$(BUILD)/examples/attention_loop

clean:
	rm -rf $(BUILD)

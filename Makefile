# Kiln's quick start: `make demo` and `make test` work on a fresh Debian 12 machine.
BUILD_DIR ?= build
PRESET ?= default
PREFIX ?= /usr/local
JOBS ?= $(shell nproc)

.PHONY: all deps configure build test demo install clean format lint-budget docs

all: build

deps:
	./scripts/install-deps.sh

configure: deps
	cmake --preset $(PRESET)

build: configure
	cmake --build --preset $(PRESET) -j $(JOBS)

test: build
	ctest --preset $(PRESET) -j $(JOBS)

demo: build
	./scripts/demo.sh $(BUILD_DIR)

# docs/ops.md, the op catalogue, from the op table (a test fails while it is out of date).
docs: build
	./scripts/gen-ops-doc.sh $(BUILD_DIR)/bin/kiln

install: build
	cmake --install $(BUILD_DIR) --prefix $(PREFIX)

format:
	clang-format -i $$(git ls-files '*.cpp' '*.h')

clean:
	rm -rf $(BUILD_DIR) build-asan

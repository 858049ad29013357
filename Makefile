# Kiln's quick start: `make demo` and `make test` work on a fresh Debian 12 machine.
BUILD_DIR ?= build
PRESET ?= default
PREFIX ?= /usr/local
JOBS ?= $(shell nproc)
# PYTHON=0 leaves out the Python package (no PyPI downloads); otherwise scripts/setup-python.sh
# makes .venv (nanobind, numpy, torch) and the build includes the package and its tests.
PYTHON ?= 1

.PHONY: all deps configure build test demo install clean format lint-budget docs

all: build

deps:
	./scripts/install-deps.sh

configure: deps
	@if [ "$(PYTHON)" != 0 ] && py=$$(./scripts/setup-python.sh | tail -1) && [ -x "$$py" ]; then \
	  echo "cmake --preset $(PRESET) -DKILN_BUILD_PYTHON=ON -DPython_EXECUTABLE=$$py"; \
	  cmake --preset $(PRESET) -DKILN_BUILD_PYTHON=ON -DPython_EXECUTABLE=$$py; \
	else \
	  [ "$(PYTHON)" = 0 ] || echo "make: the Python environment could not be set up; building without the Python package"; \
	  cmake --preset $(PRESET) -DKILN_BUILD_PYTHON=OFF; \
	fi

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

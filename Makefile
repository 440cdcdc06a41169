# The README's two commands are `make demo` and `make test`.
# On machines without a GPU, torch's CPU build is installed first and pinned, so that no later
# step lets pip pull a multi-GB CUDA build. Elsewhere, install your own torch build before `make`.
PYTHON ?= python3
VENV   ?= .venv
TORCH  ?= torch==2.13.0
PY      = $(VENV)/bin/python
STAMP   = $(VENV)/.installed
# transformers + accelerate (and trl, peft, datasets) on dslaunch's `deepspeed` distribution, for tests/compat (no real DeepSpeed)
VENV_COMPAT  ?= .venv-compat
COMPAT_STAMP  = $(VENV_COMPAT)/.installed

.PHONY: setup compat-venv deepspeed-venv ray demo test lint docs bench stress system-deps gpu-check gpu-targets gpu-wheels clean conformance

setup: $(STAMP)

# Naming the installed torch in the second install keeps it: no extra (triton) may swap its build.
$(STAMP): pyproject.toml
	$(PYTHON) -m venv $(VENV)
	$(PY) -c "import torch" 2>/dev/null || $(PY) -m pip install -q "$(TORCH)"
	$(PY) -m pip install -q -e '.[dev,triton]' "torch==$$($(PY) -c 'import torch; print(torch.__version__)' 2>/dev/null)"
	touch $(STAMP)

compat-venv: $(COMPAT_STAMP)

# Never fails the build: on failure it records why and tests/compat skips with that reason.
# dslaunch is editable there, so only the compat package or this recipe rebuild it (not pyproject.toml).
$(COMPAT_STAMP): compat/deepspeed/pyproject.toml scripts/compat_venv.sh | $(STAMP)
	bash scripts/compat_venv.sh $(PY) $(VENV_COMPAT)

# DeepSpeed's own unit tests against real DeepSpeed 0.19.8 and against dslaunch (two venvs under
# .venv-conformance/, built once); DEEPSPEED_SRC is a DeepSpeed source checkout (its tests/ folder).
# CONFORMANCE_FLAGS: e.g. --no-distributed (quick), --file unit/...py, --side dslaunch.
# Real DeepSpeed (its own venv, torch pinned to the main venv's): the checkpoint-interop tests run it
# as the peer that writes checkpoints dslaunch loads. Built once (a stamp in the venv).
deepspeed-venv: setup
	cd scripts/conformance && $(abspath $(PY)) -c "import run, torch; from pathlib import Path; \
	run.build_venv('deepspeed', Path('../../.venv-conformance/deepspeed').resolve(), torch.__version__)"

conformance: setup
	@test -n "$(DEEPSPEED_SRC)" || { echo "make conformance DEEPSPEED_SRC=<DeepSpeed source checkout>"; exit 2; }
	OMP_NUM_THREADS=1 $(PY) scripts/conformance/run.py --deepspeed-src "$(DEEPSPEED_SRC)" $(CONFORMANCE_FLAGS)

# A real ZeRO-2 training job on localhost with 2 worker processes.
demo: setup
	$(VENV)/bin/dslaunch --num_gpus 2 scripts/examples/train.py \
		--deepspeed --deepspeed_config scripts/examples/ds_config.json

# OS packages the multi-host tests need (root only; a no-op otherwise).
system-deps:
	bash scripts/system_deps.sh

lint: setup
	$(VENV)/bin/ruff check .

# Ray for tests/launcher/runners/ray (`--launcher ray`, Ray Train): the `ray` extra, ~500 MB and ~100 s
# here, so not in `dev`; the torch pin keeps the CPU build. Without it those tests skip and say why.
ray: setup
	$(PY) -c "import ray" 2>/dev/null || $(PY) -m pip install -q 'ray[train]>=2.60' "torch==$$($(PY) -c 'import torch; print(torch.__version__)')"

# The documentation site (mkdocs.yml, docs/) into .site/, strict: a broken link or anchor fails it;
# the reference pages are generated from the code while it builds (scripts/docs/hooks.py).
# NO_MKDOCS_2_WARNING: mkdocs-material 9.7+ prints a banner about MkDocs 2 on every build.
docs: setup
	NO_MKDOCS_2_WARNING=1 $(VENV)/bin/mkdocs build --strict --quiet

# Two pytest workers (pytest-xdist): much of the suite waits on subprocesses, sockets and timeouts.
# A test file is a unit of work, the namespace cluster's tests one unit (tests/conftest.py).
TEST_WORKERS ?= 2
test: setup compat-venv deepspeed-venv ray system-deps gpu-wheels lint docs
	$(PY) -m pytest -q -n $(TEST_WORKERS)

bench: setup
	$(PY) -c "import deepspeed" 2>/dev/null || $(PY) -m pip install -q --no-build-isolation deepspeed
	$(PY) scripts/bench/run_all.py

# Exit codes under a CPU hog, dslaunch against DeepSpeed (not a timing: run apart from `bench`).
stress: setup
	$(PY) -c "import deepspeed" 2>/dev/null || $(PY) -m pip install -q --no-build-isolation deepspeed
	$(PY) scripts/bench/exit_stress.py

# On a machine with a CUDA GPU and its own torch (no venv there: that torch is the one to test).
# Without network, first run scripts/gpu/wheels.sh on a machine with PyPI and carry .whl/ over.
# GPU_CHECK_DEADLINE_S (default 460) bounds the whole check; `make gpu-targets` prints the block
# BENCHMARKS.md records from its results (the GPU's name, dslaunch beside DeepSpeed, the targets).
gpu-check:
	bash scripts/gpu/check.sh $(or $(OUT),gpu-check)

gpu-targets:
	$(PYTHON) scripts/gpu/report.py --targets $(or $(OUT),gpu-check)

# The wheels a GPU check carries (real DeepSpeed 0.19.8 among them): needs PyPI; the tests check
# that they install offline (tests/gpu/test_carry.py).
gpu-wheels: .whl/.built
.whl/.built: scripts/gpu/wheels.sh | $(STAMP)
	bash scripts/gpu/wheels.sh
	touch $@

clean:
	rm -rf $(VENV) $(VENV_COMPAT) .pytest_cache .ruff_cache *.egg-info .site

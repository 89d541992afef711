# Two entry points: `make demo` (set up, then the main job) and `make test` (set up, then
# every test). Each sets up a virtual environment from scratch when it is missing.
PYTHON ?= python3.11
VENV ?= .venv
# cpu -> tensorflow-cpu; use EXTRAS=gpu,demo,test for the CUDA-capable tensorflow wheel.
EXTRAS ?= cpu,demo,test
PY := $(VENV)/bin/python

.PHONY: setup ops horovod sysdeps demo test test-quick lint format bench-network docs wheel

# uv installs the pinned set in about half of pip's time, byte-compiled as pip leaves it, pip
# included; the venv starts without pip and uv comes through this Python's pip (6 s less than
# a venv with its pip upgraded). pip installs it where uv cannot be had or cannot install.
$(VENV)/.installed: setup.cfg setup.py pyproject.toml constraints.txt
	$(PYTHON) -m venv --without-pip $(VENV)
	$(PYTHON) -m pip --python $(PY) install -q uv && \
		$(PY) -m uv pip install -q --python $(PY) --compile-bytecode -c constraints.txt \
			pip -e '.[$(EXTRAS)]' || \
		{ $(PY) -m ensurepip -q && $(PY) -m pip install -q -c constraints.txt -e '.[$(EXTRAS)]'; }
	touch $@

# `make ops` asks the build, which rebuilds what is stale (also after a change of CXXFLAGS);
# `make setup` runs it only when the kernel sources, the build script or the environment are
# newer than the last build (the question costs a TensorFlow import, ~5 s).
OPS_BUILT := tf_sparsify/ops/lib/build_info.json
ops: $(VENV)/.installed
	$(PY) -m tf_sparsify.ops.build

$(OPS_BUILT): $(VENV)/.installed tf_sparsify/ops/build.py $(shell find custom_ops -type f)
	$(PY) -m tf_sparsify.ops.build

setup: $(OPS_BUILT)

# A platform wheel with the compiled kernels for this TensorFlow, and the sdist, into dist/.
wheel: ops
	$(PY) scripts/build_wheel.py

# Horovod 0.28.1 built for this TensorFlow by the installer the package ships (the script
# `python -m tf_sparsify install-horovod` runs, called directly: the command would import
# TensorFlow first, 5 s on the way to the build). It needs the environment, not the kernels:
# `make -j2 setup horovod` builds both at once.
horovod: $(VENV)/.installed
	bash tf_sparsify/install_horovod.sh $(VENV)

# iproute2 (ip, tc) for the bandwidth benchmark's rate limits; a message where it cannot.
sysdeps:
	bash scripts/install_system_deps.sh

demo: setup
	$(PY) examples/digits_demo.py $(DEMO_ARGS)

# ruff, then import-linter's contracts (.importlinter: which layers may import which).
lint: $(VENV)/.installed
	$(PY) -m ruff check .
	$(PY) -m ruff format --check .
	$(VENV)/bin/lint-imports --no-cache

# The documentation site (mkdocs.yml, docs/) into site/; warnings are errors.
docs: $(VENV)/.installed
	NO_MKDOCS_2_WARNING=1 $(PY) -m mkdocs build --strict --site-dir site

# Rate-limited links need root; BENCH_ARGS, e.g. "--quick" or "--mode accuracy".
bench-network: setup horovod sysdeps
	$(PY) -m benchmarks.network $(BENCH_ARGS)

# The kernels, Horovod and the lint at once (each build leaves a core idle part of its time);
# then two pytest workers (both cores); each test file stays on one, so its fixtures launch
# once. The files that launch the most processes start first (tests/conftest.py orders them).
test:
	$(MAKE) --no-print-directory -j2 --output-sync=target setup horovod sysdeps lint
	TF_SPARSIFY_REQUIRE_OPS=1 $(PY) -m pytest -q -n 2 --dist loadfile --no-loadscope-reorder

# The inner loop: every test but those that launch processes (pytest.mark.processes: Horovod,
# multi-worker jobs, pip, wheel and site builds, documentation examples), compile with XLA
# (pytest.mark.xla) or run an example or experiment end to end (pytest.mark.example); needs no
# Horovod. No module fixture is left to share, so the tests go to either worker one by one.
test-quick: setup
	TF_SPARSIFY_REQUIRE_OPS=1 $(PY) -m pytest -q -n 2 --dist load \
		-m "not processes and not xla and not example"

format: $(VENV)/.installed
	$(PY) -m ruff format .
	$(PY) -m ruff check --fix .

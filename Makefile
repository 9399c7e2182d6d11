VENV ?= .venv
PY := $(VENV)/bin/python
# The newest JAX the registry serves needs Python ≥ 3.12; `make test` also runs a fast subset there, in VENV312.
# PY312: a Python 3.12 interpreter; by default the first of these that really runs as 3.12 (a pyenv shim on PATH
# may not).
VENV312 ?= .venv312
PY312 ?= $(shell for p in python3.12 $(wildcard $(HOME)/.pyenv/versions/3.12*/bin/python3 /usr/local/bin/python3.12 \
	/usr/bin/python3.12); do "$$p" -c 'import sys; assert sys.version_info[:2] == (3, 12)' 2>/dev/null && \
	{ echo "$$p"; break; }; done)
# The subset on the newest JAX: what can differ between JAX versions — kernels, model, sharding, compiling for TPU
# and GPU (the compile extra installs the newest jax's plugins), a run and a sweep in process — without the slow
# tier (end-to-end processes, every-target compiles), which the full run above covers, and of each parametrized
# test its first and last case (`--cases first-and-last`: the ones between vary sizes and dtypes, not JAX APIs).
# None of it compiles cuDNN attention (slow tier), so its venv takes the compile-kernels extra: no cuDNN or cuBLAS.
NEWEST_JAX_TESTS := tests/test_kernels.py tests/test_mosaic_gpu_resources.py tests/test_model.py tests/test_sharding.py \
	tests/test_aot.py tests/test_train.py tests/test_sweep.py

# `make train` needs the package alone; the tests also need the dev tools and the compile (libtpu, CUDA compiler
# plugin: GBs) and eval (lm-eval) extras, installed once on top (the marker file records it).
$(PY):
	python3 -m venv $(VENV) && $(PY) -m pip install -q --upgrade pip && $(PY) -m pip install -q -e .

$(VENV)/test-extras: | $(PY)
	$(PY) -m pip install -q -e ".[dev,compile,eval]" && touch $@

# Each run prints its ten slowest tests and writes the time ledger (`python tests/ledger.py .cache/ledger/main.json`
# prints where the time went; docs/testing.md).
test: $(VENV)/test-extras
	$(PY) -m pytest tests notebooks --nbmake -n 2 --dist worksteal --durations=10 --ledger .cache/ledger/main.json
	@$(MAKE) --no-print-directory test-newest-jax

# The edit loop: everything but the slow tier and the notebooks, of each parametrized test its first case
# (docs/testing.md).
test-fast: $(VENV)/test-extras
	$(PY) -m pytest tests -m "not slow" --cases first -n 2 --dist worksteal

# The fast subset on the newest JAX, in its own virtualenv; skipped (saying so) where no Python 3.12 is found.
test-newest-jax:
	@if [ -z "$(PY312)" ]; then \
		echo "test-newest-jax: SKIPPED — no Python 3.12 interpreter found (python3.12 on PATH, ~/.pyenv/versions/3.12*;" \
			"set PY312=/path/to/python3.12); only the jax in $(VENV) was tested"; \
	else \
		{ test -f $(VENV312)/installed || { "$(PY312)" -m venv $(VENV312) && \
			$(VENV312)/bin/python -m pip install -q --upgrade pip && \
			$(VENV312)/bin/python -m pip install -q -e ".[dev,compile-kernels]" && touch $(VENV312)/installed; }; } && \
		$(VENV312)/bin/python -c 'import sys, diffjax, jax; print(f"test-newest-jax: Python {sys.version.split()[0]}, jax {jax.__version__}")' && \
		$(VENV312)/bin/python -m pytest $(NEWEST_JAX_TESTS) -m "not slow" --cases first-and-last -n 2 --dist worksteal \
			--durations=10 --ledger .cache/ledger/newest-jax.json; \
	fi

device-check: $(VENV)/test-extras
	$(PY) experiments/device_check.py --out runs/device_check

# One folder of wheels for a GPU machine that has its own jax (GPU_JAX, on Python GPU_PYTHON) but no package registry:
# diffjax's wheel and what it and tokenizers need, resolved by pip against the machine's jax with this venv's versions
# as constraints (`pip freeze`), less what the machine has: GPU_HAS, jax and what it brings, and GPU_WHEELS_LEAVE_OUT
# (the lent device machines' image also has matplotlib and tensorstore). There, with the checkout:
#   pip install --no-index --find-links dist/gpu-wheels diffjax && python experiments/device_check.py --out DIR
GPU_WHEELS ?= dist/gpu-wheels
GPU_PYTHON ?= 3.12
GPU_JAX ?= 0.11.2
GPU_HAS ?= jax jaxlib numpy scipy ml_dtypes opt_einsum
GPU_WHEELS_LEAVE_OUT ?=
GPU_LEFT_OUT = $(subst -,_,$(GPU_HAS) $(GPU_WHEELS_LEAVE_OUT))
gpu-wheels: | $(PY)
	rm -rf $(GPU_WHEELS) && mkdir -p $(GPU_WHEELS)
	$(PY) -m pip wheel -q --no-deps -w $(GPU_WHEELS) .
	$(PY) -m pip freeze --exclude-editable | grep -v " @ " \
		| grep -viE "^($(subst _,[-_],$(subst $() ,|,$(strip diffjax $(GPU_LEFT_OUT)))))==" > $(GPU_WHEELS)/constraints.txt
	echo "jax==$(GPU_JAX)" >> $(GPU_WHEELS)/constraints.txt
	$(PY) -m pip download -q --only-binary=:all: --python-version $(GPU_PYTHON) -d $(GPU_WHEELS) \
		-c $(GPU_WHEELS)/constraints.txt $(GPU_WHEELS)/diffjax-*.whl tokenizers
	for p in $(GPU_LEFT_OUT); do find $(GPU_WHEELS) -iname "$$p-[0-9]*.whl" -delete; done
	@du -sh $(GPU_WHEELS)

# Before device time: the device check compiled for an H100 with the GPU machine's own jax (GPU_JAX on Python 3.12,
# in its own venv; the newest-JAX venv has a newer one), so what fails to compile there fails here first.
VENV_GPU_JAX ?= .venv-gpu-jax
gpu-preflight:
	@test -n "$(PY312)" || { echo "gpu-preflight: needs a Python 3.12 interpreter (set PY312=/path/to/python3.12)"; exit 2; }
	test -f $(VENV_GPU_JAX)/installed || { "$(PY312)" -m venv $(VENV_GPU_JAX) && \
		$(VENV_GPU_JAX)/bin/python -m pip install -q --upgrade pip && \
		$(VENV_GPU_JAX)/bin/python -m pip install -q -e . "jax[cuda12-local]==$(GPU_JAX)" "nvidia-cuda-nvcc-cu12>=12.6" \
			"nvidia-cudnn-cu12>=9.8,<10" && touch $(VENV_GPU_JAX)/installed; }
	$(VENV_GPU_JAX)/bin/python experiments/device_check.py --compile-only --out runs/gpu_preflight

train: $(PY)
	$(VENV)/bin/diffjax train

summary: $(PY)
	$(VENV)/bin/diffjax summary --config configs/small.py:size=tiny,arch=diff

.PHONY: test test-fast test-newest-jax device-check gpu-wheels gpu-preflight train summary

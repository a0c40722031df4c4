# evalsuite: `make eval` runs the main job offline; `make test` the default test tier (every area, a few minutes
# on 2 cores: pytest -m "not slow"), `make test-all` every test (CI); tests/conftest.py says which tests are slow.
PYTHON ?= python3
VENV   ?= .venv
# The CPU wheel on these machines; on a GPU box use e.g. `make TORCH=torch==2.13.0+cu128`.
TORCH  ?= torch==2.13.0
BIN    := $(VENV)/bin
STAMP  := $(VENV)/.installed
export HF_HUB_OFFLINE = 1
export HF_DATASETS_OFFLINE = 1

# make eval MODEL=dir|org/name[,...] MODE=m[,m] PREDICTOR=p PREDICTOR_PATH=f TASKS=t[,t] LIMIT=n DATA_DIR=dir CACHE=f
#           LINK=l DB=url SANDBOX=weak DEVICE=cuda DTYPE=bfloat16 BATCH=n FEWSHOT=n GEN_KWARGS=k=v[,k=v] SEED=n
#           CHAT_TEMPLATE=1|name PLAN=measure|replay   (no PREDICTOR: each mode runs its own, e.g. gate for speculative, hybrid for hybrid;
#           a Hub id comes from the local Hugging Face cache, HF_HUB_OFFLINE=0 downloads it)
MODEL     ?= models/tiny-qwen3-moe,models/tiny-glm4-moe,models/tiny-qwen3-vl-moe
MODE      ?= resident,on-demand,router-preserving,speculative,hybrid
PREDICTOR ?=
PREDICTOR_PATH ?=
TASKS     ?=
LIMIT     ?= 10
CACHE     ?= 0.25
LINK      ?= ufs4
DATA_DIR  ?= $(wildcard ../shared/data)
DB        ?=
SANDBOX   ?=
DEVICE    ?= cpu
DTYPE     ?=
BATCH     ?= 1
FEWSHOT   ?=
GEN_KWARGS ?=
SEED      ?=
CHAT_TEMPLATE ?=
# On the CPU, replay: the modes' TPOTs come from one cost measurement per model, so they compare whatever the
# machine's speed did while the grid ran (timed one after another, a shared machine's speed changes flag
# them). Elsewhere, and with PLAN=measure, every configuration is timed through the engine.
PLAN      ?= $(if $(filter cpu,$(DEVICE)),replay,measure)
EVAL_ARGS = --model $(MODEL) --modes $(MODE) $(if $(PREDICTOR),--predictor '$(PREDICTOR)') \
	$(if $(PREDICTOR_PATH),--predictor-path $(PREDICTOR_PATH)) $(if $(TASKS),--tasks $(TASKS)) \
	--limit $(LIMIT) --cache-capacity $(CACHE) --link $(LINK) $(if $(DATA_DIR),--data-dir $(DATA_DIR)) \
	$(if $(DB),--db $(DB)) $(if $(SANDBOX),--sandbox $(SANDBOX)) --device $(DEVICE) $(if $(DTYPE),--dtype $(DTYPE)) \
	--batch-size $(BATCH) $(if $(FEWSHOT),--num-fewshot $(FEWSHOT)) $(if $(GEN_KWARGS),--gen-kwargs '$(GEN_KWARGS)') \
	$(if $(SEED),--seed $(SEED)) $(if $(PLAN),--plan $(PLAN)) \
	$(if $(filter 1 yes true,$(CHAT_TEMPLATE)),--apply-chat-template,\
	$(if $(CHAT_TEMPLATE),--apply-chat-template $(CHAT_TEMPLATE))) \
	--confirm-run-unsafe-code

GATE_DB  = sqlite:///results/gate.db
GATE_LIMIT ?= 20

.PHONY: eval test test-all gate report bench sweep tiny-models clean

$(STAMP): pyproject.toml setup.py
	$(PYTHON) -m venv $(VENV)
	$(BIN)/pip install -q --upgrade pip
	$(BIN)/pip install -q "$(TORCH)"
	$(BIN)/pip install -q -e '.[test]'
	touch $@

eval: $(STAMP)
	$(BIN)/evalsuite eval $(EVAL_ARGS)

test: $(STAMP)
	$(BIN)/python -m pytest -q -m "not slow"

test-all: $(STAMP)
	$(BIN)/python -m pytest -q

# The project's own gates (gates.yaml) on fresh runs of the shipped tiny models.
gate: $(STAMP)
	mkdir -p results && rm -f results/gate.db
	$(BIN)/evalsuite eval --model models/tiny-qwen3-moe,models/tiny-glm4-moe \
		--modes resident,on-demand,router-preserving,speculative --predictor gate \
		--tasks evalsuite_arith,evalsuite_yesno --limit $(GATE_LIMIT) --cache-capacity 0.25 --link ufs4 \
		--db $(GATE_DB) --out results/gate
	$(BIN)/evalsuite eval --model models/tiny-qwen3-vl-moe \
		--modes resident,on-demand,router-preserving,speculative --predictor gate \
		--tasks evalsuite_vision --limit $(GATE_LIMIT) --cache-capacity 0.25 --link ufs4 \
		--db $(GATE_DB) --out results/gate
	$(BIN)/evalsuite gate --config gates.yaml --db $(GATE_DB)

report: $(STAMP)
	$(BIN)/evalsuite report $(if $(DB),--db $(DB)) --out results/report

# A declarative grid (docs/sweeps.md): make sweep SWEEP=file.yaml [RAY=auto|local|ray://head:10001] [DB=url]
SWEEP ?= sweeps/tiny.yaml
RAY   ?=
sweep: $(STAMP)
	$(BIN)/evalsuite sweep $(SWEEP) $(if $(RAY),--ray $(RAY)) $(if $(DB),--db $(DB))

# Decode TPOT of every mode vs the overlap bound, engine overhead, simulator check (docs/performance.md).
bench: $(STAMP)
	$(BIN)/evalsuite bench --models models/tiny-qwen3-moe --links pcie4,ufs4,sdcard --capacities 0.1,0.25,0.5 --tokens 32 \
		--out results/bench/tiny
	$(BIN)/evalsuite bench --models qwen3-30b-a3b --layers 8 --prompt-tokens 4 --links pcie4,sdcard --capacities 0.25 \
		--predictors gate,trace-oracle,oracle --tokens 8 --repeats 3 --out results/bench/qwen3-30b-a3b

# The shipped models from seed 0: the two text models in parallel (one thread each), then the
# vision-language one; --resume continues a cut-off run. Each is then calibrated: the predictor.safetensors
# beside its weights is what the trained predictors (the modes' defaults) read.
tiny-models: $(STAMP)
	$(BIN)/evalsuite train-tiny --model qwen --out models --seed 0 --resume & \
	$(BIN)/evalsuite train-tiny --model glm --out models --seed 0 --resume & wait
	$(BIN)/evalsuite train-tiny --model vl --out models --seed 0 --resume
	for m in tiny-qwen3-moe tiny-glm4-moe tiny-qwen3-vl-moe; do \
		$(BIN)/evalsuite calibrate --model models/$$m --out models/$$m || exit 1; done

clean:
	rm -rf $(VENV) *.egg-info

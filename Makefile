# One command for the main job, one for the tests. Both set everything up first.
#   make demo   build the repository for the small model trained here (checkpoints/trained/), start
#               tritonserver, stream its ~5 s held-out demo utterance, write out/mel_0.npy and
#               out/mel_0.png (ground truth above the streamed mel), stop the server.
#               MEANFLOW=1: the 2-step student; SIZE=full: full-size seeded random weights (cost only);
#               VOICE=1: start by a voice registered from a reference wav made here (voice_encoder);
#               TEXT="..." [SPEAKER=0-7]: speak your own sentence in one of the corpus' voices (espeak-ng)
#   make test   set up and run the test suite (what .ci/run calls; it installs perf_analyzer, see below)
PY311   ?= /usr/bin/python3.11
VENV    ?= .venv
PYTHON  := $(VENV)/bin/python
SIZE    ?= small
SECONDS ?= 5
STAMP   := $(VENV)/.installed

.PHONY: setup demo test test-fast benchmark clean train espeak perf-analyzer model-analyzer prometheus

$(STAMP): pyproject.toml contract/pyproject.toml client/pyproject.toml
	@test -x $(PY311) || { echo "need the system Python 3.11 at $(PY311) (the Triton stub embeds it): apt-get install python3.11-venv"; exit 1; }
	test -x $(PYTHON) || $(PY311) -m venv $(VENV)
	$(PYTHON) -m pip install -q --upgrade pip
	$(PYTHON) -m pip install -q $$(test -d /opt/wheels && echo --find-links /opt/wheels) -e contract -e client \
	  -e ".[server,test,train]"
	touch $(STAMP)

setup: $(STAMP)

demo: setup $(if $(TEXT),espeak)
	$(PYTHON) scripts/demo.py --size $(SIZE) --seconds $(SECONDS) $(if $(MEANFLOW),--meanflow) $(if $(VOICE),--voice) \
	  $(if $(TEXT),--text "$(TEXT)" --speaker $(or $(SPEAKER),0))

# Two pytest workers by default, a module each at a time (pytest-xdist), one torch/OpenMP thread each: the suite
# sleeps and waits on servers as much as it computes, and one process kept only one of the 2 cores busy.
# The longest modules go first (tests/conftest.py, SLOWEST_FIRST). TEST_WORKERS=1: one process (README, Tests)
TEST_WORKERS ?= 2
PARALLEL = $(if $(filter 1,$(TEST_WORKERS)),,-n $(TEST_WORKERS) --dist loadfile --no-loadscope-reorder)
test: setup espeak perf-analyzer model-analyzer prometheus
	$(if $(PARALLEL),OMP_NUM_THREADS=1 )$(PYTHON) -m pytest -q -rs --durations=20 $(PARALLEL)

test-fast: setup
	$(PYTHON) -m pytest -q -m "not server and not fullsize"

benchmark: setup
	$(PYTHON) scripts/benchmark.py

clean:
	rm -rf $(VENV) model_repository/*/ out/
	find checkpoints -mindepth 1 -maxdepth 1 ! -name trained -exec rm -rf {} + 2>/dev/null || true

# Retrain the small demo models (checkpoints/trained/) from scratch: espeak-ng corpus, HiFT vocoder, CFM
# teacher, meanflow student (scripts/train_small.py), seeded, several hours on 2 cores; BUDGET=60 stops after
# an hour (run again to go on from where it stopped). Figures: scripts/evaluate_small.py (results/small_model.md).
train: setup espeak
	$(PYTHON) scripts/train_small.py $(if $(BUDGET),--budget-min $(BUDGET))

# perf_analyzer (Triton's load generator, docs/operations.md) into .tools/perf_analyzer/: the binary of the
# tritonclient 2.41.1 wheel and the CUDA runtime it links (loads without a GPU; s3flow_tools.perf_analyzer), and
# Debian's libb64-0d, installed when missing
perf-analyzer: setup
	@ldconfig -p | grep -q 'libb64\.so\.0d' || { echo "installing libb64-0d (apt-get)"; \
	  apt-get update -qq && apt-get install -y -qq libb64-0d >/dev/null; } || \
	  { echo "perf_analyzer needs libb64-0d: apt-get install -y libb64-0d (as root)"; exit 1; }
	$(PYTHON) -m s3flow_tools.perf_analyzer install

# Triton Model Analyzer 1.58.0 (pip's triton-model-analyzer) into a venv of its own, .tools/model-analyzer/:
# it pins optuna, numba and cuda-python, none of which the server needs (s3flow_tools.model_analyzer)
model-analyzer: setup perf-analyzer
	$(PYTHON) -m s3flow_tools.model_analyzer install

# Prometheus with promtool (Debian's package) for tests/test_prometheus.py; installed when missing
prometheus:
	@command -v promtool >/dev/null && command -v prometheus >/dev/null || { echo "installing prometheus (apt-get)"; \
	  apt-get update -qq && apt-get install -y -qq --no-install-recommends prometheus >/dev/null; } || \
	  { echo "prometheus is needed: apt-get install -y prometheus (as root)"; exit 1; }

# espeak-ng (Debian) for the corpus and for `make demo TEXT=...`; installed when missing
espeak:
	@command -v espeak-ng >/dev/null || { echo "installing espeak-ng (apt-get)"; \
	  apt-get update -qq && apt-get install -y -qq espeak-ng >/dev/null; } || \
	  { echo "espeak-ng is needed: apt-get install -y espeak-ng (as root)"; exit 1; }

# The workbook's two commands:  `make lab` (open it) and `make test` (run every test).
# Both create the virtual environment in .venv on first use.
PYTHON ?= python3
VENV   := .venv
BIN    := $(VENV)/bin
STAMP  := $(VENV)/.installed
export HF_HUB_OFFLINE := 1
export TOKENIZERS_PARALLELISM := false

.PHONY: lab test check env clean-notebooks offline-bundle reset answer-key learner-docs guide-figures

env: $(STAMP)

$(STAMP): requirements.txt pyproject.toml
	test -x $(BIN)/python || $(PYTHON) -m venv $(VENV)
	$(BIN)/python -m pip install --quiet --upgrade pip
	$(BIN)/python -m pip install --quiet -r requirements.txt -e .
	# the "cpp" attention backend's kernel, built now rather than in the middle of a notebook (no compiler: skipped)
	$(BIN)/python -m labkit.core.attention
	# notebook 14's quantized GEMV kernels, likewise
	$(BIN)/python -m labkit.core.quant
	# decode_plan=True's C++ step (both kernels' sources again, in one module), likewise
	$(BIN)/python -m labkit.core.engine
	touch $(STAMP)

## Open the workbook in JupyterLab on 127.0.0.1 (works as root too).
lab: $(STAMP)
	$(BIN)/jupyter lab --ip=127.0.0.1 --allow-root --notebook-dir=notebooks

## Run every test: the linter, the layer contracts, unit tests, then every notebook under nbval in smoke mode.
test: $(STAMP)
	$(BIN)/ruff check labkit tests scripts
	$(BIN)/lint-imports --no-logo
	LABKIT_SMOKE=1 $(BIN)/python -m pytest

## The fast tier for everyday work (a few minutes): the linter, the layer contracts and the unit tests; no notebooks,
## browser, benchmark scripts or worker processes (tests marked "integration"), nor the randomised "slow" ones.
check: $(STAMP)
	$(BIN)/ruff check labkit tests scripts
	$(BIN)/lint-imports --no-logo
	LABKIT_SMOKE=1 $(BIN)/python -m pytest tests --ignore=tests/e2e -m "not integration and not slow" -q

## Strip outputs from every notebook (before committing).
clean-notebooks: $(STAMP)
	$(BIN)/jupyter nbconvert --clear-output --inplace notebooks/*.ipynb

## Gather everything for a room without internet into DIR (needs internet): make offline-bundle DIR=/media/usb/labkit-bundle
offline-bundle:
	@test -n "$(DIR)" || { echo "usage: make offline-bundle DIR=/path/to/a/new/folder"; exit 2; }
	$(PYTHON) scripts/offline_bundle.py gather "$(DIR)"

## Put a notebook back as shipped, keeping yours in notebooks/.backups/: make reset NB=03 (NB=all: every changed one)
reset: $(STAMP)
	@test -n "$(NB)" || { echo "usage: make reset NB=03   (or NB=all)"; exit 2; }
	$(BIN)/python -m labkit.course.reset $(if $(filter all,$(NB)),--all,$(NB))

## Regenerate docs/answer_key.md from the notebooks and labkit's reference solutions
answer-key: $(STAMP)
	$(BIN)/python scripts/make_answer_key.py
	$(BIN)/python scripts/make_learner_docs.py

## Regenerate the README's path, the learner path's and instructor guide's task regions (tasks-*) from TASKS
learner-docs: $(STAMP)
	$(BIN)/python scripts/make_learner_docs.py

## Re-render the guides' benchmark figures (figures-* regions) from docs/benchmarks/*.json, after a benchmark re-run
guide-figures: $(STAMP)
	$(BIN)/python scripts/make_guide_figures.py

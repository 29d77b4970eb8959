PY ?= python3
VENV := .venv
BIN := $(VENV)/bin

.PHONY: demo test bench clean

$(BIN)/python:
	$(PY) -m venv $(VENV)
	$(BIN)/python -m pip install -q --upgrade pip

$(VENV)/.installed: pyproject.toml | $(BIN)/python
	$(BIN)/python -m pip install -q -e ".[test,spark]"
	touch $@

$(VENV)/.installed-bench: pyproject.toml $(VENV)/.installed
	$(BIN)/python -m pip install -q -e ".[test,spark,bench]"
	touch $@

demo: $(VENV)/.installed
	$(BIN)/python -m eindecomp_sql.demo

test: $(VENV)/.installed
	$(BIN)/python -m pytest

# the numbers in bench/RESULTS.md: GEMMs and contractions against numpy, dask and pure SQL;
# graphs under every strategy; the cost model's calibration (about 30 minutes on 2 cores)
bench: $(VENV)/.installed-bench
	$(BIN)/python bench/calibrate.py
	$(BIN)/python bench/graphs_run.py
	$(BIN)/python bench/run.py
	$(BIN)/python bench/gemm_bar.py
	$(BIN)/python bench/run.py --markdown-only

clean:
	rm -rf $(VENV) build *.egg-info

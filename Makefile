# Two commands do all the set-up: `make demo` and `make test`. Both create .venv if it is missing.
SHELL := /bin/bash
.SHELLFLAGS := -o pipefail -c
PYTHON ?= python3
VENV := .venv
PY := $(VENV)/bin/python
NPROC ?= 4
TECHNIQUES := muon_zero.py mhc.py cp_compress.py tensor_ckpt.py

.PHONY: demo test bench notebooks clean

$(VENV)/.installed: requirements.txt
	test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PY) -m pip install --quiet -r requirements.txt
	touch $@

demo: $(VENV)/.installed
	@mkdir -p results
	@for f in $(TECHNIQUES); do \
	  if [ -f $$f ]; then \
	    echo "=== torchrun --nproc_per_node=$(NPROC) $$f"; \
	    OMP_NUM_THREADS=1 $(PY) -m torch.distributed.run --nproc_per_node=$(NPROC) $$f 2>&1 | tee results/$${f%.py}.txt || exit 1; \
	  fi; \
	done
	@echo; echo "Results (each demo's full output):"; ls -1 results/*.txt

test: $(VENV)/.installed
	$(PY) -m pytest

bench: $(VENV)/.installed
	@for b in benchmarks/bench_*.py; do echo "=== $$b"; $(PY) $$b || exit 1; done

notebooks: $(VENV)/.installed
	$(PY) notebooks/build.py

clean:
	rm -rf $(VENV) results

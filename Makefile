# Two commands do all the set-up: `make demo` and `make test`. Both create .venv when needed
# (tools/venv.sh: Python >= 3.11 checked, a venv made by another Python or left half-installed is
# made again or finished, never silently reused).
#
# torch==2.13.0 from the default package index is the CUDA build: with its nvidia-* libraries it
# downloads several GB (about 1.5 GB for the whole venv with the CPU-only build). Without a GPU,
# take the CPU-only wheel index address from PyTorch's install selector (pip, Linux, CPU) and run
#     make demo TORCH_INDEX=<that address>
# Other Python: make demo PYTHON=python3.12. Another venv folder: make test VENV=/tmp/venv.
SHELL := /bin/bash
.SHELLFLAGS := -o pipefail -c
PYTHON ?= python3
VENV ?= .venv
TORCH_INDEX ?=
PY := $(VENV)/bin/python
NPROC ?= 4
TECHNIQUES := muon_zero.py mhc.py cp_compress.py tensor_ckpt.py
# a student's folder of files to grade (default: the reference itself); ONLY: regions or file
# stems, comma-separated (muon_zero.newton_schulz); TIMEOUT: seconds per test; OUT: where
# `make assignments` writes (default build/student, never overwritten once edited)
SUBMISSION ?=
ONLY ?=
TIMEOUT ?=
OUT ?=
# test-slow: more pytest arguments (files, --ignore=...; .ci/run splits the tier in two), and
# which of its tests (.ci/run leaves the graded ones to make grade-fit's grading)
SLOW_ARGS ?=
SLOW_MARK ?= slow
# make bench FULL=1: the full tables too
FULL ?=

.PHONY: venv venv-test demo test test-slow test-all lint bench notebooks lab assignments grade \
	grade-check grade-mistakes grade-alternatives grade-fit expected release gpu-check clean

venv:
	@tools/venv.sh "$(PYTHON)" "$(VENV)" "$(TORCH_INDEX)" requirements.txt

venv-test:
	@tools/venv.sh "$(PYTHON)" "$(VENV)" "$(TORCH_INDEX)" requirements.txt requirements-test.txt

demo: venv
	@mkdir -p results
	@for f in $(TECHNIQUES); do \
	  if [ -f $$f ]; then \
	    echo "=== torchrun --nproc_per_node=$(NPROC) $$f"; \
	    OMP_NUM_THREADS=1 $(PY) -m torch.distributed.run --nproc_per_node=$(NPROC) $$f 2>&1 \
	      | tee results/$${f%.py}.txt || exit 1; \
	  fi; \
	done
	@echo; echo "Results (each demo's full output):"; ls -1 results/*.txt

lint: venv-test
	$(VENV)/bin/ruff check .
	$(VENV)/bin/ruff format --check .

# Two tiers (each test file marks its slow cases, and says why): `make test` lints, then runs
# the default tier, one representative of every slow part; `make test-slow` the rest (CI runs
# both). One line per test as it finishes, the ten slowest, then the tier's wall time.
test: lint
	@echo '$(PY) -m pytest -v -m "not slow" --durations=10'; start=$$SECONDS; rc=0; \
	$(PY) -m pytest -v -m "not slow" --durations=10 || rc=$$?; \
	echo "make test: the default tier took $$((SECONDS - start)) s"; exit $$rc

test-slow: venv-test
	@echo '$(PY) -m pytest -v -m "$(SLOW_MARK)" --durations=10 $(SLOW_ARGS)'; start=$$SECONDS; rc=0; \
	$(PY) -m pytest -v -m "$(SLOW_MARK)" --durations=10 $(SLOW_ARGS) || rc=$$?; \
	echo "make test-slow: the slow tier took $$((SECONDS - start)) s"; exit $$rc

test-all: test test-slow

# every chapter against what one would use instead, one run at quick sizes (minutes on 2 cores):
# ratios printed, benchmarks/results.json and benchmarks/RESULTS.md written; a chapter that fails
# is reported and the rest run. FULL=1: full sizes, then every benchmarks/bench_*.py's own tables.
bench: venv
	OMP_NUM_THREADS=1 $(PY) benchmarks/run_all.py $(if $(FULL),--full)

notebooks: venv
	$(PY) notebooks/build.py

# Jupyter in notebooks/: each kernel starts there and imports the files (the venv knows the root)
lab: venv
	cd notebooks && $(abspath $(VENV))/bin/jupyter lab

assignments: venv
	$(PY) tools/assignments.py $(if $(OUT),--out "$(OUT)")

grade: venv-test
	$(PY) tools/grade.py $(if $(SUBMISSION),--submission "$(SUBMISSION)") \
	  $(if $(ONLY),--only "$(ONLY)") $(if $(TIMEOUT),--per-test-timeout "$(TIMEOUT)")

# every solution region, stubbed alone, must make each graded test that names it fail
grade-check: venv-test
	$(PY) tools/grade.py --check-regions

# every catalogued mistake (tests/mistakes/) spliced in alone loses points, with its message
grade-mistakes: venv-test
	$(PY) tools/grade.py --check-mistakes $(ONLY)

# every catalogued correct alternative (tests/alternatives/) keeps full marks
grade-alternatives: venv-test
	$(PY) tools/grade.py --check-alternatives $(ONLY)

# the reference graded inside Gradescope's default limits (768 MB, half a CPU; a cgroup: root):
# full marks, peak working set <= 650 MB, <= 360 s, else it fails; at a drawn case whose fp32
# rounding is among the largest seen (GRADE_DRAW to pick another), as the autograder draws them
grade-fit: venv-test
	GRADE_DRAW=$${GRADE_DRAW:-628923452} $(PY) tools/measure_grading.py

# the graded tests' expected values for their public cases, from the references only the autograder
# zip holds (tests/graded/hidden/): the student repository's tests read them; the reference's check
# them on every run (a stale store fails there)
expected: venv-test
	rm -f tests/graded/stored/*.pt
	GRADE_WRITE_EXPECTED=1 OMP_NUM_THREADS=1 $(PY) -m pytest -q -p no:cacheprovider \
	  tests/graded/test_mhc.py tests/graded/test_muon_zero.py tests/graded/test_cp_compress.py \
	  tests/graded/test_tensor_ckpt.py::test_activation_memory_drops_by_the_forgotten_bytes \
	  tests/graded/test_compose.py

# the course kit: build/release/student/ (the repository a student clones, no solution in it) and
# build/release/autograder.zip (Gradescope's setup.sh and run_autograder); then the leak search
release: venv-test
	$(PY) tools/release.py

gpu-check: venv-test
	$(PY) tools/gpu_check.py

clean:
	rm -rf $(VENV) results build

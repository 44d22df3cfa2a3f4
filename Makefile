VENV ?= .venv
PY := $(VENV)/bin/python
STAMP := $(VENV)/.installed

.PHONY: demo demo-s3 demo-recovery test lint bench clean

$(STAMP): pyproject.toml constraints-dev.txt
	python3 -m venv $(VENV)
	$(PY) -m pip install -q --upgrade pip
	$(PY) -m pip install -q -c constraints-dev.txt torch==2.13.0
	$(PY) -m pip install -q -c constraints-dev.txt -e ".[test,lint]"
	touch $(STAMP)

# torchtitan's own model and parallelize code for tests/test_titan_real.py, beside the venv (its pins would replace
# fsspec, which s3fs pins, and pull in datasets, wandb and pandas): these packages only, without their dependencies;
# only that test's ranks put .titan on their path.
TITAN := .titan/.installed
$(TITAN): $(STAMP)
	rm -rf .titan
	$(PY) -m pip install -q --no-deps --target .titan torchtitan==0.3.0 spmd_types==0.2.3 torch_checkpointing==0.1.1 \
		einops==0.8.2 tyro==1.0.17 docstring-parser==0.18.0 typeguard==4.6.1 triton==3.9.0
	touch $(TITAN)

demo: $(STAMP)
	$(PY) examples/demo.py

demo-s3: $(STAMP)
	$(PY) tools/s3_demo.py

# Recovery without a person: vckpt supervise around a faulty 3-rank torchrun job, then vckpt replay.
demo-recovery: $(STAMP)
	$(PY) examples/recovery_demo.py

# Style is held by tools, not by review: ruff (lint, import order), mypy (strict), the size rules, the layering
# (import-linter's contracts in pyproject.toml, docs/DESIGN.md), the bound on untyped dicts inside the library, and
# no import circle inside a package.
lint: $(STAMP)
	$(VENV)/bin/ruff check verified_ckpt cli tools examples
	$(VENV)/bin/mypy
	$(PY) tools/size_check.py verified_ckpt cli
	$(VENV)/bin/lint-imports
	$(PY) tools/any_dicts.py
	$(PY) tools/import_cycles.py

# Two workers, a test file each at a time (module fixtures run once): on a 2-core host the suite's I/O-bound
# tests (S3, the service, crash points) overlap the CPU-bound multi-rank ones. Bytecode is written even where the
# environment says not to (PYTHONDONTWRITEBYTECODE): the suite starts hundreds of processes (ranks, CLIs, jobs),
# and each compiled this checkout's modules again, 1.4 CPU-seconds for the DDP example's imports.
test: lint $(TITAN)
	PYTHONDONTWRITEBYTECODE= $(PY) -m pytest -q -n 2 --dist loadfile --no-loadscope-reorder

bench: $(STAMP)
	$(PY) -m pip install -q boto3 "botocore==$$($(PY) -c 'import botocore; print(botocore.__version__)')"
	$(PY) tools/bench/bench_store.py
	$(PY) tools/bench/bench_guard.py --world-size 3 --steps 40
	$(PY) tools/bench/bench_s3.py --mib 512 --repeats 3

clean:
	rm -rf $(VENV) .titan .pytest_cache .hypothesis .mypy_cache .ruff_cache

VENV ?= .venv
PY := $(VENV)/bin/python
STAMP := $(VENV)/.installed

.PHONY: demo demo-s3 test bench clean

$(STAMP): pyproject.toml constraints-dev.txt
	python3 -m venv $(VENV)
	$(PY) -m pip install -q --upgrade pip
	$(PY) -m pip install -q -c constraints-dev.txt torch==2.13.0
	$(PY) -m pip install -q -c constraints-dev.txt -e ".[test]"
	touch $(STAMP)

demo: $(STAMP)
	$(PY) examples/demo.py

demo-s3: $(STAMP)
	$(PY) tools/s3_demo.py

test: $(STAMP)
	$(PY) -m pytest -q

bench: $(STAMP)
	$(PY) -m pip install -q boto3 "botocore==$$($(PY) -c 'import botocore; print(botocore.__version__)')"
	$(PY) tools/bench/bench_store.py
	$(PY) tools/bench/bench_guard.py --world-size 3 --steps 40
	$(PY) tools/bench/bench_s3.py --mib 512 --repeats 3

clean:
	rm -rf $(VENV) .pytest_cache .hypothesis

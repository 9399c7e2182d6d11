VENV ?= .venv
PY := $(VENV)/bin/python

$(PY):
	python3 -m venv $(VENV) && $(PY) -m pip install -q --upgrade pip && $(PY) -m pip install -q -e ".[dev,compile,eval]"

test: $(PY)
	$(PY) -m pytest tests notebooks --nbmake -n 2 --dist worksteal

train: $(PY)
	$(VENV)/bin/diffjax train

summary: $(PY)
	$(VENV)/bin/diffjax summary --config configs/small.py:size=tiny,arch=diff

.PHONY: test train summary

# One-command set-up: every target creates the virtual environment it needs.
PYTHON ?= python3
VENV ?= .venv
BIN := $(VENV)/bin
RUN ?= runs/demo

.PHONY: demo test venv clean

venv: $(VENV)/.installed

$(VENV)/.installed: pyproject.toml constraints.txt
	$(PYTHON) -m venv $(VENV)
	$(BIN)/python -m pip install --quiet -c constraints.txt -e '.[test,flower]'
	touch $@

# The main job on the bundled digits dataset: DP-FedAvg with record-level DP-SGD, attacked after every
# round (loss and gradient-norm membership inference), then the privacy report.
demo: venv
	$(BIN)/fedaudit train --algorithm fedavg --dp --noise-multiplier 1.0 --max-grad-norm 1.0 \
		--batch-size 32 --lr 0.5 --local-epochs 2 --width 32 --rounds 5 --out $(RUN) --overwrite
	$(BIN)/fedaudit attack $(RUN) --target all --no-progress
	$(BIN)/fedaudit report $(RUN) --out $(RUN)/report --format html --format md
	@echo "Report: $(RUN)/report/report.html"

test: venv
	OMP_NUM_THREADS=1 $(BIN)/python -m pytest -n 2 -q

clean:
	rm -rf $(VENV) runs

# One-command set-up: every target creates the virtual environment it needs.
PYTHON ?= python3
VENV ?= .venv
BIN := $(VENV)/bin
RUN ?= runs/demo

.PHONY: demo test venv clean

# The extras installed: the tests' and Flower's (.ci/run adds audit-reference, the canary audit's reference library).
EXTRAS ?= test,flower

venv: $(VENV)/.installed

# pip byte-compiles the installed files one after another (about 60 s of a 2-core machine's 125); compileall on every
# core does it in 40, and leaves out the packages' own test folders (a fifth of the files: pandas alone ships 1,100),
# which nothing imports. Like pip, it also leaves out the few files written for a newer Python (torch ships one in
# Python 3.12 syntax), which is why its exit status is not checked: a file it did not compile is compiled if imported.
$(VENV)/.installed: pyproject.toml constraints.txt
	$(PYTHON) -m venv $(VENV)
	$(BIN)/python -m pip install --quiet --no-compile -c constraints.txt -e '.[$(EXTRAS)]'
	$(BIN)/python -m compileall -qq -j 0 -x '/tests?/' $(VENV)/lib || true
	touch $@

# The main job on the bundled digits dataset: the same federated setup trained twice, without DP (FedAvg) and with
# record-level DP-SGD (DP-FedAvg), both attacked (loss and gradient-norm membership inference), one report that
# compares them. Settings chosen by measurement (README): the non-DP model leaks visibly, the DP one does not.
# One torch thread and one vector instruction set: the README's figures are deterministic only at a fixed thread count
# and a fixed ATen kernel ISA (float sums change order with more threads, and between the AVX2 and AVX-512 kernels:
# the demo's loss bound is 1.579 with one and 1.691 with the other), tests/cli/test_demo.py checks them, and on this
# small model one thread is also the fastest. AVX2 is what every x86-64 machine of the last decade has.
DEMO_ENV = OMP_NUM_THREADS=1 ATEN_CPU_CAPABILITY=avx2
DEMO_SETUP = --algorithm fedavg --dataset digits --partition iid --num-clients 2 --holdout-fraction 0.8 \
	--width 32 --rounds 15 --local-epochs 2 --lr 1.0
demo: venv
	$(DEMO_ENV) $(BIN)/fedaudit train $(DEMO_SETUP) --out $(RUN)/fedavg --overwrite
	$(DEMO_ENV) $(BIN)/fedaudit train $(DEMO_SETUP) --dp --noise-multiplier 2 --max-grad-norm 1 --out $(RUN)/dp-fedavg --overwrite
	$(DEMO_ENV) $(BIN)/fedaudit attack $(RUN)/fedavg $(RUN)/dp-fedavg --signal loss --signal grad-norm --method threshold
	$(DEMO_ENV) $(BIN)/fedaudit report $(RUN)/fedavg $(RUN)/dp-fedavg --out $(RUN)/report --format html --format md --overwrite
	@echo "Report: $(RUN)/report/report.html"

# Format and lint first (ruff, configured in pyproject.toml), then the suite on two workers (its 15 slowest tests
# listed at the end: where a slow machine spends its time).
test: venv
	$(BIN)/ruff format --check --quiet .
	$(BIN)/ruff check --quiet .
	NO_MKDOCS_2_WARNING=1 $(BIN)/mkdocs build --strict --quiet --site-dir "$$(mktemp -d)"
	OMP_NUM_THREADS=1 $(BIN)/python -m pytest -n 2 -q --durations=15

clean:
	rm -rf $(VENV) runs

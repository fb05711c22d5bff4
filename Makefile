# Shortcuts; the README's commands are the reference.
.PHONY: test bench wheel memcheck

test:
	python3 -m pip install -e '.[test]' && python3 -m pytest

bench:
	python3 -m pip install . && python3 -m lockmgr.bench --quick

# sdist + a manylinux wheel per local CPython, each tested as installed (scripts/check-wheels.sh)
wheel:
	bash scripts/check-wheels.sh

# valgrind memcheck of the fault-injection stress mix on the compiled core (scripts/memcheck.sh):
# fails on any invalid access or "definitely lost" block in lockmgr code
memcheck:
	python3 -m pip install -e '.[test]' && PYTHON=python3 bash scripts/memcheck.sh

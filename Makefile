# Shortcuts; the README's commands are the reference.
.PHONY: test bench wheel

test:
	python3 -m pip install -e '.[test]' && python3 -m pytest

bench:
	python3 -m pip install . && python3 -m lockmgr.bench --quick

# sdist + a manylinux wheel per local CPython, each tested as installed (scripts/check-wheels.sh)
wheel:
	bash scripts/check-wheels.sh

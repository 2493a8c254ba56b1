"""Benchmarks: scripts that print a table and write JSON (`python -m bench.NAME --out=F.json`).

Installed with the project (pyproject lists `bench`), so each runs as a module from any
directory and as a file (`python bench/NAME.py`); shared harness code is in `bench/arms.py`.
"""

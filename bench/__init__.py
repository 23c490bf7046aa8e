"""The benchmarks: one script per measurement (`python bench/NAME.py ...`, or
`python -m bench.NAME ...` from the repository root), each writing its section of
docs/benchmarks.md. What the scripts share is in `bench/lib/`; no script imports
another."""

"""Studies and headline runs, each beside the results it produced under ``benchmarks/results/`` (see
``benchmarks/README.md``); run one with ``python -m benchmarks.<name> --help``."""

"""python -m training.recipe: see the package's docstring (or --help)."""

import sys

from griffin.cli import run_cli

from .cli import parse_args

parse_args()  # --help and usage errors answer here, before torch and transformers load

from .run import INPUT_ERRORS, main  # noqa: E402

sys.exit(run_cli(main, INPUT_ERRORS))

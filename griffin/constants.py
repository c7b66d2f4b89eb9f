"""Names the commands need before anything heavy loads (their ``--help`` answers without torch)."""

EMBEDDED_TARGET = "smollm2-135m-instruct"

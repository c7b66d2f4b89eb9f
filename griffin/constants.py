"""Names the commands need before anything heavy loads (their ``--help`` answers without torch)."""

EMBEDDED_TARGET = "smollm2-135m-instruct"
TOKEN_LOSSES = ("soft-ce", "fkl", "rkl", "jsd", "tvd", "tvdpp")  # training.losses: the token-level objectives

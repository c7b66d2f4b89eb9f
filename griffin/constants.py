"""Names the commands need before anything heavy loads (their ``--help`` answers without torch)."""

EMBEDDED_TARGET = "smollm2-135m-instruct"
TOKEN_LOSSES = ("soft-ce", "fkl", "rkl", "jsd", "tvd", "tvdpp")  # training.losses: the token-level objectives
HEAD_ARCHS = ("griffin", "eagle", "eagle3", "griffin3")  # griffin.config.DraftConfig.arch
FUSED_ARCHS = ("eagle3", "griffin3")  # the EAGLE-3 generation: three fused target layers, training-time test
TTT_STEPS = 7  # EAGLE-3's training-time test unrolls this many steps

"""The embedded target: concurrent first use converts the GGUF once and leaves a complete cache."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest

from tests.conftest import ROOT

CONVERT = """
import logging
logging.basicConfig(level="INFO")
from griffin.target import embedded_target_path, load_target
path = embedded_target_path()
model, tok = load_target("smollm2-135m-instruct")
assert tok.eos_token == "<|im_end|>" and tok.bos_token is None
print(path)
"""


@pytest.mark.embedded
def test_concurrent_first_use_converts_once(tmp_path):
    env = {**os.environ, "GRIFFIN_CACHE": str(tmp_path), "PYTHONPATH": str(ROOT), "OMP_NUM_THREADS": "1"}
    procs = [subprocess.Popen([sys.executable, "-c", CONVERT], cwd=ROOT, env=env, stdout=subprocess.PIPE,
                              stderr=subprocess.PIPE, text=True) for _ in range(2)]
    outs = [p.communicate(timeout=600) for p in procs]
    for proc, (_, err) in zip(procs, outs):
        assert proc.returncode == 0, err
    final = tmp_path / "targets" / "smollm2-135m-instruct"
    assert {out.strip() for out, _ in outs} == {str(final)}
    assert sum(err.count("converting the embedded target") for _, err in outs) == 1  # the other process waited
    assert (final / "config.json").is_file() and list(final.glob("*.safetensors"))
    leftovers = [p.name for p in final.parent.iterdir() if p.name.startswith(".") and not p.name.endswith(".lock")]
    assert leftovers == []  # no half-written conversion folder

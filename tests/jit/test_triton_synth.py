"""The Triton synthesizer: the same region classes as Triton source, numerics checked under
Triton's interpreter (``TRITON_INTERPRET=1``, CPU tensors, tiny shapes) in a subprocess — the
variable must be set before triton is imported. Speed needs a GPU and is not measured here."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import triton  # noqa: F401  (the test extra installs it: a missing triton fails, never skips)

ROOT = Path(__file__).resolve().parents[2]

SCRIPT = r'''
import json, sys
import torch
from fuel.graph import DType, FusedOpParams, FusedOps
from fuel.jit import ArchSku, Declined
from fuel.jit.adopt import verify
from fuel.jit.triton_synth import TritonSynthesizer
from fuel.kernels import RECIPE_TOLERANCE
from tests.jit.helpers import float_feeds, fused_node, paged, reference, request_for

synth = TritonSynthesizer(cache_dir=__import__("pathlib").Path(sys.argv[1]))
F32, BF16 = DType.F32, DType.BF16
cases = {
    "residual_add_rms_norm": (FusedOps.RESIDUAL_ADD_RMS_NORM, FusedOpParams.ResidualAddRmsNorm(1e-5), [[3, 24], [3, 24], [24]]),
    "rms_norm": (FusedOps.RMS_NORM, FusedOpParams.RmsNorm(1e-5), [[2, 3, 20], [20]]),
    "softmax": (FusedOps.SOFTMAX_LAST_DIM, FusedOpParams.SoftmaxLastDim(), [[4, 17]]),
    "silu_mul": (FusedOps.SILU_MUL, FusedOpParams.SiluMul(), [[3, 12], [3, 12]]),
    "rope": (FusedOps.ROPE, FusedOpParams.Rope(), [[2, 2, 3, 8], [3, 8], [3, 8]]),
}
results = {}
for dtype in (F32, BF16):
    for name, (fid, params, shapes) in cases.items():
        g, node = fused_node(fid, params, shapes, [dtype] * len(shapes))
        answer = synth.synthesize(request_for(g, node, ArchSku.SM90))
        kernel = synth.take_kernel(answer.entry_point)
        feeds = float_feeds(g, node)
        check = verify(kernel.run(*feeds.values()), reference(g, node, feeds), RECIPE_TOLERANCE[dtype])
        results[f"{name}/{dtype.value}"] = [check.ok, check.max_abs_error, check.report]
    for label, case in (("paged", dict()), ("paged_softcap", dict(softcap=5.0)),
                        ("paged_three_queries", dict(q_len=3))):
        g, node, feeds = paged(dtype=dtype, **case)
        answer = synth.synthesize(request_for(g, node, ArchSku.SM90))
        kernel = synth.take_kernel(answer.entry_point)
        check = verify(kernel.run(*feeds.values()), reference(g, node, feeds), RECIPE_TOLERANCE[dtype])
        results[f"{label}/{dtype.value}"] = [check.ok, check.max_abs_error, check.report]
g, node = fused_node(FusedOps.FUSED_LINEAR, FusedOpParams.FusedLinear(), [[4, 8], [16, 8]], [F32, F32])
results["fused_linear"] = synth.synthesize(request_for(g, node, ArchSku.SM90)).reason
results["cpu_request"] = synth.synthesize(request_for(g, node, ArchSku.CPU)).reason
print(json.dumps(results))
'''


@pytest.fixture(scope="module")
def interpreted(tmp_path_factory):
    env = dict(os.environ, TRITON_INTERPRET="1", PYTHONPATH=str(ROOT))
    done = subprocess.run([sys.executable, "-c", SCRIPT, str(tmp_path_factory.mktemp("triton"))],
                          cwd=ROOT, env=env, capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stderr[-3000:]
    return json.loads(done.stdout.strip().splitlines()[-1])


@pytest.mark.parametrize("case", [
    f"{name}/{dtype}" for dtype in ("f32", "bf16")
    for name in ("residual_add_rms_norm", "rms_norm", "softmax", "silu_mul", "rope", "paged",
                 "paged_softcap", "paged_three_queries")])
def test_triton_kernel_matches_its_decomposition_under_the_interpreter(interpreted, case):
    # Why: the emitted Triton source must compute the recipe (f32: 2e-5; bf16: 6e-2).
    ok, error, report = interpreted[case]
    assert ok, report
    if case.endswith("/f32"):
        assert error < 1e-5


def test_triton_declines_matmul_and_cpu_requests(interpreted):
    assert "`matmul` is not a row-wise op" in interpreted["fused_linear"]
    assert interpreted["cpu_request"] == "Triton builds CUDA kernels; the request targets the CPU"

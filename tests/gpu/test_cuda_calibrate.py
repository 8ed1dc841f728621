"""CUDA lane: a GPU calibration (Note [calibrating on one GPU]) timed on the first GPU in
bf16 predicts the whole model from one and two blocks: the stand-in of every block, timed
the same way, takes what ``layers x block + rest`` said, and the projection at one rank
replays it."""

import lanes

lanes.require_cuda_lane()

import pytest  # noqa: E402
import torch  # noqa: E402

from fullshard.projection import Cluster, ModelShape, Settings, device_named  # noqa: E402
from fullshard.projection.calibrate import calibrate_device, stand_in_seconds  # noqa: E402
from fullshard.projection.costs import compute_seconds  # noqa: E402

# about 1B parameters of Llama-style blocks, 12 of them: fits one GPU whole, so the
# prediction can be checked against the whole model
LLAMA = ModelShape("llama-1b-12", 2048, 12, 16, 4, 5632, 32000, False, True)


def test_one_and_two_blocks_predict_the_whole_model_on_this_gpu():
    gpu = torch.device("cuda", 0)
    spec = device_named("h100")  # its peak only scales the efficiency: the rate is measured
    device, measured = calibrate_device(spec, LLAMA, 4, 2048, gpu, steps=10)
    predicted = LLAMA.n_layers * measured["block"] + measured["rest"]
    whole = stand_in_seconds(LLAMA, LLAMA.n_layers, 4, 2048, gpu, torch.bfloat16, steps=10)
    assert predicted == pytest.approx(whole, rel=0.10), (predicted, whole)
    units = compute_seconds(LLAMA, Cluster(device, 1, 1), Settings("no_shard", 4, 2048))
    assert sum(u.forward + u.backward for u in units) == pytest.approx(predicted, rel=1e-9)

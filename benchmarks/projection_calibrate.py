"""The GPU calibration's two-depth prediction against the whole model, timed the same way.

``fullshard project --calibrate`` on a GPU times a stand-in of the model's shape with one
block and with two and predicts the whole model as ``layers x block + rest`` (Note
[calibrating on one GPU], projection/calibrate.py). This times both on the device given
(the CPU by default, in fp32; a GPU in bf16) for a few shapes and prints predicted over
timed:

    OMP_NUM_THREADS=1 python benchmarks/projection_calibrate.py [--device cuda] [--repeats 2]
"""

from __future__ import annotations

import argparse
import os
import sys

import torch

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "src"))

from fullshard.projection import Device, ModelShape  # noqa: E402
from fullshard.projection.calibrate import calibrate_device, stand_in_seconds  # noqa: E402

SHAPES = [
    ModelShape("llama-style d256 x6", 256, 6, 4, 2, 688, 512, False, True),
    ModelShape("gpt-style d256 x6", 256, 6, 4, 4, 1024, 512, True, False, learned_positions=128),
    ModelShape("llama-style d512 x8", 512, 8, 8, 2, 1376, 2048, False, True),
]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--repeats", type=int, default=2)
    parser.add_argument("--batch", type=int, default=4)
    parser.add_argument("--seq", type=int, default=128)
    args = parser.parse_args()
    device = torch.device(args.device)
    dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    # the efficiency is a fraction of this peak; only the timings are reported
    spec = Device("timed", 1e18, 2**40, 1e12, "cpu")
    print(f"torch {torch.__version__}, {device}, {dtype}, {args.batch} x {args.seq} tokens")
    print("| shape | block ms | rest ms | predicted ms | timed ms | predicted / timed |")
    print("|---|---:|---:|---:|---:|---:|")
    for shape in SHAPES:
        for _ in range(args.repeats):
            _, measured = calibrate_device(spec, shape, args.batch, args.seq, device, dtype,
                                           steps=7)
            predicted = shape.n_layers * measured["block"] + measured["rest"]
            whole = stand_in_seconds(shape, shape.n_layers, args.batch, args.seq, device,
                                     dtype, steps=7)
            print(f"| {shape.name} | {measured['block'] * 1e3:.2f} | "
                  f"{measured['rest'] * 1e3:.2f} | {predicted * 1e3:.1f} | {whole * 1e3:.1f} | "
                  f"{predicted / whole:.3f} |", flush=True)


if __name__ == "__main__":
    main()

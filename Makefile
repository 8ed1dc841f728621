# The two commands a newcomer needs: `make run` and `make test`.
# Each creates .venv on first use: `make run` with what training needs (and matplotlib for
# its loss curve), `make test` with
# the test toolchain too (transformers, accelerate, lightning, torchao, ...). torch==2.13.0
# is installed before the project so that pip does not resolve a multi-GB CUDA build.
PYTHON ?= python3
VENV := .venv
PY := $(VENV)/bin/python
RUN_STAMP := $(VENV)/.installed-run
STAMP := $(VENV)/.installed

.PHONY: run test test-fast test-multinode test-extended test-scale soak test-torch test-torch-suite test-gpu gpu-wheels gpu-check test-torchtitan bench bench-projection setup clean

$(RUN_STAMP): pyproject.toml
	test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PY) -m pip install -q --upgrade pip
	$(PY) -m pip install -q torch==2.13.0
	$(PY) -m pip install -q -e '.[plot]'
	touch $(RUN_STAMP)

$(STAMP): $(RUN_STAMP)
	$(PY) -m pip install -q -e '.[dev]'
	touch $(STAMP)

setup: $(STAMP)

# The default preset: a small GPT on Tiny Shakespeare over 2 local ranks (~5 min on 2 cores).
run: $(RUN_STAMP)
	OMP_NUM_THREADS=1 $(PY) -m fullshard train

# Two pytest workers (pytest-xdist): most of a multi-rank test is spent starting processes
# and waiting in collectives, so two at a time finish the suite ~17% sooner on 2 cores.
# A run that collects nothing fails (pytest's exit 5), as any other error does.
test: $(STAMP)
	OMP_NUM_THREADS=1 $(PY) -m pytest tests -m "not multinode and not soak and not extended and not scale" -n 2

# Several "nodes" on 127.0.0.1 (two launchers, c10d rendezvous; ~3 minutes): CI runs it
# after `make test`.
test-multinode: $(STAMP)
	OMP_NUM_THREADS=1 $(PY) -m pytest tests -m multinode

# World sizes 8 to 1,024 in one process, torch's fake process group (tests/scale, ~30 s):
# shard bytes, the collectives of a step, host work per step against the world size. One
# worker, not in `make test`: its timings want the machine's cores to themselves. CI runs it.
test-scale: $(STAMP)
	OMP_NUM_THREADS=1 $(PY) -m pytest tests -m scale

# More combinations than `make test` has time for (the tests marked extended): CI runs
# it after the multi-node lane.
test-extended: $(STAMP)
	OMP_NUM_THREADS=1 $(PY) -m pytest tests -m extended -n 2

# The tests a developer runs often (under 2 minutes on 2 cores, two workers as in `make
# test`): everything but those that carry @pytest.mark.slow.
test-fast: $(STAMP)
	OMP_NUM_THREADS=1 $(PY) -m pytest tests -m "not slow and not soak and not extended and not scale" -n 2

# 2,000 steps of the default preset losing a worker every ~300 steps, against the same run
# without faults (48 minutes on 2 cores): tests/train/test_launch_soak_restarts.py.
soak: $(STAMP)
	OMP_NUM_THREADS=1 $(PY) -m pytest tests/train/test_launch_soak_restarts.py -m soak

# The CUDA lane (tests/gpu): NCCL ranks, one per visible GPU, against references on the
# same GPUs. It runs on the Python that has a CUDA torch: .venv where one exists (the CPU
# torch there makes it skip), else the machine's python3 (a GPU box with torch
# preinstalled: nothing is installed, no registry needed). Skipped, with one line saying
# why, without a GPU; pytest's exit 5 (everything skipped) is not a failure.
# Every other target is the CPU lane, which hides CUDA (tests/lanes.py).
GPU_PYTHON ?= $(if $(wildcard $(PY)),$(PY),python3)
test-gpu:
	FULLSHARD_TEST_LANE=cuda OMP_NUM_THREADS=1 $(GPU_PYTHON) -m pytest tests/gpu -rs; rc=$$?; \
	if [ $$rc -eq 5 ]; then echo "the CUDA lane ran no test (no GPU visible?)"; exit 0; fi; exit $$rc

# The GPU box (torch 2.11 for Python 3.12 preinstalled, no package registry; docs/benchmarks.md).
# `make gpu-wheels`, here: the wheels fullshard needs that the box lacks, into
# $(GPU_WHEELS) (git-ignored, ~4 MB; carried to the box with the working tree).
# `make gpu-check`, there: installs them without a registry, fullshard editable without
# dependencies against the box's torch, then runs every GPU check in under 9 minutes and
# writes one report, $(GPU_CHECK_OUT)/gpu-check.md (benchmarks/gpu_check.py).
GPU_WHEELS := .gpu-wheels
GPU_CHECK_OUT ?= $(if $(OUT),$(OUT),runs/gpu-check)
# tyro's needs (docstring_parser, typeguard, typing_extensions: pip takes these only if
# the box's are missing or too old), tomli-w, torchao, and setuptools for building
# fullshard's editable install in isolation; Megatron-FSDP (and its einops) for
# benchmarks/gpu.py's side-by-side.
GPU_WHEEL_PKGS := tyro==1.0.17 docstring_parser==0.18.0 typeguard==4.6.1 \
	typing_extensions==4.16.0 tomli_w==1.2.0 torchao==0.18.0 setuptools==80.9.0 \
	megatron-fsdp==0.6.1 einops==0.8.2
gpu-wheels:
	rm -rf $(GPU_WHEELS) && mkdir -p $(GPU_WHEELS)
	$(PYTHON) -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 \
		--implementation cp --platform manylinux_2_28_x86_64 --platform manylinux_2_17_x86_64 \
		--platform manylinux2014_x86_64 --platform any -d $(GPU_WHEELS) $(GPU_WHEEL_PKGS)
	du -sh $(GPU_WHEELS)

gpu-check:
	OMP_NUM_THREADS=8 $(GPU_PYTHON) benchmarks/gpu_check.py --wheels $(GPU_WHEELS) \
		--out $(GPU_CHECK_OUT)

# The suite on another torch, in a venv of its own: `make test-torch TORCH=2.15.0` (or
# 2.11.0). Those are CUDA builds (several GB, with NVIDIA's libraries; they run on a CPU);
# PIP_CONFIG_FILE=/dev/null lifts a machine-wide pip cap on torch's version, if any.
TORCH ?= 2.15.0
TORCH_VENV := .venv-torch-$(TORCH)
test-torch:
	test -x $(TORCH_VENV)/bin/python || $(PYTHON) -m venv $(TORCH_VENV)
	PIP_CONFIG_FILE=/dev/null $(TORCH_VENV)/bin/python -m pip install -q torch==$(TORCH)
	PIP_CONFIG_FILE=/dev/null $(TORCH_VENV)/bin/python -m pip install -q -e '.[dev]'
	OMP_NUM_THREADS=1 $(TORCH_VENV)/bin/python -m pytest tests -m "not multinode and not soak and not extended and not scale" -n 2

# PyTorch's own FSDP2 tests (test/distributed/_composable/fsdp/) against fullshard, on CPU
# ranks over gloo: torch_suite/run.py; docs/conformance.md has the results. The files are
# PyTorch's, not carried here: it reads them from torch_suite/upstream/ (MANIFEST names
# each file's commit and SHA-256). expecttest is what torch's test helpers import.
test-torch-suite: $(STAMP)
	$(PY) -m pip install -q expecttest
	OMP_NUM_THREADS=1 $(PY) torch_suite/run.py

# torchtitan's own FSDP code on fullshard. Not a dependency: torchtitan's imports pull
# triton (~1 GB), so its runtime dependencies are installed here without theirs.
TORCHTITAN_PKGS := torchtitan==0.3.0 spmd_types==0.2.3 tyro==1.0.17 docstring_parser==0.18.0 triton==3.9.0
test-torchtitan: $(STAMP)
	$(PY) -m pip install -q --no-deps $(TORCHTITAN_PKGS)
	OMP_NUM_THREADS=1 $(PY) -m pytest tests/conformance/test_torchtitan.py

bench: $(STAMP)
	OMP_NUM_THREADS=1 $(PY) benchmarks/compare_fsdp2.py

# The projection against the published FSDP runs: leave-one-source-out first (four fits,
# several minutes; reported, not checked), then the split (fails when its held-out figures
# fall below docs/projection.md's), then against fullshard runs on
# this machine at world sizes 1, 2 and 4: fails when one is off by more than 15% (a
# measurement: run it on a quiet machine).
bench-projection: $(STAMP)
	OMP_NUM_THREADS=1 $(PY) benchmarks/projection_published.py --check
	OMP_NUM_THREADS=1 $(PY) benchmarks/projection_cpu.py --check 0.15

clean:
	rm -rf $(VENV) build src/*.egg-info .pytest_cache

"""The process group a worker starts: NCCL for the GPUs, with gloo beside it for the
host tensors of an offloading run."""

from fullshard.train.launch.launcher import process_group_backend


def test_offloading_runs_add_gloo_beside_nccl_for_host_tensors():
    assert process_group_backend("cuda", offload=True) == "cpu:gloo,cuda:nccl"
    assert process_group_backend("cuda", offload=False) == "nccl"
    assert process_group_backend("cpu", offload=True) == "gloo"

"""What a cluster scheduler tells a process (train/launch/cluster.py): Slurm's compressed
host lists expanded as ``scontrol show hostnames`` does. How the launcher uses them is
tested through the command line, in tests/cli/test_launch_flags.py."""

from fullshard.train.launch.cluster import expand_hostlist


def test_slurm_hostlists_expand_as_scontrol_does():
    assert expand_hostlist("node1") == ["node1"]
    assert expand_hostlist("gpu[08-10,3],login2") == ["gpu08", "gpu09", "gpu10", "gpu3",
                                                       "login2"]
    assert expand_hostlist("r[1-2]-n[1,3]") == ["r1-n1", "r1-n3", "r2-n1", "r2-n3"]
    assert expand_hostlist("a-ib,b[1-2]-ib") == ["a-ib", "b1-ib", "b2-ib"]

"""The tests of PyTorch's FSDP2 suite that do not run here, each with its reason.

Keys are ``file::Class::test`` (a ``*`` test name covers the class). Three kinds:

- ``CPU``: the test needs an accelerator (it moves CPU tensors to it, compares with
  ``cuda:N`` devices, uses CUDA streams, events or memory stats). Skipped in both runs.
- ``PRIVATE``: the test reads or calls torch's private FSDP2 internals
  (``fully_shard.state(m)``, ``_fsdp_param_group``, ``_get_managed_modules``...), which
  fullshard does not have; the public behaviour behind it is named in the reason.
  Skipped on fullshard only.
- ``DIFFERS``: fullshard knowingly behaves otherwise; the reason says what a user sees.
  Skipped on fullshard only.
docs/conformance.md lists them all.
"""

CPU = "needs an accelerator"
PRIVATE = "reads torch's private FSDP2 state"
DIFFERS = "fullshard differs"

EXCLUDED: dict[str, tuple[str, str]] = {
    # -- test_fully_shard_init.py ------------------------------------------------------------
    "test_fully_shard_init.py::TestFullyShardDeviceTensor::*": (
        CPU, "checks that fully_shard moves CPU parameters to the current accelerator"),
    "test_fully_shard_init.py::TestFullyShardDeviceDTensor::*": (
        CPU, "checks that fully_shard moves DTensor parameters to the accelerator and refuses "
             "a CPU tensor-parallel mesh under an accelerator FSDP mesh"),
    "test_fully_shard_init.py::TestFullyShardMetaDeviceInit::test_meta_device_1d_init": (
        CPU, "materializes on torch.device(type, current_device()), which has no CPU form"),
    "test_fully_shard_init.py::TestFullyShardMetaDeviceInit::test_meta_device_2d_init": (
        CPU, "materializes on torch.device(type, current_device()), which has no CPU form"),
    "test_fully_shard_init.py::TestFullyShardManagedModulesAndStates::test_managed_modules_nested": (
        PRIVATE, "calls torch's _get_managed_modules on a model with a fullshard unit inside; "
                 "the behaviour (a unit's parameters are not its parent's) is "
                 "tests/conformance/test_fsdp2_behaviour.py's"),
    "test_fully_shard_init.py::TestFullyShardManagedModulesAndStates::test_managed_modules_nested_fully_shard_and_replicate": (
        PRIVATE, "calls torch's _get_managed_modules on a model with a fullshard unit inside"),
    "test_fully_shard_init.py::TestFullyShardManagedModulesAndStates::test_managed_states_nested_fully_shard": (
        PRIVATE, "calls torch's _get_managed_states on a model with a fullshard unit inside"),
    "test_fully_shard_init.py::TestFullyShardLazyInit::*": (
        PRIVATE, "fully_shard.state(module) and its _lazy_init/_is_root/_fsdp_param_group; "
                 "fullshard's fully_shard has no .state (a single root, lazy init at the first "
                 "forward and parameter FQNs are fullshard's own tests')"),
    "test_fully_shard_init.py::TestFullyShardShardedParameterTensor::test_raise_noncontiguous_parameter": (
        DIFFERS, "fullshard shards a non-contiguous (channels_last) parameter, which torch "
                 "refuses with NotImplementedError: the user's model trains instead of failing"),
    "test_fully_shard_init.py::TestFullyShardMixedDtypeParam::test_mixed_dtypes_no_grad_param": (
        DIFFERS, "one unit's parameters must share a dtype in fullshard (one flat all-gather); "
                 "torch accepts a frozen float8 parameter beside float32 ones. The user gets a "
                 "TypeError naming both and is told to shard them apart"),
}


def exclusion(nodeid: str) -> tuple[str, str] | None:
    """The (kind, reason) for a pytest node id, or None."""
    path, _, rest = nodeid.partition("::")
    key = f"{path.rsplit('/', 1)[-1]}::{rest}"
    cls = rest.split("::")[0]
    return EXCLUDED.get(key) or EXCLUDED.get(f"{path.rsplit('/', 1)[-1]}::{cls}::*")

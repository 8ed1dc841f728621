"""The error the NCCL rules raise."""


class NcclRuleError(AssertionError):
    """A collective that NCCL would turn into a hang, a crash or silent corruption.

    An ``AssertionError``: it marks a test failing, and code that falls back on a
    ``RuntimeError`` from a collective must not swallow it."""

"""What the delayed update adds to the host: each delayed unit's copy of its shard and
its second gradient buffer, in the replay's ledger (memory/replay.py).

Under ``OverlappedStep(delayed=True)`` (Note [the delayed update] in delayed_update.py)
every CPU-offloaded group that the host thread steps keeps, from its first delayed step
on, a ``PendingShard``: a copy of its flat shard that its gathers read while the host
step writes the shard (core/features/pending_shard.py; one buffer, reused, pinned where the
compute device is CUDA), and a second sharded gradient buffer: the next backward writes
it while the host step reads the one handed out. A group that keeps persistent gradients
keeps both buffers for good (``GradReduction.hand_off_kept``); a group that gets fresh
gradients each step frees the one handed out when its host step ends, which under the
delayed update (meant for host steps longer than forward and backward) is after the next
backward has written its own, so both are counted. A group with tensor-subclass
parameters gathers them on its own and waits for its step instead: no copy, no second
buffer. Both stay allocated through the step, so they are counted throughout.
"""

from __future__ import annotations

from .byte_ledger import GRADIENTS, SHARDED_PARAMS, ByteLedger
from .run_settings import ReplayGroup, RunSettings


def allocate_delayed_copies(ledger: ByteLedger, groups: list[ReplayGroup],
                            s: RunSettings) -> None:
    """Enter each delayed group's shard copy and second gradient buffer as host bytes."""
    if not s.delayed_update or s.states_on_disk:
        return
    for g in groups:
        layout = g.layout
        if not s.offloads(layout) or not layout.trainable or layout.subclass:
            continue
        ledger.alloc(("delayed copy", g.index), SHARDED_PARAMS,
                     s.host_buffer_bytes(layout.shard_numel * s.param_dtype.itemsize), True)
        ledger.alloc(("second gradients", g.index), GRADIENTS,
                     s.host_buffer_bytes(layout.reduce_numel * s.param_dtype.itemsize), True)

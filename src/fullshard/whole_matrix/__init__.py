"""Optimizers that need whole matrices (Muon, Shampoo-like) on sharded parameters.

Note [whole-matrix optimizers]
``torch.optim.Muon`` orthogonalizes each 2-D update with a Newton-Schulz iteration over
the *whole* matrix. Stepped on a rank's row shard, as any FSDP hands it (or on a
DTensor, whose matmuls torch's Muon turns into shard-local ones), it orthogonalizes each
shard on its own: training goes on, several percent away from one process's. fullshard
instead steps every such parameter whole, once, on one rank, and moves per step only
what that needs:

* Each parameter is owned by one rank of its shard group, chosen the same way on every
  rank: greedily by the step's cost (the Newton-Schulz matmuls, 2 m^2 n + m^3 for an
  m x n matrix, m <= n), largest first, to the least loaded rank. Every sharded
  parameter the optimizer holds is placed, with a gradient this step or not, so owners
  stay put from step to step (they keep state, below) until ``param_groups`` change.
* An all-to-all sends every rank's rows of each parameter's reduced gradient to its
  owner, which assembles the whole gradient (padding dropped). The optimizer's own step
  then runs, unchanged, on the rank's owned whole matrices only (the others are taken
  out of ``param_groups``).
* Another all-to-all sends each owner's updated rows of the parameter back to the ranks
  that hold them, which copy them into their shards.

That is 2 x (N-1)/N of the parameters' bytes per step over a shard group of N ranks, the
least any whole-matrix step can move: the gradient to one rank, the update back.

In rounds. Both exchanges would wait on the step, and the step on them, if each ran once
for every parameter. For an optimizer that steps each parameter from its own gradient
and states alone (Muon and Adafactor; ``register_whole_matrix_optimizer(cls,
steps_each_alone=True)`` declares another), the step runs in rounds of one parameter
per owner, each owner's largest first, so that a round takes about as long on every
rank. Round k+1's gather is issued before round k steps; round k's rows go back as soon
as it has stepped, while round k+1 steps. The optimizer's own step runs once per round
on what that round gives the rank, without the step hooks (the user's hooks run once,
around ``step()``); the last round is the stock step's, beside the optimizer's plain
parameters. At most the next round's pieces and this round's whole gradient exist at
once, not every owned whole gradient. The bytes are the same; the collectives are two per round instead of two per step. An
optimizer not so declared, or a subclass that overrides ``step`` without being declared
itself (it may count or combine across parameters), steps in one round: one call of
its step over everything the rank owns.

The bytes stay the least because the owner keeps, between steps, what the step also
needs:

* Its optimizer states, whole (Muon's momentum). ``opt.state[p]`` holds an empty dict
  meanwhile. ``state_dict()`` first hands the states back in torch's layout (a pre-hook:
  each state shaped like the parameter as a DTensor sharded like it, the others, such
  as Adafactor's factored moments and step count, by value on every rank), so
  ``state_dict()``, DCP and fullshard.checkpoint see ordinary sharded states and a
  checkpoint resumes at any world size. ``state_dict()`` is then a collective over each
  shard group, as DCP's state dicts are. States found in ``opt.state[p]`` at a step
  (handed back, loaded, or set by hand) are the current ones and travel to the owner
  with the gradient, once; ``load_state_dict`` drops what the owners held (a pre-hook),
  and a parameter whose entry was removed (``opt.state.clear()``) starts afresh, as in
  one process. The ranks must agree on which parameters have entries: a step after
  states were loaded or changed on some ranks only is refused on every rank (E225).
* A whole copy of the parameter, used while every rank's rows still hold, bit for bit,
  what the last step wrote there. Each rank keeps those rows (the return's buffer, 1/N
  of the parameters) and compares; one all-reduce of a few bytes per parameter tells
  every rank which parameters changed (a load, an edit under ``no_grad``, another
  optimizer), and their rows travel with the gradient. A version counter cannot tell:
  a unit's parameters view one flat shard and share its counter, so an AdamW step on
  the unit's biases bumps every matrix's, and writes through ``.data`` bump none.

Memory per rank: the owned whole parameters and states (about 1/N of the matrices each
when balanced) and its rows as last written (1/N), where the sharded states took 1/N;
during a step in rounds, about four of the largest matrix (the next round's gather, this
round's whole gradient, the last round's return): the rows as last written are dropped
once compared, and each round's returned rows take their place. In one round, the owned
whole gradients and the pieces in flight.

The result is one process's, bit for bit where the arithmetic is the same (each matrix is
stepped by the same code on the same values); docs/benchmarks.md has the measured time
and bytes. Hybrid sharding steps each replica group alike. A parameter sharded on another
dim (``shard_placement_fn``) travels as its pieces along that dim (columns for
``Shard(1)``), which the owner joins along it. A tensor-parallel parameter, or one whose
states are offloaded to disk, is refused at the first step.
A step that raised leaves the states as the stock step left them (as in one process)
and the shards as they were; the owners' whole copies are dropped.

``torch.optim.Muon`` and ``torch.optim.Adafactor`` are registered;
``register_whole_matrix_optimizer(cls)`` declares another optimizer class whose update
needs whole parameters.
"""

from __future__ import annotations

import torch

from collections.abc import Callable

from .exchange import Item, by_group, shard_group
from .kept import Kept, forget, kept_for, kept_if_unchanged
from .recipe import owners_by_cost, step_cost
from .rounds import Round, plan_rounds

# Muon orthogonalizes each matrix; Adafactor factors each matrix's second moment over its
# whole rows and columns (on DTensor shards torch's fails outright). Both step each
# parameter on its own (no state shared between parameters), so a step may run in rounds.
WHOLE_MATRIX_OPTIMIZERS: set[type] = {getattr(torch.optim, name) for name in ("Muon", "Adafactor")
                                      if hasattr(torch.optim, name)}
STEPS_EACH_ALONE: set[type] = set(WHOLE_MATRIX_OPTIMIZERS)


def register_whole_matrix_optimizer(cls: type, steps_each_alone: bool = False) -> None:
    """Declare that optimizer class ``cls`` needs whole parameters for its update: fullshard
    then steps its sharded parameters whole, each on one rank (Note [whole-matrix
    optimizers]). ``steps_each_alone=True`` says that its step updates each parameter from
    that parameter's gradient and states only (nothing kept per group, such as a shared
    step count): its step may then run a few parameters at a time, each round's updates
    travelling back while the next round steps. An optimizer decides at its first step
    whether it needs whole parameters: register the class before that."""
    if not (isinstance(cls, type) and issubclass(cls, torch.optim.Optimizer)):
        raise TypeError(f"register_whole_matrix_optimizer: expected a torch.optim.Optimizer "
                        f"subclass, got {cls!r}")
    WHOLE_MATRIX_OPTIMIZERS.add(cls)
    (STEPS_EACH_ALONE.add if steps_each_alone else STEPS_EACH_ALONE.discard)(cls)


def needs_whole_matrices(opt: torch.optim.Optimizer) -> bool:
    return any(isinstance(opt, cls) for cls in WHOLE_MATRIX_OPTIMIZERS)


def steps_each_alone(opt: torch.optim.Optimizer) -> bool:
    """Whether ``opt``'s class is declared to step each parameter on its own. A subclass
    inherits the declaration unless it overrides ``step`` without being declared itself
    (its step may count or combine across parameters)."""
    for cls in type(opt).__mro__:
        if cls in WHOLE_MATRIX_OPTIMIZERS:
            return cls in STEPS_EACH_ALONE
        if "step" in vars(cls):
            return False
    return False


class WholeStep:
    """What ``before`` swapped into the optimizer, for ``after`` to send back and undo."""

    def __init__(self, kept: Kept, items: list[Item]):
        self.kept = kept
        self.items = items    # the parameters stepped (those with a gradient), in order
        self.rounds: list[Round] = []
        self.groups: list[tuple[dict, list]] = []  # (param_group, its original params)
        self.whole: dict[int, torch.Tensor] = {}   # id(DTensor param) -> whole tensor here
        self.taken: dict[int, dict] = {}  # id(param) -> the state the owner held, in use
        self.stepped: set[int] = set()    # id(param) of those stepped before the stock step


def before(opt: torch.optim.Optimizer, owners: list[list],
           step_alone: Callable[[torch.optim.Optimizer], None] | None = None) -> WholeStep:
    """Gather each sharded parameter's gradient (and whatever its owner lacks) whole on
    its owner and leave in ``param_groups`` only what the stock step still steps here:
    its owned whole tensors of the last round and the optimizer's other (plain)
    parameters. With ``step_alone`` (the optimizer's step without hooks; for optimizers
    that step each parameter alone), the rounds before the last are stepped here, each
    round's updated rows sent back while the next one steps."""
    kept = _kept(opt, owners)
    step = WholeStep(kept, [item for item in kept.items if item.param.grad is not None])
    for item in step.items:
        _check_supported(opt, item.sp)
    per_round = 1 if step_alone is not None else None
    try:
        step.rounds = [rnd for group_items in by_group(step.items)
                       for rnd in plan_rounds(opt, kept, group_items, per_round)]
        kept.rows = {}  # compared: the returns bring the rows this step writes
        _run_rounds(opt, step, step_alone)
    except BaseException:
        undo(opt, step)
        raise
    sharded = {id(item.param) for item in kept.items}
    for group in opt.param_groups:
        params = group["params"]
        if not any(id(p) in sharded for p in params):
            continue
        step.groups.append((group, params))
        group["params"] = [step.whole.get(id(p), p) for p in params
                           if id(p) not in sharded
                           or (id(p) in step.whole and id(p) not in step.stepped)]
    return step


def after(opt: torch.optim.Optimizer, step: WholeStep) -> None:
    """Keep each owned parameter's whole copy and states on its owner, send the updated
    rows back, restore ``param_groups``."""
    for group, params in step.groups:
        group["params"] = params
    for rnd in step.rounds:
        if rnd.back is None:  # stepped by the stock step
            _keep(opt, step, rnd)
            rnd.start_return(step)
    written: dict[int, torch.Tensor] = {}
    for rnd in step.rounds:
        rnd.finish_return(written)
    step.kept.rows = written  # a parameter not stepped now is gathered whole when it is


def undo(opt: torch.optim.Optimizer, step: WholeStep) -> None:
    """After a step that raised: ``param_groups`` as before ``before``, the shards as they
    were, the owners' states as the step left them; the whole copies are dropped."""
    for group, params in step.groups:
        group["params"] = params
    for key, value in step.whole.items():
        opt.state.pop(value, None)
        value.grad = None
    step.kept.states.update(step.taken)
    forget(opt)


# -- the rounds ------------------------------------------------------------------------
def _run_rounds(opt: torch.optim.Optimizer, step: WholeStep, step_alone) -> None:
    """Each round's gather is issued while the round before it assembles and steps; each
    round stepped here sends its rows back while the next steps. The last round (every
    round, without ``step_alone``) is left to the stock step."""
    rounds = step.rounds
    early = len(rounds) - 1 if step_alone is not None else 0
    group_of = {id(p): i for i, group in enumerate(opt.param_groups) for p in group["params"]}
    if rounds:
        rounds[0].start_gather(opt)
    for k, rnd in enumerate(rounds):
        if k + 1 < len(rounds):
            rounds[k + 1].start_gather(opt)
        rnd.assemble(opt, step)
        if k < early:
            _step_round(opt, step, rnd, group_of, step_alone)
            _keep(opt, step, rnd)
            rnd.start_return(step)
            if k > 0:  # sent while this round stepped: its send buffer can go
                rounds[k - 1].settle_return()


def _step_round(opt, step: WholeStep, rnd: Round, group_of: dict, step_alone) -> None:
    """The optimizer's own step over this rank's whole parameters of one round alone."""
    mine = [id(e.item.param) for e in rnd.mine()]
    if not mine:
        return
    lists: list[list] = [[] for _ in opt.param_groups]
    for key in mine:
        lists[group_of[key]].append(step.whole[key])
        step.stepped.add(key)
    saved = [group["params"] for group in opt.param_groups]
    try:
        for group, params in zip(opt.param_groups, lists):
            group["params"] = params
        step_alone(opt)
    finally:
        for group, params in zip(opt.param_groups, saved):
            group["params"] = params


def _keep(opt, step: WholeStep, rnd: Round) -> None:
    """After a round stepped: each owner keeps its whole copies and states (Note: "Between
    steps"); ``opt.state`` holds an empty entry for each of the round's parameters."""
    kept = step.kept
    for entry in rnd.entries:
        key = id(entry.item.param)
        value = step.whole.get(key)
        if value is not None:
            kept.states[key] = opt.state.pop(value, {})
            kept.whole[key] = value
            value.grad = None
        opt.state[entry.item.param] = {}
        kept.held.add(key)


# -- which rank steps what -------------------------------------------------------------
def _kept(opt: torch.optim.Optimizer, owners: list[list]) -> Kept:
    found = [(p, sp, shard_group(p)) for group, group_owners in zip(opt.param_groups, owners)
             for p, sp in zip(group["params"], group_owners) if sp is not None]
    signature = tuple((id(p), id(pg), p.shape) for p, _, pg in found)
    kept = kept_if_unchanged(opt, signature)
    if kept is not None:  # the owners stay put until the parameters change
        return kept
    placed = {}
    for pg_id in dict.fromkeys(id(pg) for _, _, pg in found):  # each shard group alone
        members = [(p, sp, pg) for p, sp, pg in found if id(pg) == pg_id]
        owners = owners_by_cost([step_cost(p.shape[0], p.numel()) for p, _, _ in members],
                                members[0][2].size())
        for (p, sp, pg), owner in zip(members, owners):
            placed[id(p)] = Item(p, sp, pg, owner)
    return kept_for(opt, [placed[id(p)] for p, _, _ in found], signature)


def _check_supported(opt: torch.optim.Optimizer, sp) -> None:
    why = ("it is tensor-parallel" if sp.tp_spec is not None else
           "its unit keeps optimizer states on disk"
           if type(sp.offload).__name__ == "DiskOffloadPolicy" else None)
    if why is not None:
        raise RuntimeError(
            f"fullshard: {type(opt).__name__} needs whole matrices "
            "(Note [whole-matrix optimizers]) "
            f"but parameter '{sp.fqn}' cannot be stepped whole: {why}. Shard it without "
            "tensor parallelism and with optimizer states in memory, or give it to an "
            "elementwise optimizer.")

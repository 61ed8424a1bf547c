"""Trials of different GPU counts on the GPUs of a node: what the study loop asks an
executor before it starts a trial (:class:`~autotune.exec.Executor`'s ``fits``,
``has_room``, and :func:`never_fits`), and the parallelism rules bound to the executor's
nodes.

The loop asks the sampler for the next config only while some GPU is free and no sampled
trial waits; a sampled trial that does not fit the free GPUs waits (it is the only one)
until running trials give back enough GPUs of one node, so a large trial is never starved
by small ones and no GPU idles while a trial that fits waits. An executor without GPU
bookkeeping (inline, a CPU host) counts slots instead: one trial per slot.
"""

from __future__ import annotations

import logging
from pathlib import Path
from typing import TYPE_CHECKING

from autotune.errors import AutotuneError
from autotune.parallelism import ModelSize, ParallelRules
from autotune.space import SearchSpace

if TYPE_CHECKING:
    from autotune.exec._parallel import Executor
    from autotune.trial import TrialSpec

__all__ = ["never_fits", "with_parallel_rules"]

logger = logging.getLogger(__name__)


def never_fits(executor: Executor, spec: TrialSpec) -> str | None:
    """Why the executor can never start ``spec`` (it needs more GPUs than any node has);
    None when it can once GPUs are free."""
    pool = executor.pool
    need = executor.reservation(spec)
    if pool is None or need <= pool.largest_node:
        return None
    return (f"the trial needs {need} GPUs of one node, but the largest node has "
            f"{pool.largest_node}: lower the parallel sizes (or --gpus-per-trial)")


def with_parallel_rules(space: SearchSpace, *, model: Path, executor: Executor) -> SearchSpace:
    """``space`` with vLLM's parallelism rules for ``model`` on the executor's nodes
    (:class:`autotune.parallelism.ParallelRules`): a sample that breaks one is rejected
    before any server starts, with the figures in its reason. The space's fact ``gpus``
    becomes the largest node's GPUs (its parallelism knobs exist where it is > 1)."""
    node = executor.gpu_node()
    if node is not None and node.gpus != space.facts.gpus:  # the parallelism knobs' fact
        space = space.with_facts(space.facts.model_copy(update={"gpus": node.gpus}))
    try:
        size = ModelSize.from_model_dir(model)
    except AutotuneError as exc:
        logger.warning("parallelism rules off: %s", exc)
        return space
    return space.with_checks(ParallelRules(size=size, node=node))

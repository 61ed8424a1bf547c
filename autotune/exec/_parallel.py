"""Ray: run trials as tasks, one per GPU slot (one at a time on a CPU-only machine).

The driver asks and tells Optuna; workers only run :func:`autotune.trial.run_trial` and
return a :class:`TrialOutcome`. A worker that dies (or a node that goes away) becomes a
failed outcome with reason ``worker_died``; it never loses the study.
"""

from __future__ import annotations

import inspect
import logging
import os
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from types import ModuleType
from typing import TYPE_CHECKING, Any, Literal, Protocol, cast, runtime_checkable

from autotune.engine._launcher import DIR_ENV as PRELOAD_DIR_ENV
from autotune.errors import AutotuneError
from autotune.events import PhaseReporter
from autotune.hardware import cpu_count, gpu_memory_gib, gpu_names
from autotune.parallelism import GpuPool, Node
from autotune.store import FailureReason
from autotune.trial import TrialOutcome, TrialSpec, run_trial

if TYPE_CHECKING:
    from ray.util.queue import Queue

__all__ = ["Executor", "InlineExecutor", "RayExecutor"]

logger = logging.getLogger(__name__)


@runtime_checkable
class Executor(Protocol):
    """Runs trials. Contract: ``slots`` trials may be in flight; ``submit`` returns a handle;
    ``wait`` blocks until at least one in-flight trial finished and returns those outcomes
    (failed workers come back as failed outcomes, never as exceptions); ``cancel_all``
    stops what is in flight and returns their numbers; ``shutdown`` releases resources and
    never raises.

    Placement (:mod:`autotune.exec`): ``pool`` is the free GPUs of each node the executor
    keeps (None: no GPU bookkeeping, one trial per slot); ``reservation(spec)`` the GPUs
    the trial takes (0 without a pool); ``fits(spec)`` whether it can start now (its GPUs
    free on one node, or a slot free); ``has_room()`` whether some GPU (or slot) is free,
    i.e. worth asking for another trial; ``gpu_node()`` the largest node (its GPUs, one
    GPU's memory), None without GPUs.

    ``on_phase`` (optional) is called in the driver, from ``wait``, with the phases the
    trial reports (``(number, phase, elapsed_s, detail)``, see
    :data:`autotune.events.PHASES`); an executor may drop them but never fails for them."""

    slots: int
    pool: GpuPool | None

    def submit(self, spec: TrialSpec, *, on_phase: PhaseReporter | None = None) -> object: ...

    def wait(self, timeout_s: float | None = None) -> list[TrialOutcome]: ...

    def in_flight(self) -> int: ...

    def cancel_all(self) -> list[int]: ...

    def shutdown(self) -> None: ...

    def reservation(self, spec: TrialSpec) -> int: ...

    def fits(self, spec: TrialSpec) -> bool: ...

    def has_room(self) -> bool: ...

    def gpu_node(self) -> Node | None: ...


class InlineExecutor:
    """Runs each trial in this process (for debugging: ``--no-ray``); one slot."""

    slots = 1
    pool: GpuPool | None = None  # the trial sees all of this machine's GPUs

    def __init__(self, fn: Callable[..., TrialOutcome] = run_trial) -> None:
        self._fn = fn
        self._pending: list[tuple[TrialSpec, PhaseReporter | None]] = []

    def submit(self, spec: TrialSpec, *, on_phase: PhaseReporter | None = None) -> TrialSpec:
        self._pending.append((spec, on_phase))
        return spec

    def in_flight(self) -> int:
        return len(self._pending)

    def wait(self, timeout_s: float | None = None) -> list[TrialOutcome]:
        out = [_call(self._fn, s, on_phase) for s, on_phase in self._pending]
        self._pending.clear()
        return out

    def cancel_all(self) -> list[int]:
        numbers = [s.number for s, _ in self._pending]
        self._pending.clear()
        return numbers

    def reservation(self, spec: TrialSpec) -> int:
        return 0

    def fits(self, spec: TrialSpec) -> bool:
        return len(self._pending) < self.slots

    def has_room(self) -> bool:
        return len(self._pending) < self.slots

    def gpu_node(self) -> Node | None:
        """This machine's GPUs (the trial sees all of them), None without any."""
        n = len(gpu_names())
        return Node(gpus=n, gpu_memory_gib=gpu_memory_gib()) if n else None

    def shutdown(self) -> None:
        pass


def _accepts_on_phase(fn: Callable[..., object]) -> bool:
    try:
        return "on_phase" in inspect.signature(fn).parameters
    except (TypeError, ValueError):
        return False


def _call(fn: Callable[..., TrialOutcome], spec: TrialSpec,
          on_phase: PhaseReporter | None) -> TrialOutcome:
    """``fn(spec)``, with the phase reporter when ``fn`` takes one."""
    if on_phase is not None and _accepts_on_phase(fn):
        return fn(spec, on_phase=on_phase)
    return fn(spec)


#: What a worker sends the driver for each phase: ``(number, phase, elapsed_s, detail)``,
#: the arguments of a :data:`PhaseReporter`.
Phase = tuple[int, str, float, str]


class _PhaseQueue(Protocol):
    """The worker's side of the phase queue (a ``ray.util.queue.Queue``)."""

    def put_nowait(self, item: Phase) -> None: ...


def _remote_trial(fn: Callable[..., TrialOutcome], spec: TrialSpec,
                  queue: _PhaseQueue | None) -> TrialOutcome:
    """In a Ray worker: run the trial, sending its phases to the driver through ``queue``."""
    if queue is None:
        return _call(fn, spec, None)

    def report(number: int, phase: str, elapsed_s: float, detail: str) -> None:
        try:  # phases are for displays: losing one must never fail the trial
            item: Phase = (number, phase, elapsed_s, detail)
            queue.put_nowait(item)
        except Exception:
            logger.debug("trial %d: phase %s not delivered", number, phase, exc_info=True)

    return _call(fn, spec, report)


@dataclass
class _Flight:
    spec: TrialSpec
    ref: object  # Ray's ObjectRef of the task: it returns the TrialOutcome
    on_phase: PhaseReporter | None = None
    node: str = ""  # the Ray node id and the GPUs the driver reserved there
    gpus: tuple[int, ...] = ()


def _node_pool(ray: ModuleType) -> GpuPool:
    """The alive nodes' GPUs (node id -> GPU indices), from Ray's view of the cluster."""
    nodes = {}
    for n in ray.nodes():
        count = int((n.get("Resources") or {}).get("GPU", 0)) if n.get("Alive") else 0
        if count:
            nodes[str(n["NodeID"])] = list(range(count))
    return GpuPool(nodes)


class RayExecutor:
    """Trials as Ray tasks on a local Ray (default) or a cluster (``address``).

    A trial gets its server's GPUs (``TrialSpec.server_gpus``: TP x PP x DP), at least
    ``gpus_per_trial``, all on one node: the driver keeps each node's free GPUs
    (:class:`~autotune.parallelism.GpuPool`), picks the node (best fit) and pins the task
    there; Ray gives the task that many whole GPUs (``CUDA_VISIBLE_DEVICES`` in the
    worker, which the vLLM server inherits), never one of another trial's. With
    ``gpus_per_trial`` 0 (no GPUs), ``cpus_per_trial`` CPUs and one trial per slot.
    ``slots`` (in-flight trials) defaults to the cluster's GPUs // gpus_per_trial, or 1
    when there are no GPUs: a CPU server and its load generator already fill a machine.
    ``num_gpus`` (a local Ray only): the GPUs it offers, e.g. fake ones for tests.
    """

    def __init__(
        self,
        *,
        address: str | None = None,
        gpus_per_trial: int = 0,
        cpus_per_trial: float = 1.0,
        slots: int | None = None,
        fn: Callable[..., TrialOutcome] = run_trial,
        num_gpus: int | None = None,
    ) -> None:
        if address:
            _use_cluster_token()  # before Ray reads its auth mode
        try:
            import ray
        except ImportError as exc:  # pragma: no cover - ray is a core dependency
            raise AutotuneError("Ray is not installed; pip install 'ray'") from exc
        self._ray = ray
        self._owns_ray = False
        if not ray.is_initialized():
            kwargs: dict[str, Any] = {
                "include_dashboard": False,
                "logging_level": logging.WARNING,
                "log_to_driver": False,
                "configure_logging": False,
            }
            if address:
                kwargs["address"] = address
            else:
                # A local Ray of our own, sized to this machine ("local": not a cluster that
                # `ray start` or RAY_ADDRESS left on this host, which Ray would otherwise
                # join and then refuse num_cpus); workers inherit our environment.
                kwargs["address"] = "local"
                kwargs["num_cpus"] = max(2, cpu_count())
                if num_gpus is not None:
                    kwargs["num_gpus"] = num_gpus
                kwargs["runtime_env"] = {"env_vars": {"RAY_DEDUP_LOGS": "0"}}
            import signal

            # ray.init installs its own SIGTERM handler (sys.exit); keep the caller's, which
            # turns SIGTERM into a clean stop of the study.
            handlers = {sig: signal.getsignal(sig) for sig in (signal.SIGTERM, signal.SIGINT)}
            try:
                ray.init(**kwargs)
                for sig, handler in handlers.items():
                    if handler is not None:
                        signal.signal(sig, handler)
            except Exception as exc:
                where = f"the Ray cluster at {address}" if address else "a local Ray"
                raise AutotuneError(
                    f"cannot start or join {where}: {type(exc).__name__}: {exc}; check "
                    "--ray-address (host:port of 'ray start --head'), or omit it for a local Ray"
                    + (". Ray >= 2.52 clusters use token authentication: give this machine the "
                       "cluster's token (~/.ray/auth_token, RAY_AUTH_TOKEN_PATH or "
                       "RAY_AUTH_TOKEN; see 'ray get-auth-token') or start every node with "
                       "RAY_AUTH_MODE=disabled" if address else "")
                ) from exc
            self._owns_ray = True
        resources = ray.cluster_resources()
        total_gpus = int(resources.get("GPU", 0))
        self.pool: GpuPool | None = _node_pool(ray) if gpus_per_trial else None
        largest = self.pool.largest_node if self.pool is not None else 0
        if gpus_per_trial > largest:
            raise AutotuneError(
                f"a trial needs {gpus_per_trial} GPU(s) of one node but the largest node of "
                f"the Ray cluster has {largest} ({total_gpus} in all); lower --gpus-per-trial "
                "or add GPU nodes"
            )
        if slots is None:
            slots = max(1, total_gpus // gpus_per_trial) if gpus_per_trial else 1
        self.slots = slots
        self.gpus_per_trial = gpus_per_trial
        self._fn = fn
        # the trials' phases, made on use (False: Ray could not make one)
        self._queue: Queue | Literal[False] | None = None
        options: dict[str, Any] = {}
        preload = os.environ.get(PRELOAD_DIR_ENV)
        if preload:  # the tuner's preloaded interpreters (a Ray started earlier lacks it)
            options["runtime_env"] = {"env_vars": {PRELOAD_DIR_ENV: preload}}
        self._task = ray.remote(_remote_trial)
        self._options: dict[str, Any] = {"num_gpus": gpus_per_trial,
                                         "num_cpus": 0 if gpus_per_trial else cpus_per_trial,
                                         "max_retries": 0, **options}
        self._gpu_memory_gib = gpu_memory_gib() if self.pool is not None else None
        self._flights: list[_Flight] = []
        logger.info("Ray: %s, %d trial slot(s)", resources, slots)

    def nodes(self) -> int:
        return sum(1 for n in self._ray.nodes() if n.get("Alive"))

    # -- placement (autotune.exec) ------------------------------------------------------
    def reservation(self, spec: TrialSpec) -> int:
        """GPUs the trial reserves: its server's, at least ``gpus_per_trial`` (0: none)."""
        return max(self.gpus_per_trial, spec.server_gpus) if self.gpus_per_trial else 0

    def fits(self, spec: TrialSpec) -> bool:
        if self.pool is None:
            return len(self._flights) < self.slots
        return len(self._flights) < self.slots and self.pool.fits(self.reservation(spec))

    def has_room(self) -> bool:
        free = self.pool.free() > 0 if self.pool is not None else True
        return free and len(self._flights) < self.slots

    def gpu_node(self) -> Node | None:
        if self.pool is None:
            return None
        return Node(gpus=self.pool.largest_node, gpu_memory_gib=self._gpu_memory_gib)

    def submit(self, spec: TrialSpec, *, on_phase: PhaseReporter | None = None) -> object:
        queue = self._phase_queue() if on_phase is not None else None
        options, node, gpus = dict(self._options), "", cast(tuple[int, ...], ())
        if self.pool is not None:
            from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy

            n = self.reservation(spec)
            node, gpus = self.pool.take(n)  # the driver's count; Ray picks the GPU ids
            options.update(num_gpus=n, scheduling_strategy=NodeAffinitySchedulingStrategy(
                node_id=node, soft=False))
        ref = self._task.options(**options).remote(self._fn, spec, queue)
        self._flights.append(_Flight(spec, ref, on_phase, node, gpus))
        return ref

    def _release(self, flight: _Flight) -> None:
        if self.pool is not None and flight.gpus:
            self.pool.release(flight.node, flight.gpus)

    def _phase_queue(self) -> Queue | None:
        if self._queue is None:
            try:
                from ray.util.queue import Queue

                self._queue = Queue(actor_options={"num_cpus": 0})
            except Exception as exc:  # noqa: BLE001 - no phases is no reason to stop a study
                logger.warning("Ray: no queue for the trials' phases (%s): phases not shown", exc)
                self._queue = False
        # not "self._queue or None": a ray Queue has a length, so an empty one is falsy
        return None if self._queue is False else self._queue

    def _drain_phases(self) -> None:
        if self._queue is None or self._queue is False:
            return
        try:
            items = self._queue.get_nowait_batch(self._queue.qsize())
        except Exception as exc:  # noqa: BLE001 - phases are for displays
            logger.debug("Ray: reading the phase queue: %s", exc)
            return
        reporters = {f.spec.number: f.on_phase for f in self._flights}
        for number, phase, elapsed_s, detail in items:
            report = reporters.get(number)
            if report is not None:
                report(number, phase, elapsed_s, detail)

    def in_flight(self) -> int:
        return len(self._flights)

    def wait(self, timeout_s: float | None = None) -> list[TrialOutcome]:
        if not self._flights:
            return []
        refs = [f.ref for f in self._flights]
        deadline = None if timeout_s is None else time.monotonic() + timeout_s
        while True:  # in slices of 1 s, handing on the trials' phases in between
            left = 1.0 if deadline is None else max(0.0, min(1.0, deadline - time.monotonic()))
            ready, _ = self._ray.wait(refs, num_returns=1, timeout=left)
            self._drain_phases()
            if ready or (deadline is not None and time.monotonic() >= deadline):
                break
        done: list[TrialOutcome] = []
        for ref in ready:
            flight = next(f for f in self._flights if f.ref == ref)
            self._flights.remove(flight)
            self._release(flight)
            try:
                done.append(self._ray.get(ref))
            except Exception as exc:  # noqa: BLE001 - a dead worker is a failed trial, not a crash
                logger.warning("trial %d: worker failed: %s", flight.spec.number, exc)
                done.append(
                    TrialOutcome(
                        number=flight.spec.number, ok=False, reason=FailureReason.WORKER_DIED,
                        message=f"the Ray worker running this trial failed: "
                                f"{type(exc).__name__}: {str(exc)[:2000]}",
                    )
                )  # fmt: skip
        return done

    def cancel_all(self) -> list[int]:
        numbers = []
        for f in self._flights:
            try:
                self._ray.cancel(f.ref, force=True)
            except Exception as exc:  # noqa: BLE001 - keep cancelling the others
                logger.warning("cancelling trial %d: %s", f.spec.number, exc)
            numbers.append(f.spec.number)
            self._release(f)
        self._flights.clear()
        return numbers

    def shutdown(self) -> None:
        if self._flights:
            self.cancel_all()
        if self._queue:
            try:
                self._queue.shutdown(force=True)
            except Exception as exc:  # noqa: BLE001 - shutdown never raises
                logger.debug("Ray: stopping the phase queue: %s", exc)
        if self._owns_ray:
            try:
                self._ray.shutdown()
            except Exception as exc:  # noqa: BLE001 - shutdown never raises
                logger.warning("Ray shutdown: %s", exc)


def _use_cluster_token() -> None:
    """Joining a cluster: use the local Ray auth token when one is there.

    Ray 2.60 starts a head with token authentication and writes the token to
    ``~/.ray/auth_token``, but a process that joins with ``address=`` and no
    ``RAY_AUTH_MODE`` does not send it (seen: "Failed to connect to Ray cluster"). An
    explicit ``RAY_AUTH_MODE`` is left alone.
    """
    if "RAY_AUTH_MODE" in os.environ:
        return
    token_file = Path(os.environ.get("RAY_AUTH_TOKEN_PATH") or Path.home() / ".ray" / "auth_token")
    from_env = bool(os.environ.get("RAY_AUTH_TOKEN"))
    if from_env or token_file.is_file():
        os.environ["RAY_AUTH_MODE"] = "token"
        logger.info("Ray: joining with token authentication (token from %s)",
                    "RAY_AUTH_TOKEN" if from_env else token_file)

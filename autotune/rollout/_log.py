"""The rollout's record: a JSON-lines log (one event a line, flushed as it happens) and a
summary written atomically at the end; both go to MLflow as the rollout run's artifacts."""

from __future__ import annotations

import json
import logging
import time
from collections.abc import Callable, Mapping
from pathlib import Path

from autotune.results import write_json_atomic

__all__ = ["RolloutLog"]

logger = logging.getLogger(__name__)


class RolloutLog:
    """Appends events to ``path`` (``rollout.jsonl``); ``echo`` also sees each event (the
    CLI prints progress from it)."""

    def __init__(self, path: Path, *, echo: Callable[[Mapping[str, object]], None] | None = None
                 ) -> None:
        self.path = path
        path.parent.mkdir(parents=True, exist_ok=True)
        self._file = path.open("a", encoding="utf-8")
        self.echo = echo
        self.events: list[dict[str, object]] = []

    def event(self, kind: str, **fields: object) -> dict[str, object]:
        rec: dict[str, object] = {"t": round(time.time(), 3), "event": kind, **fields}
        self.events.append(rec)
        self._file.write(json.dumps(rec, sort_keys=False, default=str) + "\n")
        self._file.flush()
        logger.info("rollout: %s %s", kind, fields.get("why", ""))
        if self.echo is not None:
            self.echo(rec)
        return rec

    def write_summary(self, summary: Mapping[str, object]) -> Path:
        path = self.path.with_name("summary.json")
        write_json_atomic(path, dict(summary))
        return path

    def close(self) -> None:
        self._file.close()

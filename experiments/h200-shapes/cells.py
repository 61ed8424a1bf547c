"""The cross-evaluation driver: one config, one server start, each shape it still lacks
measured in turn on that server (autotune.trial.run_trials_on_one_server).

    python3 experiments/h200-shapes/cells.py GROUP.json --gpu N --log LOG \\
        [--deadline EPOCH_S] -- COMMON_BENCH_ARGS...

GROUP.json (`steps.py plan` writes one per server): cells whose flags and env are equal,
each a planned cell file (its `autotune bench` arguments: shape, objective, SLOs, capacity
start, caps, warm-up; as `steps.py bench-args` gives them) and an output prefix
(RES/cross-KEY/CFG). COMMON_BENCH_ARGS: what every cell shares (--model, --cache-dir,
--start-timeout, --seed). Each cell is parsed exactly as `autotune bench` parses its
arguments (autotune.cli._bench), all before the start, so a bad cell costs no start. The
server starts once (its log: LOG); each shape is warmed up on its own, then measured as a
fresh `autotune bench` would measure it. As soon as a cell is measured, its files are written:

- PREFIX.json: `autotune bench --json`'s output, plus `server_reused` (false on the cell
  that started the server: its start_s, compile_s, start_phases are the start's; true on
  the later ones: start_s 0);
- PREFIX.run.json: gpu, started, wall_s (its turn: the first cell's includes the start),
  rc (0 ok, 1 failed: as bench's exit code), source, args, and the server's cells
  (`server_cells`) with the start's seconds on the first (`server_start_s`);
- PREFIX.err: the log lines of its turn; PREFIX-server-log.tgz: the server log's head (the
  start) and the tail of its own part of the log (the name run.sh gave one server's log).

A failed cell is a result (the config does not serve that shape), and the next cell runs
on the same server while it serves; a server that died fails the rest without a restart.
One line per cell goes to stdout (run.sh writes them to progress.txt). --deadline: cells
that would not finish by then (one start plus their expected seconds, in order:
steps.fit_cells) are left for a later session. SIGTERM (run.sh's timeout): the cell in
progress gets PREFIX.run.json with rc 124 and no PREFIX.json (it is measured again next
session), the finished cells stay, and the driver exits at once; the server's process
group is stopped by the library's reaper (SIGTERM, SIGKILL 15 s later). Exit: 0 when each
cell that fitted was measured (ok or not), 2 for bad arguments, 124 when stopped (130:
SIGINT).
"""

from __future__ import annotations

import argparse
import contextlib
import importlib.util
import io
import json
import logging
import os
import signal
import sys
import tarfile
import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

HERE = Path(__file__).resolve().parent
_spec = importlib.util.spec_from_file_location("h200_shapes_steps", HERE / "steps.py")
steps = importlib.util.module_from_spec(_spec)  # type: ignore[arg-type]
_spec.loader.exec_module(steps)  # type: ignore[union-attr]

HEAD_BYTES, TAIL_BYTES = 20_000, 30_000  # of a server log, per cell (run.sh's logtails)
_STOPS = {signal.SIGTERM, signal.SIGINT}


def _utc(t: float) -> str:
    return time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime(t))


def _write(path: Path, text: str | bytes) -> None:
    """Atomically: a reader (or a kill) never sees half a file."""
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(path.name + ".part")
    tmp.write_bytes(text.encode() if isinstance(text, str) else text)
    os.replace(tmp, path)


def say(line: str) -> None:
    print(line, flush=True)


class Cells:
    """The files of a group's cells, written one cell at a time as each is measured."""

    def __init__(self, cells: list[dict[str, Any]], specs: list[Any], *, gpu: int, log: Path,
                 notes: list[str], extra: dict[str, Any]) -> None:
        self.cells, self.specs, self.gpu, self.log = cells, specs, gpu, log
        self.notes, self.extra = notes, extra
        self.i, self.begun, self.offset = 0, time.time(), 0
        self.handler: logging.Handler | None = None
        # a stop waits while a cell's files are written (held by done, or by the stop)
        self._writing = threading.Lock()
        self.stop_rc: int | None = None
        self._begin()

    def name(self, i: int) -> str:
        return f"cross:{self.cells[i]['key']} {self.cells[i]['config']}"

    def prefix(self, i: int) -> Path:
        return Path(self.cells[i]["prefix"])

    def _begin(self) -> None:
        """Cell ``self.i``'s turn begins: its .err takes the log lines from now on."""
        i = self.i
        self.begun = time.time()
        err = self.prefix(i).with_name(self.prefix(i).name + ".err")
        err.parent.mkdir(parents=True, exist_ok=True)
        err.write_text(self.notes[i])
        self.handler = logging.FileHandler(err)
        self.handler.setFormatter(logging.Formatter(
            "%(asctime)s %(levelname)s %(name)s: %(message)s"))
        logging.getLogger().addHandler(self.handler)
        how = "starts the server" if i == 0 else "same server"
        say(f"{self.name(i)} on gpu{self.gpu} ({how}, cell {i + 1}/{len(self.cells)})")

    def _end(self) -> None:
        if self.handler is not None:
            logging.getLogger().removeHandler(self.handler)
            self.handler.close()
            self.handler = None

    def _run_json(self, rc: int, **more: Any) -> None:
        c, i = self.cells[self.i], self.i
        spec = json.loads(Path(c["file"]).read_text())
        rec = {"gpu": self.gpu, "started": _utc(self.begun),
               "wall_s": round(time.time() - self.begun), "rc": rc,
               "source": spec.get("source"), "args": spec["args"],
               "server_log": self.log.name, "server_cell": i + 1,
               "server_cells": [f"{x['key']}/{x['config']}" for x in self.cells], **more}
        p = self.prefix(i)
        _write(p.with_name(p.name + ".run.json"), json.dumps(rec, indent=1) + "\n")

    def _log_tgz(self) -> None:
        """The server log's head (its start, up to HEAD_BYTES) and this cell's part of it
        (its last TAIL_BYTES; the first cell's part is the start, so its head too)."""
        p = self.prefix(self.i)
        try:
            data = Path(self.specs[self.i].log_path).read_bytes()
        except (OSError, TypeError):
            data = b""
        begin, self.offset = self.offset, len(data)
        part = data[begin:]
        keep_head = HEAD_BYTES if begin == 0 else 0
        if len(part) > keep_head + TAIL_BYTES:
            part = (part[:keep_head] + f"\n[... {len(part) - keep_head - TAIL_BYTES} bytes "
                    "left out ...]\n".encode() + part[-TAIL_BYTES:])
        head = data[: min(HEAD_BYTES, begin)]
        if head:
            head += (f"\n[... the server's start above (the log's first {len(head)} bytes); "
                     f"this cell's part below, from byte {begin} ...]\n").encode()
        text = head + part
        member = f"cross-{self.cells[self.i]['key']}-{self.cells[self.i]['config']}.log"
        buf = io.BytesIO()
        with tarfile.open(fileobj=buf, mode="w:gz") as tar:
            info = tarfile.TarInfo(member)
            info.size, info.mtime = len(text), int(time.time())
            tar.addfile(info, io.BytesIO(text))
        _write(p.with_name(p.name + "-server-log.tgz"), buf.getvalue())

    def done(self, outcome: Any) -> None:
        """``on_outcome``: cell ``self.i`` is measured (ok or not): its files, then the next."""
        from autotune.cli._bench import bench_json

        with self._writing:
            self._done(outcome, bench_json)
        self.try_stop()  # a stop that came while the files were written

    def _done(self, outcome: Any, bench_json: Callable[..., dict[str, Any]]) -> None:
        self._end()
        d = {**bench_json(self.specs[self.i], outcome), "server_reused": outcome.server_reused,
             **self.extra}
        p = self.prefix(self.i)
        _write(p.with_name(p.name + ".json"), json.dumps(d, indent=2) + "\n")
        rc = 0 if outcome.ok else 1
        more = ({"server_reused": True} if outcome.server_reused
                else {"server_start_s": outcome.start_s, "server_compile_s": outcome.compile_s})
        self._run_json(rc, **more)
        self._log_tgz()
        why = "" if outcome.ok else f" ({outcome.reason})"
        say(f"{self.name(self.i)} on gpu{self.gpu} exit {rc}{why}")
        self.i += 1
        if self.i < len(self.cells):
            self._begin()

    def request_stop(self, rc: int) -> None:
        """From the signal handler: stop now, or (a cell's files being written) once they
        are whole. Not signal masks: a process-directed signal reaches a thread that does
        not block it, and Python runs the handler in the main thread mid-write anyway."""
        self.stop_rc = rc
        self.try_stop()

    def try_stop(self) -> None:
        """If a stop was asked and no cell's files are being written: mark the cell in
        progress and end the process (the lock stays held: nothing writes after this)."""
        rc = self.stop_rc
        if rc is None or not self._writing.acquire(blocking=False):
            return
        self.stopped(rc, "stopped at the time limit (SIGTERM)" if rc == 124 else "interrupted")
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(rc)

    def stopped(self, rc: int, why: str) -> None:
        """Stopped mid-way: the cell in progress gets its run.json (no result), the rest
        nothing (pending). Called as the process ends (try_stop): no logging here (its .err
        handler stays open: the process ends next)."""
        if self.i >= len(self.cells):
            return
        self._run_json(rc, note=why)
        self._log_tgz()
        say(f"{self.name(self.i)} on gpu{self.gpu} exit {rc} ({why})")
        for j in range(self.i + 1, len(self.cells)):
            say(f"{self.name(j)} not measured on gpu{self.gpu}: {why}")


def _parse(cells: list[dict[str, Any]], common: list[str], log: Path
           ) -> tuple[list[Any], list[str]]:
    """Each cell's TrialSpec (as `autotune bench COMMON CELL-ARGS` builds it; one server
    log for all) and what bench would have printed to stderr before measuring it."""
    from autotune.cli._bench import bench_spec, parse_bench

    specs: list[Any] = []
    notes: list[str] = []
    for i, c in enumerate(cells):
        argv = [*common, *steps.cell_bench_args(json.loads(Path(c["file"]).read_text()))]
        err = io.StringIO()
        try:
            with contextlib.redirect_stderr(err):
                args = parse_bench((["--log", str(log)] if i == 0 else []) + argv)
                spec = bench_spec(args, number=i,
                                  log_path=Path(specs[0].log_path) if specs else None)
        except BaseException:  # argparse's exit, a ConfigError: its words go to stderr
            sys.stderr.write(f"cell {c['key']}/{c['config']}: {err.getvalue()}")
            raise
        specs.append(spec)
        notes.append(err.getvalue() + f"benchmarking: {' '.join(spec.flags)}; server log: "
                     f"{spec.log_path} (cell {i + 1} of {len(cells)} on one server)\n")
    return specs, notes


def main(argv: list[str] | None = None, *, runner: Callable[..., Any] | None = None,
         extra: dict[str, Any] | None = None) -> int:
    """``runner``: what measures the specs on one server (default
    autotune.trial.run_trials_on_one_server; dryrun.py passes a stand-in); ``extra``: keys
    added to every cell's JSON."""
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("group", type=Path, help="a group file of steps.py plan")
    ap.add_argument("--gpu", type=int, default=0, help="the GPU (for run.json; "
                    "CUDA_VISIBLE_DEVICES picks it)")
    ap.add_argument("--log", type=Path, required=True, help="the server's log")
    ap.add_argument("--deadline", type=float, default=None,
                    help="epoch seconds: leave the cells that would not finish by then")
    ap.epilog = "after '--': the bench options every cell shares (--model M ...)"
    argv = list(sys.argv[1:] if argv is None else argv)
    cut = argv.index("--") if "--" in argv else len(argv)
    a = ap.parse_args(argv[:cut])
    common = argv[cut + 1 :]
    group = json.loads(a.group.read_text())
    cells: list[dict[str, Any]] = list(group["cells"])
    if a.deadline is not None:
        left = a.deadline - time.time()
        n = steps.fit_cells([c["expected_s"] for c in cells], group["start_expected_s"], left)
        need = group["start_expected_s"] + sum(c["expected_s"] for c in cells[:n])
        for c in cells[n:]:
            need += c["expected_s"]
            say(f"cross:{c['key']} {c['config']} not started on gpu{a.gpu}: {left:.0f} s left, "
                f"the server and its cells up to this one take ~{need} (a later session)")
        cells = cells[:n]
    if not cells:
        return 0
    from autotune.errors import AutotuneError

    logging.basicConfig(level=logging.WARNING,
                        format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    logging.getLogger("autotune").setLevel(logging.INFO)  # into each cell's .err
    for h in logging.getLogger().handlers:
        h.setLevel(logging.WARNING)  # stderr: warnings only, as bench without -v
    try:
        specs, notes = _parse(cells, common, a.log)
    except AutotuneError as exc:
        print(f"cells: error: {exc}", file=sys.stderr)
        return 2
    if runner is None:
        from autotune.trial import run_trials_on_one_server as runner
    out = Cells(cells, specs, gpu=a.gpu, log=Path(specs[0].log_path), notes=notes,
                extra=extra or {})

    def stop(signum: int, frame: Any) -> None:
        # Not an exception: raised from a signal handler it can land in an event loop's
        # callback, which logs it and goes on (uvloop does). The cell in progress is
        # marked, then the process ends; the library's reaper stops the server's process
        # group (SIGTERM, then SIGKILL after 15 s), as for any tuner that dies.
        out.request_stop(124 if signum == signal.SIGTERM else 130)

    for sig in _STOPS:
        signal.signal(sig, stop)
    runner(specs, on_outcome=out.done)
    return 0


if __name__ == "__main__":
    sys.exit(main())

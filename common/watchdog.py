"""A stalled process named, not waited on: after --hang_timeout seconds without progress (the beats: each training
step's end, each evaluation batch), every process that can still run writes its stacks to
<output_dir>/hang/rank-<r>.txt, the lowest of them prints one line naming the ranks that stalled and those waiting for
them, and the job ends with exit 124. The ranks meet in the output folder, which every node sees: no collective is
added to a step. Phases slow by nature (saves, loads, the first step) get as long as the collectives around them can
wait (--ddp_timeout), less the time to report."""

import collections
import faulthandler
import json
import os
import re
import socket
import sys
import threading
import time
import traceback
from contextlib import suppress
from pathlib import Path

from accelerate.utils import gather_object
from tqdm.auto import tqdm

from .args import first_to_say
from .preemption import HUNG_EXIT_CODE, run_ended, write_status

MARGIN = 20.0  # seconds a reporting process waits for the others' stacks
STEPS_OF_NO_PROGRESS = 3  # a step is not stalled before it has taken this many of the run's median steps
SLOW_PHASES = ("checkpoint save", "final save", "checkpoint load")
# (function names, the phase): the first phase here with a function in the main thread's stack names it.
PHASES = (
    (("save_checkpoint", "write_checkpoint", "save_state"), "checkpoint save"),
    (("save_model", "write_results"), "final save"),
    (("load_checkpoint", "load_state"), "checkpoint load"),
    (("evaluate", "evaluate_causal_lm"), "evaluation"),
    (("_next_data", "__next__", "fetch", "__getitems__", "__getitem__"), "data loading"),
    (("step", "clip_grad_norm_"), "optimizer step"),  # torch's optimizers run inside their step()
    (("backward", "forward", "_call_impl"), "forward/backward"),
)
# A frame of torch.distributed, DDP or Accelerate's operations whose name says it waits for the other processes.
WAITS = re.compile(r"broadcast|reduce|gather|barrier|wait|recv|send|sync")


def phase_of(frames) -> tuple[str, bool]:
    """(the phase, whether it waits in a collective) of a stack, innermost frame last. A backward pass counts as
    waiting: DDP's gradient all-reduce runs inside it, out of Python's sight."""
    names = [f.name for f in frames]
    places = ("distributed", "accelerate/utils/operations", "common/preemption")
    waiting = any(WAITS.search(f.name) and any(p in f.filename for p in places) for f in frames)
    waiting = waiting or any(name in ("backward", "_engine_run_backward") for name in names[-4:])
    found = [phase for keys, phase in PHASES if any(name in keys for name in names)] or ["training step"]
    return found[0] + (" (data loading)" if "data loading" in found[1:] else ""), waiting


def start_watchdog(accelerator, args):
    """The run's Watchdog (--hang_timeout, --ddp_timeout, --output_dir), its thread started now; or None: with
    --hang_timeout 0 nothing is watched."""
    if not args.hang_timeout:
        return None
    return Watchdog(accelerator, args.hang_timeout, args.ddp_timeout, args.output_dir)


class Watchdog:
    def __init__(self, accelerator, hang_timeout: float, ddp_timeout: float, output_dir):
        self.timeout, self.folder = hang_timeout, Path(output_dir) / "hang"
        self.slow_timeout = max(hang_timeout, ddp_timeout - 2 * MARGIN)
        self.rank, self.world = accelerator.process_index, accelerator.num_processes
        self.ranks = gather_object([(socket.gethostname(), os.getpid())])  # who each rank is, for the report
        self._main, self._continued = threading.main_thread().ident, time.perf_counter()
        # (step, time.perf_counter()) of the last beats: the training loop appends one as each step ends (data, no
        # call: a step runs no code of this module); an evaluation's beat is (None, time), at most one in a row.
        # The last steps' durations are those of consecutive steps with no other beat between.
        self.beats = collections.deque([(None, self._continued)], maxlen=33)
        self.step = 0  # the last step beaten, as this thread last looked
        threading.Thread(target=self._watch, name="hang-watchdog", daemon=True).start()

    def beat(self, step: int | None = None) -> None:
        """Progress: the end of optimizer step `step` (what the training loop appends itself), or with None one that
        is not a step's end (an evaluation's batch)."""
        if step is None and self.beats[-1][0] is None:
            self.beats[-1] = (None, time.perf_counter())
        else:
            self.beats.append((step, time.perf_counter()))

    def _looked(self) -> tuple[float, float]:
        """(the last progress, the seconds without progress that make a stall) from the beats so far; sets `step`.
        The limit is --hang_timeout, or more where the run's steps are long for it (--ddp_timeout 10 gives 5 s; a
        step of 4 s under load took 6 and was killed as a hang)."""
        beats = list(self.beats)  # a copy made at once: the main thread appends meanwhile
        self.step = next((step for step, _ in reversed(beats) if step is not None), self.step)
        steps = sorted(
            t - before for (one, before), (other, t) in zip(beats, beats[1:]) if one is not None and other == one + 1
        )
        limit = max(self.timeout, STEPS_OF_NO_PROGRESS * steps[len(steps) // 2]) if steps else self.timeout
        return max(beats[-1][1], self._continued), limit

    def _watch(self) -> None:
        """Until the main thread stalls; then this rank's report, the line, and the exit. Not once the run has ended:
        a main() called from a user's script returns to it, which may take its time."""
        slow_seen = 0.0  # when a slow phase was last seen: the time it took is not the next phase's
        period = min(5.0, self.timeout / 4)
        woke = time.perf_counter()
        while True:
            time.sleep(period)
            if run_ended():
                return
            phase, waiting = phase_of(traceback.extract_stack(sys._current_frames()[self._main]))
            last, steps_limit = self._looked()
            slow = phase in SLOW_PHASES or self.step == 0  # before the first step ends: compiling, warming up
            now = time.perf_counter()
            slept, woke = now - woke, now
            if slept > period + max(period, 2.0):  # this process did not run meanwhile: stopped (SIGSTOP, a job
                self._continued = now  # suspended by its scheduler) and continued; its time is not idle
                continue
            slow_seen = now if slow else slow_seen
            idle = now - (last if slow else max(last, slow_seen))
            if idle >= (self.slow_timeout if slow else steps_limit):
                break
        limit = f"--ddp_timeout less {2 * MARGIN:.0f} s, for a {phase}" if slow else "--hang_timeout"
        if not slow and steps_limit > self.timeout:
            limit = f"{STEPS_OF_NO_PROGRESS} of the run's median steps, above --hang_timeout"
        self.folder.mkdir(parents=True, exist_ok=True)
        host, pid = self.ranks[self.rank]
        mine = {"rank": self.rank, "host": host, "pid": pid, "step": self.step, "phase": phase, "waiting": waiting}
        part = self.folder / f".rank-{self.rank}.txt"  # renamed once whole: a half-written report is not read
        with open(part, "w") as f:
            f.write(json.dumps(mine) + "\n")
            f.flush()
            faulthandler.dump_traceback(f, all_threads=True)
        part.replace(self.folder / f"rank-{self.rank}.txt")
        _wait(lambda: len(self._reports()) == self.world)
        found, said = self._reports(), self.folder / "reported"
        reporter = str(self.ranks[min(found)][1])  # its pid: an earlier hang's file says another
        if self.rank == min(found):  # the lowest rank that can still run says it, once
            first_to_say(HUNG_EXIT_CODE)  # for its node's processes, ended by this
            tqdm.write(f"error: {self.line(found, idle, limit)}", file=sys.stderr)  # on a line of its own, below a bar
            said.write_text(reporter)
            for rank in set(range(self.world)) - set(found):  # frozen or dead here: it would hold the job up
                if self.ranks[rank][0] == host:
                    with suppress(OSError):
                        os.kill(self.ranks[rank][1], 9)
        else:  # not before it is said: this exit would break the collective the reporter waits in, and end it first
            _wait(lambda: said.is_file() and said.read_text() == reporter)
        write_status("error")
        os._exit(HUNG_EXIT_CODE)

    def _reports(self) -> dict:
        """This hang's reports by rank: an earlier hang's (a resumed run's) names another host or pid."""
        found = {}
        for path in self.folder.glob("rank-*.txt"):
            with suppress(OSError, ValueError, LookupError):
                report = json.loads(path.read_text().partition("\n")[0])
                if list(self.ranks[report["rank"]]) == [report["host"], report["pid"]]:
                    found[report["rank"]] = report
        return found

    def line(self, found: dict, idle: float, limit: str) -> str:
        """The one line: who stalled (no report, or one not waiting in a collective), who waits for them."""
        waiting = [rank for rank in sorted(found) if found[rank]["waiting"]]
        said = []
        for rank in (r for r in range(self.world) if r not in waiting):
            how = "without answering (frozen, or dead)"
            if rank in found:
                how = f"after step {found[rank]['step']} in {found[rank]['phase']}"
            said.append(f"rank {rank} ({self.ranks[rank][0]}, pid {self.ranks[rank][1]}) stalled {how}")
        if said and waiting:
            ranks = f"rank {waiting[0]} waits" if len(waiting) == 1 else f"ranks {', '.join(map(str, waiting))} wait"
            said.append(f"{ranks} for {'it' if len(said) == 1 else 'them'} in {found[waiting[0]]['phase']}")
        who = "; ".join(said) or "every rank waits in a collective: one of them skipped or added one"
        return (
            f"no progress for {idle:.0f} s ({limit}): {who}; the stacks of the ranks that could answer are in "
            f"{self.folder}/; the checkpoints already saved are intact (exit {HUNG_EXIT_CODE})"
        )


def _wait(done) -> None:
    """Until `done()`, for MARGIN seconds at most."""
    deadline = time.monotonic() + MARGIN
    while time.monotonic() < deadline and not done():
        time.sleep(0.2)

"""Every process a command starts ends with it: at its end, on Ctrl-C, on SIGTERM.

The commands that start a local Ray cluster (``python -m drpo_openrlhf.train`` without a
cluster to join, ``make demo``, ``drpo-sweep``'s local backend) own what it runs: Ray's GCS,
raylet and workers, the vLLM engine core each engine actor spawns, DeepSpeed ranks, the
reward's grader workers. Not all of them stay in the owner's process tree: a Ray worker that
its raylet kills without its exit handlers leaves its vLLM engine core to init, where it runs
on (one did at 19% CPU after a Ctrl-C of ``make demo``, until killed by hand). So ownership
is a token in an environment variable, which every process started after it is set
inherits, wherever it is reparented: ``owning_processes`` sets one and, when its block is
left, ends every process that carries it (SIGTERM, then SIGKILL), as the Slurm launcher does
on its nodes. Nested owners add their own token; the outer one ends theirs too.

``interrupt_on_signals`` makes SIGTERM unwind a command as Ctrl-C does (``Interrupted``, a
``KeyboardInterrupt``), so that both reach the same clean-up and the same last line; a
terminal's Ctrl-C reaches every process of the foreground group at once, and a command that
forwards it to its child must not cut that child's own clean-up short, so a second signal
while stopping is ignored. Imports nothing of the package, so every layer can use it.
"""

from __future__ import annotations

import atexit
import os
import secrets
import signal
import subprocess
import sys
import threading
import time
import warnings
from collections.abc import Callable, Iterator
from contextlib import contextmanager, suppress
from pathlib import Path
from typing import IO, Any

OWNERS_VAR = "DRPO_PROCESS_OWNERS"
GRACE_S = 5.0  # from SIGTERM to SIGKILL: a Ray worker's exit handlers stop its vLLM engine
KILL_WAIT_S = 5.0  # after SIGKILL, for the kernel to remove them
POLL_S = 0.1
# none left for this long before the end is believed: a process that a dying one (a raylet
# starting its agents) forked just then, read while it execs, shows no environment
SETTLE_S = 0.5
DRAIN_S = 10.0  # for a stopped child's last output, once it has exited
SIGNAL_NAMES = {signal.SIGINT: "SIGINT (Ctrl-C)", signal.SIGTERM: "SIGTERM"}
STOP_SIGNALS = (signal.SIGINT, signal.SIGTERM)


class Interrupted(KeyboardInterrupt):
    """A command stopped by a signal: SIGINT (Ctrl-C) or SIGTERM, unwinding as Ctrl-C does."""

    def __init__(self, signum: int = signal.SIGINT) -> None:
        super().__init__(signum)
        self.signum = signum

    @property
    def name(self) -> str:
        return SIGNAL_NAMES.get(self.signum, signal.Signals(self.signum).name)

    @property
    def exit_code(self) -> int:
        """What a shell reports for a command its signal ended: 128 + the signal's number."""
        return 128 + self.signum


def interruption(stop: BaseException) -> Interrupted | None:
    """``stop`` as an ``Interrupted``, or None when it is no interruption: a plain
    ``KeyboardInterrupt`` is Ctrl-C; ``SystemExit(15)`` is what Ray's own SIGTERM handler
    raises in a driver (``ray.init`` installs it, so a run whose ``ray.init`` OpenRLHF makes
    meets it)."""
    if isinstance(stop, Interrupted):
        return stop
    if isinstance(stop, KeyboardInterrupt):
        return Interrupted(signal.SIGINT)
    if isinstance(stop, SystemExit) and stop.code == signal.SIGTERM:
        return Interrupted(signal.SIGTERM)
    return None


def as_interrupted(stop: KeyboardInterrupt) -> Interrupted:
    """A ``KeyboardInterrupt`` as an ``Interrupted``: a plain one is Ctrl-C."""
    return stop if isinstance(stop, Interrupted) else Interrupted(signal.SIGINT)


def _interrupt(signum: int, frame: object) -> None:
    for other in STOP_SIGNALS:
        if signal.getsignal(other) is _interrupt:
            signal.signal(other, _already_stopping)
    raise Interrupted(signum)


def _already_stopping(signum: int, frame: object) -> None:
    """A signal while the command stops: its clean-up is bounded, so it runs to its end (a
    handler, not SIG_IGN, which a process started meanwhile would inherit)."""


def interrupt_on_signals() -> dict[int, Any]:
    """SIGINT and SIGTERM raise ``Interrupted`` in the main thread, once; the previous
    handlers are returned for ``restore_signals``. A signal the process was started with
    ignored (SIGINT in a shell's background job) stays ignored."""
    previous: dict[int, Any] = {}
    if threading.current_thread() is not threading.main_thread():
        return previous
    for signum in STOP_SIGNALS:
        if signal.getsignal(signum) is not signal.SIG_IGN:
            previous[signum] = signal.signal(signum, _interrupt)
    return previous


@contextmanager
def keeping_sigterm() -> Iterator[None]:
    """Around ``ray.init``, which installs Ray's SIGTERM handler (a C++ stack dump, then
    ``sys.exit``) over the process's: the handler before it is put back if it was the
    process's own (a Python function, such as ``interrupt_on_signals``')."""
    handler = signal.getsignal(signal.SIGTERM)
    yield
    if callable(handler) and threading.current_thread() is threading.main_thread():
        signal.signal(signal.SIGTERM, handler)


# the start of the FutureWarning that every ray.init of the pinned Ray prints
RAY_OVERRIDE_TIP = "Tip: In future versions of Ray, Ray will no longer override accelerator"


def quiet_ray_tip() -> None:
    """Hide the FutureWarning that the pinned Ray's ``ray.init`` prints on every driver: it
    announces a default that a later Ray will change (RAY_ACCEL_ENV_VAR_OVERRIDE_ON_ZERO).
    Setting that variable to silence it would change today's behaviour (the visible-devices
    variable of a Ray worker without GPUs), which this Ray's users get; only the text goes."""
    warnings.filterwarnings("ignore", message=RAY_OVERRIDE_TIP, category=FutureWarning)


def exiting() -> None:
    """This process is on its way out: SIGINT and SIGTERM no longer interrupt it, so that its
    exit handlers (Ray's shutdown, an owner's end) run to their end. One it was started with
    ignored stays ignored."""
    if threading.current_thread() is not threading.main_thread():
        return
    for signum in STOP_SIGNALS:
        if signal.getsignal(signum) is not signal.SIG_IGN:
            signal.signal(signum, _already_stopping)


@contextmanager
def uninterrupted() -> Iterator[None]:
    """SIGINT and SIGTERM do nothing during the block (a stopping command's clean-up and the
    line that says why it stopped, both bounded); the handlers before it are back after."""
    with _stop_signals_handled_by(_already_stopping):
        yield


@contextmanager
def _stop_signals_handled_by(handler: Callable[[int, Any], None]) -> Iterator[None]:
    """``handler`` for SIGINT and SIGTERM during the block, in the main thread (where Python
    runs signal handlers; elsewhere nothing changes); one ignored stays ignored."""
    if threading.current_thread() is not threading.main_thread():
        yield
        return
    previous = {
        signum: signal.signal(signum, handler)
        for signum in STOP_SIGNALS
        if signal.getsignal(signum) is not signal.SIG_IGN
    }
    try:
        yield
    finally:
        restore_signals(previous)


def restore_signals(previous: dict[int, Any]) -> None:
    for signum, handler in previous.items():
        signal.signal(signum, handler if handler is not None else signal.SIG_DFL)


def _tokens(value: str | None) -> list[str]:
    return [t for t in (value or "").split(",") if t]


def claim() -> str:
    """A new owner token, added to this process's environment: every process it starts from
    now on, and all that those start, carry it."""
    token = f"{os.getpid()}-{secrets.token_hex(4)}"
    os.environ[OWNERS_VAR] = ",".join([*_tokens(os.environ.get(OWNERS_VAR)), token])
    return token


def release(token: str) -> None:
    """Processes started from now on no longer carry ``token``."""
    rest = [t for t in _tokens(os.environ.get(OWNERS_VAR)) if t != token]
    if rest:
        os.environ[OWNERS_VAR] = ",".join(rest)
    else:
        os.environ.pop(OWNERS_VAR, None)


def _owners(pid_dir: Path) -> list[str]:
    """The tokens a process was started with (``/proc/PID/environ``; a zombie's is empty)."""
    prefix = f"{OWNERS_VAR}=".encode()
    for entry in (pid_dir / "environ").read_bytes().split(b"\0"):
        if entry.startswith(prefix):
            return _tokens(entry[len(prefix) :].decode(errors="replace"))
    return []


def carrying(token: str) -> list[int]:
    """The ids of the live processes, other than this one, that carry ``token``."""
    found = []
    for pid_dir in Path("/proc").glob("[0-9]*"):
        try:
            mine = token in _owners(pid_dir)
        except OSError:  # gone meanwhile, or another user's
            continue
        if mine and int(pid_dir.name) != os.getpid():
            found.append(int(pid_dir.name))
    return found


def _signal_all(pids: list[int], signum: int) -> None:
    for pid in pids:
        with suppress(ProcessLookupError, PermissionError):
            os.kill(pid, signum)


def end_carrying(token: str, grace_s: float = GRACE_S) -> int:
    """End every process that carries ``token``: SIGTERM (to each as it is found, since a
    dying Ray worker's engine may still start one), SIGKILL to what is left after ``grace_s``.
    Returns how many there were. A SIGINT or SIGTERM meanwhile takes effect once it is done."""
    with _signals_deferred():
        return _end(token, grace_s)


@contextmanager
def _signals_deferred() -> Iterator[None]:
    """SIGINT and SIGTERM noted during the block and raised again after it, to the handlers
    they had (blocking them would not do: the kernel then hands them to another thread, and
    Python runs its handler in the main thread all the same)."""
    pending: list[int] = []
    try:
        with _stop_signals_handled_by(lambda signum, frame: pending.append(signum)):
            yield
    finally:
        for signum in dict.fromkeys(pending):
            signal.raise_signal(signum)


def _end(token: str, grace_s: float) -> int:
    start = time.monotonic()
    seen: set[int] = set()
    quiet_since: float | None = None
    while True:
        pids = carrying(token)
        elapsed = time.monotonic() - start
        if pids:
            quiet_since = None
        elif quiet_since is None:
            quiet_since = elapsed
        if elapsed > grace_s + KILL_WAIT_S or (
            quiet_since is not None and elapsed - quiet_since >= SETTLE_S
        ):
            return len(seen)
        if elapsed < grace_s:
            _signal_all([p for p in pids if p not in seen], signal.SIGTERM)
        else:
            _signal_all(pids, signal.SIGKILL)
        seen.update(pids)
        time.sleep(POLL_S)


@contextmanager
def owning_processes(report: Callable[[str], None] | None = None) -> Iterator[str]:
    """Own every process started inside the block (yields the token); on leaving it, however
    it is left, end those still alive. ``report`` is told how many there were, if any."""
    token = claim()
    try:
        yield token
    finally:
        release(token)
        _report(token, end_carrying(token), report)


def _report(token: str, count: int, report: Callable[[str], None] | None) -> None:
    left = carrying(token)
    if report is None or not (count or left):
        return
    line = f"stopped {count} process(es) left behind"
    report(line + (f"; still alive after SIGKILL: {left}" if left else ""))


def own_until_exit(before_end: Callable[[], None], report: Callable[[str], None]) -> str:
    """Own every process started from now on until this process exits: at exit,
    ``before_end`` (e.g. ``ray.shutdown``, which stops the cluster in its own order), then
    end those still alive. For a command whose cluster is started deep inside a library."""
    token = claim()

    def end() -> None:
        try:
            before_end()
        finally:
            _report(token, end_carrying(token), report)

    atexit.register(end)
    return token


def run_child(
    command: list[str],
    sink: IO[str],
    on_line: Callable[[str], None],
    stop_timeout_s: float,
    env: dict[str, str] | None = None,
) -> int:
    """Runs ``command`` to its end and returns its status; a thread copies its output into
    ``sink`` line by line and hands each line to ``on_line``, so that a signal, which Python
    delivers to the main thread, never falls between reading a line and writing it. If this
    command stops meanwhile (a signal, any exception), so does the child: with the signal that
    interrupted this one (a duplicate of a terminal's Ctrl-C is ignored by our commands) or
    SIGTERM, SIGKILL after ``stop_timeout_s``; then the stop goes on."""
    process = subprocess.Popen(
        command, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=env
    )
    copier = threading.Thread(target=_copy, args=(process.stdout, sink, on_line), daemon=True)
    copier.start()
    try:
        return process.wait()
    except BaseException as stop:
        _stop_child(process, stop, stop_timeout_s)
        raise
    finally:  # its last lines, unless a process it started holds the pipe open
        copier.join(timeout=DRAIN_S)


def _stop_child(process: subprocess.Popen, stop: BaseException, timeout_s: float) -> None:
    interrupted = interruption(stop)
    if process.poll() is None:
        with suppress(ProcessLookupError):
            process.send_signal(interrupted.signum if interrupted else signal.SIGTERM)
    try:
        process.wait(timeout=timeout_s)
    except subprocess.TimeoutExpired:
        process.kill()
        process.wait()


def _copy(stream: IO[str] | None, sink: IO[str], on_line: Callable[[str], None]) -> None:
    if stream is None:
        return
    for line in stream:
        try:
            sink.write(line)
        except (OSError, ValueError):  # the caller closed the sink: it stopped waiting
            return
        try:
            on_line(line)
        except Exception as error:  # a line it could not echo: the copy goes on
            print(f"could not echo a line of the child's output: {error!r}", file=sys.stderr)

"""What a person sees at the terminal, and the complete log in `<workdir>/train.log`.

    console.setup()                    # main(), first: console handler + buffered file log
    console.log_to_file(workdir)       # once the config is valid: train.log gets everything
    console.header(config, workdir, config_file)
    with console.Progress("SFT", total, done) as bar: bar.update(n, "loss 1.2 | acc 0.5")
    logging.info("...", extra=console.SHOW)   # an INFO line worth a user's attention

The console shows warnings, errors and the INFO records marked `SHOW`; everything else
(JAX's backend probing, orbax and optax chatter, the resolved config at DEBUG) goes to
train.log only. Records from before the workdir is known (JAX probes its backends while
the config is validated) are held and written when the file opens, so a config error
leaves no file behind.

Progress: on a terminal, a tqdm bar with ETA and the live metrics as its postfix; log
lines are written above it (tqdm.write) so they never tear the bar. Elsewhere (CI, a
pipe: stdout is not a tty) one plain line at the first update, then every 10% or 30 s,
and at the last step.
"""

from __future__ import annotations

import logging
import os
import sys
import time

from absl import logging as absl_logging
from tqdm import tqdm

LOG_FILE = "train.log"
SHOW = {"console": True}  # `extra=` for an INFO record the console should show too


class _ConsoleHandler(logging.Handler):
    def __init__(self):
        super().__init__(logging.INFO)
        self.setFormatter(logging.Formatter("%(message)s"))

    def filter(self, record):
        if record.name == "py.warnings":  # library deprecation notices: the file has them
            return False
        return record.levelno >= logging.WARNING or getattr(record, "console", False)

    def emit(self, record):
        try:
            msg = self.format(record)
            if record.levelno >= logging.WARNING:
                msg = f"{record.levelname.lower()}: {msg}"
            tqdm.write(msg, file=sys.stderr)
        except Exception:  # noqa: BLE001 - logging must never raise into the caller
            self.handleError(record)


class _FileHandler(logging.Handler):
    """Every record into one file, held in memory until the file is opened."""

    def __init__(self):
        super().__init__(logging.DEBUG)
        self.setFormatter(absl_logging.PythonFormatter())
        self._held: list[logging.LogRecord] = []
        self._file = None

    def open(self, path: str) -> None:
        with self.lock:
            if self._file is not None:
                self._file.close()
            self._file = open(path, "a")  # noqa: SIM115 - closed at exit by logging.shutdown
            for record in self._held:
                self._write(record)
            self._held = []

    def _write(self, record):
        self._file.write(self.format(record) + "\n")
        self._file.flush()

    def emit(self, record):
        try:
            if self._file is None:
                if len(self._held) < 10_000:
                    self._held.append(record)
            else:
                self._write(record)
        except Exception:  # noqa: BLE001
            self.handleError(record)

    def close(self):
        with self.lock:
            if self._file is not None:
                self._file.close()
                self._file = None
        super().close()


_file_handler: _FileHandler | None = None


def setup() -> None:
    """Route logging: the console (filtered) and the workdir's log file (everything)."""
    global _file_handler
    root = logging.getLogger()
    for h in list(root.handlers):  # absl's handler would print every INFO line to stderr
        if isinstance(h, absl_logging.ABSLHandler):
            root.removeHandler(h)
    root.setLevel(logging.INFO)
    # Our own DEBUG records (the resolved config) reach the file; libraries' stay out.
    logging.getLogger("learner_jax").setLevel(logging.DEBUG)
    logging.captureWarnings(True)
    _file_handler = _FileHandler()
    root.addHandler(_ConsoleHandler())
    root.addHandler(_file_handler)


def log_to_file(workdir: str) -> str | None:
    """Start writing `<workdir>/train.log` (appending: a resumed run continues it)."""
    if _file_handler is None:  # library use (tests): logging stays as the caller set it
        return None
    path = os.path.join(workdir, LOG_FILE)
    _file_handler.open(path)
    return path


def interactive() -> bool:
    return sys.stdout.isatty()


def header(config, workdir: str, config_file: str = "") -> str:
    """What runs and where to look, as printed at the start of a run."""
    import jax

    m, tb = config.model, os.path.join(workdir, "tb")
    model = (
        m.hf_dir or f"tiny {m.tiny_family}, {m.tiny_num_layers} layers x {m.tiny_hidden_size} wide"
    )
    phases = []
    if config.sft.steps:
        phases.append(f"SFT {config.sft.steps} steps")
    if config.total_steps:
        phases.append(
            f"RL {config.total_steps} steps ({config.loss.name}, staleness {config.staleness},"
            f" publish every {config.publish_every}, {config.local_workers} local workers)"
        )
    devices = jax.devices()
    mesh = " x ".join(f"{k} {v}" for k, v in config.mesh.items())
    lines = [
        f"echo2 train {config_file}".rstrip(),
        f"  runs     {', then '.join(phases) or 'nothing (sft.steps = total_steps = 0)'}",
        f"  task     {config.task.name}; model {model}",
        f"  devices  {len(devices)} x {devices[0].platform}; mesh {mesh}",
        f"  workdir  {workdir}  ({LOG_FILE}, config.json, metrics.jsonl)",
        f"  watch    tensorboard --logdir {tb}",
    ]
    if config.total_steps:
        from learner_jax.run_config import broadcast_mode

        store = config.bridge.store or os.path.join(workdir, "weights")
        mode = broadcast_mode(config)
        how = {"store": "every worker reads it", "chain": "relayed worker to worker"}.get(
            mode, f"relayed along a tree of fan-out {config.bridge.broadcast_fanout}"
        )
        lines.append(f"  weights  {store}, {how} (bridge.broadcast={config.bridge.broadcast})")
        lines.append("  plots    reward.png, utilization.png, ... and summary.md at the end")
    text = "\n".join(lines)
    print(text, flush=True)
    return text


def _clock(seconds: float) -> str:
    seconds = int(max(seconds, 0))
    h, rest = divmod(seconds, 3600)
    return f"{h}:{rest // 60:02d}:{rest % 60:02d}" if h else f"{rest // 60:02d}:{rest % 60:02d}"


class Progress:
    """A progress display from `done` to `total` steps; `offset` + n is the learner step."""

    def __init__(
        self,
        name: str,
        total: int,
        done: int = 0,
        offset: int = 0,
        every_s: float = 30.0,
        every_frac: float = 0.1,
        tty: bool | None = None,
    ):
        self.name, self.total, self.offset = name, total, offset
        self.every_s, self.every_n = every_s, max(1, int(every_frac * total))
        self._t0 = time.monotonic()
        self._first: tuple[float, int] | None = None  # rate is measured from the first update
        self._printed_at: float | None = None
        self._printed_n = done
        self._bar = None
        if interactive() if tty is None else tty:
            # A pty may report a 0 x 0 size (script, some CI runners): then a fixed size, since
            # tqdm hides its bar when it reads 0 rows. Asked of the terminal itself, as tqdm
            # does: shutil would take COLUMNS/LINES from the environment and disagree.
            try:
                size = os.get_terminal_size(sys.stdout.fileno())
            except (OSError, ValueError):
                size = os.terminal_size((0, 0))
            known = size.columns > 0 and size.lines > 0
            self._bar = tqdm(
                total=total,
                initial=done,
                desc=name,
                unit="step",
                file=sys.stdout,
                dynamic_ncols=known,
                ncols=None if known else 120,
                nrows=None if known else 24,
                smoothing=0.05,
            )

    def update(self, n: int, text: str) -> None:
        if self._bar is not None:
            self._bar.set_postfix_str(text, refresh=False)
            self._bar.update(n - self._bar.n)
            return
        now = time.monotonic()
        if self._first is None:  # the first step compiles: it says nothing about the rest
            self._first = (now, n)
        if (
            self._printed_at is None
            or n >= self.total
            or now - self._printed_at >= self.every_s
            or n - self._printed_n >= self.every_n
        ):
            print(self.line(n, text, now), flush=True)
            self._printed_at, self._printed_n = now, n

    def line(self, n: int, text: str, now: float) -> str:
        elapsed = now - self._t0
        t1, n1 = self._first or (now, n)
        rate = (n - n1) / (now - t1) if now > t1 else 0.0
        eta = _clock((self.total - n) / rate) if rate > 0 else "?"
        step = f"step {n + self.offset:>5}/{self.total + self.offset}"
        pct = 100 * n / max(self.total, 1)
        return f"{self.name} {pct:3.0f}% | {step} | {text} | {_clock(elapsed)} < {eta}"

    def close(self) -> None:
        if self._bar is not None:
            self._bar.close()

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()

"""The console: the header, compact progress lines off a terminal, and what the log handlers
let through."""

import logging
import os

from learner_jax.reporting import console

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))


def test_progress_lines_off_a_terminal(capsys):
    bar = console.Progress("RL", total=100, done=10, offset=50, every_s=1e9, tty=False)
    for n in range(11, 101):
        bar.update(n, f"reward {n / 100:.2f}")
    bar.close()
    lines = capsys.readouterr().out.splitlines()
    # The first update, then every 10 steps (10%), and the last one: not one per step.
    assert [line.split(" | ")[1] for line in lines] == [
        f"step {s:>5}/150" for s in (61, 71, 81, 91, 101, 111, 121, 131, 141, 150)
    ]
    assert lines[0].startswith("RL  11% | step    61/150 | reward 0.11 | ")
    assert lines[-1].startswith("RL 100% | step   150/150 | reward 1.00 | 00:00 < ")


def test_console_shows_warnings_and_marked_lines_the_file_gets_all(tmp_path, capsys):
    root = logging.getLogger()
    saved = (root.handlers[:], root.level)
    try:
        console.setup()
        logging.info("jax chatter")  # before the workdir is known: held for the file
        console.log_to_file(str(tmp_path))
        logging.info("resumed from step 3 (rl)", extra=console.SHOW)
        logging.warning("task ran out of SFT examples")
        logging.getLogger("learner_jax.train").debug("resolved config: ...")
        logging.debug("library debug")
    finally:
        for h in root.handlers:
            if h not in saved[0]:
                h.close()
        root.handlers[:] = saved[0]
        root.setLevel(saved[1])
        logging.captureWarnings(False)
    err = capsys.readouterr().err
    assert err.splitlines() == [
        "resumed from step 3 (rl)",
        "warning: task ran out of SFT examples",
    ]
    log = (tmp_path / console.LOG_FILE).read_text()
    for text in ("jax chatter", "resumed from step 3", "ran out", "resolved config"):
        assert text in log, text
    assert "library debug" not in log


def test_header_says_what_runs_and_how_weights_travel(tmp_path, capsys):
    from learner_jax import config_file

    c = config_file.load_config(os.path.join(ROOT, "configs", "tiny_arith.py"))
    text = console.header(c, str(tmp_path), "configs/tiny_arith.py")
    assert text.startswith("echo2 train configs/tiny_arith.py") and len(text.splitlines()) == 8
    assert "SFT 2000 steps, then RL 300 steps" in text
    assert f"weights  {tmp_path}/weights, every worker reads it (bridge.broadcast=auto)" in text
    c.bridge.store = "s3://bucket/run"
    assert "s3://bucket/run, relayed worker to worker" in console.header(c, str(tmp_path))


def test_progress_bar_shows_on_a_terminal_that_reports_no_size():
    """A pty of size 0 x 0 (script, some CI runners) with COLUMNS/LINES in the environment:
    the bar must still be drawn (tqdm hides a bar when it reads 0 rows)."""
    import pty
    import subprocess
    import sys

    code = (
        "from learner_jax.reporting import console\n"
        "p = console.Progress('SFT', 4, tty=True)\n"
        "for i in range(1, 5): p.update(i, 'loss 0.5')\n"
        "p.close()\n"
    )
    parent, child = pty.openpty()  # a fresh pty reports 0 columns and 0 lines
    env = dict(os.environ, COLUMNS="120", LINES="40")
    proc = subprocess.Popen(
        [sys.executable, "-c", code], stdout=child, stderr=child, env=env, cwd=ROOT
    )
    os.close(child)
    out = b""
    while True:
        try:
            chunk = os.read(parent, 4096)
        except OSError:  # EIO: the child closed its side
            break
        if not chunk:
            break
        out += chunk
    os.close(parent)
    assert proc.wait(timeout=60) == 0, out
    assert b"SFT: 100%" in out and b"4/4" in out, out

"""The console: the header, compact progress lines off a terminal, and what the log handlers
let through."""

import logging
import os

from learner_jax import console

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


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

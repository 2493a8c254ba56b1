"""The console: compact progress lines off a terminal, and what the log handlers let through."""

import logging

from learner_jax import console


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

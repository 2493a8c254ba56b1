"""`python -m learner_jax.report --workdir=DIR`: re-draw a run's report from its files
(the command keeps this path; the code is learner_jax/reporting/report.py)."""

if __name__ == "__main__":
    import runpy

    runpy.run_module("learner_jax.reporting.report", run_name="__main__", alter_sys=True)

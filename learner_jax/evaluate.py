"""`python -m learner_jax.evaluate`: evaluate a checkpoint or an HF directory on a benchmark
file (DESIGN.md names the command at this path; the code is learner_jax/evaluation/)."""

if __name__ == "__main__":
    from learner_jax.evaluation import eval_cli

    eval_cli.run_main()

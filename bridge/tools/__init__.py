"""Tools that models call, run in the sandbox (bridge/tasks/sandbox.py). Each module here
imports the standard library only: the sandbox's helper process imports a tool's module
once, and a light module keeps that first call well inside a reward timeout."""

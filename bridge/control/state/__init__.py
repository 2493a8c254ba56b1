"""The controller's state: SQLite persistence (every SQL statement in `db.py`), group
commit, the hot state kept in memory between flushes, the announced version, and the undo
of what a crashed run did past its checkpoint."""

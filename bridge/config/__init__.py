"""The run's settings, declared once (keys.py) with what derives from them (schema.py)."""

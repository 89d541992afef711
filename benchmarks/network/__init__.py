"""Bandwidth benchmark: multi-process training over a rate-limited loopback (see ``run.py``)."""

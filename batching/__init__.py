"""The core of conveyor: envelope, key layout, signatures, batch forming and policy.

Imports neither FastAPI nor Celery, so it can be unit-tested and simulated on its own.
"""

"""Test doubles shared by every engineer (see ``runner.py``)."""

from tests.fakes.runner import FakeModelRunner, FakeSequence, expected_next_token

__all__ = ["FakeModelRunner", "FakeSequence", "expected_next_token"]

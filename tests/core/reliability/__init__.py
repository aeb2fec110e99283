"""Reliability tests. A package, so that its conftest does not shadow ``tests/conftest.py`` (as
``tests/e2e/browser``)."""

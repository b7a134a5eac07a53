"""Test helpers shared by several test files (importable as ``helpers.*``)."""

"""The ``afmd`` command and its verbs."""

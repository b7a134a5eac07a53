"""afmd's configuration: its shape, its layers (file, env, flags) and its rules."""

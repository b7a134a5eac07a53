"""A model sharded over ranks: each rank's share, steps in lockstep."""

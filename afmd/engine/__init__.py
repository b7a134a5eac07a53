"""The engine: models in memory, and the threads that generate with them."""

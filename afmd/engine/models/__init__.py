"""Which models exist, which are loaded, and which stay within the budget."""

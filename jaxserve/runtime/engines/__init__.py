"""Engines: the contract the runtime's loops drive, and its backends (the real OPT engine, the fake one)."""

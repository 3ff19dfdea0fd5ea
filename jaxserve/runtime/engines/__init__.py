"""Engines: the contract the runtime's loops drive (`contract.Engine`), and its backends side by side: the real
engine of every model family (`model`), the hand-computable fake (`fake`) and the timed one that sleeps a step-cost
contract (`timed`)."""

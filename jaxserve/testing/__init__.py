"""Test helpers shipped with the package: a hand-computable fake engine and tiny random OPTs."""

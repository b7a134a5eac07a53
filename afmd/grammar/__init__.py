"""Constrained decoding: grammars compiled by llguidance, enforced per sequence."""

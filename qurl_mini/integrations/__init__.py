"""Bridges from qurl-mini's equations to other trainers. `verl_plugin` is the only module that imports verl."""

"""The reference serving engine: models, loaders, attention, scheduling and the runner.

Submodules import torch; this package itself stays import-light.
"""

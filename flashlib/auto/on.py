"""``import flashlib.auto.on`` routes SDPA to flashlib for the rest of the program (see flashlib.auto).

Explained in: notebooks/11_models.
"""
from . import enable

enable()

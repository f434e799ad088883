"""flashlib — the tested library behind flashbook, a FlashAttention tutorial from first principles.

The ladder (NumPy, any leading dims, float64-capable), one module per chapter:

* :mod:`flashlib.naive` — standard attention, S and P in HBM (chapter 1);
* :mod:`flashlib.softmax`, :mod:`flashlib.memeff` — online softmax and the memory-efficient
  precursors (chapter 2);
* :mod:`flashlib.fa1` — FlashAttention-1 tiling (chapter 3);
* :mod:`flashlib.fa2` — FlashAttention-2 forward and backward (chapters 4 and 5);
* :mod:`flashlib.decoding` — Flash-Decoding, split-KV (chapter 6);
* :mod:`flashlib.iomodel` — the counted HBM/SRAM memory model every algorithm reports to;
* :mod:`flashlib.testing` — the float64 oracle and the shared checker.
"""
from . import decoding, fa1, fa2, hardware, iomodel, measure, memeff, naive, softmax, testing
from .display import show
from .iomodel import IOCounter
from .api import attention, attention_qkvpacked, decode

__version__ = "0.1.0"
__all__ = ["naive", "softmax", "memeff", "fa1", "fa2", "decoding", "iomodel", "testing", "hardware", "measure", "IOCounter", "show", "attention", "attention_qkvpacked", "decode"]

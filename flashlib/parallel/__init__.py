"""Beyond one GPU (chapter 12): ``ring`` (ring attention over torch.distributed, with the
Flash-Decoding merge) and ``launch`` (start N local processes, one per rank, and collect their
results). The ring's test harness lives in :mod:`flashlib.testing.ring`.
"""

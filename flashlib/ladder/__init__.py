"""The ladder: FlashAttention's algorithms in NumPy, one module per chapter, each checked against the
float64 oracle (:mod:`flashlib.testing`) and reporting its memory traffic to :mod:`.iomodel`.

``naive`` (chapter 1) → ``softmax`` and ``memeff`` (2) → ``fa1`` (3) → ``fa2`` (4, forward; 5, backward)
→ ``decoding`` (6, Flash-Decoding). ``masks`` holds the causal mask they share.
"""

"""Real kernels: ``kernels.triton`` (chapter 7: forward, backward and decode, their shared ``kit`` and
each kernel's ``spec``; ``configs`` per architecture) and ``kernels.cuda`` (chapter 8: the ``.cu``
sources in ``csrc/``, the CPU emulator that runs them unchanged, and their launcher). Reach them
through :func:`flashlib.attention` and :func:`flashlib.decode` (:mod:`flashlib.backends` picks one).
"""

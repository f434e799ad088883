"""Tools around the kernels: ``compile_report`` (registers, spills, shared memory and tensor-core
instructions of every kernel on sm_75–sm_90), ``bench`` (speed against torch SDPA), ``selfcheck``
(``python -m flashlib info`` / ``check``), ``measure`` (time and peak memory on this machine) and
``toolchain`` (the one place that finds compilers, caches builds and reads their reports).
"""

"""The GPU tier (``make test-gpu``): flashlib's kernels on CUDA tensors, at sizes that reach the real
kernel configs.

CI has no GPU, so ``make test`` does not collect this folder (``norecursedirs`` in pyproject.toml);
``make test-gpu`` runs it explicitly. On a machine without a CUDA GPU it says so and exits non-zero:
this tier must never pass having run nothing. GPU machines often cannot install anything, so the
tier runs on any Python that has torch, triton and pytest: tests that need another package (nbclient,
hypothesis, cupy) skip with the reason (FLASHLIB_REQUIRE_ALL=1 turns those skips into failures).
"""
from __future__ import annotations

import pytest
import torch

import flashlib.kernels.triton  # noqa: E402,F401  (compile mode when a GPU is present)

# No helpers live here: a session that collects tests/ and tests/gpu together imports both files as
# `conftest`, and `from conftest import ...` must keep finding tests/conftest.py's.


def pytest_configure(config):
    if not torch.cuda.is_available():
        pytest.exit("the GPU tier (make test-gpu) needs a CUDA GPU, and torch sees none on this machine: "
                    "nothing was run", returncode=3)


def pytest_collection_modifyitems(items):
    for item in items:
        item.add_marker(pytest.mark.gpu)


def pytest_report_header(config):
    import triton
    p = torch.cuda.get_device_properties(0)
    cc = torch.cuda.get_device_capability(0)
    return (f"GPU tier on {p.name} (sm_{cc[0]}{cc[1]}, {p.multi_processor_count} SMs); torch "
            f"{torch.__version__} (CUDA {torch.version.cuda}), triton {triton.__version__}")

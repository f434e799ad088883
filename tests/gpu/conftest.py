"""The GPU tier (``make test-gpu``): flashlib's kernels on CUDA tensors, at sizes that reach the real
kernel configs.

CI has no GPU, so ``make test`` does not collect this folder (``norecursedirs`` in pyproject.toml);
``make test-gpu`` runs it explicitly. On a machine without a CUDA GPU it says so and exits non-zero:
this tier must never pass having run nothing. GPU machines often cannot install anything, so the
tier runs on any Python that has torch, triton and pytest: a test that needs another package (nbclient,
transformers, cupy) goes through tests/conftest.py's need_module/require, which skip with the reason,
and FAIL under FLASHLIB_REQUIRE_ALL=1 (``make test-gpu`` sets it; ``make test-gpu REQUIRE_ALL=0`` on a
machine that cannot install them). No other skip exists here (tests/test_gpu_tier_rules.py checks):

* what a GPU cannot run (bfloat16 below sm_80, CUDA kernel v3 below sm_75) is not a skip: the cases
  are chosen by capability when the tier is collected (:func:`flashlib.hardware.kernel_dtypes`), and
  the refused ones become tests that the refusal is the documented error;
* tests/gpu/test_multi_gpu.py needs two GPUs: it is collected only where torch sees two or more (the
  report header says whether). ``FLASHLIB_GPU_COUNT=N`` (``make test-gpu GPUS=N``, default 1) states
  how many GPUs the machine has: fewer visible fails the tier (test_the_machine_shows_its_gpus).
"""
from __future__ import annotations

import importlib.util
import pathlib

import pytest
import torch

import flashlib.kernels.triton  # noqa: E402,F401  (compile mode when a GPU is present)

# tests/conftest.py's helpers (require, need_module, ROOT, DEVICE...), the same functions re-exported:
# pytest imports tests/conftest.py and this file both as module `conftest`, this one last, so while
# tests/gpu is collected `from conftest import need_module` finds this module; where tests/conftest.py
# is the one named `conftest`, the import finds the same functions there. No helper is defined here.
_spec = importlib.util.spec_from_file_location("flashlib_tests_conftest",
                                               pathlib.Path(__file__).resolve().parents[1] / "conftest.py")
_shared = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(_shared)
globals().update({name: value for name, value in vars(_shared).items()
                  if name.isupper() or getattr(value, "__module__", None) == _spec.name})

GPU_COUNT = torch.cuda.device_count()
# Two GPUs or more: the multi-GPU file is collected; on one it is not (not a skip: nothing to run).
collect_ignore = [] if GPU_COUNT >= 2 else ["test_multi_gpu.py"]


def pytest_configure(config):
    if not torch.cuda.is_available():
        pytest.exit("the GPU tier (make test-gpu) needs a CUDA GPU, and torch sees none on this machine: "
                    "nothing was run", returncode=3)


def pytest_collection_modifyitems(items):
    for item in items:
        item.add_marker(pytest.mark.gpu)


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_makereport(item, call):
    """Under FLASHLIB_REQUIRE_ALL a skip of any kind here (a missing package, an empty parameter list, a
    skip marker someone adds) is reported as a failure, naming the skip's reason."""
    outcome = yield
    report = outcome.get_result()
    if _shared.REQUIRE_ALL and report.skipped:
        reason = report.longrepr[2] if isinstance(report.longrepr, tuple) else str(report.longrepr)
        report.outcome = "failed"
        report.longrepr = (f"{item.nodeid} was skipped ({reason}), and FLASHLIB_REQUIRE_ALL is set: the GPU "
                           "tier allows no skip (tests/gpu/conftest.py)")


def pytest_report_header(config):
    import triton

    from flashlib.hardware import kernel_dtypes
    p = torch.cuda.get_device_properties(0)
    cc = torch.cuda.get_device_capability(0)
    multi = ("collected" if GPU_COUNT >= 2 else "not collected (one GPU)")
    return (f"GPU tier on {p.name} (sm_{cc[0]}{cc[1]}, {p.multi_processor_count} SMs); torch "
            f"{torch.__version__} (CUDA {torch.version.cuda}), triton {triton.__version__}; dtypes here: "
            f"{', '.join(kernel_dtypes('cuda'))}; {GPU_COUNT} GPU(s), test_multi_gpu.py {multi}; "
            f"FLASHLIB_REQUIRE_ALL={'1' if _shared.REQUIRE_ALL else '0'}")

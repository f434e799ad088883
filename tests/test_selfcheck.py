"""The command line: info, check, and usage on unknown arguments."""
import subprocess
import sys

import pytest

from flashlib import selfcheck
from flashlib.__main__ import main


def _cli(*args):
    return subprocess.run([sys.executable, "-m", "flashlib", *args], capture_output=True, text=True,
                          timeout=600)


def test_info_lists_versions_device_and_backends():
    d = selfcheck.info()
    assert d["torch"].startswith("2.") and d["flashlib"]
    assert set(d["backends"]) >= {"reference", "triton", "cuda"}
    assert d["backends"]["reference"][0] is True
    text = selfcheck.format_info(d)
    assert "backends:" in text and "reference" in text


def test_check_passes_for_the_reference_backend():
    rows = selfcheck.check(["reference"])
    assert {r["status"] for r in rows} == {"pass"}
    assert len(rows) == 2 * (len(selfcheck.CHECK_CASES) + 1)     # fp32 + fp16 on a CPU, + decode
    assert selfcheck.format_check(rows).splitlines()[-1] == f"{len(rows)} passed, 0 failed"


def test_check_reports_a_wrong_backend_as_fail(monkeypatch):
    from flashlib import api
    real = api.BACKENDS["reference"]
    broken = api.Backend("broken", lambda *a, **k: tuple(x * 1.01 for x in real.forward(*a, **k)),
                         real.backward, real.decode, real.check)
    monkeypatch.setitem(api.BACKENDS, "broken", broken)
    rows = selfcheck.check(["broken"])
    assert any(r["status"] == "FAIL" for r in rows)
    with pytest.raises(ValueError, match="backends must name registered backends"):
        selfcheck.check(["nope"])


def test_cli_check_and_info_end_to_end():
    out = _cli("check", "--backend", "triton")
    assert out.returncode == 0, out.stdout + out.stderr
    assert out.stdout.strip().splitlines()[-1].endswith("passed, 0 failed")
    assert "triton" in out.stdout
    assert _cli("info").returncode == 0


def test_unknown_arguments_print_usage():
    with pytest.raises(SystemExit) as e:
        main(["check", "--bogus"])
    assert e.value.code == 2
    out = _cli("frobnicate")
    assert out.returncode == 2 and "usage:" in out.stderr

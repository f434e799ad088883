"""info and check (flashlib/tools/selfcheck.py), and their commands end to end; the parser itself:
tests/test_main.py."""

import pytest
import torch

from conftest import run_cli
from flashlib.tools import selfcheck


def test_info_lists_versions_device_and_backends():
    d = selfcheck.info()
    assert d["torch"].startswith("2.") and d["flashlib"]
    assert set(d["backends"]) >= {"reference", "triton", "cuda"}
    assert d["backends"]["reference"][0] is True
    assert "forward ran here" in d["backends"]["reference"][1]
    text = selfcheck.format_info(d)
    assert "backends:" in text and "reference" in text
    ok, why = d["backends"]["cuda"]
    if ok:                                 # the CUDA backend says which kernels run here, per dtype
        import torch
        if torch.cuda.is_available() and torch.cuda.get_device_capability() >= (8, 0):
            assert "float16: forward v3, CUDA backward; bfloat16: forward v3, CUDA backward" in why, why
        elif not torch.cuda.is_available():      # the emulator runs every kernel
            assert ("kernels here — float32: forward v1, backward from another backend; float16: forward v3, "
                    "CUDA backward; bfloat16: forward v3, CUDA backward") in why, why


@pytest.mark.parametrize("variable, default, other", [("FLASHLIB_TRITON_FWD", "v1", "v4"),
                                                     ("FLASHLIB_TRITON_BWD", "v2", "v5")])
@pytest.mark.parametrize("env, expect", [(None, "{default} (default;"), ("tma", "{other} ({variable}) wherever"),
                                         ("{other}", "{other} ({variable}) wherever"),
                                         ("v7", "must be one of ('{default}', '{other}')")])
def test_info_says_which_triton_kernels_run(monkeypatch, variable, default, other, env, expect):
    if env is None:
        monkeypatch.delenv(variable, raising=False)
    else:
        monkeypatch.setenv(variable, env.format(other=other))
    expect = expect.format(default=default, variable=variable, other=other)
    line = selfcheck._triton_version(variable)
    assert expect in line
    key = "triton forward" if variable.endswith("FWD") else "triton backward"
    assert f"{key}: {line}" in selfcheck.format_info(selfcheck.info())


def test_check_passes_for_the_reference_backend():
    rows = selfcheck.check(["reference"])
    assert {r["status"] for r in rows} == {"pass"}
    assert len(rows) == len(selfcheck._dtypes(selfcheck._device())) * len(
        selfcheck._cases(selfcheck._device(), "reference"))
    assert selfcheck.format_check(rows).splitlines()[-1].startswith(f"{len(rows)} passed, 0 failed, 0 errors")
    assert selfcheck.exit_code(rows) == 0


def test_check_reports_a_wrong_backend_as_fail(monkeypatch):
    from flashlib import backends
    real = backends.BACKENDS["reference"]
    broken = backends.Backend("broken", lambda *a, **k: tuple(x * 1.01 for x in real.forward(*a, **k)),
                              real.backward, real.decode, real.check)
    monkeypatch.setitem(backends.BACKENDS, "broken", broken)
    rows = selfcheck.check(["broken"])
    assert any(r["status"] == "FAIL" for r in rows)
    assert selfcheck.exit_code(rows) == 1
    with pytest.raises(ValueError, match="backends must name registered backends"):
        selfcheck.check(["nope"])


def test_check_never_crashes_a_raising_backend_is_an_error_row(monkeypatch):
    """On an H100 the cuda backend raised BufferError and `check` died with a traceback."""
    from flashlib import backends
    real = backends.BACKENDS["reference"]

    def explode(*a, **k):
        raise BufferError("cupy.from_dlpack: tensors that require grad cannot be exported")
    monkeypatch.setitem(backends.BACKENDS, "explodes",
                        backends.Backend("explodes", explode, real.backward, explode, real.check))
    rows = selfcheck.check(["explodes", "reference"])
    mine = [r for r in rows if r["backend"] == "explodes"]
    assert mine and {r["status"] for r in mine} == {"error"}
    assert all("BufferError" in r["note"] for r in mine)
    assert {r["status"] for r in rows if r["backend"] == "reference"} == {"pass"}   # the rest still ran
    assert selfcheck.exit_code(rows) == 1
    assert " errors" in selfcheck.format_check(rows)


def test_info_tries_each_backend_instead_of_claiming(monkeypatch):
    from flashlib import backends
    real = backends.BACKENDS["reference"]

    def explode(*a, **k):
        raise RuntimeError("cannot open source file crt/mma.h")
    monkeypatch.setitem(backends.BACKENDS, "static",
                        backends.Backend("static", explode, real.backward, explode, real.check, "claims to work"))
    ok, why = selfcheck.info()["backends"]["static"]
    assert ok is False and "crt/mma.h" in why


def test_skipped_rows_do_not_fail_the_exit_status():
    rows = [{"status": "pass"}, {"status": "skipped"}]
    assert selfcheck.exit_code(rows) == 0
    assert selfcheck.exit_code(rows + [{"status": "error"}]) == 1


def test_a_check_that_ran_nothing_exits_non_zero_and_says_so(monkeypatch, capsys):
    """Every backend skipped (none can run on this device): nothing was checked, so the command fails,
    saying why, instead of exiting 0 as it did."""
    assert selfcheck.exit_code([{"status": "skipped"}, {"status": "skipped"}]) == 1
    assert selfcheck.exit_code([]) == 1
    from flashlib import backends
    from flashlib.__main__ import main

    def refuse(*a, **k):
        raise RuntimeError("no device for this backend here")
    real = backends.BACKENDS["reference"]
    monkeypatch.setitem(backends.BACKENDS, "refuses",
                        backends.Backend("refuses", real.forward, real.backward, real.decode, refuse))
    assert main(["check", "--backend", "refuses"]) == 1
    out = capsys.readouterr().out.strip().splitlines()
    assert "no device for this backend here" in "\n".join(out)          # each skipped row says why
    assert out[-2].startswith("0 passed, 0 failed, 0 errors, ") and out[-1] == selfcheck.NOTHING_RAN
    assert "nothing ran" not in selfcheck.format_check([{"status": "pass", "backend": "r", "dtype": "f",
                                                         "case": "c", "note": "", "seconds": 0.0}])


def test_determinism_row_catches_a_backward_that_changes_between_calls(monkeypatch):
    """The realistic-size row (run on a GPU) compares two backward calls bit for bit; here a small case
    on the reference backend, once honest and once with noise added on every call."""
    import torch

    from flashlib import backends
    dev = torch.device("cpu")
    small = (1, 2, 1, 9, 13, 16, True)
    assert "bit-for-bit" in selfcheck._determinism_one("reference", torch.float32, dev, small)
    real = backends.BACKENDS["reference"]
    calls = []

    def noisy_backward(*a, **k):
        calls.append(1)
        return tuple(g + len(calls) * 1e-7 for g in real.backward(*a, **k))
    monkeypatch.setitem(backends.BACKENDS, "noisy", backends.Backend("noisy", real.forward, noisy_backward,
                                                                     real.decode, real.check))
    with pytest.raises(AssertionError, match="not deterministic"):
        selfcheck._determinism_one("noisy", torch.float32, dev, small)


def test_cli_check_and_info_end_to_end():
    out = run_cli("check", "--backend", "triton")
    assert out.returncode == 0, out.stdout + out.stderr
    assert "passed, 0 failed, 0 errors" in out.stdout.strip().splitlines()[-1]
    assert "triton" in out.stdout
    assert run_cli("info").returncode == 0


@pytest.mark.parametrize("kwargs, error, message", [
    (dict(backends="reference"), TypeError, r"backends must be a list of backend names or None, got str "
                                            r"'reference' \(a list of names: \['reference'\]\)"),
    (dict(backends=3), TypeError, r"backends must be a list of backend names or None, got int 3"),
    (dict(backends=["nope"]), ValueError, r"backends must name registered backends .*got 'nope'"),
    (dict(backends=[["reference"]]), ValueError, r"backends must name registered backends .*got \['reference'\]"),
    (dict(on_row=3), TypeError, r"on_row must be a function of one row or None, got int"),
])
def test_check_refuses_bad_arguments_before_running_anything(kwargs, error, message):
    """Before: backends="reference" was read letter by letter ("got 'r'"), a list inside the list
    raised an unhashable-type TypeError, and on_row=3 failed only after the first backend had run."""
    with pytest.raises(error, match=message):
        selfcheck.check(**kwargs)


def test_variants_row_runs_where_a_backend_computes_them_and_catches_one_ignored(monkeypatch):
    """The "variants" row (window, softcap, ALiBi, sinks, dropout at once) is a case of the backends that
    declare the variants, not of those that refuse them (cuda), and it fails a backend that declares
    them but drops one (here: the softcap)."""
    from flashlib import backends
    dev = selfcheck._device()
    assert "variants" in selfcheck._cases(dev, "reference")
    assert "variants" not in selfcheck._cases(dev, "cuda")
    real = backends.BACKENDS["reference"]

    def forward(*a, softcap=0.0, **k):
        return real.forward(*a, **k)
    sloppy = backends.Backend("sloppy", forward, real.backward, real.decode, real.check,
                              variants=real.variants)
    monkeypatch.setitem(backends.BACKENDS, "sloppy", sloppy)
    assert selfcheck._run_case("reference", "variants", torch.float32, dev)[0] == "pass"
    status, note = selfcheck._run_case("sloppy", "variants", torch.float32, dev)
    assert status == "FAIL", note

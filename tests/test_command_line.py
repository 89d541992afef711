"""``python -m tf_sparsify``: ``--help`` lists every command with one line, ``--version``;
``install-horovod`` runs the installer the package ships."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

import tf_sparsify
from tests.script_runner import ROOT
from tf_sparsify.__main__ import COMMANDS, HOROVOD_INSTALLER, main


def test_help_lists_every_command_with_its_line(capsys):
    with pytest.raises(SystemExit) as exit_info:
        main(["--help"])
    assert exit_info.value.code == 0
    out = capsys.readouterr().out
    for name, summary in COMMANDS.items():
        assert name in out and summary.split()[0] in out


def test_version(capsys):
    with pytest.raises(SystemExit) as exit_info:
        main(["--version"])
    assert exit_info.value.code == 0
    assert capsys.readouterr().out.strip() == f"tf_sparsify {tf_sparsify.__version__}"


def test_no_command_prints_the_help_and_fails(capsys):
    assert main([]) == 2
    assert "whatif" in capsys.readouterr().err


def test_an_unknown_command_is_an_argparse_error(capsys):
    with pytest.raises(SystemExit) as exit_info:
        main(["what"])
    assert exit_info.value.code == 2
    err = capsys.readouterr().err
    assert "invalid choice: 'what'" in err and "'whatif'" in err  # the choices are listed


def test_install_horovod_runs_the_installer_in_the_package_that_make_and_scripts_use():
    """One script: the package's file, which a checkout's ``scripts/install_horovod.sh`` links
    to and ``make horovod`` runs for the Makefile's environment."""
    assert HOROVOD_INSTALLER == Path(tf_sparsify.__file__).resolve().parent / "install_horovod.sh"
    assert HOROVOD_INSTALLER.is_file()
    assert (Path(ROOT) / "scripts" / "install_horovod.sh").resolve() == HOROVOD_INSTALLER
    makefile = (Path(ROOT) / "Makefile").read_text()
    recipe = "horovod: $(VENV)/.installed\n\tbash tf_sparsify/install_horovod.sh $(VENV)\n"
    assert recipe in makefile


@pytest.mark.processes
def test_install_horovod_dry_run_says_what_it_would_do_for_this_environment(monkeypatch, capfd):
    """``--dry-run`` goes through the installer's checks (with ``HOROVOD_REINSTALL=1``, past an
    installed Horovod) and stops before downloading or building anything."""
    monkeypatch.setenv("HOROVOD_REINSTALL", "1")
    monkeypatch.setenv("TF_CPP_MIN_LOG_LEVEL", "2")
    code = main(["install-horovod", "--dry-run"])
    err = capfd.readouterr().err
    assert code == 0, err[-3000:]
    plan = err.splitlines()[-1]
    assert plan.startswith(f"[install_horovod] dry run ({HOROVOD_INSTALLER}): would "), plan
    assert plan.endswith(f"install it with {sys.executable} into {sys.prefix}"), plan


def test_install_horovod_help_names_what_the_build_needs(capsys):
    with pytest.raises(SystemExit) as exit_info:
        main(["install-horovod", "--help"])
    assert exit_info.value.code == 0
    out = " ".join(capsys.readouterr().out.split())
    assert "Horovod 0.28.1" in out and "cmake and a C++ compiler" in out and "--dry-run" in out

"""``python -m tf_sparsify``: ``--help`` lists every command with one line, ``--version``."""

from __future__ import annotations

import pytest

import tf_sparsify
from tf_sparsify.__main__ import COMMANDS, main


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
    assert "invalid choice: 'what'" in capsys.readouterr().err

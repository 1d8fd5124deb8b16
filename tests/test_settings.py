import os
import pathlib

from server.settings import Settings, build_parser, load_settings, markdown_table

DOCS = pathlib.Path(__file__).resolve().parents[1] / "docs" / "configuration.md"


def test_docs_list_every_setting():
    text = DOCS.read_text()
    assert markdown_table() in text, "docs/configuration.md is stale: paste `python -m server.settings`"


def test_cli_wins_over_env_which_wins_over_default(monkeypatch):
    monkeypatch.setenv("SPECSERVE_MAX_QUEUE", "77")
    monkeypatch.setenv("SPECSERVE_SPECULATION", "off")
    s = load_settings(["--speculation", "prompt_lookup"])
    assert s.max_queue == 77 and s.speculation == "prompt_lookup"
    assert load_settings([]).speculation == "off"
    monkeypatch.delenv("SPECSERVE_MAX_QUEUE")
    assert load_settings([]).max_queue == Settings.model_fields["max_queue"].default


def test_every_field_has_a_flag_and_description():
    flags = {a.dest for a in build_parser()._actions}
    for name, field in Settings.model_fields.items():
        assert name in flags and field.description


def test_invalid_env_value_is_rejected_naming_the_variable(monkeypatch, capsys):
    import pytest

    monkeypatch.setenv("SPECSERVE_PORT", "not-a-port")
    with pytest.raises(SystemExit) as exc:  # as argparse rejects a bad flag: status 2, usage line
        load_settings([])
    assert exc.value.code == 2
    err = capsys.readouterr().err
    assert "usage: specserve" in err and "SPECSERVE_PORT:" in err and "'not-a-port'" in err, err
    assert "Traceback" not in err
    assert os.environ["SPECSERVE_PORT"] == "not-a-port"


def test_help_lists_every_flag():
    """``specserve --help`` renders (argparse formats help text with %, and some descriptions
    hold a literal percent sign) and names every setting's flag and environment twin."""
    from server.settings import Settings, build_parser, env_name, flag_name

    text = " ".join(build_parser().format_help().split())  # (argparse wraps lines)
    for name in Settings.model_fields:
        assert flag_name(name) in text and env_name(name) in text, name
    assert "4-8% of their scale" in text


def test_every_choice_of_every_setting_loads_from_its_flag_and_its_variable(monkeypatch):
    """Each value a choice setting allows (strings and integers alike, e.g. the draft kernel's
    8 or 16 rows) is accepted from the command line and from the environment, where it arrives
    as text."""
    import typing

    from server.settings import _base_type, env_name, flag_name

    choices = {name: typing.get_args(_base_type(field.annotation)) for name, field in Settings.model_fields.items()
               if typing.get_origin(_base_type(field.annotation)) is typing.Literal}
    assert "draft_kernel_rows" in choices and "fused" in choices
    for name, values in choices.items():
        for value in values:
            assert getattr(load_settings([flag_name(name), str(value)]), name) == value, (name, value)
            monkeypatch.setenv(env_name(name), str(value))
            assert getattr(load_settings([]), name) == value, (name, value)
            monkeypatch.delenv(env_name(name))

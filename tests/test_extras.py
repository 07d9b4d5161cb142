"""A command whose extra is not installed says which one in one line, with no traceback; the
core (pure Python) modules import without any extra."""

from __future__ import annotations

import pytest

from . import without_extras

CLI = "import sys\nfrom spinf_worker.cli import main\nsys.exit(main({argv!r}))\n"


@pytest.mark.parametrize(("argv", "blocked", "extra"), [
    (["score", "fixtures/support_messages.jsonl"], ("torch",), "server"),
    (["serve"], ("torch",), "server"),
    (["worker", "--redis", "redis://127.0.0.1:1"], ("numpy",), "server"),
    (["calibrate", "--pack", "x", "--normal", "n", "-o", "z"], ("sklearn",), "calibrate"),
    (["api", "--redis", "redis://127.0.0.1:1"], ("fastapi",), "api"),
])
def test_missing_extra_is_one_line(argv, blocked, extra):
    done = without_extras.run(CLI.format(argv=argv), blocked=blocked, timeout=120)
    assert done.returncode == 2, done.stderr
    assert done.stderr.strip() == (
        f"spinf-serve {argv[0]}: needs the [{extra}] extra: pip install "
        f"'spinf-serve[{extra}]' (no module named {blocked[0]!r})")
    assert done.stdout == ""


def test_lazy_import_of_a_missing_extra_names_it(monkeypatch, capsys):
    """A command that gets past the check and then imports a missing package still answers
    with the extra, not a traceback."""
    from spinf_worker import cli

    monkeypatch.setattr(cli, "missing_extra", lambda command: None)

    def score(args):
        raise ModuleNotFoundError("No module named 'torch'", name="torch")

    monkeypatch.setattr(cli, "cmd_score", score)    # build_parser reads it when main runs
    assert cli.main(["score", "-"]) == 2
    assert capsys.readouterr().err.strip() == (
        "spinf-serve score: needs the [server] extra: pip install 'spinf-serve[server]' "
        "(no module named 'torch')")


def test_core_modules_import_without_any_extra():
    blocked = without_extras.SERVER_ONLY + ("fastapi", "starlette", "uvicorn", "redis", "httpx",
                                            "pydantic_settings", "prometheus_client",
                                            "structlog", "platformdirs")
    done = without_extras.run(
        "import sys\n"
        "import spinf_worker.errors, spinf_worker.protocol, spinf_worker.templates\n"
        "import spinf_worker.packs, spinf_worker.extract_values, spinf_worker.cli\n"
        "spinf_worker.packs.official_packs()\n"
        "assert 'torch' not in sys.modules and 'fastapi' not in sys.modules\n"
        "print('ok')\n", blocked=blocked, timeout=120)
    assert done.returncode == 0, done.stderr
    assert done.stdout.strip() == "ok"

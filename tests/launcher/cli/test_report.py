

def test_an_error_after_the_report_module_was_imported_is_still_one_line(capsys) -> None:
    """Importing the ``report`` subcommand binds ``report`` on the cli package (the docs build and
    ``dslaunch report`` do): the error printer must not be that name."""
    import importlib

    from dslaunch.launcher import cli

    importlib.import_module("dslaunch.launcher.cli.report")
    code = cli.main(["estimate", "--params", "lots"])
    assert code != 0
    err = capsys.readouterr().err
    assert err.startswith("dslaunch: error: ") and "Traceback" not in err, err

"""The ``kvspec`` command line: check, replay, explain, prove, targets, provision,
test-targets (see ``kvspec --help``)."""

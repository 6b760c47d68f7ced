"""Applications built on the libraries, each behind a ``rdmamw`` subcommand: the
training demo (``rdmamw demo``) and the calibration tools (``rdmamw tune``). Nothing
in the libraries imports from here."""

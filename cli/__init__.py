"""The ``tandem`` command line: servers, clients and the local launcher (see ``cli.app``)."""

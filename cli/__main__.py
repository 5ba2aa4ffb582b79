"""``python -m cli [COMMAND] ...``: the ``tandem`` command."""

from cli.app import main

if __name__ == "__main__":
    main()

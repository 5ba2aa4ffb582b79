"""``python -m gateway [FLAGS]``: run the gateway (same as ``tandem gateway [FLAGS]``)."""

import sys

from gateway.cli import app

if __name__ == "__main__":
    app(["gateway", *sys.argv[1:]], prog_name="python -m gateway")
